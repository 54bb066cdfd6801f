use std::num::ParseIntError;

/// The sum of the sizes in lines such as "report.txt 1200", one file a line.
pub fn total_size(listing: &str) -> Result<u64, ParseIntError> {
    let mut total = 0;
    for line in listing.lines() {
// @middle
        let size = line.split_whitespace().last().unwrap_or("0");
        total += size.parse::<u64>()?;
// @end
    }
    Ok(total)
}
// @tests
#[test]
fn sums() {
    assert_eq!(total_size("a.txt 100\nb.txt 23"), Ok(123));
    assert_eq!(total_size(""), Ok(0));
    assert!(total_size("a.txt lots").is_err());
}
