//! Figures for `/metrics` and `outpost outbox stats`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// A snapshot of the outbox. Counters (`*_total`) count since this open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxStats {
    pub boot: u64,
    /// Unacknowledged records stored.
    pub records: u64,
    /// Their size: keys, headers and record bytes.
    pub bytes: u64,
    pub oldest_appended_at: Option<SystemTime>,
    /// How long the oldest unacknowledged record has waited.
    pub oldest_age: Option<Duration>,
    pub dead_letters: u64,
    pub dead_letter_bytes: u64,
    pub max_bytes: u64,
    pub appended_total: u64,
    pub acked_total: u64,
    pub dead_lettered_total: u64,
    pub dropped: Dropped,
    pub flushes_total: u64,
    pub flush_errors_total: u64,
    /// 1 when this open moved a damaged database aside.
    pub quarantined_total: u64,
    /// Why records are refused now (disk full, I/O error); None: storing.
    pub unavailable: Option<String>,
    /// Databases reopened after a write error.
    pub reopens_total: u64,
    /// Records appended before a write error that a reopen could not put back.
    pub lost_total: u64,
    pub last_flush_duration: Option<Duration>,
    /// Records kept in memory while the disk refuses writes.
    pub held: super::HeldStats,
}

/// Records lost to the `max_bytes` policy or damage, by reason.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Dropped {
    /// Oldest records removed to make room (`when_full = drop_oldest`).
    pub full_drop_oldest: u64,
    /// New records refused (`when_full = reject_new`).
    pub full_reject_new: u64,
    /// Dead letters removed to make room (either policy).
    pub full_drop_dead_letter: u64,
    /// Records beyond `memory_when_read_only` while the disk refuses writes.
    pub read_only: u64,
}

impl Dropped {
    /// `(reason, count)` pairs: the `reason` label of a metric.
    pub fn by_reason(&self) -> [(&'static str, u64); 4] {
        [
            ("full_drop_oldest", self.full_drop_oldest),
            ("full_reject_new", self.full_reject_new),
            ("full_drop_dead_letter", self.full_drop_dead_letter),
            ("read_only", self.read_only),
        ]
    }

    pub fn total(&self) -> u64 {
        self.by_reason().iter().map(|(_, n)| n).sum()
    }
}

#[derive(Debug, Default)]
pub(crate) struct DropCounters {
    pub full_drop_oldest: AtomicU64,
    pub full_reject_new: AtomicU64,
    pub full_drop_dead_letter: AtomicU64,
}

impl DropCounters {
    pub fn snapshot(&self) -> Dropped {
        Dropped {
            full_drop_oldest: self.full_drop_oldest.load(Ordering::Relaxed),
            full_reject_new: self.full_reject_new.load(Ordering::Relaxed),
            full_drop_dead_letter: self.full_drop_dead_letter.load(Ordering::Relaxed),
            // Counted by the held records (degraded.rs); filled in by `stats`.
            read_only: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_by_reason_sums() {
        let d = Dropped {
            full_drop_oldest: 3,
            full_reject_new: 2,
            full_drop_dead_letter: 1,
            read_only: 4,
        };
        assert_eq!(d.total(), 10);
        assert_eq!(d.by_reason()[1], ("full_reject_new", 2));
    }
}
