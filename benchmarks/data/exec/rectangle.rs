#[derive(Debug, Clone, Copy)]
pub struct Rect {
    pub width: u32,
    pub height: u32,
}

impl Rect {
    pub fn area(&self) -> u32 {
        self.width * self.height
    }

    /// Whether `other` fits inside `self` without turning it.
    pub fn can_hold(&self, other: &Rect) -> bool {
// @middle
        self.width >= other.width && self.height >= other.height
// @end
    }
}
// @tests
#[test]
fn holds() {
    let big = Rect { width: 8, height: 7 };
    let small = Rect { width: 5, height: 1 };
    assert!(big.can_hold(&small));
    assert!(!small.can_hold(&big));
    assert!(big.can_hold(&big));
}
