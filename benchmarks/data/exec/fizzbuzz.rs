/// "Fizz" for multiples of 3, "Buzz" for multiples of 5, "FizzBuzz" for both, else the number.
pub fn fizzbuzz(n: u32) -> String {
    match (n % 3, n % 5) {
// @middle
        (0, 0) => "FizzBuzz".to_string(),
        (0, _) => "Fizz".to_string(),
        (_, 0) => "Buzz".to_string(),
        _ => n.to_string(),
// @end
    }
}
// @tests
#[test]
fn fizz() {
    let got: Vec<String> = (1..=15).map(fizzbuzz).collect();
    assert_eq!(got[2], "Fizz");
    assert_eq!(got[4], "Buzz");
    assert_eq!(got[14], "FizzBuzz");
    assert_eq!(got[6], "7");
}
