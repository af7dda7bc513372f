//! What the cascade (`stages.rs`) gets to run frames: values and two
//! callbacks handed to it by the pipeline, never the pipeline itself, so the
//! cascade reads no file of the worker's and is tested on its own.

use std::sync::{Arc, Mutex, MutexGuard};

use super::PipelineStats;
use super::snapshot::Latest;
use crate::backend::Tensor;
use crate::model::registry::LoadedModel;
use crate::postprocess::Postprocessor;
use crate::preprocess::Preprocessor;
use crate::record::ResultRecord;
use crate::source::{Frame, FrameError};

/// Counts a dropped frame under its reason (and logs it, rate-limited).
pub type CountDrop<'a> = &'a dyn Fn(&'static str, &str);

/// Makes a frame's record from its outputs and stores it (local outputs
/// first); counts the record or the drop.
pub type Emit<'a> =
    &'a dyn Fn(&Frame, &LoadedModel, u64, serde_json::Value) -> Result<ResultRecord, FrameError>;

/// One worker's view of a pipeline for a set of frames.
pub struct FrameContext<'a> {
    /// The model serving now (taken once for the set).
    pub model: Arc<LoadedModel>,
    pub stats: &'a PipelineStats,
    /// This worker's pre- and postprocessor.
    pub pre: &'a Mutex<Box<dyn Preprocessor>>,
    pub post: &'a Mutex<Box<dyn Postprocessor>>,
    pub main_input: &'a str,
    pub constants: &'a [(String, Tensor)],
    pub snapshot: &'a Latest,
    pub count_drop: CountDrop<'a>,
    pub emit: Emit<'a>,
}

pub(super) fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // State behind these locks stays consistent if a holder panicked mid-frame.
    m.lock().unwrap_or_else(|p| p.into_inner())
}
