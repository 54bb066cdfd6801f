/// How many bits of `n` are set.
pub fn count_ones(mut n: u32) -> u32 {
    let mut count = 0;
    while n != 0 {
// @middle
        count += n & 1;
        n >>= 1;
// @end
    }
    count
}
// @tests
#[test]
fn ones() {
    assert_eq!(count_ones(0), 0);
    assert_eq!(count_ones(0b1011), 3);
    assert_eq!(count_ones(u32::MAX), 32);
}
