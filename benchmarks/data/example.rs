/// Returns the greatest common divisor of `a` and `b` (Euclid's algorithm).
pub fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        let t = b;
        
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
