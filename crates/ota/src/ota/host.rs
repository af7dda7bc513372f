//! What the OTA agent needs from the running daemon: load a staged model,
//! swap it into the pipelines that use it, and watch how it does. The
//! daemon implements this; tests can drive it against a real daemon.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::model::registry::{LoadedModel, ModelError};
use crate::record::{Event, EventError};

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

/// Why the daemon could not do what the agent asked (the text goes into
/// the OTA status, so each keeps its cause's own message).
#[derive(Debug, thiserror::Error)]
pub enum ModelHostError {
    /// The staged model did not load, check or warm.
    #[error(transparent)]
    Load(#[from] ModelError),
    /// The model cannot take the running one's place (its inputs, outputs
    /// or state differ); the pipeline's own error.
    #[error(transparent)]
    Swap(Box<dyn std::error::Error + Send + Sync>),
    /// A status event was not stored.
    #[error(transparent)]
    Event(#[from] EventError),
}

pub trait ModelHost: Send + Sync {
    /// The model directory (`<model_dir>/<name>/manifest.toml`).
    fn model_dir(&self) -> PathBuf;
    /// The data directory (OTA keeps its staging area and state under `<data_dir>/ota`).
    fn data_dir(&self) -> PathBuf;
    /// Loads, checks and warms the model of a manifest (blocking: call it
    /// from `spawn_blocking`).
    fn load(&self, manifest: &Path) -> Result<Arc<LoadedModel>, ModelHostError>;
    /// The model serving pipelines under this name now, if any pipeline uses it.
    fn current(&self, name: &str) -> Option<Arc<LoadedModel>>;
    /// Swaps `model` into every pipeline that uses a model of its name
    /// (frames in flight finish on the old one). Returns the previous model.
    fn swap(&self, model: Arc<LoadedModel>) -> Result<Option<Arc<LoadedModel>>, ModelHostError>;
    /// Health of the pipelines using this model name since the last swap.
    fn health(&self, name: &str) -> ModelHealth;
    /// Stores a status event beside the results (sent upstream like one).
    fn event(&self, stream: &str, event: Event) -> Result<(), ModelHostError>;
    /// Whether the daemon has said READY (a new daemon slot's trial starts then).
    fn ready(&self) -> bool {
        true
    }
    /// Stops the daemon gracefully with exit code
    /// [`super::slots::RESTART_EXIT`], so the service manager starts the
    /// slot just installed.
    fn restart(&self) {}
}
