//! OTA figures for `/metrics`: download progress, status events by step,
//! commands by outcome, and which daemon version and slot run.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;

use crate::telemetry::metrics::{MetricSource, counter, gauge};

#[derive(Debug, Default)]
pub struct OtaStats {
    /// Bytes of the bundle being downloaded that are on disk.
    pub download_bytes: AtomicU64,
    /// Its size (0: no download in progress).
    pub download_size: AtomicU64,
    steps: Mutex<BTreeMap<&'static str, u64>>,
    commands: Mutex<BTreeMap<&'static str, u64>>,
    documents: Mutex<BTreeMap<&'static str, u64>>,
    skipped: Mutex<BTreeMap<&'static str, u64>>,
    /// (version, slot) of the running daemon.
    pub daemon: Mutex<(String, String)>,
    /// The update's phase now (`idle`, `downloading`, ..., `probation`).
    phase: Mutex<&'static str>,
    /// The last status events with their time, oldest first (the console).
    recent: Mutex<VecDeque<serde_json::Value>>,
    /// The running daemon slot is on trial (its probation is not over).
    pub daemon_trial: AtomicBool,
}

/// The OTA agent in `/v1/status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OtaSummary {
    /// `idle`, `downloading`, ..., `probation`.
    pub phase: &'static str,
    pub model_probation: bool,
    pub daemon_trial: bool,
    pub download_bytes: u64,
    pub download_size: u64,
    /// The last status events as sent upstream, with their time.
    pub recent: Vec<serde_json::Value>,
    /// Commands by outcome.
    pub commands: BTreeMap<&'static str, u64>,
}

/// Status events kept for the console.
const RECENT_EVENTS: usize = 20;

impl OtaStats {
    pub fn step(&self, step: &'static str) {
        *self.steps.lock().entry(step).or_default() += 1;
    }

    pub fn command(&self, result: &'static str) {
        *self.commands.lock().entry(result).or_default() += 1;
    }

    /// A polled manifest document, by result (`signed`, `plain`, or why refused).
    pub fn document(&self, result: &'static str) {
        bump(&self.documents, result);
    }

    /// An entry this device did not take, by reason.
    pub fn skipped(&self, reason: &'static str) {
        bump(&self.skipped, reason);
    }

    pub fn set_phase(&self, phase: &'static str) {
        *self.phase.lock() = phase;
    }

    /// Keeps a status event (as sent upstream) among the recent ones.
    pub fn remember(&self, status: &serde_json::Value) {
        let mut v = status.clone();
        if let Some(o) = v.as_object_mut() {
            o.insert(
                "ts".into(),
                crate::record::rfc3339(std::time::SystemTime::now()).into(),
            );
        }
        let mut r = self.recent.lock();
        if r.len() >= RECENT_EVENTS {
            r.pop_front();
        }
        r.push_back(v);
    }

    /// Phase, probation, the recent status events and the commands.
    pub fn summary(&self) -> OtaSummary {
        let phase = *self.phase.lock();
        let phase = if phase.is_empty() { "idle" } else { phase };
        OtaSummary {
            phase,
            model_probation: phase == "probation",
            daemon_trial: self.daemon_trial.load(Ordering::Relaxed),
            download_bytes: self.download_bytes.load(Ordering::Relaxed),
            download_size: self.download_size.load(Ordering::Relaxed),
            recent: self.recent.lock().iter().cloned().collect(),
            commands: self.commands(),
        }
    }

    pub fn commands(&self) -> BTreeMap<&'static str, u64> {
        self.commands.lock().clone()
    }
}

fn bump(m: &Mutex<BTreeMap<&'static str, u64>>, k: &'static str) {
    *m.lock().entry(k).or_default() += 1;
}

fn labelled(
    m: &Mutex<BTreeMap<&'static str, u64>>,
    label: &'static str,
) -> Vec<(Vec<(&'static str, String)>, u64)> {
    m.lock()
        .iter()
        .map(|(k, v)| (vec![(label, k.to_string())], *v))
        .collect()
}

impl MetricSource for OtaStats {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (version, slot) = self.daemon.lock().clone();
        gauge(
            enc,
            "outpost_daemon_info",
            "The running daemon: version and slot (`package` when not from an OTA slot)",
            &[(vec![("version", version), ("slot", slot)], 1.0)],
        )?;
        gauge(
            enc,
            "outpost_ota_download_bytes",
            "Bytes of the bundle being downloaded that are on disk",
            &[(vec![], self.download_bytes.load(Ordering::Relaxed) as f64)],
        )?;
        gauge(
            enc,
            "outpost_ota_download_size_bytes",
            "Size of the bundle being downloaded (0: none)",
            &[(vec![], self.download_size.load(Ordering::Relaxed) as f64)],
        )?;
        let steps: Vec<_> = self
            .steps
            .lock()
            .iter()
            .map(|(k, v)| (vec![("step", k.to_string())], *v))
            .collect();
        counter(
            enc,
            "outpost_ota_events",
            "OTA status events by step",
            &steps,
        )?;
        let cmds: Vec<_> = self
            .commands()
            .iter()
            .map(|(k, v)| (vec![("result", k.to_string())], *v))
            .collect();
        counter(
            enc,
            "outpost_ota_commands",
            "Update commands received, by result (accepted or why refused)",
            &cmds,
        )?;
        counter(
            enc,
            "outpost_ota_documents",
            "Manifest documents polled, by result (signed, plain, or why refused)",
            &labelled(&self.documents, "result"),
        )?;
        counter(
            enc,
            "outpost_ota_offers_skipped",
            "Manifest entries this device did not take, by reason (outside_wave, other_groups, invalid)",
            &labelled(&self.skipped, "reason"),
        )
    }
}
