//! The daemon as the OTA agent sees it: where models live, loading one,
//! swapping it into the pipelines that use it, their health, READY, the
//! restart into a new daemon slot, and OTA events stored as records
//! (through the same sink as the cameras' events and the results).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;

use crate::backend::ort::{Runtime, SessionOptions};
use crate::model::registry::LoadedModel;
use crate::ota::host::ModelHostError;
use crate::pipeline::Scheduler;
use crate::record::{Event, Events};

/// The daemon as the OTA agent sees it.
pub struct DaemonModelHost {
    pub scheduler: Arc<ArcSwap<Scheduler>>,
    pub runtime: Arc<Runtime>,
    pub session: SessionOptions,
    pub model_dir: PathBuf,
    pub data_dir: PathBuf,
    pub events: Events,
    pub ready: Arc<AtomicBool>,
    pub restart: tokio::sync::mpsc::Sender<()>,
}

impl DaemonModelHost {
    fn scheduler(&self) -> Arc<Scheduler> {
        self.scheduler.load_full()
    }
}

impl crate::ota::host::ModelHost for DaemonModelHost {
    fn model_dir(&self) -> PathBuf {
        self.model_dir.clone()
    }

    fn data_dir(&self) -> PathBuf {
        self.data_dir.clone()
    }

    fn load(&self, manifest: &Path) -> Result<Arc<LoadedModel>, ModelHostError> {
        Ok(Arc::new(crate::model::registry::load_manifest(
            &self.runtime,
            manifest,
            &self.session,
        )?))
    }

    fn current(&self, name: &str) -> Option<Arc<LoadedModel>> {
        self.scheduler()
            .pipelines()
            .iter()
            .map(|p| p.model())
            .find(|m| m.manifest.name == name)
    }

    fn swap(&self, model: Arc<LoadedModel>) -> Result<Option<Arc<LoadedModel>>, ModelHostError> {
        let sched = self.scheduler();
        let users: Vec<_> = sched
            .pipelines()
            .iter()
            .filter(|p| p.model().manifest.name == model.manifest.name)
            .collect();
        let mut previous = None;
        for p in users {
            previous = Some(
                p.swap_model(model.clone())
                    .map_err(|e| ModelHostError::Swap(Box::new(e)))?,
            );
        }
        Ok(previous)
    }

    fn health(&self, name: &str) -> crate::ota::host::ModelHealth {
        let sched = self.scheduler();
        let mut h = crate::ota::host::ModelHealth::default();
        for p in sched
            .pipelines()
            .iter()
            .filter(|p| p.model().manifest.name == name)
        {
            h.runs += crate::pipeline::PipelineStats::get(&p.stats.runs.batches);
            h.errors += p.stats.drop_count(crate::pipeline::DropReason::Inference);
            if let Some(v) = p.stats.runs.inference_us.summary().p99_us {
                h.p99_us = Some(h.p99_us.map_or(v, |x| x.max(v)));
            }
        }
        h
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn restart(&self) {
        let _ = self.restart.try_send(());
    }

    fn event(&self, stream: &str, event: Event) -> Result<(), ModelHostError> {
        Ok(self.events.emit("ota", stream, event)?)
    }
}
