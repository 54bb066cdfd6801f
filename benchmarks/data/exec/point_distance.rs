#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Point {
    pub x: f64,
    pub y: f64,
}

impl Point {
    pub fn new(x: f64, y: f64) -> Self {
        Point { x, y }
    }

    /// The Euclidean distance between `self` and `other`.
    pub fn distance(&self, other: &Point) -> f64 {
// @middle
        let dx = self.x - other.x;
        let dy = self.y - other.y;
        (dx * dx + dy * dy).sqrt()
// @end
    }
}
// @tests
#[test]
fn distances() {
    let a = Point::new(0.0, 0.0);
    let b = Point::new(3.0, 4.0);
    assert!((a.distance(&b) - 5.0).abs() < 1e-12);
    assert!((b.distance(&a) - 5.0).abs() < 1e-12);
    assert_eq!(a.distance(&a), 0.0);
}
