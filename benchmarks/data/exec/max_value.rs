/// The largest value in `xs`, or `None` when it is empty.
pub fn max_value(xs: &[i32]) -> Option<i32> {
// @middle
    xs.iter().copied().max()
// @end
}
// @tests
#[test]
fn maxima() {
    assert_eq!(max_value(&[]), None);
    assert_eq!(max_value(&[3]), Some(3));
    assert_eq!(max_value(&[-5, 2, 9, 1]), Some(9));
    assert_eq!(max_value(&[-5, -2, -9]), Some(-2));
}
