//! Fleet OTA: signed model updates, staged, checked, swapped in under
//! probation and rolled back on trouble; signed daemon updates installed
//! into A/B slots with a boot counter (`slots.rs`). Offers come from the
//! polled manifest document or as signed commands on the MQTT uplink's
//! command topic (`command.rs`). See docs/ota.md.
//!
//! Flow of one model update (`machine.rs` decides, `agent.rs` acts):
//! poll `manifest_url` -> download (resumable, capped) -> verify size,
//! sha256 and ed25519 signature against `trusted_keys` -> read the signed
//! manifest.json (kind, version, downgrade, minimum daemon version) -> only
//! then unpack into staging and move the complete folder into
//! `<data_dir>/ota/models/` -> load and warm up -> run the bundle's check
//! data -> swap into every pipeline of that model -> probation (error rate,
//! p99) -> commit: `<model_dir>/<name>` switched to the new version.
//!
//! Invariants:
//! - Nothing of a bundle is unpacked before its size, sha256 and signature
//!   hold; a file in it that is not listed with its sha256 fails it.
//! - A version lower than the serving one is refused unless the signed
//!   bundle says `rollback`.
//! - `<model_dir>/<name>` always names one complete version: it changes by
//!   one rename(2) (or renameat2 exchange), only at commit, after probation.
//!   The previous version's folder is kept.
//! - state.json is replaced atomically (temp, fsync, rename, fsync dir).
//! - Every step is a status event in the outbox (stream `ota`).
//!
//! Crash behaviour (SIGKILL or power loss at any point): the restart loads
//! what `<model_dir>/<name>` names, the old version or, once committed, the
//! new one. Recovery then reads the journal in state.json: interrupted
//! before the new model served -> tried again (the download resumes);
//! interrupted while it served from memory (probation) -> refused, since it
//! may be what brought the process down; link already switched -> recorded
//! as installed.

