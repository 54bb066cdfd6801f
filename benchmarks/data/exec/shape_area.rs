use std::f64::consts::PI;

pub enum Shape {
    Circle { radius: f64 },
    Rectangle { width: f64, height: f64 },
    Triangle { base: f64, height: f64 },
}

impl Shape {
    pub fn area(&self) -> f64 {
        match self {
// @middle
            Shape::Circle { radius } => PI * radius * radius,
            Shape::Rectangle { width, height } => width * height,
            Shape::Triangle { base, height } => 0.5 * base * height,
// @end
        }
    }
}
// @tests
#[test]
fn areas() {
    assert!((Shape::Circle { radius: 2.0 }.area() - 4.0 * PI).abs() < 1e-12);
    assert_eq!(Shape::Rectangle { width: 3.0, height: 4.0 }.area(), 12.0);
    assert_eq!(Shape::Triangle { base: 3.0, height: 4.0 }.area(), 6.0);
}
