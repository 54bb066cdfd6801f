/// The value of a string of binary digits such as "1011", or `None` if it has another character.
pub fn parse_binary(s: &str) -> Option<u64> {
    let mut value = 0u64;
    for c in s.chars() {
// @middle
        let bit = match c {
            '0' => 0,
            '1' => 1,
            _ => return None,
        };
        value = value * 2 + bit;
// @end
    }
    Some(value)
}
// @tests
#[test]
fn parses() {
    assert_eq!(parse_binary("1011"), Some(11));
    assert_eq!(parse_binary("0"), Some(0));
    assert_eq!(parse_binary("102"), None);
}
