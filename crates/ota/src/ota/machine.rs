//! The update state machine: pure transitions, no I/O.
//!
//! `step(state, event) -> (state, actions)`. The agent (`agent.rs`) performs
//! the actions (download, verify, unpack, load, check, swap, commit) and
//! feeds back what happened as the next event. Keeping the decisions here
//! means every policy (downgrade refusal, probation thresholds, what is
//! retried and what is refused for good) is tested without sockets, files or
//! models.
//!
//! Refused for good (the bundle's sha256 kept in `state.json`) is only
//! what a verified signature or check condemned: a signed bundle that is
//! malformed, built for another device or daemon, or that failed to load,
//! check or serve. An entry that fails before that (its version, its
//! signature line, its size, a version that differs from the signed one)
//! says nothing about the bundle it points to: it is *skipped* this time and
//! reported, so a correct entry for the same bundle can still install.
//!
//! One update runs at a time. An event that does not belong to the current
//! state leaves it unchanged and asks for nothing: a late or duplicated
//! report can never skip a step.

use std::time::Duration;

use serde::Serialize;

use super::bundle::{BundleKind, BundleManifest};
use super::failure::Failure;
use super::host::ModelHealth;
/// The offer is data of its own (`offer.rs`); this path stays.
pub use super::offer::Offer;

/// Thresholds of the probation window and what this build is.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub probation: Duration,
    /// Failed inferences / runs above which the new model is rolled back.
    pub max_error_rate: f64,
    /// p99 inference latency above which it is rolled back.
    pub max_p99: Option<Duration>,
    /// Runs needed before the thresholds are judged (one error in three
    /// runs says little).
    pub min_runs: u64,
    /// This daemon's version (bundles may demand a minimum).
    pub daemon_version: String,
    /// This build's target triple (daemon bundles must match it).
    pub target: String,
}

/// Where an update stands. The job carries the offer and the version that
/// served when it started (None: no pipeline uses that model; for a daemon
/// bundle, the running daemon's version).
#[derive(Debug, Clone, PartialEq)]
pub enum State {
    Idle,
    Downloading(Job),
    Verifying(Job),
    Staging(Job),
    Loading(Job),
    Checking(Job),
    Swapping(Job),
    /// Serving the new model from memory; the disk still holds the old one.
    Probation {
        job: Job,
        baseline: ModelHealth,
    },
    Committing(Job),
    /// A daemon bundle is in its slot: put it on trial and switch `current`.
    Activating(Job),
    RollingBack {
        job: Job,
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub offer: Offer,
    pub serving: Option<String>,
}

impl State {
    /// Short name for logs, events and the journal.
    pub fn phase(&self) -> &'static str {
        match self {
            State::Idle => "idle",
            State::Downloading(_) => "downloading",
            State::Verifying(_) => "verifying",
            State::Staging(_) => "staging",
            State::Loading(_) => "loading",
            State::Checking(_) => "checking",
            State::Swapping(_) => "swapping",
            State::Probation { .. } => "probation",
            State::Committing(_) => "committing",
            State::Activating(_) => "activating",
            State::RollingBack { .. } => "rolling_back",
        }
    }

    pub fn job(&self) -> Option<&Job> {
        match self {
            State::Idle => None,
            State::Downloading(j)
            | State::Verifying(j)
            | State::Staging(j)
            | State::Loading(j)
            | State::Checking(j)
            | State::Swapping(j)
            | State::Committing(j)
            | State::Activating(j) => Some(j),
            State::Probation { job, .. } | State::RollingBack { job, .. } => Some(job),
        }
    }
}

/// What the agent reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A bundle on offer; `serving` = version of that model serving now.
    Offered {
        offer: Offer,
        serving: Option<String>,
    },
    Downloaded,
    /// Network or disk trouble: the partial file stays for a resume.
    DownloadFailed(Failure),
    /// Size or sha256 differ from the offer: the file is discarded and the
    /// offer tried again at a later poll (the transfer may have been hit).
    Corrupt(String),
    /// The entry's signature does not verify (bad, unknown key): the entry
    /// is skipped, the bundle is not condemned.
    Unverified(String),
    /// Signed, but the bundle itself is malformed: never tried again.
    Untrusted(String),
    /// Size, sha256 and signature hold; this is what the signed bundle says.
    Verified(Box<BundleManifest>),
    Staged,
    /// A full disk ([`Failure::disk_full`]) leaves the bundle to be tried
    /// again at a later poll; any other failure refuses it.
    StageFailed(Failure),
    /// Loaded and warmed up.
    Loaded,
    LoadFailed(String),
    CheckPassed,
    CheckFailed(String),
    /// The new model serves; `baseline` = health just before the swap.
    Swapped {
        baseline: ModelHealth,
    },
    SwapFailed(String),
    /// A health sample during probation, `elapsed` since the swap.
    Health {
        elapsed: Duration,
        health: ModelHealth,
    },
    Committed,
    CommitFailed(String),
    RolledBack,
    RollbackFailed(String),
    /// The daemon slot is on trial and `current` names it.
    Activated,
    ActivateFailed(Failure),
}

