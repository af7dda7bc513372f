//! The agent: polls the fleet, performs the state machine's actions, feeds
//! back their outcome, and keeps the journal that recovery reads.
//!
//! Rooms: this file is the loop (polls, commands, one update from offer to
//! idle, the journal, recovery); `actions.rs` performs each action of the
//! state machine; `daemon_slot.rs` is the daemon-update side (staging into
//! and activating a slot, a slot's trial, what the launcher left).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ed25519_dalek::VerifyingKey;
use tokio_util::sync::CancellationToken;

use super::bundle::BundleKind;
use super::command::{self, Request};
use super::host::ModelHost;
use super::install::{Installed, Journal, Layout, StateFile};
use super::machine::{self, Event, Offer, Policy, Recovery, State, Status};
use super::slots::Slots;
use super::stats::OtaStats;
use super::{OtaConfig, fetch::Fetcher, sign};
use crate::model::registry::LoadedModel;

mod actions;
mod daemon_slot;

/// Test hook: `OUTPOST_OTA_FAILPOINT=<step>` makes the process SIGKILL
/// itself right after that step (downloaded, verified, staged, loaded,
/// checked, swapped, switched, committed), so tests can crash it at every
/// point of an update deterministically.
pub const FAILPOINT_ENV: &str = "OUTPOST_OTA_FAILPOINT";

/// What is wrong with an offer's entry before anything is downloaded:
/// the entry is skipped, the bundle not condemned.
#[derive(Debug, thiserror::Error)]
enum EntryFault {
    #[error("states {size} bytes, over max_bundle_bytes {max}")]
    TooLarge { size: u64, max: u64 },
    #[error("sha256 `{0}` is not 64 hex digits")]
    Sha256(String),
    #[error("signature: {0}")]
    Signature(sign::SignError),
}

/// Where the agent's inputs come from and its figures go.
pub struct Wiring {
    pub device: String,
    /// `[device] groups`: which targeted entries this device takes.
    pub groups: Vec<String>,
    /// Payloads of the uplink's command topic.
    pub commands: Option<tokio::sync::mpsc::Receiver<Vec<u8>>>,
    pub stats: Arc<OtaStats>,
    /// The daemon slot this process runs from (None: the packaged binary).
    pub running_slot: Option<String>,
}

pub struct Agent {
    cfg: OtaConfig,
    policy: Policy,
    host: Arc<dyn ModelHost>,
    layout: Layout,
    slots: Slots,
    trusted: Vec<VerifyingKey>,
    fetcher: Fetcher,
    wiring: Wiring,
    state: StateFile,
    /// Cancelled when the daemon stops.
    shutdown: CancellationToken,
    failpoint: Option<String>,
    /// The loaded new model of the job in progress.
    new_model: Option<Arc<LoadedModel>>,
    /// The model it replaced (for a rollback).
    previous: Option<Arc<LoadedModel>>,
    swapped_at: Option<Instant>,
    /// Entries skipped (not refused): not tried again while they stay the same.
    skipped: HashSet<String>,
    /// Junk on the command topic since the last aggregate report, by reason.
    junk: BTreeMap<&'static str, u64>,
    junk_reported: Option<Instant>,
    /// Entries already reported as not for this device (so each is told
    /// upstream once, not at every poll).
    not_selected: std::collections::HashSet<String>,
}

/// How often junk on the command topic is reported (log and status event).
const JUNK_REPORT_EVERY: Duration = Duration::from_secs(60);

/// An entry as a whole: the same bundle under other fields is another entry.
fn fingerprint(o: &Offer) -> String {
    serde_json::to_string(o).unwrap_or_default()
}

impl Agent {
    pub fn new(
        cfg: OtaConfig,
        policy: Policy,
        host: Arc<dyn ModelHost>,
        trusted: Vec<VerifyingKey>,
        fetcher: Fetcher,
        wiring: Wiring,
        shutdown: CancellationToken,
    ) -> Agent {
        let layout = Layout::new(&host.data_dir(), &host.model_dir());
        let slots = Slots::new(&host.data_dir());
        Agent {
            cfg,
            policy,
            host,
            layout,
            slots,
            trusted,
            fetcher,
            wiring,
            state: StateFile::default(),
            shutdown,
            failpoint: std::env::var(FAILPOINT_ENV).ok(),
            new_model: None,
            previous: None,
            swapped_at: None,
            skipped: HashSet::new(),
            junk: BTreeMap::new(),
            junk_reported: None,
            not_selected: Default::default(),
        }
    }

