/// Sorts `xs` in ascending order by insertion.
pub fn insertion_sort(xs: &mut [i32]) {
    for i in 1..xs.len() {
        let mut j = i;
        while j > 0 && xs[j - 1] > xs[j] {
// @middle
            xs.swap(j - 1, j);
            j -= 1;
// @end
        }
    }
}
// @tests
#[test]
fn sorts() {
    let mut a = [5, 2, 9, 1, 5, 6];
    insertion_sort(&mut a);
    assert_eq!(a, [1, 2, 5, 5, 6, 9]);
    let mut b: [i32; 0] = [];
    insertion_sort(&mut b);
}