pub mod agent;
pub mod bundle;
pub mod check;
pub mod command;
pub mod document;
pub mod failure;
pub mod fetch;
pub mod host;
pub mod install;
pub mod machine;
pub mod offer;
pub mod rollout;
pub mod sign;
pub mod slots;
pub mod stats;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[ota]` in the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtaConfig {
    /// The fleet's manifest document (JSON: `{"bundles": [{kind, name,
    /// version, url, sha256, size, signature, rollback?}]}`), http or https.
    #[serde(default)]
    pub manifest_url: Option<String>,
    /// Public keys trusted to sign bundles (several, for rotation): base64
    /// or hex of the 32-byte ed25519 key, or the path of a `.pub` file.
    #[serde(default)]
    pub trusted_keys: Vec<String>,
    /// How often the manifest is polled.
    #[serde(default = "default_poll_interval", with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Up to this much is added to each wait, at random, so a fleet does not poll in step.
    #[serde(default = "default_poll_jitter", with = "humantime_serde")]
    pub poll_jitter: Duration,
    /// Download bandwidth cap, bytes per second (none: no cap); a number
    /// or a size such as "200 kB".
    #[serde(default, with = "crate::bytesize::option")]
    pub max_bytes_per_s: Option<u64>,
    /// Connect and read timeout of the HTTP requests.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// CA certificate (PEM) for an https manifest_url; default: the system's roots.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// How long a new model serves under watch before it is committed.
    #[serde(default = "default_probation", with = "humantime_serde")]
    pub probation: Duration,
    /// Failed inferences / frames during probation above which it is rolled back.
    #[serde(default = "default_max_error_rate")]
    pub max_error_rate: f64,
    /// p99 inference latency during probation above which it is rolled back.
    #[serde(default, with = "humantime_serde")]
    pub max_p99_latency: Option<Duration>,
    /// Frames needed before the probation thresholds are judged.
    #[serde(default = "default_min_runs")]
    pub min_runs: u64,
    /// Tolerance of the bundle's check outputs: |got - want| <= tol * (1 + |want|).
    #[serde(default = "default_check_tolerance")]
    pub check_tolerance: f64,
    /// A new daemon slot must be READY within this after its start, or it
    /// exits (and the boot counter counts a failed start).
    #[serde(default = "default_daemon_ready_timeout", with = "humantime_serde")]
    pub daemon_ready_timeout: Duration,
    /// How long a new daemon slot serves after READY before it is marked good.
    #[serde(default = "default_probation", with = "humantime_serde")]
    pub daemon_probation: Duration,
    /// Starts a new daemon slot gets before the launcher falls back.
    #[serde(default = "default_daemon_max_attempts")]
    pub daemon_max_attempts: u32,
    /// The largest bundle taken: an entry stating a larger size is skipped
    /// before any download (a download is also cut at the stated size).
    #[serde(default = "default_max_bundle_bytes")]
    pub max_bundle_bytes: u64,
    /// How far ahead of this device's clock a signed command or manifest
    /// document may be dated.
    #[serde(default = "default_max_command_skew", with = "humantime_serde")]
    pub max_command_skew: Duration,
    /// Refuse manifest documents that are not signed as a whole (see
    /// docs/ota.md). A device refuses them anyway once it has accepted a
    /// signed one; set this where staged rollouts are used, so that not even
    /// a new device can be offered an update by an edit of a plain document.
    #[serde(default)]
    pub require_signed_manifest: bool,
}

/// Default `max_bundle_bytes`: 2 GiB (a large vision model with its engine).
pub const DEFAULT_MAX_BUNDLE_BYTES: u64 = 2 << 30;

fn default_max_bundle_bytes() -> u64 {
    DEFAULT_MAX_BUNDLE_BYTES
}
fn default_max_command_skew() -> Duration {
    Duration::from_millis(command::DEFAULT_MAX_SKEW_MS)
}

fn default_poll_interval() -> Duration {
    Duration::from_secs(300)
}
fn default_poll_jitter() -> Duration {
    Duration::from_secs(30)
}
fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_probation() -> Duration {
    Duration::from_secs(60)
}
fn default_max_error_rate() -> f64 {
    0.05
}
fn default_min_runs() -> u64 {
    20
}
fn default_check_tolerance() -> f64 {
    1e-4
}
fn default_daemon_ready_timeout() -> Duration {
    // As the unit's TimeoutStartSec: TensorRT builds engines at a first start.
    Duration::from_secs(15 * 60)
}
fn default_daemon_max_attempts() -> u32 {
    3
}

impl OtaConfig {
    /// Every problem, each naming its key.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        // Without a manifest_url, offers come only as MQTT commands (the
        // config as a whole checks there is a command topic).
        if let Some(u) = &self.manifest_url {
            match reqwest::Url::parse(u) {
                Ok(url) if matches!(url.scheme(), "http" | "https") => {}
                Ok(_) => p.push(format!("ota.manifest_url: `{u}` is not http or https")),
                Err(e) => p.push(format!("ota.manifest_url: `{u}`: {e}")),
            }
        }
        if self.daemon_max_attempts == 0 {
            p.push("ota.daemon_max_attempts: must be at least 1".into());
        }
        if self.daemon_ready_timeout < Duration::from_secs(1) {
            p.push("ota.daemon_ready_timeout: under 1 s".into());
        }
        if self.trusted_keys.is_empty() {
            p.push("ota.trusted_keys: empty (no bundle could ever be accepted)".into());
        }
        for (i, k) in self.trusted_keys.iter().enumerate() {
            if let Err(e) = sign::parse_public_key(k) {
                p.push(format!("ota.trusted_keys[{i}]: {e}"));
            }
        }
        if self.poll_interval < Duration::from_millis(100) {
            p.push("ota.poll_interval: under 100 ms".into());
        }
        if !(0.0..=1.0).contains(&self.max_error_rate) {
            p.push(format!(
                "ota.max_error_rate: {} is not within 0..=1",
                self.max_error_rate
            ));
        }
        if self.check_tolerance.is_nan() || self.check_tolerance < 0.0 {
            p.push("ota.check_tolerance: must be >= 0".into());
        }
        if self.max_bundle_bytes == 0 {
            p.push("ota.max_bundle_bytes: 0 would refuse every bundle".into());
        }
        if self.max_bytes_per_s == Some(0) {
            p.push("ota.max_bytes_per_s: 0 would never download".into());
        }
        if let Some(ca) = &self.ca
            && !ca.exists()
        {
            p.push(format!("ota.ca: {} does not exist", ca.display()));
        }
        p
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OtaError {
    #[error("ota: {0}")]
    Setup(String),
}

/// A running OTA agent.
pub struct OtaAgent {
    pub task: tokio::task::JoinHandle<()>,
    pub stats: Arc<stats::OtaStats>,
}

/// Starts the OTA agent on the current tokio runtime; it runs until
/// `shutdown` is cancelled. Settles what a crash left before it returns.
/// `commands` carries the payloads of the uplink's command topic; `groups`
/// are the device's rollout groups (`[device] groups`).
pub fn start(
    cfg: &OtaConfig,
    host: Arc<dyn host::ModelHost>,
    device: &str,
    groups: &[String],
    commands: Option<tokio::sync::mpsc::Receiver<Vec<u8>>>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<OtaAgent, OtaError> {
    let problems = cfg.validate();
    if !problems.is_empty() {
        return Err(OtaError::Setup(problems.join("; ")));
    }
    let trusted = cfg
        .trusted_keys
        .iter()
        .map(|k| sign::parse_public_key(k))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| OtaError::Setup(e.to_string()))?;
    let mut fetcher =
        fetch::Fetcher::new(cfg.manifest_url.as_deref(), cfg.ca.as_deref(), cfg.timeout)
            .map_err(|e| OtaError::Setup(e.to_string()))?;
    fetcher.set_document_policy(
        trusted.clone(),
        cfg.require_signed_manifest,
        cfg.max_command_skew,
    );
    let running = slots::running_slot();
    let boot = slots::Slots::new(&host.data_dir())
        .load()
        .ok()
        .flatten()
        .unwrap_or_default();
    let version = boot.version_of(running.as_deref());
    let stats = Arc::new(stats::OtaStats::default());
    *stats.daemon.lock() = (
        version.clone(),
        running.clone().unwrap_or_else(|| "package".into()),
    );
    let policy = machine::Policy {
        probation: cfg.probation,
        max_error_rate: cfg.max_error_rate,
        max_p99: cfg.max_p99_latency,
        min_runs: cfg.min_runs,
        daemon_version: version,
        target: bundle::this_target(),
    };
    let mut agent = agent::Agent::new(
        cfg.clone(),
        policy,
        host,
        trusted,
        fetcher,
        agent::Wiring {
            device: device.to_string(),
            groups: groups.to_vec(),
            commands,
            stats: stats.clone(),
            running_slot: running,
        },
        shutdown,
    );
    agent.recover();
    let task = tokio::spawn(agent.run());
    Ok(OtaAgent { task, stats })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_defaults_and_validation() {
        let k = sign::generate().unwrap();
        let text = format!(
            "manifest_url = \"http://127.0.0.1:1/m.json\"\ntrusted_keys = [\"{}\"]\nmax_p99_latency = \"20ms\"\n",
            sign::key_text(&k.verifying_key())
        );
        let c: OtaConfig = toml::from_str(&text).unwrap();
        assert_eq!(c.probation, Duration::from_secs(60));
        assert_eq!(c.max_p99_latency, Some(Duration::from_millis(20)));
        assert!(c.validate().is_empty(), "{:?}", c.validate());
        assert_eq!(c.daemon_max_attempts, 3);
        let bad: OtaConfig = toml::from_str(
            "manifest_url = \"ftp://x\"\ntrusted_keys = [\"zz\"]\nmax_error_rate = 2.0\ndaemon_max_attempts = 0\n",
        )
        .unwrap();
        let p = bad.validate();
        assert_eq!(p.len(), 4, "{p:?}");
        let commands_only: OtaConfig = toml::from_str(&format!(
            "trusted_keys = [\"{}\"]\n",
            sign::key_text(&k.verifying_key())
        ))
        .unwrap();
        assert!(commands_only.validate().is_empty());
        assert!(toml::from_str::<OtaConfig>("nope = 1").is_err());
    }
}