/// A status event sent upstream (and logged).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Status {
    pub step: &'static str,
    pub name: String,
    pub version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// What the agent must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Emit(Status),
    Download(Offer),
    /// Size, sha256, signature, then read the signed manifest.json.
    Verify(Offer),
    /// Unpack into staging, then move the complete folder into place.
    Stage(Offer),
    Load(Offer),
    Check(Offer),
    Swap(Offer),
    /// Wait a little, then report `Health`.
    Watch,
    /// Switch the model directory's link to the new version and persist.
    Commit(Offer),
    /// Swap the previous model back in.
    Rollback(Offer),
    /// Remember the bundle (by sha256) as refused: never tried again.
    Refuse(Offer),
    /// Remember this entry (not the bundle) as skipped until it changes.
    Skip(Offer),
    /// Delete the downloaded file.
    DiscardDownload(Offer),
    /// Delete the unpacked folder of a version that will not serve.
    DiscardStaged(Offer),
    /// Remove versions older than the previous one.
    Prune(Offer),
    /// Put the staged daemon slot on trial and switch `current` to it.
    Activate(Offer),
    /// Stop gracefully so the service manager starts the new slot.
    Restart,
}

/// `MAJOR.MINOR.PATCH[-pre]` compared by semver rules; None if unparsable.
pub fn cmp_versions(a: &str, b: &str) -> Option<std::cmp::Ordering> {
    let a = semver::Version::parse(a).ok()?;
    let b = semver::Version::parse(b).ok()?;
    Some(a.cmp(&b))
}

fn status(step: &'static str, job: &Job, detail: Option<String>) -> Status {
    Status {
        step,
        name: job.offer.name.clone(),
        version: job.offer.version.clone(),
        from: job.serving.clone(),
        detail,
    }
}

/// Ends a job for good: refused, files gone, back to idle.
fn refuse(step: &'static str, job: &Job, why: String, staged: bool) -> (State, Vec<Action>) {
    let mut a = vec![
        Action::Emit(status(step, job, Some(why))),
        Action::Refuse(job.offer.clone()),
        Action::DiscardDownload(job.offer.clone()),
    ];
    if staged {
        a.push(Action::DiscardStaged(job.offer.clone()));
    }
    (State::Idle, a)
}

/// Ends a job for want of disk space: what was staged goes (room for the
/// next try), the download stays, and the bundle is tried again at a later
/// poll; it is not refused.
fn disk_full(job: &Job, why: Failure) -> (State, Vec<Action>) {
    (
        State::Idle,
        vec![
            Action::Emit(status("disk_full", job, Some(why.to_string()))),
            Action::DiscardStaged(job.offer.clone()),
        ],
    )
}

/// Ends a job for this time only: the entry was wrong, not the bundle.
fn skip(job: &Job, why: String) -> (State, Vec<Action>) {
    (
        State::Idle,
        vec![
            Action::Emit(status("skipped", job, Some(why))),
            Action::Skip(job.offer.clone()),
            Action::DiscardDownload(job.offer.clone()),
        ],
    )
}

/// What is wrong with a verified bundle, if anything: `Entry` problems are
/// the offer's (skip), `Bundle` problems condemn the signed bundle (refuse).
enum Problem {
    Entry(String),
    Bundle(String),
}

/// Why the signed manifest does not fit the offer or this device, if it does not.
fn bundle_problem(m: &BundleManifest, job: &Job, p: &Policy) -> Option<Problem> {
    let o = &job.offer;
    if m.kind != o.kind || m.name != o.name || m.version != o.version {
        return Some(Problem::Entry(format!(
            "the signed bundle is {:?} {}@{}, the offer says {:?} {}",
            m.kind,
            m.name,
            m.version,
            o.kind,
            o.id()
        )));
    }
    match cmp_versions(&p.daemon_version, &m.min_daemon_version) {
        Some(std::cmp::Ordering::Less) => {
            return Some(Problem::Bundle(format!(
                "needs daemon {} or newer, this is {}",
                m.min_daemon_version, p.daemon_version
            )));
        }
        None => {
            return Some(Problem::Bundle(format!(
                "bad min_daemon_version `{}`",
                m.min_daemon_version
            )));
        }
        _ => {}
    }
    if m.kind == BundleKind::Daemon {
        match &m.target {
            Some(t) if *t == p.target => {}
            Some(t) => {
                return Some(Problem::Bundle(format!(
                    "built for {t}, this device is {}",
                    p.target
                )));
            }
            None => return Some(Problem::Bundle("daemon bundle without a target".into())),
        }
    }
    // Relative to what serves now, not a flaw of the bundle: skipped.
    if let Some(cur) = &job.serving
        && cmp_versions(&m.version, cur) == Some(std::cmp::Ordering::Less)
        && !m.rollback
    {
        return Some(Problem::Entry(format!(
            "downgrade from {cur} without a signed rollback"
        )));
    }
    None
}

