use std::fmt;

pub struct Point {
    pub x: i32,
    pub y: i32,
}

impl fmt::Display for Point {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
// @middle
        write!(f, "({}, {})", self.x, self.y)
// @end
    }
}
// @tests
#[test]
fn shown() {
    assert_eq!(Point { x: 1, y: -2 }.to_string(), "(1, -2)");
    assert_eq!(format!("{}", Point { x: 0, y: 0 }), "(0, 0)");
}
