//! `outpost fleet rollout plan.toml`: a staged rollout in waves that stops
//! itself. This file is the plan and the decisions, free of I/O; the CLI
//! (`cli/fleet.rs`) writes the documents, follows the broker and keeps the
//! state file.
//!
//! Each wave is a signed manifest document whose entry carries
//! `rollout = {percent, salt}` and/or `groups`; devices decide on their own
//! whether they are in it (`ota/rollout.rs`). The devices' OTA status events
//! on the fleet broker say how it goes, per device, for the bundle's
//! `name@version`:
//! - `downloading` (and the steps after it): started;
//! - `installed`: succeeded;
//! - `check_failed`, `load_failed`, `stage_failed`, `refused`,
//!   `rolled_back`, `rollback_failed`: failed;
//! - started and not finished within the wave's `device_timeout`: timed out
//!   (counted as failed).
//!
//! A wave is done when at least `min_devices` devices have finished since
//! the rollout began, none is still on its way, and `soak` has passed since
//! the wave's document was written and since the last device finished. The
//! rollout aborts as soon as at least `abort.min_finished` devices finished
//! and the failed share exceeds `abort.max_failure_percent`; then the
//! signed rollback document is written.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::s3::S3Target;

/// The plan file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// The signed bundle rolled out (BUNDLE.sig beside it).
    pub bundle: PathBuf,
    /// Where devices download it (absolute, or relative to the manifest URL).
    pub url: String,
    /// Private key that signs the documents (from `outpost keygen`).
    pub key: PathBuf,
    /// Names the rollout: devices' buckets depend on it (keep it for every wave).
    pub salt: String,
    /// Where each wave's signed document goes, a directory: `manifest.json`
    /// (what the devices poll) and `wave-N.json` / `rollback.json` beside
    /// it. Either this or `[s3]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out_dir: Option<PathBuf>,
    /// ...or an S3-compatible bucket, the same documents as objects under
    /// its prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3: Option<S3Target>,
    /// The fleet broker, HOST:PORT, where the devices' OTA events arrive.
    pub broker: String,
    /// First topic level of the devices' topics.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// The rollout's own state (resumed after a restart).
    pub state: PathBuf,
    /// What to publish on abort: a signed rollback bundle (built with --rollback).
    #[serde(default)]
    pub rollback: Option<RollbackPlan>,
    pub abort: Abort,
    pub waves: Vec<Wave>,
}

fn default_prefix() -> String {
    "outpost".into()
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RollbackPlan {
    pub bundle: PathBuf,
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Abort {
    /// Devices that must have finished before the rule is judged.
    pub min_finished: u64,
    /// Failed (failed, rolled back or timed out) share above which it stops.
    pub max_failure_percent: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Wave {
    /// Share of the fleet (0..=100); none: everyone in the groups.
    #[serde(default)]
    pub percent: Option<u8>,
    /// Only these device groups (empty: all).
    #[serde(default)]
    pub groups: Vec<String>,
    /// Devices that must have finished (since the start) before the next wave.
    #[serde(default)]
    pub min_devices: u64,
    /// Quiet time after the last finish before the next wave.
    #[serde(default, with = "humantime_serde")]
    pub soak: Duration,
    /// A started device that has not finished within this has timed out.
    #[serde(default = "default_device_timeout", with = "humantime_serde")]
    pub device_timeout: Duration,
}

fn default_device_timeout() -> Duration {
    Duration::from_secs(30 * 60)
}

impl Plan {
    /// Every problem at once.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.waves.is_empty() {
            p.push("waves: none".into());
        }
        if self.salt.is_empty() {
            p.push("salt: empty".into());
        }
        match (&self.out_dir, &self.s3) {
            (None, None) => p.push(
                "where the documents go: give `out_dir` (a directory) or an `[s3]` table (a bucket)"
                    .into(),
            ),
            (Some(_), Some(_)) => p.push(
                "`out_dir` and `[s3]` both given: the documents go to one place, keep one".into(),
            ),
            (Some(d), None) if d.as_os_str().is_empty() => p.push("out_dir: empty".into()),
            (_, Some(s3)) => p.extend(s3.validate()),
            _ => {}
        }
        let mut last = 0u8;
        for (i, w) in self.waves.iter().enumerate() {
            match w.percent {
                Some(x) if x > 100 => p.push(format!("waves[{i}].percent: {x} is over 100")),
                Some(x) if x < last => p.push(format!(
                    "waves[{i}].percent: {x} is below the previous wave's {last} (waves only widen)"
                )),
                Some(x) => last = x,
                None if w.groups.is_empty() => {
                    last = 100;
                }
                None => {}
            }
            if w.device_timeout.is_zero() {
                p.push(format!("waves[{i}].device_timeout: zero"));
            }
        }
        if !(0.0..=100.0).contains(&self.abort.max_failure_percent) {
            p.push(format!(
                "abort.max_failure_percent: {} is not within 0..=100",
                self.abort.max_failure_percent
            ));
        }
        if self
            .broker
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok())
            .is_none()
        {
            p.push(format!("broker: `{}` is not HOST:PORT", self.broker));
        }
        p
    }
}

