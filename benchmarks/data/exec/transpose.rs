/// The transpose of a rectangular matrix given as rows.
pub fn transpose(m: &[Vec<i32>]) -> Vec<Vec<i32>> {
    if m.is_empty() {
        return Vec::new();
    }
    let mut out = vec![vec![0; m.len()]; m[0].len()];
    for (i, row) in m.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
// @middle
            out[j][i] = v;
// @end
        }
    }
    out
}
// @tests
#[test]
fn transposes() {
    let m = vec![vec![1, 2, 3], vec![4, 5, 6]];
    assert_eq!(transpose(&m), vec![vec![1, 4], vec![2, 5], vec![3, 6]]);
    assert!(transpose(&[]).is_empty());
}
