/// The largest sum of `k` consecutive values of `xs`, or `None` if it has fewer than `k` (or `k` is 0).
pub fn max_window_sum(xs: &[i64], k: usize) -> Option<i64> {
    if k == 0 || xs.len() < k {
        return None;
    }
// @middle
    xs.windows(k).map(|w| w.iter().sum()).max()
// @end
}
// @tests
#[test]
fn windows() {
    assert_eq!(max_window_sum(&[1, 4, -2, 5, 1], 2), Some(6));
    assert_eq!(max_window_sum(&[1, 4, -2, 5, 1], 3), Some(7));
    assert_eq!(max_window_sum(&[1], 2), None);
}
