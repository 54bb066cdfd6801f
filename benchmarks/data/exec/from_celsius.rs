#[derive(Debug, PartialEq)]
pub struct Celsius(pub f64);

#[derive(Debug, PartialEq)]
pub struct Fahrenheit(pub f64);

impl From<Celsius> for Fahrenheit {
    fn from(c: Celsius) -> Self {
// @middle
        Fahrenheit(c.0 * 9.0 / 5.0 + 32.0)
// @end
    }
}
// @tests
#[test]
fn converts() {
    assert_eq!(Fahrenheit::from(Celsius(100.0)), Fahrenheit(212.0));
    let f: Fahrenheit = Celsius(-40.0).into();
    assert_eq!(f, Fahrenheit(-40.0));
}
