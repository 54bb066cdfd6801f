/// Whether `n` is prime, by trial division.
pub fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    let mut i = 2;
    while i * i <= n {
// @middle
        if n % i == 0 {
            return false;
        }
        i += 1;
// @end
    }
    true
}
// @tests
#[test]
fn primes() {
    let got: Vec<u64> = (0..30).filter(|&n| is_prime(n)).collect();
    assert_eq!(got, [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]);
    assert!(is_prime(7919));
    assert!(!is_prime(7917));
}
