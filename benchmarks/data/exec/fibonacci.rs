/// The n-th Fibonacci number: fib(0) = 0, fib(1) = 1, fib(n) = fib(n - 1) + fib(n - 2).
pub fn fib(n: u32) -> u64 {
    let (mut a, mut b) = (0u64, 1u64);
    for _ in 0..n {
// @middle
        let next = a + b;
        a = b;
        b = next;
// @end
    }
    a
}
// @tests
#[test]
fn fibs() {
    let got: Vec<u64> = (0..10).map(fib).collect();
    assert_eq!(got, [0, 1, 1, 2, 3, 5, 8, 13, 21, 34]);
    assert_eq!(fib(50), 12_586_269_025);
}
