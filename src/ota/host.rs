//! What the OTA agent needs from the running daemon: load a staged model,
//! swap it into the pipelines that use it, and watch how it does. The
//! daemon implements this; tests can drive it against a real daemon.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::model::registry::LoadedModel;

/// How the pipelines using one model are doing since it was swapped in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ModelHealth {
    /// Inference runs.
    pub runs: u64,
    /// Frames whose inference failed.
    pub errors: u64,
    /// 99th percentile inference latency, µs (None before any run).
    pub p99_us: Option<u64>,
}

pub trait ModelHost: Send + Sync {
    /// The model directory (`<model_dir>/<name>/manifest.toml`).
    fn model_dir(&self) -> PathBuf;
    /// The data directory (OTA keeps its staging area and state under `<data_dir>/ota`).
    fn data_dir(&self) -> PathBuf;
    /// Loads, checks and warms the model of a manifest (blocking: call it
    /// from `spawn_blocking`).
    fn load(&self, manifest: &Path) -> Result<Arc<LoadedModel>, String>;
    /// The model serving pipelines under this name now, if any pipeline uses it.
    fn current(&self, name: &str) -> Option<Arc<LoadedModel>>;
    /// Swaps `model` into every pipeline that uses a model of its name
    /// (frames in flight finish on the old one). Returns the previous model.
    fn swap(&self, model: Arc<LoadedModel>) -> Result<Option<Arc<LoadedModel>>, String>;
    /// Health of the pipelines using this model name since the last swap.
    fn health(&self, name: &str) -> ModelHealth;
    /// Appends a status event to the outbox (sent upstream like a result).
    fn event(&self, stream: &str, event: &serde_json::Value) -> Result<(), String>;
    /// Whether the daemon has said READY (a new daemon slot's trial starts then).
    fn ready(&self) -> bool {
        true
    }
    /// Stops the daemon gracefully with exit code
    /// [`super::slots::RESTART_EXIT`], so the service manager starts the
    /// slot just installed.
    fn restart(&self) {}
}
