/// `s` written `n` times, separated by `sep`.
pub fn repeat_joined(s: &str, n: usize, sep: &str) -> String {
// @middle
    vec![s; n].join(sep)
// @end
}
// @tests
#[test]
fn repeats() {
    assert_eq!(repeat_joined("ab", 3, "-"), "ab-ab-ab");
    assert_eq!(repeat_joined("x", 1, ", "), "x");
    assert_eq!(repeat_joined("x", 0, ", "), "");
}
