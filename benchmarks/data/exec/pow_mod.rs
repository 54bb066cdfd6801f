/// `base` to the power `exp`, modulo `m`, by repeated squaring.
pub fn pow_mod(mut base: u64, mut exp: u64, m: u64) -> u64 {
    let mut result = 1 % m;
    base %= m;
    while exp > 0 {
// @middle
        if exp & 1 == 1 {
            result = result * base % m;
        }
        base = base * base % m;
        exp >>= 1;
// @end
    }
    result
}
// @tests
#[test]
fn powers() {
    assert_eq!(pow_mod(2, 10, 1000), 24);
    assert_eq!(pow_mod(3, 0, 7), 1);
    assert_eq!(pow_mod(7, 13, 11), 2);
    assert_eq!(pow_mod(10, 9, 1), 0);
}
