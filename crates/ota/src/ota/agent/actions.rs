//! The state machine's actions, performed: each returns the event that
//! feeds back its outcome (None: nothing to feed back, or shutdown).

use std::time::{Duration, Instant};

use ed25519_dalek::VerifyingKey;

use super::{Agent, fingerprint};
use crate::ota::bundle::{self, BundleKind};
use crate::ota::check::{self, CheckError};
use crate::ota::failure::Failure;
use crate::ota::host::ModelHostError;
use crate::ota::install::{InstallError, Installed};
use crate::ota::machine::{Action, Event, Offer};
use crate::ota::sign;

/// Why a step the agent performs off the async threads failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum StepError {
    #[error(transparent)]
    Install(#[from] InstallError),
    /// Reading or writing the slots' state (`boot.json`, the link).
    #[error("{what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
    #[error(transparent)]
    Manifest(#[from] crate::model::manifest::ManifestError),
    #[error("its manifest.toml says {name}@{version}")]
    Mismatch { name: String, version: String },
    #[error(transparent)]
    Host(#[from] ModelHostError),
    #[error(transparent)]
    Check(#[from] CheckError),
    #[error("task: {0}")]
    Task(#[from] tokio::task::JoinError),
}

impl StepError {
    /// What the state machine gets: the I/O error's kind kept.
    pub(super) fn failure(&self) -> Failure {
        Failure::of(self)
    }

    /// An I/O error with what was being done.
    pub(super) fn io(what: &'static str) -> impl FnOnce(std::io::Error) -> StepError {
        move |source| StepError::Io { what, source }
    }
}

impl Agent {
    pub(super) async fn blocking<T: Send + 'static>(
        f: impl FnOnce() -> Result<T, StepError> + Send + 'static,
    ) -> Result<T, StepError> {
        tokio::task::spawn_blocking(f).await?
    }

    pub(super) async fn perform(&mut self, a: Action) -> Option<Event> {
        match a {
            Action::Emit(s) => {
                self.emit(&s);
                None
            }
            Action::Download(o) => self.download(o).await,
            Action::Verify(o) => Some(self.verify(o).await),
            Action::Stage(o) if o.kind == BundleKind::Daemon => Some(self.stage_daemon(o).await),
            Action::Activate(o) => Some(self.activate_slot(o).await),
            Action::Restart => {
                self.host.restart();
                None
            }
            Action::Stage(o) => Some(self.stage_model(o).await),
            Action::Load(o) => Some(self.load(o).await),
            Action::Check(o) => self.check(o).await,
            Action::Swap(o) => self.swap(o),
            Action::Watch => self.watch().await,
            Action::Commit(o) => Some(self.commit(o).await),
            Action::Rollback(_) => Some(self.roll_back()),
            Action::Refuse(o) => {
                self.state.refused.insert(o.sha256.to_ascii_lowercase());
                self.save();
                None
            }
            Action::Skip(o) => {
                self.skipped.insert(fingerprint(&o));
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
                self.prune(&o);
                None
            }
        }
    }

    /// Downloads (resuming a partial file) under the bandwidth cap.
    async fn download(&mut self, o: Offer) -> Option<Event> {
        let part = self.layout.download(&o.sha256.to_ascii_lowercase());
        let stats = self.wiring.stats.clone();
        stats
            .download_size
            .store(o.size, std::sync::atomic::Ordering::Relaxed);
        let r = self
            .fetcher
            .download(
                &o,
                &part,
                self.cfg.max_bytes_per_s,
                &self.shutdown,
                &stats.download_bytes,
            )
            .await;
        stats
            .download_size
            .store(0, std::sync::atomic::Ordering::Relaxed);
        stats
            .download_bytes
            .store(0, std::sync::atomic::Ordering::Relaxed);
        if self.shutdown.is_cancelled() {
            return None;
        }
        Some(match r {
            Ok(()) => {
                self.failpoint("downloaded");
                Event::Downloaded
            }
            Err(e) => Event::DownloadFailed(Failure::of(&e)),
        })
    }

    async fn verify(&mut self, o: Offer) -> Event {
        let path = self.layout.download(&o.sha256.to_ascii_lowercase());
        let trusted = self.trusted.clone();
        let ev = Self::blocking(move || Ok(verify(&path, &o, &trusted)))
            .await
            .unwrap_or_else(|e| Event::Corrupt(e.to_string()));
        if matches!(ev, Event::Verified(_)) {
            self.failpoint("verified");
        }
        ev
    }

    /// Unpacks a model bundle into its version folder (not yet linked).
    async fn stage_model(&mut self, o: Offer) -> Event {
        let layout = self.layout.clone();
        let bundle = layout.download(&o.sha256.to_ascii_lowercase());
        let r = Self::blocking(move || {
            layout.stage(&bundle, &o.name, &o.version)?;
            let m = crate::model::manifest::Manifest::load(
                &layout.model_path(&o.name, &o.version).join("manifest.toml"),
            )?;
            if m.name != o.name || m.version != o.version {
                return Err(StepError::Mismatch {
                    name: m.name,
                    version: m.version,
                });
            }
            Ok(())
        })
        .await;
        match r {
            Ok(()) => {
                self.failpoint("staged");
                Event::Staged
            }
            Err(e) => Event::StageFailed(e.failure()),
        }
    }

    async fn load(&mut self, o: Offer) -> Event {
        let host = self.host.clone();
        let manifest = self
            .layout
            .model_path(&o.name, &o.version)
            .join("manifest.toml");
        match Self::blocking(move || Ok(host.load(&manifest)?)).await {
            Ok(m) => {
                self.new_model = Some(m);
                self.failpoint("loaded");
                Event::Loaded
            }
            Err(e) => Event::LoadFailed(e.to_string()),
        }
    }

    /// Runs the bundle's check data through the loaded model.
    async fn check(&mut self, o: Offer) -> Option<Event> {
        let model = self.new_model.clone()?;
        let folder = self.layout.model_path(&o.name, &o.version);
        let tol = self.cfg.check_tolerance;
        Some(
            match Self::blocking(move || Ok(check::run(&model, &folder, tol)?)).await {
                Ok(n) => {
                    if n.is_none() {
                        tracing::warn!(bundle = %o.id(), "OTA: bundle has no check data; only the warm-up ran");
                    }
                    self.failpoint("checked");
                    Event::CheckPassed
                }
                Err(e) => Event::CheckFailed(e.to_string()),
            },
        )
    }

    /// Puts the new model into the pipelines that use it (probation starts).
    fn swap(&mut self, o: Offer) -> Option<Event> {
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
                Some(Event::SwapFailed(e.to_string()))
            }
        }
    }

    /// One look at the model's health during probation.
    async fn watch(&mut self) -> Option<Event> {
        let job_name = self.state.journal.as_ref()?.name.clone();
        let every =
            (self.policy.probation / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let stop = self.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.cancelled() => return None,
        }
        let elapsed = self.swapped_at.map(|t| t.elapsed()).unwrap_or_default();
        Some(Event::Health {
            elapsed,
            health: self.host.health(&job_name),
        })
    }

    /// Switches the model link to the new version for good.
    async fn commit(&mut self, o: Offer) -> Event {
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
                Event::Committed
            }
            Err(e) => Event::CommitFailed(e.to_string()),
        }
    }

    fn roll_back(&mut self) -> Event {
        let Some(prev) = self.previous.clone() else {
            return Event::RollbackFailed("no previous model held".into());
        };
        match self.host.swap(prev) {
            Ok(_) => Event::RolledBack,
            Err(e) => Event::RollbackFailed(e.to_string()),
        }
    }

    /// Keeps the installed version and the one before it.
    fn prune(&mut self, o: &Offer) {
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
        // The entry's signature line, not the bundle: skipped, not refused.
        return Event::Unverified(e.to_string());
    }
    match bundle::read_manifest(path) {
        Ok(m) => Event::Verified(Box::new(m)),
        Err(e) => Event::Untrusted(format!("signed but malformed: {e}")),
    }
}
