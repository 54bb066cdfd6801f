/// Reverses `xs` in place.
pub fn reverse_in_place(xs: &mut [i32]) {
    let n = xs.len();
    for i in 0..n / 2 {
// @middle
        xs.swap(i, n - 1 - i);
// @end
    }
}
// @tests
#[test]
fn reverses() {
    let mut a = [1, 2, 3, 4, 5];
    reverse_in_place(&mut a);
    assert_eq!(a, [5, 4, 3, 2, 1]);
    let mut b = [1, 2];
    reverse_in_place(&mut b);
    assert_eq!(b, [2, 1]);
}
