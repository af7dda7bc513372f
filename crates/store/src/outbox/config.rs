//! `[outbox]` settings.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How the outbox behaves and how much disk it may take.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxConfig {
    /// Group commit period: a record is durable at most this long (plus one
    /// flush) after its append. Shorter costs more fsyncs; an idle outbox
    /// never flushes.
    #[serde(with = "humantime_serde")]
    pub flush_interval: Duration,
    /// Flush early once this many records were appended since the last
    /// flush, so a burst does not pile up a large unflushed tail.
    pub flush_records: usize,
    /// Budget for stored records plus dead letters (keys, headers and
    /// record bytes; sled's on-disk size is larger, see the module header).
    /// A number of bytes or a size such as "1 GiB".
    #[serde(with = "crate::bytesize")]
    pub max_bytes: u64,
    /// What an append does when the budget is spent.
    pub when_full: WhenFull,
    /// sled's page cache in bytes. The outbox is written once and read once,
    /// so a big cache buys little and costs resident memory on small devices.
    #[serde(with = "crate::bytesize")]
    pub cache_capacity: u64,
    /// While the disk refuses writes (a file system turned read-only, I/O
    /// errors), new records are held in memory up to this many bytes (keys,
    /// headers and record bytes), then `when_full` decides which go; those
    /// are counted. 0 holds none.
    #[serde(with = "crate::bytesize")]
    pub memory_when_read_only: u64,
    /// sled writes its log through zstd: about a third of the flash's
    /// writes and disk per record during an outage, for some CPU per
    /// record. A database of the other kind is converted at the next start.
    pub compress: bool,
}

/// Default group commit period.
pub const DEFAULT_FLUSH_INTERVAL: Duration = Duration::from_millis(10);
/// Default early-flush threshold.
pub const DEFAULT_FLUSH_RECORDS: usize = 1000;
/// Default budget: 1 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;
/// Default sled cache.
/// 8 MiB: a 1,000,000-record backlog of a compressed log measures 80 MB
/// resident while appending and 147 MB after a reopen's scan
/// (benches/outbox.rs; sled keeps per-page state on top of the cache).
pub const DEFAULT_CACHE_CAPACITY: u64 = 8 << 20;
/// Default memory for records while the disk is read-only: 16 MiB, about
/// 35,000 records of 450 bytes (minutes to hours of a site's results).
pub const DEFAULT_MEMORY_WHEN_READ_ONLY: u64 = 16 << 20;

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            flush_interval: DEFAULT_FLUSH_INTERVAL,
            flush_records: DEFAULT_FLUSH_RECORDS,
            max_bytes: DEFAULT_MAX_BYTES,
            when_full: WhenFull::default(),
            cache_capacity: DEFAULT_CACHE_CAPACITY,
            memory_when_read_only: DEFAULT_MEMORY_WHEN_READ_ONLY,
            compress: true,
        }
    }
}

/// Policy when an append would exceed `max_bytes`. Dead letters (records the
/// fleet refused, never to be sent) are always dropped first, oldest first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenFull {
    /// Drop the oldest records until the new one fits: the freshest data wins.
    #[default]
    DropOldest,
    /// Refuse the new record (`OutboxError::Full`): what is stored is kept.
    RejectNew,
}

impl OutboxConfig {
    /// Every problem, empty when the config is usable.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.flush_interval.is_zero() {
            p.push("flush_interval must be above 0 (e.g. \"10ms\")".to_string());
        } else if self.flush_interval > Duration::from_secs(60) {
            p.push(format!(
                "flush_interval {:?} is above 60s: that much data could be lost in a power cut",
                self.flush_interval
            ));
        }
        if self.flush_records == 0 {
            p.push("flush_records must be at least 1".to_string());
        }
        if self.max_bytes < 64 << 10 {
            p.push(format!(
                "max_bytes {} is below the minimum of 65536",
                self.max_bytes
            ));
        }
        if self.cache_capacity < 1 << 20 {
            p.push(format!(
                "cache_capacity {} is below the minimum of 1048576",
                self.cache_capacity
            ));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_named() {
        let c = OutboxConfig::default();
        assert!(c.validate().is_empty());
        assert_eq!(c.flush_interval, Duration::from_millis(10));
        assert_eq!(c.flush_records, 1000);
        assert_eq!(c.max_bytes, 1 << 30);
        assert_eq!(c.when_full, WhenFull::DropOldest);
        assert_eq!(c.cache_capacity, 8 << 20);
        assert_eq!(c.memory_when_read_only, 16 << 20);
    }

    #[test]
    fn parses_toml_with_humantime_and_policy() {
        let c: OutboxConfig = toml::from_str(
            "flush_interval = \"25ms\"\nwhen_full = \"reject_new\"\nmax_bytes = 1048576\n",
        )
        .unwrap();
        assert_eq!(c.flush_interval, Duration::from_millis(25));
        assert_eq!(c.when_full, WhenFull::RejectNew);
        assert_eq!(c.max_bytes, 1 << 20);
        assert_eq!(c.flush_records, DEFAULT_FLUSH_RECORDS);
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = toml::from_str::<OutboxConfig>("flush_every = \"1s\"\n").unwrap_err();
        assert!(e.to_string().contains("flush_every"), "{e}");
    }

    #[test]
    fn validate_lists_every_problem() {
        let c = OutboxConfig {
            flush_interval: Duration::ZERO,
            flush_records: 0,
            max_bytes: 10,
            when_full: WhenFull::RejectNew,
            cache_capacity: 0,
            memory_when_read_only: 0,
            compress: true,
        };
        assert_eq!(c.validate().len(), 4, "{:?}", c.validate());
    }
}
