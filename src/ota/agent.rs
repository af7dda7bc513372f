//! The agent: polls the fleet, performs the state machine's actions, feeds
//! back their outcome, and keeps the journal that recovery reads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::VerifyingKey;
use tokio::sync::watch;

use super::bundle::{self, BundleKind};
use super::host::ModelHost;
use super::install::{Installed, Journal, Layout, StateFile};
use super::machine::{self, Action, Event, Offer, Policy, Recovery, State, Status};
use super::{OtaConfig, check, fetch::Fetcher, sign};
use crate::model::registry::LoadedModel;

/// Test hook: `OUTPOST_OTA_FAILPOINT=<step>` makes the process SIGKILL
/// itself right after that step (downloaded, verified, staged, loaded,
/// checked, swapped, switched, committed), so tests can crash it at every
/// point of an update deterministically.
pub const FAILPOINT_ENV: &str = "OUTPOST_OTA_FAILPOINT";

pub struct Agent {
    cfg: OtaConfig,
    policy: Policy,
    host: Arc<dyn ModelHost>,
    layout: Layout,
    trusted: Vec<VerifyingKey>,
    fetcher: Option<Fetcher>,
    state: StateFile,
    shutdown: watch::Receiver<bool>,
    failpoint: Option<String>,
    /// The loaded new model of the job in progress.
    new_model: Option<Arc<LoadedModel>>,
    /// The model it replaced (for a rollback).
    previous: Option<Arc<LoadedModel>>,
    swapped_at: Option<Instant>,
}

impl Agent {
    pub fn new(
        cfg: OtaConfig,
        policy: Policy,
        host: Arc<dyn ModelHost>,
        trusted: Vec<VerifyingKey>,
        fetcher: Option<Fetcher>,
        shutdown: watch::Receiver<bool>,
    ) -> Agent {
        let layout = Layout::new(&host.data_dir(), &host.model_dir());
        Agent {
            cfg,
            policy,
            host,
            layout,
            trusted,
            fetcher,
            state: StateFile::default(),
            shutdown,
            failpoint: std::env::var(FAILPOINT_ENV).ok(),
            new_model: None,
            previous: None,
            swapped_at: None,
        }
    }

    fn failpoint(&self, step: &str) {
        if self.failpoint.as_deref() == Some(step) {
            tracing::warn!(step, "OTA failpoint: SIGKILL");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    }

    fn emit(&self, s: &Status) {
        tracing::info!(
            step = s.step,
            model = %s.name,
            version = %s.version,
            from = s.from.as_deref().unwrap_or(""),
            detail = s.detail.as_deref().unwrap_or(""),
            "OTA"
        );
        let v = serde_json::to_value(s).unwrap_or_default();
        if let Err(e) = self.host.event("ota", &v) {
            tracing::warn!(error = %e, "OTA: status event not stored");
        }
    }

    fn save(&self) {
        if let Err(e) = self.layout.save_state(&self.state) {
            tracing::error!(error = %e, path = %self.layout.state_path().display(), "OTA: state not saved");
        }
    }

    /// Reads the state and settles what a crash left. Runs before polling.
    pub fn recover(&mut self) {
        self.layout.clean_leftovers();
        self.state = match self.layout.load_state() {
            Ok(s) => s,
            Err(e) => {
                // Written atomically, so this is outside damage: start afresh
                // (the model link still says what serves).
                tracing::error!(error = %e, "OTA: state.json unreadable; starting with an empty state");
                StateFile::default()
            }
        };
        let Some(j) = self.state.journal.take() else {
            return;
        };
        let linked = self.layout.linked_version(&j.name);
        let status = |step, detail: String| Status {
            step,
            name: j.name.clone(),
            version: j.version.clone(),
            from: linked.clone(),
            detail: Some(detail),
        };
        match machine::recover(Some(&j.phase), &j.version, linked.as_deref()) {
            Recovery::Clean => {}
            Recovery::Finish => {
                let previous = self
                    .state
                    .models
                    .get(&j.name)
                    .map(|i| i.version.clone())
                    .filter(|v| *v != j.version);
                self.state.models.insert(
                    j.name.clone(),
                    Installed {
                        version: j.version.clone(),
                        previous,
                    },
                );
                self.emit(&status(
                    "installed",
                    format!("finished after a restart in phase {}", j.phase),
                ));
            }
            Recovery::Retry => {
                tracing::info!(model = %j.name, version = %j.version, phase = %j.phase, "OTA: update interrupted before serving; it will be tried again");
            }
            Recovery::Refuse => {
                self.state.refused.insert(j.sha256.clone());
                let _ = std::fs::remove_dir_all(self.layout.version_dir(&j.name, &j.version));
                self.emit(&status(
                    "rolled_back",
                    format!(
                        "the process stopped during {} of the new version; serving {} again",
                        j.phase,
                        linked.as_deref().unwrap_or("the previous version")
                    ),
                ));
            }
        }
        self.save();
    }

    /// Polls until shutdown.
    pub async fn run(mut self) {
        if self.fetcher.is_none() {
            return;
        }
        loop {
            if *self.shutdown.borrow() {
                return;
            }
            let polled = match self.fetcher.as_mut() {
                Some(f) => f.poll().await,
                None => return,
            };
            match polled {
                Ok(offers) => {
                    for offer in offers {
                        if *self.shutdown.borrow() {
                            return;
                        }
                        if self
                            .state
                            .refused
                            .contains(&offer.sha256.to_ascii_lowercase())
                        {
                            continue;
                        }
                        self.update(offer).await;
                    }
                }
                Err(e) => tracing::warn!(error = %e, "OTA: manifest poll failed"),
            }
            let wait = self.cfg.poll_interval + jitter(self.cfg.poll_jitter);
            let mut stop = self.shutdown.clone();
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }

    /// One update from offer to idle.
    async fn update(&mut self, offer: Offer) {
        let serving = match offer.kind {
            BundleKind::Model => self
                .host
                .current(&offer.name)
                .map(|m| m.manifest.version.clone()),
            BundleKind::Daemon => None,
        };
        let mut state = State::Idle;
        let mut next = Some(Event::Offered { offer, serving });
        while let Some(ev) = next.take() {
            let (s, actions) = machine::step(state, ev, &self.policy);
            state = s;
            self.journal(&state);
            for a in actions {
                if let Some(ev) = self.perform(a).await {
                    next = Some(ev);
                }
            }
            if next.is_none() && state != State::Idle {
                // Stopped mid-update (shutdown): a graceful stop is not a
                // crash, so the update is tried again after the restart.
                self.state.journal = None;
                self.save();
                break;
            }
        }
        self.new_model = None;
        self.previous = None;
        self.swapped_at = None;
    }

    /// Persists the phase when it changes (what recovery decides from).
    fn journal(&mut self, state: &State) {
        let j = state.job().map(|job| Journal {
            name: job.offer.name.clone(),
            version: job.offer.version.clone(),
            sha256: job.offer.sha256.to_ascii_lowercase(),
            phase: state.phase().to_string(),
        });
        if j != self.state.journal {
            self.state.journal = j;
            self.save();
        }
    }

    async fn blocking<T: Send + 'static>(
        f: impl FnOnce() -> Result<T, String> + Send + 'static,
    ) -> Result<T, String> {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| format!("task: {e}"))?
    }

