use std::num::ParseIntError;

/// Parses a comma-separated list of integers such as "1, 2, 3".
pub fn parse_numbers(s: &str) -> Result<Vec<i64>, ParseIntError> {
// @middle
    s.split(',').map(|part| part.trim().parse::<i64>()).collect()
// @end
}
// @tests
#[test]
fn parses() {
    assert_eq!(parse_numbers("1, 2, 3").unwrap(), vec![1, 2, 3]);
    assert_eq!(parse_numbers("-7").unwrap(), vec![-7]);
    assert!(parse_numbers("1, x").is_err());
}