/// Whether the probation health crosses a threshold (Some(reason)).
fn unhealthy(baseline: &ModelHealth, now: &ModelHealth, p: &Policy) -> Option<String> {
    let runs = now.runs.saturating_sub(baseline.runs);
    let errors = now.errors.saturating_sub(baseline.errors);
    let seen = runs + errors;
    if seen < p.min_runs.max(1) {
        return None;
    }
    let rate = errors as f64 / seen as f64;
    if rate > p.max_error_rate {
        return Some(format!(
            "error rate {rate:.3} over {seen} frames passes max_error_rate {}",
            p.max_error_rate
        ));
    }
    if let (Some(max), Some(p99)) = (p.max_p99, now.p99_us)
        && Duration::from_micros(p99) > max
    {
        return Some(format!(
            "p99 latency {p99} µs passes max_p99_latency {} µs",
            max.as_micros()
        ));
    }
    None
}

/// The transition function.
pub fn step(state: State, event: Event, p: &Policy) -> (State, Vec<Action>) {
    use Event as E;
    use State as S;
    match (state, event) {
        (S::Idle, E::Offered { offer, serving }) => {
            let job = Job { offer, serving };
            {
                match &job.serving {
                    // A model not served here: nothing to update.
                    None if job.offer.kind == BundleKind::Model => return (S::Idle, vec![]),
                    None => {}
                    Some(cur) if *cur == job.offer.version => return (S::Idle, vec![]),
                    // The entry's own fields, not yet verified: skipped, not refused.
                    Some(cur) => match cmp_versions(&job.offer.version, cur) {
                        None => {
                            return skip(
                                &job,
                                format!("version `{}` is not semver", job.offer.version),
                            );
                        }
                        Some(std::cmp::Ordering::Less) if !job.offer.rollback => {
                            return skip(
                                &job,
                                format!("downgrade from {cur} without a signed rollback"),
                            );
                        }
                        _ => {}
                    },
                }
            }
            let a = vec![
                Action::Emit(status("downloading", &job, None)),
                Action::Download(job.offer.clone()),
            ];
            (S::Downloading(job), a)
        }
        (S::Downloading(job), E::Downloaded) => {
            let a = vec![Action::Verify(job.offer.clone())];
            (S::Verifying(job), a)
        }
        (S::Downloading(job), E::DownloadFailed(why)) => {
            // The partial file stays: the next poll resumes it.
            let step = if why.disk_full() {
                "disk_full"
            } else {
                "download_failed"
            };
            (
                S::Idle,
                vec![Action::Emit(status(step, &job, Some(why.to_string())))],
            )
        }
        (S::Verifying(job), E::Corrupt(why)) => (
            S::Idle,
            vec![
                Action::Emit(status("corrupt", &job, Some(why))),
                Action::DiscardDownload(job.offer.clone()),
            ],
        ),
        (S::Verifying(job), E::Unverified(why)) => skip(&job, why),
        (S::Verifying(job), E::Untrusted(why)) => refuse("refused", &job, why, false),
        (S::Verifying(job), E::Verified(m)) => match bundle_problem(&m, &job, p) {
            Some(Problem::Entry(why)) => skip(&job, why),
            Some(Problem::Bundle(why)) => refuse("refused", &job, why, false),
            None => {
                let a = vec![
                    Action::Emit(status("verified", &job, None)),
                    Action::Stage(job.offer.clone()),
                ];
                (S::Staging(job), a)
            }
        },
        (S::Staging(job), E::Staged) if job.offer.kind == BundleKind::Daemon => {
            let a = vec![
                Action::Emit(status("staged", &job, None)),
                Action::Activate(job.offer.clone()),
            ];
            (S::Activating(job), a)
        }
        (S::Activating(job), E::Activated) => {
            let a = vec![
                Action::Emit(status(
                    "restarting",
                    &job,
                    Some("on trial in its slot; the daemon restarts into it".into()),
                )),
                Action::DiscardDownload(job.offer.clone()),
                Action::Restart,
            ];
            (S::Idle, a)
        }
        (S::Activating(job), E::ActivateFailed(why)) if why.disk_full() => disk_full(&job, why),
        (S::Activating(job), E::ActivateFailed(why)) => {
            refuse("stage_failed", &job, why.to_string(), false)
        }
        (S::Staging(job), E::Staged) => {
            let a = vec![
                Action::Emit(status("staged", &job, None)),
                Action::Load(job.offer.clone()),
            ];
            (S::Loading(job), a)
        }
        (S::Staging(job), E::StageFailed(why)) if why.disk_full() => disk_full(&job, why),
        (S::Staging(job), E::StageFailed(why)) => {
            refuse("stage_failed", &job, why.to_string(), true)
        }
        (S::Loading(job), E::Loaded) => {
            let a = vec![
                Action::Emit(status("loaded", &job, None)),
                Action::Check(job.offer.clone()),
            ];
            (S::Checking(job), a)
        }
        (S::Loading(job), E::LoadFailed(why)) => refuse("load_failed", &job, why, true),
        (S::Checking(job), E::CheckPassed) => {
            let a = vec![
                Action::Emit(status("checked", &job, None)),
                Action::Swap(job.offer.clone()),
            ];
            (S::Swapping(job), a)
        }
        (S::Checking(job), E::CheckFailed(why)) => refuse("check_failed", &job, why, true),
        (S::Swapping(job), E::Swapped { baseline }) => {
            let a = vec![
                Action::Emit(status(
                    "probation",
                    &job,
                    Some(format!("{} s", p.probation.as_secs_f64())),
                )),
                Action::Watch,
            ];
            (S::Probation { job, baseline }, a)
        }
        (S::Swapping(job), E::SwapFailed(why)) => {
            // Some pipelines may have taken the new model before one refused it.
            let a = vec![Action::Rollback(job.offer.clone())];
            let reason = format!("swap failed: {why}");
            (S::RollingBack { job, reason }, a)
        }
        (S::Probation { job, baseline }, E::Health { elapsed, health }) => {
            if let Some(why) = unhealthy(&baseline, &health, p) {
                let a = vec![Action::Rollback(job.offer.clone())];
                return (S::RollingBack { job, reason: why }, a);
            }
            if elapsed >= p.probation {
                let a = vec![Action::Commit(job.offer.clone())];
                return (S::Committing(job), a);
            }
            (S::Probation { job, baseline }, vec![Action::Watch])
        }
        (S::Committing(job), E::Committed) => {
            let a = vec![
                Action::Emit(status("installed", &job, None)),
                Action::DiscardDownload(job.offer.clone()),
                Action::Prune(job.offer.clone()),
            ];
            (S::Idle, a)
        }
        (S::Committing(job), E::CommitFailed(why)) => {
            // Memory serves the new model, the disk the old one: go back to
            // the old so a restart changes nothing.
            let a = vec![Action::Rollback(job.offer.clone())];
            let reason = format!("commit failed: {why}");
            (S::RollingBack { job, reason }, a)
        }
        (S::RollingBack { job, reason }, E::RolledBack) => {
            refuse("rolled_back", &job, reason, true)
        }
        (S::RollingBack { job, reason }, E::RollbackFailed(why)) => {
            // The disk still holds the old version: a restart serves it.
            let detail =
                format!("{reason}; rollback failed: {why} (a restart serves the previous version)");
            refuse("rollback_failed", &job, detail, false)
        }
        // Anything else is late or out of order: ignored.
        (s, _) => (s, vec![]),
    }
}