/// How a device is doing with the bundle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    NotSelected,
    Started,
    Succeeded,
    Failed,
    TimedOut,
}

impl Outcome {
    fn finished(self) -> bool {
        matches!(
            self,
            Outcome::Succeeded | Outcome::Failed | Outcome::TimedOut
        )
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceState {
    pub outcome: Outcome,
    /// The wave it was in when it last changed.
    pub wave: usize,
    /// Unix ms of the last change.
    pub since_ms: u64,
}

/// Where the rollout stands: the state file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// The wave in progress (index into `waves`).
    pub wave: usize,
    /// Unix ms when the current wave's document was written (None: not yet).
    pub wave_written_ms: Option<u64>,
    pub devices: BTreeMap<String, DeviceState>,
    /// `done` or `aborted: why`, once over.
    pub finished: Option<String>,
    /// An abort decided whose rollback document is not written yet: it
    /// stays decided (a restart writes the rollback), whatever comes after.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aborting: Option<String>,
}

/// What to do now.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Write the current wave's document.
    WriteWave(usize),
    Wait,
    /// The current wave is done; go on to the next.
    NextWave,
    Done,
    Abort(String),
}

/// Counts over all devices: (finished, failed, in progress).
pub fn counts(s: &State) -> (u64, u64, u64) {
    let mut c = (0, 0, 0);
    for d in s.devices.values() {
        if d.outcome.finished() {
            c.0 += 1;
        }
        if matches!(d.outcome, Outcome::Failed | Outcome::TimedOut) {
            c.1 += 1;
        }
        if d.outcome == Outcome::Started {
            c.2 += 1;
        }
    }
    c
}

/// Takes one OTA status event of `device` (for `name@version` only).
pub fn observe(s: &mut State, device: &str, step: &str, now_ms: u64) {
    let outcome = match step {
        "not_selected" => Outcome::NotSelected,
        "installed" => Outcome::Succeeded,
        "check_failed" | "load_failed" | "stage_failed" | "refused" | "rolled_back"
        | "rollback_failed" => Outcome::Failed,
        "downloading" | "verified" | "staged" | "loaded" | "checked" | "probation"
        | "download_failed" | "corrupt" | "command_accepted" => Outcome::Started,
        _ => return,
    };
    let wave = s.wave;
    let d = s.devices.entry(device.to_string()).or_insert(DeviceState {
        outcome,
        wave,
        since_ms: now_ms,
    });
    // A finished device stays finished (a late `downloading` retry after a
    // failure does not reopen it), except that a later success wins over a
    // time-out.
    let keep =
        d.outcome.finished() && !(d.outcome == Outcome::TimedOut && outcome == Outcome::Succeeded);
    if !keep && d.outcome != outcome {
        d.outcome = outcome;
        d.wave = wave;
        d.since_ms = now_ms;
    }
}

/// Marks started devices that took too long.
pub fn time_out(plan: &Plan, s: &mut State, now_ms: u64) {
    let Some(w) = plan.waves.get(s.wave) else {
        return;
    };
    let limit = w.device_timeout.as_millis() as u64;
    for d in s.devices.values_mut() {
        if d.outcome == Outcome::Started && now_ms.saturating_sub(d.since_ms) > limit {
            d.outcome = Outcome::TimedOut;
            d.since_ms = now_ms;
        }
    }
}

