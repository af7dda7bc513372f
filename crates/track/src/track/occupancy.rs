//! How many objects of each label a zone holds, per stream: the count told
//! (`zone_occupancy`, the gauge, the status) changes only once a new count
//! held for the zone's `inertia` consecutive frames, so a box flickering on
//! the edge or a detector missing one frame does not flood the outbox.
//!
//! Invariants:
//! - a change is told once, dated at the first frame of the new count;
//! - a count that comes back to the told one before `inertia` frames is no
//!   change; a count that moves on to a third value starts its run again.

use std::time::SystemTime;

/// A change of a zone's count of one label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub count: u32,
    pub previous: u32,
    /// The first frame of the new count.
    pub at: SystemTime,
}

/// One zone's count of one label.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    told: u32,
    pending: u32,
    run: u32,
    run_start: Option<SystemTime>,
}

impl Counter {
    pub fn told(&self) -> u32 {
        self.told
    }

    /// This frame's count `raw`, at `at`.
    pub fn step(&mut self, raw: u32, inertia: u32, at: SystemTime) -> Option<Change> {
        if raw == self.told {
            self.run = 0;
            self.run_start = None;
            return None;
        }
        if self.run == 0 || raw != self.pending {
            self.pending = raw;
            self.run = 0;
            self.run_start = Some(at);
        }
        self.run += 1;
        if self.run < inertia.max(1) {
            return None;
        }
        let change = Change {
            count: raw,
            previous: self.told,
            at: self.run_start.unwrap_or(at),
        };
        *self = Counter {
            told: raw,
            ..Counter::default()
        };
        Some(change)
    }

    /// The stream ended: whatever was counted is gone at once.
    pub fn empty(&mut self, at: SystemTime) -> Option<Change> {
        let previous = self.told;
        *self = Counter::default();
        (previous > 0).then_some(Change {
            count: 0,
            previous,
            at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn t(f: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(f * 100)
    }

    /// Feeds `counts` one a frame; the changes told, by frame.
    fn run(inertia: u32, counts: &[u32]) -> Vec<(usize, Change)> {
        let mut c = Counter::default();
        counts
            .iter()
            .enumerate()
            .filter_map(|(f, n)| c.step(*n, inertia, t(f as u64)).map(|ch| (f, ch)))
            .collect()
    }

    #[test]
    fn a_change_is_told_after_inertia_frames_dated_at_its_first() {
        let got = run(3, &[0, 1, 1, 1, 1, 2, 2, 2, 0, 0, 0]);
        let ch = |count, previous, at| Change {
            count,
            previous,
            at: t(at),
        };
        assert_eq!(
            got,
            vec![(3, ch(1, 0, 1)), (7, ch(2, 1, 5)), (10, ch(0, 2, 8))]
        );
    }

    #[test]
    fn a_flicker_shorter_than_inertia_is_no_change() {
        assert!(run(3, &[0, 1, 1, 0, 1, 0, 1, 1, 0]).is_empty());
        // Inertia 1: every change at once.
        assert_eq!(run(1, &[0, 1, 0]).len(), 2);
    }

    #[test]
    fn a_count_moving_on_starts_its_run_again() {
        // 1 for two frames, then 2: the run restarts at the 2.
        let got = run(3, &[0, 1, 1, 2, 2, 2]);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].0, 5);
        assert_eq!(
            got[0].1,
            Change {
                count: 2,
                previous: 0,
                at: t(3)
            }
        );
    }

    #[test]
    fn an_ended_stream_empties_at_once() {
        let mut c = Counter::default();
        for f in 0..3 {
            c.step(2, 3, t(f));
        }
        assert_eq!(c.told(), 2);
        assert_eq!(
            c.empty(t(9)),
            Some(Change {
                count: 0,
                previous: 2,
                at: t(9)
            })
        );
        assert_eq!(c.empty(t(10)), None);
    }
}
