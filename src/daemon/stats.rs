//! What reloads did and which models a generation could not load, for
//! `/metrics`: `outpost_reloads_total{result}` and
//! `outpost_models_refused_total`. A model refused at start or on a reload
//! (its manifest, file, declared sizes or warm-up) is logged with its
//! reason and counted here; the daemon keeps serving.

use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::DescriptorEncoder;

use crate::telemetry::metrics::{MetricSource, counter};

/// How one reload ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ReloadOutcome {
    /// The new config runs.
    Applied,
    /// The new config was not taken (it did not read, or a model or its
    /// pipelines could not be built): the running generation never stopped.
    Refused,
    /// Built, but it failed to start: the previous config runs again.
    RolledBack,
}

#[derive(Debug, Default)]
pub(super) struct GenerationStats {
    applied: AtomicU64,
    refused: AtomicU64,
    rolled_back: AtomicU64,
    models_refused: AtomicU64,
}

impl GenerationStats {
    pub(super) fn reload(&self, outcome: ReloadOutcome) {
        let c = match outcome {
            ReloadOutcome::Applied => &self.applied,
            ReloadOutcome::Refused => &self.refused,
            ReloadOutcome::RolledBack => &self.rolled_back,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn model_refused(&self) {
        self.models_refused.fetch_add(1, Ordering::Relaxed);
    }
}

impl MetricSource for GenerationStats {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counter(
            enc,
            "outpost_reloads",
            "Reloads (SIGHUP, POST /v1/reload) by result: applied, refused (the running \
             generation kept serving), rolled_back (the new one failed to start)",
            &[
                (vec![("result", "applied".into())], get(&self.applied)),
                (vec![("result", "refused".into())], get(&self.refused)),
                (
                    vec![("result", "rolled_back".into())],
                    get(&self.rolled_back),
                ),
            ],
        )?;
        counter(
            enc,
            "outpost_models_refused",
            "Models a generation could not load, at start or on a reload (manifest, file, \
             declared sizes, warm-up)",
            &[(Vec::new(), get(&self.models_refused))],
        )
    }
}
