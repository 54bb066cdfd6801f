/// Counts events.
#[derive(Debug, Default)]
pub struct Counter {
    count: u64,
}

impl Counter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Counts one more event and returns the new total.
    pub fn increment(&mut self) -> u64 {
// @middle
        self.count += 1;
        self.count
// @end
    }

    pub fn get(&self) -> u64 {
        self.count
    }

    pub fn reset(&mut self) {
        self.count = 0;
    }
}
// @tests
#[test]
fn counts() {
    let mut c = Counter::new();
    assert_eq!(c.increment(), 1);
    assert_eq!(c.increment(), 2);
    assert_eq!(c.get(), 2);
    c.reset();
    assert_eq!(c.increment(), 1);
}
