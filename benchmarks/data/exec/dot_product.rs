/// The dot product of two vectors of the same length.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
// @middle
    a.iter().zip(b).map(|(x, y)| x * y).sum()
// @end
}
// @tests
#[test]
fn dots() {
    assert_eq!(dot(&[1.0, 2.0, 3.0], &[4.0, 5.0, 6.0]), 32.0);
    assert_eq!(dot(&[], &[]), 0.0);
}
