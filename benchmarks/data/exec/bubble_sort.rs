/// Sorts `xs` in ascending order by repeatedly swapping neighbours out of order.
pub fn bubble_sort(xs: &mut [i32]) {
    let n = xs.len();
    for i in 0..n {
        for j in 0..n - 1 - i {
// @middle
            if xs[j] > xs[j + 1] {
                xs.swap(j, j + 1);
            }
// @end
        }
    }
}
// @tests
#[test]
fn sorts() {
    let mut a = [4, 1, 3, 9, 7];
    bubble_sort(&mut a);
    assert_eq!(a, [1, 3, 4, 7, 9]);
}
