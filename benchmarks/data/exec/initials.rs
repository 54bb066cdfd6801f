/// The upper-case first letters of the words of a name: "ada king lovelace" gives "AKL".
pub fn initials(name: &str) -> String {
// @middle
    name.split_whitespace()
        .filter_map(|w| w.chars().next())
        .flat_map(|c| c.to_uppercase())
        .collect()
// @end
}
// @tests
#[test]
fn letters() {
    assert_eq!(initials("ada king lovelace"), "AKL");
    assert_eq!(initials("  grace  hopper "), "GH");
    assert_eq!(initials(""), "");
}
