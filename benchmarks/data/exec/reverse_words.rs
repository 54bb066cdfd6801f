/// The words of `s` in reverse order, joined by single spaces.
pub fn reverse_words(s: &str) -> String {
// @middle
    s.split_whitespace().rev().collect::<Vec<_>>().join(" ")
// @end
}
// @tests
#[test]
fn reversed() {
    assert_eq!(reverse_words("hello world"), "world hello");
    assert_eq!(reverse_words("  a  b c "), "c b a");
    assert_eq!(reverse_words(""), "");
}
