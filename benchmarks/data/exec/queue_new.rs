/// A queue of jobs, served first come, first served.
pub struct Queue {
    jobs: Vec<String>,
    served: usize,
}

impl Queue {
    /// An empty queue.
    pub fn new() -> Self {
// @middle
        Queue {
            jobs: Vec::new(),
            served: 0,
        }
// @end
    }

    pub fn add(&mut self, job: &str) {
        self.jobs.push(job.to_string());
    }

    pub fn next(&mut self) -> Option<&str> {
        let job = self.jobs.get(self.served)?;
        self.served += 1;
        Some(job)
    }
}
// @tests
#[test]
fn queues() {
    let mut q = Queue::new();
    assert_eq!(q.next(), None);
    q.add("a");
    q.add("b");
    assert_eq!(q.next(), Some("a"));
    assert_eq!(q.next(), Some("b"));
    assert_eq!(q.next(), None);
}