    async fn perform(&mut self, a: Action) -> Option<Event> {
        match a {
            Action::Emit(s) => {
                self.emit(&s);
                None
            }
            Action::Download(o) => {
                let part = self.layout.download(&o.sha256.to_ascii_lowercase());
                let fetcher = self.fetcher.as_ref()?;
                let r = fetcher
                    .download(&o, &part, self.cfg.max_bytes_per_s, &self.shutdown)
                    .await;
                if *self.shutdown.borrow() {
                    return None;
                }
                Some(match r {
                    Ok(()) => {
                        self.failpoint("downloaded");
                        Event::Downloaded
                    }
                    Err(e) => Event::DownloadFailed(e),
                })
            }
            Action::Verify(o) => {
                let path = self.layout.download(&o.sha256.to_ascii_lowercase());
                let trusted = self.trusted.clone();
                let ev = Self::blocking(move || Ok(verify(&path, &o, &trusted)))
                    .await
                    .unwrap_or_else(Event::Corrupt);
                if matches!(ev, Event::Verified(_)) {
                    self.failpoint("verified");
                }
                Some(ev)
            }
            Action::Stage(o) => {
                let layout = self.layout.clone();
                let bundle = layout.download(&o.sha256.to_ascii_lowercase());
                let r = Self::blocking(move || {
                    layout.stage(&bundle, &o.name, &o.version)?;
                    let m = crate::model::manifest::Manifest::load(
                        &layout.model_path(&o.name, &o.version).join("manifest.toml"),
                    )
                    .map_err(|e| e.to_string())?;
                    if m.name != o.name || m.version != o.version {
                        return Err(format!("its manifest.toml says {}@{}", m.name, m.version));
                    }
                    Ok(())
                })
                .await;
                Some(match r {
                    Ok(()) => {
                        self.failpoint("staged");
                        Event::Staged
                    }
                    Err(e) => Event::StageFailed(e),
                })
            }
            Action::Load(o) => {
                let host = self.host.clone();
                let manifest = self
                    .layout
                    .model_path(&o.name, &o.version)
                    .join("manifest.toml");
                match Self::blocking(move || host.load(&manifest)).await {
                    Ok(m) => {
                        self.new_model = Some(m);
                        self.failpoint("loaded");
                        Some(Event::Loaded)
                    }
                    Err(e) => Some(Event::LoadFailed(e)),
                }
            }
            Action::Check(o) => {
                let model = self.new_model.clone()?;
                let folder = self.layout.model_path(&o.name, &o.version);
                let tol = self.cfg.check_tolerance;
                Some(
                    match Self::blocking(move || check::run(&model, &folder, tol)).await {
                        Ok(n) => {
                            if n.is_none() {
                                tracing::warn!(bundle = %o.id(), "OTA: bundle has no check data; only the warm-up ran");
                            }
                            self.failpoint("checked");
                            Event::CheckPassed
                        }
                        Err(e) => Event::CheckFailed(e),
                    },
                )
            }
            Action::Swap(o) => {
                let model = self.new_model.clone()?;
                let before = self.host.current(&o.name);
                let baseline = self.host.health(&o.name);
                match self.host.swap(model) {
                    Ok(prev) => {
                        self.previous = prev.or(before);
                        self.swapped_at = Some(Instant::now());
                        self.failpoint("swapped");
                        Some(Event::Swapped { baseline })
                    }
                    Err(e) => {
                        self.previous = before;
                        Some(Event::SwapFailed(e))
                    }
                }
            }
            Action::Watch => {
                let job_name = self.state.journal.as_ref()?.name.clone();
                let every = (self.policy.probation / 4)
                    .clamp(Duration::from_millis(50), Duration::from_secs(1));
                let mut stop = self.shutdown.clone();
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.wait_for(|s| *s) => return None,
                }
                let elapsed = self.swapped_at.map(|t| t.elapsed()).unwrap_or_default();
                Some(Event::Health {
                    elapsed,
                    health: self.host.health(&job_name),
                })
            }
            Action::Commit(o) => {
                let layout = self.layout.clone();
                let (name, version) = (o.name.clone(), o.version.clone());
                let fp = self.failpoint.clone();
                let r = Self::blocking(move || {
                    let prev = layout.switch(&name, &version)?;
                    if fp.as_deref() == Some("switched") {
                        let _ = rustix::process::kill_process(
                            rustix::process::getpid(),
                            rustix::process::Signal::KILL,
                        );
                    }
                    Ok(prev)
                })
                .await;
                match r {
                    Ok(prev) => {
                        self.state.models.insert(
                            o.name.clone(),
                            Installed {
                                version: o.version.clone(),
                                previous: prev.filter(|p| *p != o.version),
                            },
                        );
                        self.save();
                        self.failpoint("committed");
                        Some(Event::Committed)
                    }
                    Err(e) => Some(Event::CommitFailed(e)),
                }
            }
            Action::Rollback(_) => {
                let Some(prev) = self.previous.clone() else {
                    return Some(Event::RollbackFailed("no previous model held".into()));
                };
                Some(match self.host.swap(prev) {
                    Ok(_) => Event::RolledBack,
                    Err(e) => Event::RollbackFailed(e),
                })
            }
            Action::Refuse(o) => {
                self.state.refused.insert(o.sha256.to_ascii_lowercase());
                self.save();
                None
            }
            Action::DiscardDownload(o) => {
                let _ = std::fs::remove_file(self.layout.download(&o.sha256.to_ascii_lowercase()));
                None
            }
            Action::DiscardStaged(o) => {
                // Never the folder the model link points to.
                if self.layout.linked_version(&o.name).as_deref() != Some(o.version.as_str()) {
                    let _ = std::fs::remove_dir_all(self.layout.version_dir(&o.name, &o.version));
                }
                let _ = std::fs::remove_dir_all(self.layout.staging(&o.name, &o.version));
                None
            }
            Action::Prune(o) => {
                let prev = self
                    .state
                    .models
                    .get(&o.name)
                    .and_then(|i| i.previous.clone());
                let mut keep = vec![o.version.as_str()];
                if let Some(p) = prev.as_deref() {
                    keep.push(p);
                }
                self.layout.prune(&o.name, &keep);
                None
            }
        }
    }
}

/// Size, sha256 and signature of a downloaded bundle, then its signed
/// manifest.json; nothing is unpacked.
fn verify(path: &std::path::Path, o: &Offer, trusted: &[VerifyingKey]) -> Event {
    let (digest, size) = match sign::sha256_file(path) {
        Ok(x) => x,
        Err(e) => return Event::Corrupt(e.to_string()),
    };
    if size != o.size {
        return Event::Corrupt(format!("{size} bytes, the offer says {}", o.size));
    }
    let sha = hex::encode(digest);
    if !sha.eq_ignore_ascii_case(&o.sha256) {
        return Event::Corrupt(format!("sha256 {sha}, the offer says {}", o.sha256));
    }
    if let Err(e) = sign::verify_digest(trusted, &digest, &o.signature) {
        return Event::Untrusted(e.to_string());
    }
    match bundle::read_manifest(path) {
        Ok(m) => Event::Verified(Box::new(m)),
        Err(e) => Event::Untrusted(format!("signed but malformed: {e}")),
    }
}

/// A random part of `max`, so a fleet does not poll in step.
fn jitter(max: Duration) -> Duration {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        return Duration::ZERO;
    }
    max.mul_f64(u64::from_le_bytes(b) as f64 / u64::MAX as f64)
}