/// What a crash left, read at start from the journal and the model link.
#[derive(Debug, Clone, PartialEq)]
pub enum Recovery {
    /// Nothing was in progress.
    Clean,
    /// The link points to the new version: the commit finished before the
    /// crash; record it as installed.
    Finish,
    /// Interrupted before the new model served: try again (the download resumes).
    Retry,
    /// Interrupted while the new model served from memory (probation or
    /// commit before the link switched): the restart serves the old one, and
    /// the new one, which may have brought the process down, is refused.
    Refuse,
}

/// Decides from the journal's phase and the version the model link points to.
pub fn recover(phase: Option<&str>, new_version: &str, linked: Option<&str>) -> Recovery {
    let Some(phase) = phase else {
        return Recovery::Clean;
    };
    if linked == Some(new_version) {
        return Recovery::Finish;
    }
    match phase {
        "swapping" | "probation" | "committing" | "rolling_back" => Recovery::Refuse,
        // A daemon activation: the launcher's boot counter settles it.
        "activating" => Recovery::Clean,
        _ => Recovery::Retry,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            probation: Duration::from_secs(60),
            max_error_rate: 0.1,
            max_p99: Some(Duration::from_millis(50)),
            min_runs: 10,
            daemon_version: "0.2.0".into(),
            target: "x86_64-unknown-linux-gnu".into(),
        }
    }

    fn offer(version: &str) -> Offer {
        Offer {
            kind: BundleKind::Model,
            name: "m".into(),
            version: version.into(),
            url: "m.tar".into(),
            sha256: "ab".repeat(32),
            size: 10,
            signature: String::new(),
            rollback: false,
            rollout: None,
            groups: Vec::new(),
        }
    }

    fn job(version: &str) -> Job {
        Job {
            offer: offer(version),
            serving: Some("1.0.0".into()),
        }
    }

    fn signed(version: &str) -> Box<BundleManifest> {
        Box::new(BundleManifest {
            format: 1,
            kind: BundleKind::Model,
            name: "m".into(),
            version: version.into(),
            target: None,
            min_daemon_version: "0.1.0".into(),
            rollback: false,
            files: Default::default(),
        })
    }

    fn steps(a: &[Action]) -> Vec<&'static str> {
        a.iter()
            .filter_map(|a| match a {
                Action::Emit(s) => Some(s.step),
                _ => None,
            })
            .collect()
    }

    fn has(a: &[Action], f: impl Fn(&Action) -> bool) -> bool {
        a.iter().any(f)
    }

    fn h(runs: u64, errors: u64, p99_us: Option<u64>) -> ModelHealth {
        ModelHealth {
            runs,
            errors,
            p99_us,
        }
    }

    #[test]
    fn idle_offer_of_a_newer_version_downloads() {
        let (s, a) = step(
            State::Idle,
            Event::Offered {
                offer: offer("1.1.0"),
                serving: Some("1.0.0".into()),
            },
            &policy(),
        );
        assert_eq!(s, State::Downloading(job("1.1.0")));
        assert!(has(
            &a,
            |a| matches!(a, Action::Download(o) if o.version == "1.1.0")
        ));
        assert_eq!(steps(&a), ["downloading"]);
    }

    #[test]
    fn idle_offer_of_the_serving_version_or_an_unserved_model_is_ignored() {
        for serving in [Some("1.1.0".to_string()), None] {
            let (s, a) = step(
                State::Idle,
                Event::Offered {
                    offer: offer("1.1.0"),
                    serving,
                },
                &policy(),
            );
            assert_eq!(s, State::Idle);
            assert!(a.is_empty());
        }
    }

    #[test]
    fn idle_offer_of_a_lower_version_is_skipped_without_download() {
        let (s, a) = step(
            State::Idle,
            Event::Offered {
                offer: offer("0.9.0"),
                serving: Some("1.0.0".into()),
            },
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["skipped"]);
        // The version is the entry's word, not the signed bundle's.
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
        assert!(has(&a, |a| matches!(a, Action::Skip(_))));
        assert!(!has(&a, |a| matches!(a, Action::Download(_))));
    }

    #[test]
    fn idle_offer_with_a_bad_version_is_skipped() {
        let (s, a) = step(
            State::Idle,
            Event::Offered {
                offer: offer("one"),
                serving: Some("1.0.0".into()),
            },
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(has(&a, |a| matches!(a, Action::Skip(_))));
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
    }

    #[test]
    fn rollback_offer_downloads_but_needs_the_signed_flag() {
        let mut o = offer("0.9.0");
        o.rollback = true;
        let (s, a) = step(
            State::Idle,
            Event::Offered {
                offer: o.clone(),
                serving: Some("1.0.0".into()),
            },
            &policy(),
        );
        assert!(matches!(s, State::Downloading(_)));
        assert!(has(&a, |a| matches!(a, Action::Download(_))));
        let j = Job {
            offer: o,
            serving: Some("1.0.0".into()),
        };
        // Unsigned flag: skipped (relative to what serves now).
        let (s2, a2) = step(
            State::Verifying(j.clone()),
            Event::Verified(signed("0.9.0")),
            &policy(),
        );
        assert_eq!(s2, State::Idle);
        assert_eq!(steps(&a2), ["skipped"]);
        // Signed rollback: staged.
        let mut m = signed("0.9.0");
        m.rollback = true;
        let (s3, a3) = step(State::Verifying(j.clone()), Event::Verified(m), &policy());
        assert_eq!(s3, State::Staging(j));
        assert!(has(&a3, |a| matches!(a, Action::Stage(_))));
    }

    #[test]
    fn daemon_offer_downloads_when_newer_than_the_running_daemon() {
        let mut o = offer("0.3.0");
        o.kind = BundleKind::Daemon;
        let offered = |o: &Offer, serving: &str| {
            step(
                State::Idle,
                Event::Offered {
                    offer: o.clone(),
                    serving: Some(serving.into()),
                },
                &policy(),
            )
        };
        assert!(matches!(offered(&o, "0.2.0").0, State::Downloading(_)));
        let (s, a) = offered(&o, "0.3.0");
        assert_eq!((s, a.len()), (State::Idle, 0), "already running");
        let (s, a) = offered(&o, "0.4.0");
        assert_eq!(s, State::Idle);
        assert_eq!(
            steps(&a),
            ["skipped"],
            "a downgrade needs a signed rollback"
        );
    }

    fn daemon_job() -> Job {
        let mut j = job("0.3.0");
        j.offer.kind = BundleKind::Daemon;
        j.offer.name = "outpost".into();
        j.serving = Some("0.2.0".into());
        j
    }

    #[test]
    fn daemon_bundle_is_staged_activated_and_restarts() {
        let j = daemon_job();
        let mut m = signed("0.3.0");
        m.kind = BundleKind::Daemon;
        m.name = "outpost".into();
        m.target = Some(policy().target);
        let (s, a) = step(State::Verifying(j.clone()), Event::Verified(m), &policy());
        assert_eq!(s, State::Staging(j.clone()));
        assert_eq!(steps(&a), ["verified"]);
        let (s, a) = step(s, Event::Staged, &policy());
        assert_eq!(s, State::Activating(j.clone()));
        assert!(has(&a, |a| matches!(a, Action::Activate(_))));
        assert!(!has(&a, |a| matches!(a, Action::Load(_))), "no model load");
        assert_eq!(s.phase(), "activating");
        let (s2, a2) = step(s.clone(), Event::Activated, &policy());
        assert_eq!(s2, State::Idle);
        assert_eq!(steps(&a2), ["restarting"]);
        assert_eq!(a2.last(), Some(&Action::Restart));
        let (s3, a3) = step(
            s,
            Event::ActivateFailed(Failure::Other("disk full".into())),
            &policy(),
        );
        assert_eq!(s3, State::Idle);
        assert_eq!(steps(&a3), ["stage_failed"]);
        assert!(has(&a3, |a| matches!(a, Action::Refuse(_))));
        assert_eq!(
            recover(Some("activating"), "0.3.0", None),
            Recovery::Clean,
            "the boot counter settles an interrupted activation"
        );
    }

    #[test]
    fn downloaded_goes_to_verify() {
        let (s, a) = step(
            State::Downloading(job("1.1.0")),
            Event::Downloaded,
            &policy(),
        );
        assert_eq!(s, State::Verifying(job("1.1.0")));
        assert_eq!(a, vec![Action::Verify(offer("1.1.0"))]);
    }

    #[test]
    fn download_failure_keeps_the_partial_file_and_is_not_refused() {
        let (s, a) = step(
            State::Downloading(job("1.1.0")),
            Event::DownloadFailed(Failure::Other("reset".into())),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["download_failed"]);
        assert!(!has(&a, |a| matches!(
            a,
            Action::Refuse(_) | Action::DiscardDownload(_)
        )));
    }

    #[test]
    fn corrupt_download_is_discarded_and_retried_later() {
        let (s, a) = step(
            State::Verifying(job("1.1.0")),
            Event::Corrupt("sha256".into()),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(has(&a, |a| matches!(a, Action::DiscardDownload(_))));
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
    }

    #[test]
    fn untrusted_bundle_is_refused_for_good() {
        let (s, a) = step(
            State::Verifying(job("1.1.0")),
            Event::Untrusted("unknown key".into()),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(has(&a, |a| matches!(a, Action::Refuse(_))));
        assert!(has(&a, |a| matches!(a, Action::DiscardDownload(_))));
    }

    #[test]
    fn unverified_entry_is_skipped_not_refused() {
        let (s, a) = step(
            State::Verifying(job("1.1.0")),
            Event::Unverified("bad signature".into()),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["skipped"]);
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
        assert!(has(&a, |a| matches!(a, Action::DiscardDownload(_))));
    }

    #[test]
    fn verified_bundle_is_staged() {
        let (s, a) = step(
            State::Verifying(job("1.1.0")),
            Event::Verified(signed("1.1.0")),
            &policy(),
        );
        assert_eq!(s, State::Staging(job("1.1.0")));
        assert_eq!(steps(&a), ["verified"]);
        assert!(has(&a, |a| matches!(a, Action::Stage(_))));
    }

    #[test]
    fn verified_bundle_that_differs_from_the_offer_is_skipped() {
        // The right file under the wrong version: the entry is wrong, the
        // bundle is fine for an entry that names it right.
        let (s, a) = step(
            State::Verifying(job("1.1.0")),
            Event::Verified(signed("1.2.0")),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
        assert!(has(&a, |a| matches!(a, Action::Skip(_))));
    }

    #[test]
    fn verified_bundle_needing_a_newer_daemon_is_refused() {
        let mut m = signed("1.1.0");
        m.min_daemon_version = "9.0.0".into();
        let (s, a) = step(
            State::Verifying(job("1.1.0")),
            Event::Verified(m),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(
            matches!(&a[0], Action::Emit(st) if st.detail.as_deref().unwrap_or("").contains("9.0.0"))
        );
    }

    #[test]
    fn daemon_bundle_for_another_target_is_refused() {
        let mut j = job("0.3.0");
        j.offer.kind = BundleKind::Daemon;
        j.serving = None;
        let mut m = signed("0.3.0");
        m.kind = BundleKind::Daemon;
        m.target = Some("aarch64-unknown-linux-gnu".into());
        let (s, a) = step(
            State::Verifying(j.clone()),
            Event::Verified(m.clone()),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(
            matches!(&a[0], Action::Emit(st) if st.detail.as_deref().unwrap_or("").contains("aarch64"))
        );
        // The right target is staged.
        m.target = Some(policy().target);
        let (s, _) = step(
            State::Verifying(j.clone()),
            Event::Verified(m.clone()),
            &policy(),
        );
        assert_eq!(s, State::Staging(j.clone()));
        // No target at all: refused.
        m.target = None;
        let (s, a) = step(State::Verifying(j), Event::Verified(m), &policy());
        assert_eq!(s, State::Idle);
        assert!(has(&a, |a| matches!(a, Action::Refuse(_))));
    }

    #[test]
    fn staged_loads_and_stage_failure_refuses_and_cleans() {
        let (s, a) = step(State::Staging(job("1.1.0")), Event::Staged, &policy());
        assert_eq!(s, State::Loading(job("1.1.0")));
        assert!(has(&a, |a| matches!(a, Action::Load(_))));
        let (s, a) = step(
            State::Staging(job("1.1.0")),
            Event::StageFailed(Failure::Other("unpack failed".into())),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert!(has(&a, |a| matches!(a, Action::DiscardStaged(_))));
        assert!(has(&a, |a| matches!(a, Action::Refuse(_))));
    }

    /// The I/O error's kind reaches the machine: a full disk frees what
    /// was staged and leaves the bundle for a later poll, a refused
    /// permission refuses it as any other stage failure.
    #[test]
    fn a_full_disk_is_retried_later_and_a_refused_permission_refuses() {
        let io = |kind: std::io::ErrorKind| {
            Failure::of(&crate::ota::install::InstallError::Io {
                what: "write",
                path: "/data/ota/staging/m/1.1.0/model.onnx".into(),
                source: std::io::Error::from(kind),
            })
        };
        let (s, a) = step(
            State::Staging(job("1.1.0")),
            Event::StageFailed(io(std::io::ErrorKind::StorageFull)),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["disk_full"]);
        assert!(has(&a, |a| matches!(a, Action::DiscardStaged(_))));
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
        assert!(!has(&a, |a| matches!(a, Action::DiscardDownload(_))));
        let (s, a) = step(
            State::Staging(job("1.1.0")),
            Event::StageFailed(io(std::io::ErrorKind::PermissionDenied)),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["stage_failed"]);
        assert!(has(&a, |a| matches!(a, Action::Refuse(_))));
        // A download that fills the disk says so.
        let (_, a) = step(
            State::Downloading(job("1.1.0")),
            Event::DownloadFailed(io(std::io::ErrorKind::StorageFull)),
            &policy(),
        );
        assert_eq!(steps(&a), ["disk_full"]);
    }

    #[test]
    fn loaded_checks_and_load_failure_refuses() {
        let (s, a) = step(State::Loading(job("1.1.0")), Event::Loaded, &policy());
        assert_eq!(s, State::Checking(job("1.1.0")));
        assert!(has(&a, |a| matches!(a, Action::Check(_))));
        let (s, a) = step(
            State::Loading(job("1.1.0")),
            Event::LoadFailed("warm-up".into()),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["load_failed"]);
        assert!(has(&a, |a| matches!(a, Action::DiscardStaged(_))));
    }

    #[test]
    fn check_passed_swaps_and_check_failure_refuses() {
        let (s, a) = step(State::Checking(job("1.1.0")), Event::CheckPassed, &policy());
        assert_eq!(s, State::Swapping(job("1.1.0")));
        assert!(has(&a, |a| matches!(a, Action::Swap(_))));
        let (s, a) = step(
            State::Checking(job("1.1.0")),
            Event::CheckFailed("probs differ".into()),
            &policy(),
        );
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["check_failed"]);
        assert!(!has(&a, |a| matches!(a, Action::Swap(_))));
    }

    #[test]
    fn swapped_starts_probation_and_swap_failure_rolls_back() {
        let b = h(5, 0, None);
        let (s, a) = step(
            State::Swapping(job("1.1.0")),
            Event::Swapped { baseline: b },
            &policy(),
        );
        assert_eq!(
            s,
            State::Probation {
                job: job("1.1.0"),
                baseline: b
            }
        );
        assert!(has(&a, |a| matches!(a, Action::Watch)));
        let (s, a) = step(
            State::Swapping(job("1.1.0")),
            Event::SwapFailed("inputs differ".into()),
            &policy(),
        );
        assert!(matches!(s, State::RollingBack { .. }));
        assert_eq!(a, vec![Action::Rollback(offer("1.1.0"))]);
    }

    fn probation(baseline: ModelHealth) -> State {
        State::Probation {
            job: job("1.1.0"),
            baseline,
        }
    }

    #[test]
    fn probation_keeps_watching_while_healthy_and_commits_at_the_end() {
        let b = h(100, 2, None);
        let (s, a) = step(
            probation(b),
            Event::Health {
                elapsed: Duration::from_secs(10),
                health: h(200, 3, Some(1000)),
            },
            &policy(),
        );
        assert_eq!(s, probation(b));
        assert_eq!(a, vec![Action::Watch]);
        let (s, a) = step(
            probation(b),
            Event::Health {
                elapsed: Duration::from_secs(60),
                health: h(300, 3, Some(1000)),
            },
            &policy(),
        );
        assert_eq!(s, State::Committing(job("1.1.0")));
        assert_eq!(a, vec![Action::Commit(offer("1.1.0"))]);
    }

    #[test]
    fn probation_without_traffic_commits() {
        let (s, _) = step(
            probation(h(0, 0, None)),
            Event::Health {
                elapsed: Duration::from_secs(61),
                health: h(0, 0, None),
            },
            &policy(),
        );
        assert_eq!(s, State::Committing(job("1.1.0")));
    }

    #[test]
    fn probation_rolls_back_on_errors_counted_since_the_swap() {
        // 50 errors before the swap do not count against the new model.
        let b = h(100, 50, None);
        let (s, _) = step(
            probation(b),
            Event::Health {
                elapsed: Duration::from_secs(5),
                health: h(120, 51, None),
            },
            &policy(),
        );
        assert_eq!(s, probation(b));
        let (s, a) = step(
            probation(b),
            Event::Health {
                elapsed: Duration::from_secs(5),
                health: h(110, 60, None),
            },
            &policy(),
        );
        assert!(matches!(&s, State::RollingBack { reason, .. } if reason.contains("error rate")));
        assert_eq!(a, vec![Action::Rollback(offer("1.1.0"))]);
    }

    #[test]
    fn probation_rolls_back_on_p99_latency_but_not_before_min_runs() {
        let b = h(0, 0, None);
        let (s, _) = step(
            probation(b),
            Event::Health {
                elapsed: Duration::from_secs(1),
                health: h(3, 0, Some(900_000)),
            },
            &policy(),
        );
        assert_eq!(s, probation(b));
        let (s, _) = step(
            probation(b),
            Event::Health {
                elapsed: Duration::from_secs(1),
                health: h(30, 0, Some(900_000)),
            },
            &policy(),
        );
        assert!(matches!(&s, State::RollingBack { reason, .. } if reason.contains("p99")));
    }

    #[test]
    fn committed_installs_and_prunes() {
        let (s, a) = step(State::Committing(job("1.1.0")), Event::Committed, &policy());
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["installed"]);
        assert!(has(&a, |a| matches!(a, Action::Prune(_))));
        assert!(!has(&a, |a| matches!(a, Action::Refuse(_))));
    }

    #[test]
    fn commit_failure_rolls_back_in_memory() {
        let (s, a) = step(
            State::Committing(job("1.1.0")),
            Event::CommitFailed("EROFS".into()),
            &policy(),
        );
        assert!(matches!(s, State::RollingBack { .. }));
        assert_eq!(a, vec![Action::Rollback(offer("1.1.0"))]);
    }

    #[test]
    fn rolled_back_refuses_the_version_and_deletes_it() {
        let s0 = State::RollingBack {
            job: job("1.1.0"),
            reason: "p99".into(),
        };
        let (s, a) = step(s0.clone(), Event::RolledBack, &policy());
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["rolled_back"]);
        assert!(has(&a, |a| matches!(a, Action::Refuse(_))));
        assert!(has(&a, |a| matches!(a, Action::DiscardStaged(_))));
        let (s, a) = step(s0, Event::RollbackFailed("x".into()), &policy());
        assert_eq!(s, State::Idle);
        assert_eq!(steps(&a), ["rollback_failed"]);
        // The staged folder may still be in use by the pipelines: kept.
        assert!(!has(&a, |a| matches!(a, Action::DiscardStaged(_))));
    }

    #[test]
    fn out_of_order_events_change_nothing() {
        let states = [
            State::Idle,
            State::Downloading(job("1.1.0")),
            State::Verifying(job("1.1.0")),
            State::Loading(job("1.1.0")),
            probation(h(0, 0, None)),
            State::Committing(job("1.1.0")),
        ];
        for s in states {
            // Events no state above accepts.
            for e in [Event::RolledBack, Event::Staged, Event::CheckPassed] {
                let (s2, a) = step(s.clone(), e, &policy());
                assert_eq!(s2, s);
                assert!(a.is_empty());
            }
        }
        // A second offer while busy does not start another update.
        let busy = State::Loading(job("1.1.0"));
        let (s2, a) = step(
            busy.clone(),
            Event::Offered {
                offer: offer("1.2.0"),
                serving: Some("1.0.0".into()),
            },
            &policy(),
        );
        assert_eq!(s2, busy);
        assert!(a.is_empty());
    }

    #[test]
    fn recovery_after_a_crash() {
        assert_eq!(recover(None, "1.1.0", Some("1.0.0")), Recovery::Clean);
        for early in ["downloading", "verifying", "staging", "loading", "checking"] {
            assert_eq!(
                recover(Some(early), "1.1.0", Some("1.0.0")),
                Recovery::Retry
            );
        }
        for late in ["swapping", "probation", "committing", "rolling_back"] {
            assert_eq!(
                recover(Some(late), "1.1.0", Some("1.0.0")),
                Recovery::Refuse
            );
            assert_eq!(recover(Some(late), "1.1.0", None), Recovery::Refuse);
        }
        // The link already points to the new version: the commit got that far.
        assert_eq!(
            recover(Some("committing"), "1.1.0", Some("1.1.0")),
            Recovery::Finish
        );
    }

    #[test]
    fn version_order_is_semver() {
        use std::cmp::Ordering::*;
        assert_eq!(cmp_versions("1.10.0", "1.9.0"), Some(Greater));
        assert_eq!(cmp_versions("1.0.0-rc.1", "1.0.0"), Some(Less));
        assert_eq!(cmp_versions("x", "1.0.0"), None);
    }
}
