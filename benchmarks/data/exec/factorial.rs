/// n! for small n (overflows past 20).
pub fn factorial(n: u64) -> u64 {
// @middle
    let mut result = 1;
    for i in 2..=n {
        result *= i;
    }
    result
// @end
}
// @tests
#[test]
fn factorials() {
    assert_eq!(factorial(0), 1);
    assert_eq!(factorial(1), 1);
    assert_eq!(factorial(5), 120);
    assert_eq!(factorial(20), 2_432_902_008_176_640_000);
}
