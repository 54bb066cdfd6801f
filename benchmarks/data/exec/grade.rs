/// The letter grade for a score out of 100: A from 90, B from 80, C from 70, D from 60, else F.
pub fn grade(score: u32) -> char {
    match score {
// @middle
        90..=100 => 'A',
        80..=89 => 'B',
        70..=79 => 'C',
        60..=69 => 'D',
        _ => 'F',
// @end
    }
}
// @tests
#[test]
fn grades() {
    assert_eq!(grade(95), 'A');
    assert_eq!(grade(80), 'B');
    assert_eq!(grade(79), 'C');
    assert_eq!(grade(60), 'D');
    assert_eq!(grade(12), 'F');
}
