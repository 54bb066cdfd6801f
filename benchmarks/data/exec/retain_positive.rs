/// Removes every value that is not positive, keeping the order of the rest.
pub fn keep_positive(xs: &mut Vec<i32>) {
// @middle
    xs.retain(|&x| x > 0);
// @end
}
// @tests
#[test]
fn keeps() {
    let mut v = vec![3, -1, 0, 7, -5, 2];
    keep_positive(&mut v);
    assert_eq!(v, vec![3, 7, 2]);
}
