/// The mean number of characters of the words of `text`, or 0.0 when it has none.
pub fn average_word_length(text: &str) -> f64 {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.is_empty() {
        return 0.0;
    }
// @middle
    let total: usize = words.iter().map(|w| w.chars().count()).sum();
    total as f64 / words.len() as f64
// @end
}
// @tests
#[test]
fn lengths() {
    assert_eq!(average_word_length("ab abcd"), 3.0);
    assert_eq!(average_word_length("   "), 0.0);
}
