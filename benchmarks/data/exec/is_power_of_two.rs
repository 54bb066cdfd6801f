/// Whether `n` is a power of two (1, 2, 4, ...). Zero is not.
pub fn is_power_of_two(n: u64) -> bool {
// @middle
    n != 0 && n & (n - 1) == 0
// @end
}
// @tests
#[test]
fn powers() {
    assert!(is_power_of_two(1));
    assert!(is_power_of_two(64));
    assert!(is_power_of_two(1 << 40));
    assert!(!is_power_of_two(0));
    assert!(!is_power_of_two(12));
    assert!(!is_power_of_two(63));
}
