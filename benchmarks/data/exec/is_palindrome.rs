/// Whether `s` reads the same forwards and backwards, character by character.
pub fn is_palindrome(s: &str) -> bool {
// @middle
    s.chars().eq(s.chars().rev())
// @end
}
// @tests
#[test]
fn palindromes() {
    assert!(is_palindrome(""));
    assert!(is_palindrome("racecar"));
    assert!(is_palindrome("abba"));
    assert!(!is_palindrome("abca"));
    assert!(is_palindrome("été"));
}
