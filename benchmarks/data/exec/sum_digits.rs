/// The sum of the decimal digits of `n`.
pub fn sum_digits(mut n: u64) -> u64 {
    let mut sum = 0;
    while n > 0 {
// @middle
        sum += n % 10;
        n /= 10;
// @end
    }
    sum
}
// @tests
#[test]
fn digits() {
    assert_eq!(sum_digits(0), 0);
    assert_eq!(sum_digits(7), 7);
    assert_eq!(sum_digits(1234), 10);
    assert_eq!(sum_digits(99_999), 45);
}
