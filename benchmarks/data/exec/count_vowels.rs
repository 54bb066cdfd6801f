/// How many vowels (a, e, i, o, u, either case) `s` has.
pub fn count_vowels(s: &str) -> usize {
// @middle
    s.chars().filter(|c| "aeiouAEIOU".contains(*c)).count()
// @end
}
// @tests
#[test]
fn vowels() {
    assert_eq!(count_vowels(""), 0);
    assert_eq!(count_vowels("rhythm"), 0);
    assert_eq!(count_vowels("Hello World"), 3);
    assert_eq!(count_vowels("AEIOU aeiou"), 10);
}
