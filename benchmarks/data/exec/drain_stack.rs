/// Pops every item off `stack` and returns them in the order they came off.
pub fn drain_stack(mut stack: Vec<u32>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Some(top) = stack.pop() {
// @middle
        out.push(top);
// @end
    }
    out
}
// @tests
#[test]
fn drains() {
    assert_eq!(drain_stack(vec![1, 2, 3]), vec![3, 2, 1]);
    assert!(drain_stack(vec![]).is_empty());
}