/// The next step of the rollout.
pub fn decide(plan: &Plan, s: &State, now_ms: u64) -> Decision {
    if s.finished.is_some() {
        return Decision::Done;
    }
    if let Some(reason) = &s.aborting {
        return Decision::Abort(reason.clone());
    }
    let (finished, failed, in_progress) = counts(s);
    if finished >= plan.abort.min_finished.max(1) {
        let share = failed as f64 * 100.0 / finished as f64;
        if share > plan.abort.max_failure_percent {
            return Decision::Abort(format!(
                "{failed} of {finished} finished devices failed ({share:.0} % > {} %)",
                plan.abort.max_failure_percent
            ));
        }
    }
    let Some(w) = plan.waves.get(s.wave) else {
        return Decision::Done;
    };
    let Some(written) = s.wave_written_ms else {
        return Decision::WriteWave(s.wave);
    };
    let last_finish = s
        .devices
        .values()
        .filter(|d| d.outcome.finished())
        .map(|d| d.since_ms)
        .max()
        .unwrap_or(0)
        .max(written);
    let soaked = now_ms.saturating_sub(last_finish) >= w.soak.as_millis() as u64;
    if finished >= w.min_devices && in_progress == 0 && soaked {
        if s.wave + 1 >= plan.waves.len() {
            Decision::Done
        } else {
            Decision::NextWave
        }
    } else {
        Decision::Wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        toml::from_str(
            r#"
bundle = "b.tar"
url = "b.tar"
key = "k"
salt = "s"
out_dir = "out"
broker = "127.0.0.1:1883"
state = "st.json"
[abort]
min_finished = 2
max_failure_percent = 20
[[waves]]
percent = 10
min_devices = 1
soak = "10s"
[[waves]]
percent = 100
min_devices = 3
device_timeout = "1m"
"#,
        )
        .unwrap()
    }

    #[test]
    fn waves_advance_after_min_devices_and_soak() {
        let p = plan();
        assert!(p.validate().is_empty(), "{:?}", p.validate());
        let mut s = State::default();
        assert_eq!(decide(&p, &s, 0), Decision::WriteWave(0));
        s.wave_written_ms = Some(1000);
        assert_eq!(decide(&p, &s, 2000), Decision::Wait);
        observe(&mut s, "a", "downloading", 2000);
        observe(&mut s, "b", "not_selected", 2000);
        assert_eq!(decide(&p, &s, 20_000), Decision::Wait, "a is on its way");
        observe(&mut s, "a", "installed", 5000);
        assert_eq!(decide(&p, &s, 14_000), Decision::Wait, "soaking");
        assert_eq!(decide(&p, &s, 15_000), Decision::NextWave);
        s.wave = 1;
        s.wave_written_ms = Some(15_000);
        observe(&mut s, "b", "downloading", 16_000);
        observe(&mut s, "b", "installed", 17_000);
        observe(&mut s, "c", "installed", 17_000);
        assert_eq!(counts(&s), (3, 0, 0));
        assert_eq!(decide(&p, &s, 17_000), Decision::Done);
    }

    #[test]
    fn failures_over_the_share_abort_and_timeouts_count() {
        let p = plan();
        let mut s = State {
            wave_written_ms: Some(0),
            ..State::default()
        };
        observe(&mut s, "a", "check_failed", 1000);
        assert_eq!(
            decide(&p, &s, 1000),
            Decision::Wait,
            "one finished is under min_finished"
        );
        observe(&mut s, "b", "installed", 1000);
        assert!(matches!(decide(&p, &s, 1000), Decision::Abort(r) if r.contains("1 of 2")));
        // A failed device stays failed when it retries.
        observe(&mut s, "a", "downloading", 2000);
        assert_eq!(s.devices["a"].outcome, Outcome::Failed);
        // Time-outs.
        let mut s = State {
            wave: 1,
            wave_written_ms: Some(0),
            ..State::default()
        };
        observe(&mut s, "a", "downloading", 0);
        time_out(&p, &mut s, 59_000);
        assert_eq!(s.devices["a"].outcome, Outcome::Started);
        time_out(&p, &mut s, 61_000);
        assert_eq!(s.devices["a"].outcome, Outcome::TimedOut);
        observe(&mut s, "a", "installed", 62_000);
        assert_eq!(s.devices["a"].outcome, Outcome::Succeeded);
    }

    #[test]
    fn bad_plans_are_named() {
        let mut p = plan();
        p.waves[1].percent = Some(5);
        p.abort.max_failure_percent = 150.0;
        p.broker = "nope".into();
        assert_eq!(p.validate().len(), 3, "{:?}", p.validate());
        assert!(toml::from_str::<Plan>("nope = 1").is_err());
    }

    #[test]
    fn documents_go_to_a_directory_or_a_bucket_not_both() {
        let p: Plan = toml::from_str(
            r#"
bundle = "b.tar"
url = "b.tar"
key = "k"
salt = "s"
broker = "127.0.0.1:1883"
state = "st.json"
[s3]
endpoint = "http://127.0.0.1:9000"
bucket = "fleet"
prefix = "outpost/"
[abort]
min_finished = 1
max_failure_percent = 0
[[waves]]
percent = 100
"#,
        )
        .unwrap();
        assert!(p.validate().is_empty(), "{:?}", p.validate());
        let t = p.s3.as_ref().unwrap();
        assert_eq!(t.region, "us-east-1");
        assert_eq!(t.key("manifest.json"), "outpost/manifest.json");
        assert_eq!(p.out_dir, None);
        let mut both = p.clone();
        both.out_dir = Some("out".into());
        assert!(
            both.validate()[0].contains("both given"),
            "{:?}",
            both.validate()
        );
        let mut neither = p.clone();
        neither.s3 = None;
        assert!(
            neither.validate()[0].contains("give `out_dir`"),
            "{:?}",
            neither.validate()
        );
        let mut bad = p;
        bad.s3.as_mut().unwrap().endpoint = "nope".into();
        assert!(
            bad.validate()[0].starts_with("s3.endpoint"),
            "{:?}",
            bad.validate()
        );
    }

    #[test]
    fn an_abort_stays_decided_until_its_rollback_is_written() {
        let p = plan();
        let mut s = State {
            wave_written_ms: Some(0),
            aborting: Some("2 of 2 finished devices failed".into()),
            ..State::default()
        };
        // Later successes bring the share under the limit; the abort holds.
        for d in ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"] {
            observe(&mut s, d, "installed", 1000);
        }
        assert!(matches!(decide(&p, &s, 2000), Decision::Abort(r) if r.starts_with("2 of 2")));
        let back: State = serde_json::from_slice(&serde_json::to_vec(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        // A state file from before the field reads as no abort.
        let old: State = serde_json::from_str(
            r#"{"wave":0,"wave_written_ms":null,"devices":{},"finished":null}"#,
        )
        .unwrap();
        assert_eq!(old.aborting, None);
    }
}
