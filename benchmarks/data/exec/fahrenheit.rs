/// Converts a temperature from degrees Celsius to degrees Fahrenheit.
pub fn celsius_to_fahrenheit(celsius: f64) -> f64 {
// @middle
    celsius * 9.0 / 5.0 + 32.0
// @end
}
// @tests
#[test]
fn converts() {
    assert_eq!(celsius_to_fahrenheit(0.0), 32.0);
    assert_eq!(celsius_to_fahrenheit(100.0), 212.0);
    assert_eq!(celsius_to_fahrenheit(-40.0), -40.0);
}