    /// What can be told of an entry before downloading anything: its
    /// sha256 and signature line are well formed, the signature (over the
    /// stated sha256) holds, the stated size is within `max_bundle_bytes`.
    fn precheck(&self, o: &Offer) -> Result<(), EntryFault> {
        if o.size > self.cfg.max_bundle_bytes {
            return Err(EntryFault::TooLarge {
                size: o.size,
                max: self.cfg.max_bundle_bytes,
            });
        }
        let digest: [u8; 32] = hex::decode(&o.sha256)
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| EntryFault::Sha256(o.sha256.clone()))?;
        sign::verify_digest(&self.trusted, &digest, &o.signature)
            .map(|_| ())
            .map_err(EntryFault::Signature)
    }

    /// Reports junk on the command topic in aggregate, at most every
    /// [`JUNK_REPORT_EVERY`]; counts wait for the next report.
    fn report_junk(&mut self) {
        if self.junk.is_empty()
            || self
                .junk_reported
                .is_some_and(|t| t.elapsed() < JUNK_REPORT_EVERY)
        {
            return;
        }
        let total: u64 = self.junk.values().sum();
        let by: Vec<String> = self.junk.iter().map(|(r, n)| format!("{r} {n}")).collect();
        let detail = format!(
            "{total} unauthenticated command(s) refused ({}); reported at most every {} s",
            by.join(", "),
            JUNK_REPORT_EVERY.as_secs()
        );
        tracing::warn!(total, "OTA: junk on the command topic: {detail}");
        emit(
            &*self.host,
            &self.wiring.stats,
            &Status {
                step: "commands_refused",
                name: String::new(),
                version: String::new(),
                from: None,
                detail: Some(detail),
            },
        );
        self.junk.clear();
        self.junk_reported = Some(Instant::now());
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
        emit(&*self.host, &self.wiring.stats, s);
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
        self.fetcher.set_last_signed(self.state.last_manifest);
        self.recover_daemon();
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

    /// Polls and takes commands until shutdown.
    pub async fn run(mut self) {
        self.start_daemon_trial();
        let polling = self.cfg.manifest_url.is_some();
        let mut commands = self.wiring.commands.take();
        if !polling && commands.is_none() {
            return;
        }
        let mut poll_now = polling;
        loop {
            if self.shutdown.is_cancelled() {
                return;
            }
            if poll_now {
                match self.fetcher.poll().await {
                    Ok(opened) => {
                        self.document_taken(&opened);
                        for offer in opened.offers {
                            if self.shutdown.is_cancelled() {
                                return;
                            }
                            if self
                                .state
                                .refused
                                .contains(&offer.sha256.to_ascii_lowercase())
                                || self.skipped.contains(&fingerprint(&offer))
                            {
                                continue;
                            }
                            if !self.selected(&offer) {
                                continue;
                            }
                            self.update(offer).await;
                        }
                    }
                    Err(e) => {
                        if let super::fetch::PollError::Document(d) = &e {
                            self.wiring.stats.document(d.reason());
                        }
                        tracing::warn!(error = %e, "OTA: manifest poll failed");
                    }
                }
            }
            let wait = self.cfg.poll_interval + crate::backoff::jitter(self.cfg.poll_jitter);
            let stop = self.shutdown.clone();
            let sleep = async {
                if polling {
                    tokio::time::sleep(wait).await
                } else {
                    std::future::pending().await
                }
            };
            let cmd = async {
                match commands.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            enum Woke {
                Timer,
                Stop,
                Command(Option<Vec<u8>>),
            }
            let woke = tokio::select! {
                _ = sleep => Woke::Timer,
                _ = stop.cancelled() => Woke::Stop,
                c = cmd => Woke::Command(c),
            };
            self.report_junk();
            match woke {
                Woke::Timer => poll_now = polling,
                Woke::Stop => return,
                Woke::Command(Some(payload)) => {
                    poll_now = self.command(&payload).await && polling;
                }
                Woke::Command(None) => {
                    commands = None;
                    if !polling {
                        return;
                    }
                    poll_now = false;
                }
            }
        }
    }

    /// Handles one command payload; true when it asks for a poll now.
    async fn command(&mut self, payload: &[u8]) -> bool {
        let opened = command::open_with_skew(
            payload,
            &self.trusted,
            &self.wiring.device,
            command::unix_ms_now(),
            self.state.last_command,
            u64::try_from(self.cfg.max_command_skew.as_millis()).unwrap_or(u64::MAX),
        );
        let (c, req) = match opened {
            Ok(x) => x,
            Err(e) if e.is_junk() => {
                // Anyone can publish these: counted, reported in aggregate.
                self.wiring.stats.command(e.reason());
                *self.junk.entry(e.reason()).or_insert(0) += 1;
                tracing::debug!(error = %e, "OTA: unauthenticated command refused");
                self.report_junk();
                return false;
            }
            Err(e) => {
                self.wiring.stats.command(e.reason());
                tracing::warn!(error = %e, "OTA: update command refused");
                self.emit(&Status {
                    step: "command_refused",
                    name: String::new(),
                    version: String::new(),
                    from: None,
                    detail: Some(e.to_string()),
                });
                return false;
            }
        };
        self.state.last_command = Some(c.issued_ms);
        self.save();
        // Signed by the fleet: its issue time is a reference for the clock
        // (a clock far ahead of every reference is not trusted).
        crate::clock::confirm(i64::try_from(c.issued_ms.saturating_mul(1000)).unwrap_or(i64::MAX));
        self.wiring.stats.command("accepted");
        match req {
            Request::Poll => {
                tracing::info!("OTA: command: poll now");
                true
            }
            Request::Install(offer) => {
                let offer = match self.fetcher.resolve(offer) {
                    Ok(o) => o,
                    Err(e) => {
                        self.emit(&Status {
                            step: "command_refused",
                            name: c
                                .bundle
                                .as_ref()
                                .map(|b| b.name.clone())
                                .unwrap_or_default(),
                            version: c
                                .bundle
                                .as_ref()
                                .map(|b| b.version.clone())
                                .unwrap_or_default(),
                            from: None,
                            detail: Some(e.to_string()),
                        });
                        return false;
                    }
                };
                self.emit(&Status {
                    step: "command_accepted",
                    name: offer.name.clone(),
                    version: offer.version.clone(),
                    from: None,
                    detail: Some(if offer.rollback { "rollback" } else { "update" }.into()),
                });
                if self
                    .state
                    .refused
                    .contains(&offer.sha256.to_ascii_lowercase())
                {
                    self.emit(&Status {
                        step: "refused",
                        name: offer.name.clone(),
                        version: offer.version.clone(),
                        from: None,
                        detail: Some("this bundle was refused before".into()),
                    });
                    return false;
                }
                if !self.selected(&offer) {
                    return false;
                }
                self.update(offer).await;
                false
            }
        }
    }

    /// Counts an accepted document, logs what it left out, and keeps the
    /// issue time of a signed one (later documents must not be older).
    fn document_taken(&mut self, opened: &super::document::Opened) {
        self.wiring.stats.document(if opened.signed.is_some() {
            "signed"
        } else {
            "plain"
        });
        for (id, why) in &opened.skipped {
            self.wiring.stats.skipped("invalid");
            tracing::warn!(bundle = %id, reason = %why, "OTA: manifest entry skipped");
        }
        let last = self.fetcher.last_signed();
        if last.is_some() && last != self.state.last_manifest {
            self.state.last_manifest = last;
            self.save();
        }
    }

    /// Whether this device takes the offer (rollout percent and groups);
    /// tells the fleet once when it does not.
    fn selected(&mut self, offer: &Offer) -> bool {
        let s = super::rollout::select(offer, &self.wiring.device, &self.wiring.groups);
        let Some(reason) = s.reason() else {
            return true;
        };
        let key = format!(
            "{}|{:?}|{:?}",
            offer.sha256.to_ascii_lowercase(),
            offer.rollout,
            offer.groups
        );
        if self.not_selected.insert(key) {
            self.wiring.stats.skipped(match s {
                super::rollout::Selection::OtherGroups => "other_groups",
                _ => "outside_wave",
            });
            self.emit(&Status {
                step: "not_selected",
                name: offer.name.clone(),
                version: offer.version.clone(),
                from: None,
                detail: Some(reason),
            });
        }
        false
    }

    /// One update from offer to idle.
    async fn update(&mut self, offer: Offer) {
        if let Err(why) = self.precheck(&offer) {
            // The entry, not the bundle: skipped (no download), reported once.
            self.skipped.insert(fingerprint(&offer));
            self.emit(&Status {
                step: "skipped",
                name: offer.name.clone(),
                version: offer.version.clone(),
                from: None,
                detail: Some(why.to_string()),
            });
            return;
        }
        let serving = match offer.kind {
            BundleKind::Model => self
                .host
                .current(&offer.name)
                .map(|m| m.manifest.version.clone()),
            BundleKind::Daemon => Some(self.policy.daemon_version.clone()),
        };
        let mut state = State::Idle;
        let mut next = Some(Event::Offered { offer, serving });
        while let Some(ev) = next.take() {
            let (s, actions) = machine::step(state, ev, &self.policy);
            state = s;
            self.wiring.stats.set_phase(state.phase());
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
}

/// Logs a status event, counts it, and appends it to the outbox.
fn emit(host: &dyn ModelHost, stats: &OtaStats, s: &Status) {
    tracing::info!(
        step = s.step,
        name = %s.name,
        version = %s.version,
        from = s.from.as_deref().unwrap_or(""),
        detail = s.detail.as_deref().unwrap_or(""),
        "OTA"
    );
    stats.step(s.step);
    let v = serde_json::to_value(s).unwrap_or_default();
    stats.remember(&v);
    if let Err(e) = host.event("ota", crate::record::Event::ota(v)) {
        tracing::warn!(error = %e, "OTA: status event not stored");
    }
}
