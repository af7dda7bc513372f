//! The result record: what a pipeline produces for the fleet. A leaf room:
//! sources (which answer with records), pipelines, the outbox and the API
//! all use it, and it uses nothing of theirs.
//!
//! `id` = `<device>/<boot>/<seq>`: `boot` counts daemon starts (persisted by
//! the outbox), `seq` counts records within a boot. The id is fixed when the
//! record is made and stored with it, so every retry and every restart sends
//! the same id and the fleet can drop duplicates.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecord {
    pub id: String,
    pub device: String,
    pub pipeline: String,
    pub stream: String,
    pub seq: u64,
    /// RFC 3339, UTC, microseconds.
    pub ts: String,
    /// `name@version`.
    pub model: String,
    /// The execution provider that served it.
    pub ep: String,
    /// Inference time of the item (batch time for micro-batched items).
    pub latency_us: u64,
    pub outputs: serde_json::Value,
    /// When the frame was captured (cameras), RFC 3339 UTC with microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captured: Option<String>,
    /// Made while the system clock was not trusted: `clock`, `boot_id`,
    /// `since_boot_us` (absent otherwise).
    #[serde(flatten)]
    pub clock: Option<ClockMark>,
}

/// A record made while the system clock was not trusted: the uplink
/// recomputes `ts` from the boot's offset once it is known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockMark {
    pub clock: ClockLabel,
    /// `/proc/sys/kernel/random/boot_id` of the boot that made it.
    pub boot_id: String,
    /// Time since that boot (CLOCK_BOOTTIME) when it was made.
    pub since_boot_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClockLabel {
    /// `ts` is the system clock as it was, not trusted.
    Unsynced,
    /// `ts` was recomputed from the boot's offset when it was sent.
    Corrected,
}

impl ResultRecord {
    pub fn make_id(device: &str, boot: u64, seq: u64) -> String {
        format!("{device}/{boot}/{seq}")
    }
}

/// Formats a system time as RFC 3339 UTC with microseconds (humantime;
/// times before 1970 are written as the epoch).
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let t = t.max(std::time::UNIX_EPOCH);
    humantime::format_rfc3339_micros(t).to_string()
}

/// Ids `<device>/<boot>/<seq>`: one sequence per daemon start.
pub struct IdGen {
    pub device: String,
    pub boot: u64,
    seq: AtomicU64,
}

impl IdGen {
    pub fn new(device: String, boot: u64) -> Self {
        IdGen {
            device,
            boot,
            seq: AtomicU64::new(0),
        }
    }

    pub fn next(&self) -> (String, u64) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        (ResultRecord::make_id(&self.device, self.boot, seq), seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        // 2026-11-30T02:30:41.5Z
        let t = UNIX_EPOCH + Duration::from_micros(1_796_005_841_500_000);
        assert_eq!(rfc3339(t), "2026-11-30T02:30:41.500000Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000Z");
    }

    #[test]
    fn record_serializes_with_the_documented_keys() {
        let r = ResultRecord {
            id: ResultRecord::make_id("gw", 3, 17),
            device: "gw".into(),
            pipeline: "vad".into(),
            stream: "mic1".into(),
            seq: 17,
            ts: rfc3339(UNIX_EPOCH),
            model: "silero_vad@6.2.3".into(),
            ep: "cpu".into(),
            latency_us: 120,
            outputs: serde_json::json!({"event": "start"}),
            captured: None,
            clock: None,
        };
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["id"], "gw/3/17");
        for k in [
            "id",
            "device",
            "pipeline",
            "stream",
            "seq",
            "ts",
            "model",
            "ep",
            "latency_us",
            "outputs",
        ] {
            assert!(v.get(k).is_some(), "{k}");
        }
    }
}
