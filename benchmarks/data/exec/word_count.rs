use std::collections::HashMap;

/// How many times each whitespace-separated word occurs in `text`.
pub fn word_count(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
// @middle
        *counts.entry(word.to_string()).or_insert(0) += 1;
// @end
    }
    counts
}
// @tests
#[test]
fn counts() {
    let c = word_count("the cat and the hat and the bat");
    assert_eq!(c["the"], 3);
    assert_eq!(c["and"], 2);
    assert_eq!(c["cat"], 1);
    assert_eq!(c.len(), 5);
    assert!(word_count("  ").is_empty());
}
