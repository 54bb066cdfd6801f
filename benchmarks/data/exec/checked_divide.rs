#[derive(Debug, PartialEq)]
pub enum MathError {
    DivisionByZero,
}

/// `a / b`, or an error when `b` is zero.
pub fn divide(a: i32, b: i32) -> Result<i32, MathError> {
// @middle
    if b == 0 {
        return Err(MathError::DivisionByZero);
    }
    Ok(a / b)
// @end
}
// @tests
#[test]
fn divides() {
    assert_eq!(divide(7, 2), Ok(3));
    assert_eq!(divide(-9, 3), Ok(-3));
    assert_eq!(divide(1, 0), Err(MathError::DivisionByZero));
}
