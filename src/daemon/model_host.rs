//! The daemon as the OTA agent sees it: where models live, loading one,
//! swapping it into the pipelines that use it, their health, READY, the
//! restart into a new daemon slot, and OTA events stored as records.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;

use crate::backend::ort::{Runtime, SessionOptions};
use crate::model::registry::LoadedModel;
use crate::outbox::Outbox;
use crate::pipeline::{IdGen, Scheduler};

/// The daemon as the OTA agent sees it.
pub struct DaemonModelHost {
    pub scheduler: Arc<ArcSwap<Scheduler>>,
    pub runtime: Arc<Runtime>,
    pub session: SessionOptions,
    pub model_dir: PathBuf,
    pub data_dir: PathBuf,
    pub outbox: Outbox,
    pub ids: Arc<IdGen>,
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

    fn load(&self, manifest: &Path) -> Result<Arc<LoadedModel>, String> {
        crate::model::registry::load_manifest(&self.runtime, manifest, &self.session)
            .map(Arc::new)
            .map_err(|e| e.to_string())
    }

    fn current(&self, name: &str) -> Option<Arc<LoadedModel>> {
        self.scheduler()
            .pipelines()
            .iter()
            .map(|p| p.model())
            .find(|m| m.manifest.name == name)
    }

    fn swap(&self, model: Arc<LoadedModel>) -> Result<Option<Arc<LoadedModel>>, String> {
        let sched = self.scheduler();
        let users: Vec<_> = sched
            .pipelines()
            .iter()
            .filter(|p| p.model().manifest.name == model.manifest.name)
            .collect();
        let mut previous = None;
        for p in users {
            previous = Some(p.swap_model(model.clone()).map_err(|e| e.to_string())?);
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
            h.runs += crate::pipeline::PipelineStats::get(&p.stats.batches);
            h.errors += p.stats.drops().get("inference_error").copied().unwrap_or(0);
            if let Some(v) = p.stats.inference_us.summary().p99_us {
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

    fn event(&self, stream: &str, event: &serde_json::Value) -> Result<(), String> {
        let (id, seq) = self.ids.next();
        let mut rec = serde_json::json!({
            "id": id,
            "device": self.ids.device,
            "pipeline": "ota",
            "stream": stream,
            "seq": seq,
            "event": event,
        });
        crate::clock::stamp_json(&mut rec);
        let bytes = serde_json::to_vec(&rec).map_err(|e| e.to_string())?;
        self.outbox
            .append(stream, &bytes)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}
