/// Splits `key = value` at its first `=`, trimming both sides; `None` without an `=`.
pub fn parse_pair(s: &str) -> Option<(&str, &str)> {
// @middle
    let (key, value) = s.split_once('=')?;
    Some((key.trim(), value.trim()))
// @end
}
// @tests
#[test]
fn pairs() {
    assert_eq!(parse_pair("name = m31r"), Some(("name", "m31r")));
    assert_eq!(parse_pair("a=b=c"), Some(("a", "b=c")));
    assert_eq!(parse_pair("no equals"), None);
}
