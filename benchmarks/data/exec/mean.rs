/// The arithmetic mean of `xs`, or `None` when it is empty.
pub fn mean(xs: &[f64]) -> Option<f64> {
// @middle
    if xs.is_empty() {
        return None;
    }
    Some(xs.iter().sum::<f64>() / xs.len() as f64)
// @end
}
// @tests
#[test]
fn means() {
    assert_eq!(mean(&[]), None);
    assert_eq!(mean(&[2.0]), Some(2.0));
    assert_eq!(mean(&[1.0, 2.0, 3.0, 4.0]), Some(2.5));
}
