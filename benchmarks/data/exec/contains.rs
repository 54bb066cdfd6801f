/// Whether `needle` occurs in `haystack`.
pub fn contains(haystack: &[i32], needle: i32) -> bool {
    for &x in haystack {
// @middle
        if x == needle {
            return true;
        }
// @end
    }
    false
}
// @tests
#[test]
fn finds() {
    assert!(contains(&[1, 2, 3], 2));
    assert!(!contains(&[1, 2, 3], 4));
    assert!(!contains(&[], 0));
}
