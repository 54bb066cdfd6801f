/// `s` with its first character in upper case.
pub fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
// @middle
        Some(first) => first.to_uppercase().collect::<String>() + chars.as_str(),
        None => String::new(),
// @end
    }
}
// @tests
#[test]
fn capitalized() {
    assert_eq!(capitalize("hello"), "Hello");
    assert_eq!(capitalize("Rust"), "Rust");
    assert_eq!(capitalize(""), "");
    assert_eq!(capitalize("élan"), "Élan");
}
