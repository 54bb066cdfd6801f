/// The index of the smallest value in `xs` (the first, if several), or `None` when it is empty.
pub fn min_index(xs: &[i32]) -> Option<usize> {
    let mut best: Option<usize> = None;
    for (i, &x) in xs.iter().enumerate() {
// @middle
        match best {
            Some(b) if xs[b] <= x => {}
            _ => best = Some(i),
        }
// @end
    }
    best
}
// @tests
#[test]
fn minima() {
    assert_eq!(min_index(&[]), None);
    assert_eq!(min_index(&[4, 2, 8, 2]), Some(1));
    assert_eq!(min_index(&[-1]), Some(0));
}
