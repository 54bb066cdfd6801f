use std::collections::HashSet;

/// The distinct values of `xs`, in ascending order.
pub fn unique_sorted(xs: &[i32]) -> Vec<i32> {
// @middle
    let set: HashSet<i32> = xs.iter().copied().collect();
    let mut out: Vec<i32> = set.into_iter().collect();
    out.sort();
    out
// @end
}
// @tests
#[test]
fn uniques() {
    assert_eq!(unique_sorted(&[3, 1, 3, 2, 1]), vec![1, 2, 3]);
    assert!(unique_sorted(&[]).is_empty());
}
