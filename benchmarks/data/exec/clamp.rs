/// `x` limited to the range `lo..=hi`.
pub fn clamp(x: i32, lo: i32, hi: i32) -> i32 {
// @middle
    if x < lo {
        lo
    } else if x > hi {
        hi
    } else {
        x
    }
// @end
}
// @tests
#[test]
fn clamps() {
    assert_eq!(clamp(5, 0, 10), 5);
    assert_eq!(clamp(-3, 0, 10), 0);
    assert_eq!(clamp(42, 0, 10), 10);
}
