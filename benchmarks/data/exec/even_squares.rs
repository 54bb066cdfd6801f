/// The squares of the even numbers in `xs`, in order.
pub fn even_squares(xs: &[i64]) -> Vec<i64> {
// @middle
    xs.iter().filter(|&&x| x % 2 == 0).map(|&x| x * x).collect()
// @end
}
// @tests
#[test]
fn squares() {
    assert_eq!(even_squares(&[1, 2, 3, 4, 5, 6]), vec![4, 16, 36]);
    assert_eq!(even_squares(&[-2, 7]), vec![4]);
    assert!(even_squares(&[]).is_empty());
}
