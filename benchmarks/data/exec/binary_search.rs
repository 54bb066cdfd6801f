/// The index of `target` in the sorted slice `xs`, if it is there.
pub fn binary_search(xs: &[i32], target: i32) -> Option<usize> {
    let mut lo = 0;
    let mut hi = xs.len();
    while lo < hi {
// @middle
        let mid = lo + (hi - lo) / 2;
        if xs[mid] == target {
            return Some(mid);
        } else if xs[mid] < target {
            lo = mid + 1;
        } else {
            hi = mid;
        }
// @end
    }
    None
}
// @tests
#[test]
fn search() {
    let xs = [1, 3, 5, 7, 9, 11];
    for (i, &x) in xs.iter().enumerate() {
        assert_eq!(binary_search(&xs, x), Some(i));
    }
    assert_eq!(binary_search(&xs, 4), None);
    assert_eq!(binary_search(&xs, 12), None);
    assert_eq!(binary_search(&[], 1), None);
}
