//! `outpost plan --records-per-second R`: what keeping R records a second
//! costs the flash, so an operator can size an SD card or an eMMC.
//!
//! The model (measured by `cargo bench --bench outbox_wear`, see
//! docs/operations.md#flash-wear): a group commit every `flush_interval`
//! that has records to commit, and each commit dirties the pages its bytes
//! fill plus, on average, one page it shares with the next commit. So the
//! bytes written a second are
//!
//! `R × OUTBOX_LOG_BYTES_PER_RECORD + commits/s × PAGE`,
//!
//! with `commits/s = min(R, 1 / flush_interval)`. The disk an outage fills
//! is `OUTBOX_DISK_BYTES_PER_RECORD` per record kept.

use std::time::Duration;

use serde::Serialize;

/// The page the kernel counts a write in.
pub const PAGE: f64 = 4096.0;
/// The record size the two figures below were measured with.
pub const MEASURED_RECORD_BYTES: f64 = 447.0;
/// What sled's compressed log takes per result record of
/// [`MEASURED_RECORD_BYTES`] beyond the page each commit dirties: fitted to
/// the bench's median outage figures (910 B a record at 500 records/s,
/// 4,547 B at 20), which the model then gives within 20 %, erring high at
/// the high rate (1,069 and 4,346 B).
pub const OUTBOX_LOG_BYTES_PER_RECORD: f64 = 250.0;
/// Disk held per kept record of [`MEASURED_RECORD_BYTES`] during an outage
/// (the bench: 0.98-0.99 × the records' bytes).
pub const OUTBOX_DISK_BYTES_PER_RECORD: f64 = 440.0;

#[derive(Debug, Clone, Serialize)]
pub struct FlashPlan {
    pub records_per_second: f64,
    pub commits_per_second: f64,
    pub written_bytes_per_day: f64,
    pub outage_disk_bytes_per_day: f64,
    /// Days a flash of `flash_bytes` rated for `cycles` program/erase
    /// cycles lasts at this rate (the daemon's writes alone).
    pub lifetime_days: Option<f64>,
}

/// The plan for `records_per_second` records of `record_bytes` each (the
/// figures scale with the record's size), committed every `flush_interval`;
/// `flash` = (bytes, rated cycles) for a lifetime.
pub fn flash_plan(
    records_per_second: f64,
    record_bytes: f64,
    flush_interval: Duration,
    flash: Option<(u64, u64)>,
) -> FlashPlan {
    let r = records_per_second.max(0.0);
    let scale = record_bytes.max(1.0) / MEASURED_RECORD_BYTES;
    let commits = r.min(1.0 / flush_interval.as_secs_f64().max(1e-6));
    let per_second = r * OUTBOX_LOG_BYTES_PER_RECORD * scale + commits * PAGE;
    let per_day = per_second * 86_400.0;
    FlashPlan {
        records_per_second: r,
        commits_per_second: commits,
        written_bytes_per_day: per_day,
        outage_disk_bytes_per_day: r * OUTBOX_DISK_BYTES_PER_RECORD * scale * 86_400.0,
        lifetime_days: flash
            .filter(|_| per_day > 0.0)
            .map(|(bytes, cycles)| bytes as f64 * cycles as f64 / per_day),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_grow_with_the_rate_and_each_commit_costs_a_page() {
        let i = Duration::from_millis(10);
        let slow = flash_plan(20.0, 447.0, i, None);
        let fast = flash_plan(500.0, 447.0, i, None);
        // The bench's figures, within 20 %.
        let per_record = |p: &FlashPlan| p.written_bytes_per_day / 86_400.0 / p.records_per_second;
        assert!((per_record(&fast) - 910.0).abs() < 182.0, "{fast:?}");
        assert!((per_record(&slow) - 4547.0).abs() < 909.0, "{slow:?}");
        assert_eq!(slow.commits_per_second, 20.0);
        assert_eq!(fast.commits_per_second, 100.0);
        assert!(fast.written_bytes_per_day > slow.written_bytes_per_day);
        // At a low rate every record is a commit of its own: a page or more.
        assert!(slow.written_bytes_per_day / (20.0 * 86_400.0) >= PAGE);
        assert_eq!(
            flash_plan(0.0, 447.0, i, Some((1 << 30, 1000))).lifetime_days,
            None
        );
        let life = flash_plan(500.0, 447.0, i, Some((32_000_000_000, 1000)))
            .lifetime_days
            .unwrap();
        assert!(life > 0.0);
    }
}
