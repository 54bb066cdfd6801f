/// Returns the greatest common divisor of `a` and `b` (Euclid's algorithm).
pub fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        let t = b;
// @middle
        b = a % b;
        a = t;
// @end
    }
    a
}

/// Returns the least common multiple of `a` and `b`, or 0 if either is 0.
pub fn lcm(a: u64, b: u64) -> u64 {
    if a == 0 || b == 0 {
        return 0;
    }
    a / gcd(a, b) * b
}
// @tests
#[test]
fn gcd_values() {
    assert_eq!(gcd(12, 18), 6);
    assert_eq!(gcd(17, 5), 1);
    assert_eq!(gcd(0, 9), 9);
    assert_eq!(gcd(9, 0), 9);
    assert_eq!(lcm(4, 6), 12);
}
