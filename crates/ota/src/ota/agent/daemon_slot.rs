//! The daemon-update side of the agent: a daemon bundle staged into the
//! slot that is neither good nor running and activated (boot.json, then the
//! `current` link), a new slot's trial until it is marked good, and what
//! the launcher left when a slot fell back. The slot store itself and the
//! launcher's hand-over are in `ota/slots.rs`.

use std::time::Duration;

use super::actions::StepError;
use super::{Agent, emit};
use crate::ota::machine::{Event, Offer, Status};
use crate::ota::slots::{BootState, SlotInfo};

impl Agent {
    /// What the launcher left: a daemon slot that fell back is reported and
    /// refused for good.
    pub(super) fn recover_daemon(&mut self) {
        let mut boot = match self.slots.load() {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => {
                tracing::error!(error = %e, "OTA: daemon slots unreadable");
                return;
            }
        };
        let Some(fb) = boot.fell_back.take() else {
            return;
        };
        if !fb.sha256.is_empty() {
            self.state.refused.insert(fb.sha256.to_ascii_lowercase());
        }
        self.emit(&Status {
            step: "rolled_back",
            name: "outpost".into(),
            version: fb.version.clone(),
            from: Some(self.policy.daemon_version.clone()),
            detail: Some(format!(
                "slot {} did not stay up after {} start(s); running {}",
                fb.slot,
                fb.attempts,
                fb.to
                    .as_deref()
                    .map(|s| format!("slot {s}"))
                    .unwrap_or_else(|| "the packaged binary".into())
            )),
        });
        if let Err(e) = self.slots.save(&boot) {
            tracing::error!(error = %e, "OTA: daemon slots not saved");
        }
        self.save();
    }

    /// A daemon slot on trial: once READY and `daemon_probation` later, it
    /// is marked good (the launcher stops counting its starts).
    pub(super) fn start_daemon_trial(&self) {
        let Some(slot) = self.wiring.running_slot.clone() else {
            return;
        };
        let on_trial =
            matches!(self.slots.load(), Ok(Some(b)) if b.trying.as_deref() == Some(slot.as_str()));
        if !on_trial {
            return;
        }
        let host = self.host.clone();
        let slots = self.slots.clone();
        let stats = self.wiring.stats.clone();
        let probation = self.cfg.daemon_probation;
        let stop = self.shutdown.clone();
        tracing::info!(slot = %slot, probation_s = probation.as_secs_f64(), "OTA: this daemon slot is on trial");
        stats
            .daemon_trial
            .store(true, std::sync::atomic::Ordering::Relaxed);
        tokio::spawn(async move {
            let trial = async {
                while !host.ready() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(probation).await;
            };
            tokio::select! {
                _ = trial => {}
                _ = stop.cancelled() => return,
            }
            let r = tokio::task::spawn_blocking(
                move || -> Result<Option<(BootState, bool)>, StepError> {
                    let Some(mut b) = slots.load().map_err(StepError::io("reading boot.json"))?
                    else {
                        return Ok(None);
                    };
                    let marked = b.mark_good(&slot);
                    if marked {
                        slots.save(&b).map_err(StepError::io("writing boot.json"))?;
                    }
                    Ok(Some((b, marked)))
                },
            )
            .await
            .map_err(StepError::from)
            .and_then(|r| r);
            match r {
                Ok(Some((b, true))) => {
                    stats
                        .daemon_trial
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    let good = b.good.clone().unwrap_or_default();
                    emit(
                        &*host,
                        &stats,
                        &Status {
                            step: "installed",
                            name: "outpost".into(),
                            version: b.version_of(Some(&good)),
                            from: None,
                            detail: Some(format!("slot {good} is good")),
                        },
                    );
                }
                Ok(_) => {}
                Err(e) => tracing::error!(error = %e, "OTA: could not mark the daemon slot good"),
            }
        });
    }

    /// Unpacks a daemon bundle into the inactive slot.
    pub(super) async fn stage_daemon(&mut self, o: Offer) -> Event {
        let slots = self.slots.clone();
        let bundle = self.layout.download(&o.sha256.to_ascii_lowercase());
        let running = self.wiring.running_slot.clone();
        let r = Self::blocking(move || {
            let boot = slots
                .load()
                .map_err(StepError::io("reading boot.json"))?
                .unwrap_or_default();
            slots
                .stage(&bundle, boot.inactive(running.as_deref()))
                .map(|_| ())
                .map_err(StepError::from)
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

    /// Makes the staged slot the one tried at the next start.
    pub(super) async fn activate_slot(&mut self, o: Offer) -> Event {
        let slots = self.slots.clone();
        let running = self.wiring.running_slot.clone();
        let max = self.cfg.daemon_max_attempts;
        let r = Self::blocking(move || {
            let mut boot = slots
                .load()
                .map_err(StepError::io("reading boot.json"))?
                .unwrap_or_default();
            let slot = boot.inactive(running.as_deref());
            boot.try_slot(
                slot,
                SlotInfo {
                    version: o.version.clone(),
                    sha256: o.sha256.to_ascii_lowercase(),
                },
                max,
                running.as_deref(),
            );
            // boot.json first: a crash before the link switches
            // still starts the new slot (the launcher follows boot.json).
            slots
                .save(&boot)
                .map_err(StepError::io("writing boot.json"))?;
            slots
                .point_current(Some(slot))
                .map_err(StepError::io("pointing the current slot"))
        })
        .await;
        match r {
            Ok(()) => {
                self.failpoint("activated");
                Event::Activated
            }
            Err(e) => Event::ActivateFailed(e.failure()),
        }
    }
}
