#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    North,
    East,
    South,
    West,
}

impl Direction {
    /// The direction pointing the other way.
    pub fn opposite(self) -> Direction {
        match self {
// @middle
            Direction::North => Direction::South,
            Direction::East => Direction::West,
            Direction::South => Direction::North,
            Direction::West => Direction::East,
// @end
        }
    }
}
// @tests
#[test]
fn opposites() {
    use Direction::*;
    for d in [North, East, South, West] {
        assert_ne!(d.opposite(), d);
        assert_eq!(d.opposite().opposite(), d);
    }
    assert_eq!(North.opposite(), South);
    assert_eq!(East.opposite(), West);
}
