/// The product of an n x m matrix and an m x p matrix, both given as rows.
pub fn matmul(a: &[Vec<i64>], b: &[Vec<i64>]) -> Vec<Vec<i64>> {
    let (n, m, p) = (a.len(), b.len(), b[0].len());
    let mut c = vec![vec![0; p]; n];
    for i in 0..n {
        for j in 0..p {
// @middle
            for k in 0..m {
                c[i][j] += a[i][k] * b[k][j];
            }
// @end
        }
    }
    c
}
// @tests
#[test]
fn multiplies() {
    let a = vec![vec![1, 2], vec![3, 4]];
    let b = vec![vec![5, 6], vec![7, 8]];
    assert_eq!(matmul(&a, &b), vec![vec![19, 22], vec![43, 50]]);
}
