use std::collections::HashMap;

/// The character that occurs most often in `s` (the smallest one on a tie), or `None` for "".
pub fn most_common_char(s: &str) -> Option<char> {
    let mut counts: HashMap<char, usize> = HashMap::new();
    for c in s.chars() {
// @middle
        *counts.entry(c).or_insert(0) += 1;
// @end
    }
    counts.into_iter().max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0))).map(|(c, _)| c)
}
// @tests
#[test]
fn common() {
    assert_eq!(most_common_char(""), None);
    assert_eq!(most_common_char("hello"), Some('l'));
    assert_eq!(most_common_char("abab"), Some('a'));
}
