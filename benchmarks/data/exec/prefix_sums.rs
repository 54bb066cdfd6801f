/// The running totals of `xs`: element i is the sum of xs[0..=i].
pub fn prefix_sums(xs: &[i64]) -> Vec<i64> {
    let mut out = Vec::with_capacity(xs.len());
    let mut total = 0;
    for &x in xs {
// @middle
        total += x;
        out.push(total);
// @end
    }
    out
}
// @tests
#[test]
fn sums() {
    assert_eq!(prefix_sums(&[1, 2, 3, 4]), vec![1, 3, 6, 10]);
    assert_eq!(prefix_sums(&[5, -5]), vec![5, 0]);
    assert!(prefix_sums(&[]).is_empty());
}
