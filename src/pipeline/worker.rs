//! One pipeline at run time: decode -> infer -> postprocess -> (cascade)
//! -> stream hook -> record -> sink. How it runs (serial or not, batching,
//! cascade) is its [`Mode`], decided when it is built; the frames of one
//! set go through one path (`worker/run.rs`) whatever the mode.
//!
//! A bad frame (undecodable, wrong size, failing inference) is counted under
//! its [`DropReason`], logged at a limited rate, answered with the error
//! when someone waits for it, and skipped; the pipeline keeps running.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::drops::DropReason;
use super::hook::{AnyState, DynStreamHook, StreamEnd};
use super::mode::{Batching, Mode};
use super::snapshot::Latest;
use super::stages::{Cascade, StageStats};
use super::{IdGen, PipelineConfig, PipelineStats, RateLimitedLog, RecordSink};
use crate::backend::Tensor;
use crate::model::registry::LoadedModel;
use crate::model::state::StreamStates;
use crate::output::LocalOutputs;
use crate::pipeline::WhenFull;
use crate::postprocess::{PostprocessConfig, Postprocessor};
use crate::preprocess::{PreprocessConfig, Preprocessor};
use crate::source::camera::CameraState;
use crate::source::{Frame, SourceConfig};
use crate::stream_table::{Evicted, Reason, StreamTable};

mod run;

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("pipeline `{pipeline}`: {detail}")]
    Setup { pipeline: String, detail: String },
}

/// A pipeline's stream table in figures (`/v1/status`, `/metrics`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct StreamsHeld {
    /// Streams with state held now.
    pub held: usize,
    /// `max_streams`.
    pub max: usize,
    /// Streams evicted as least recently seen to make room for a new one.
    pub evicted_lru: u64,
    /// Streams expired after `stream_idle` unseen.
    pub evicted_idle: u64,
}

/// A model that cannot take another's place in a pipeline.
#[derive(Debug, thiserror::Error)]
#[error("{new} cannot replace {old} in pipeline `{pipeline}`: inputs, outputs or state differ")]
pub struct SwapError {
    pub new: String,
    pub old: String,
    pub pipeline: String,
}

/// A stream's hook state that left the table, to be ended outside its lock.
type Ended = (String, AnyState, StreamEnd);

/// A pipeline ready to run.
pub struct Pipeline {
    pub cfg: PipelineConfig,
    /// Swapped atomically by OTA updates: each batch takes the model once, so
    /// frames in flight finish on the version they started with.
    model: RwLock<Arc<LoadedModel>>,
    pub stats: PipelineStats,
    main_input: String,
    constants: Vec<(String, Tensor)>,
    /// One pre/postprocessor per worker for stateless pipelines; serial
    /// pipelines use the first only (their per-stream state lives there).
    pre: Vec<Mutex<Box<dyn Preprocessor>>>,
    post: Vec<Mutex<Box<dyn Postprocessor>>>,
    states: Mutex<StreamStates>,
    /// The streams that may hold state here (bounded, least recently seen
    /// evicted, idle ones expired), each with its hook state once the hook
    /// saw it; a stream it lets go is reset in `pre`, `post`, `states` and
    /// the stages, and its hook state ended. Taken before any of those
    /// locks, never while one is held.
    streams: Mutex<StreamTable<Option<AnyState>>>,
    mode: Mode,
    /// Runs on each result after postprocessing, with state per stream.
    hook: Option<Box<dyn DynStreamHook>>,
    sink: Arc<dyn RecordSink>,
    outputs: LocalOutputs,
    ids: Arc<IdGen>,
    log: RateLimitedLog,
    /// Stages, pyramids and thumbnails (see stages.rs); `None`: the plain path.
    cascade: Option<Cascade>,
    /// The latest frame and outputs, for annotated snapshots.
    snapshot: Latest,
    /// The tracking behind the hook, for its counts and snapshots.
    tracking: Option<Arc<crate::track::PipelineTracking>>,
    /// The motion gate in front of the detector (`[pipelines.motion]`).
    motion: Option<super::motion::MotionGate>,
}

impl Pipeline {
    /// Builds a pipeline from its config and its loaded model. `workers` is
    /// the size of the worker pool (stateless pipelines get a pre/post
    /// processor per worker so decoding runs in parallel).
    pub fn new(
        cfg: PipelineConfig,
        model: Arc<LoadedModel>,
        model_dir: &Path,
        workers: usize,
        sink: Arc<dyn RecordSink>,
        ids: Arc<IdGen>,
    ) -> Result<Pipeline, PipelineError> {
        Pipeline::build(cfg, model, model_dir, workers, sink, ids, None)
    }

    /// [`Pipeline::new`] with a stream hook after postprocessing (see
    /// `hook.rs`): its state per stream lives in the pipeline's stream
    /// table, and the pipeline is run by one worker at a time.
    pub fn build(
        mut cfg: PipelineConfig,
        model: Arc<LoadedModel>,
        model_dir: &Path,
        workers: usize,
        sink: Arc<dyn RecordSink>,
        ids: Arc<IdGen>,
        hook: Option<Box<dyn DynStreamHook>>,
    ) -> Result<Pipeline, PipelineError> {
        let setup = |detail: String| PipelineError::Setup {
            pipeline: cfg.name.clone(),
            detail,
        };
        let m = &model.manifest;
        let pre_cfg: PreprocessConfig = cfg
            .preprocess
            .clone()
            .or_else(|| m.preprocess.clone())
            .ok_or_else(|| {
                setup(format!(
                    "model `{}` declares no preprocessing: set [pipelines.preprocess]",
                    m.name
                ))
            })?;
        let post_cfg: PostprocessConfig = cfg
            .postprocess
            .clone()
            .or_else(|| m.postprocess.clone())
            .unwrap_or_default();
        let mut problems = pre_cfg.validate();
        let mut cameras = super::cameras::CameraFeeds::default();
        let camera = match &cfg.source {
            SourceConfig::Camera(c) if c.is_many() => {
                // Each camera holds its own latest frames (its lane of the
                // queue); the camera's `queue` is each lane's bound.
                cfg.queue = c.queue;
                cfg.when_full = Some(WhenFull::DropOldest);
                if !matches!(
                    pre_cfg,
                    PreprocessConfig::Image { .. } | PreprocessConfig::Pyramid { .. }
                ) {
                    problems.push(format!(
                        "a camera source needs image (or pyramid) preprocessing; model `{}` declares another",
                        m.name
                    ));
                }
                cameras.0 = c
                    .resolved_many
                    .iter()
                    .map(|d| {
                        Arc::new(super::cameras::CameraFeed::new(
                            &d.name,
                            Arc::new(CameraState::new(d.shown())),
                        ))
                    })
                    .collect();
                if cameras.is_empty() {
                    problems.push("the camera source names no camera of [[cameras]]".into());
                }
                None
            }
            SourceConfig::Camera(c) => {
                // Latest frame: the camera's own bound replaces the queue, and
                // the oldest frame always makes room (counted `stale`).
                cfg.queue = c.queue;
                cfg.when_full = Some(WhenFull::DropOldest);
                if !matches!(
                    pre_cfg,
                    PreprocessConfig::Image { .. } | PreprocessConfig::Pyramid { .. }
                ) {
                    problems.push(format!(
                        "a camera source needs image (or pyramid) preprocessing; model `{}` declares another",
                        m.name
                    ));
                }
                Some(Arc::new(CameraState::new(c.shown())))
            }
            _ => None,
        };
        problems.extend(post_cfg.validate());
        if let Some(out) = post_cfg.output()
            && !m.outputs.iter().any(|o| o.name == out)
        {
            problems.push(format!(
                "postprocessing reads output `{out}`, which model `{}` does not have",
                m.name
            ));
        }
        let main_input = match &cfg.input {
            Some(i) => {
                if !m.inputs.iter().any(|x| &x.name == i) {
                    problems.push(format!("input `{i}` is not an input of model `{}`", m.name));
                }
                i.clone()
            }
            None => m
                .inputs
                .iter()
                .find(|i| i.fill.is_none() && !m.is_state_input(&i.name))
                .map(|i| i.name.clone())
                .unwrap_or_default(),
        };
        if main_input.is_empty() {
            problems.push(format!(
                "model `{}` has no input a frame could feed",
                m.name
            ));
        }
        if !problems.is_empty() {
            return Err(setup(problems.join("; ")));
        }
        let constants: Vec<(String, Tensor)> = m
            .inputs
            .iter()
            .filter(|i| i.name != main_input && !m.is_state_input(&i.name))
            .map(|i| {
                let shape = i
                    .spec()
                    .concrete_shape(1)
                    .map_err(|e| setup(format!("model `{}`: {e}", m.name)))?;
                Ok((
                    i.name.clone(),
                    Tensor::filled(i.dtype, &shape, i.fill.unwrap_or(0.0)),
                ))
            })
            .collect::<Result<_, PipelineError>>()?;
        // Decided here, once: how this pipeline runs its frames.
        let mode = Mode::decide(&cfg, m, &pre_cfg, &post_cfg, &main_input, hook.is_some());
        let motion = super::motion::MotionConfig::gates(
            cfg.motion.as_ref(),
            matches!(cfg.source, SourceConfig::Camera(_)),
            matches!(post_cfg, PostprocessConfig::Detections(_)),
        )
        .then(|| {
            let input = match &pre_cfg {
                PreprocessConfig::Image { width, height, .. } => (*width, *height),
                _ => (0, 0),
            };
            super::motion::MotionGate::new(cfg.motion.clone().unwrap_or_default(), input)
        });
        if let Some(g) = &motion
            && g.regions()
            && (mode.cascade
                || !matches!(pre_cfg, PreprocessConfig::Image { .. })
                || !matches!(post_cfg, PostprocessConfig::Detections(_)))
        {
            return Err(setup(
                "motion.regions needs a detector (detections postprocessing) with plain image preprocessing, without stages or a pyramid: the crops' boxes are mapped back to the frame".into(),
            ));
        }
        let cascade = if mode.cascade {
            Some(Cascade::new(&cfg, pre_cfg.clone()).map_err(|e| setup(e.to_string()))?)
        } else {
            None
        };
        let copies = if mode.serial { 1 } else { workers.max(1) };
        let base = model.path.parent().unwrap_or(model_dir).to_path_buf();
        let mut pre = Vec::with_capacity(copies);
        let mut post = Vec::with_capacity(copies);
        for _ in 0..copies {
            pre.push(Mutex::new(pre_cfg.build()));
            post.push(Mutex::new(
                post_cfg.build(&base).map_err(|e| setup(e.to_string()))?,
            ));
        }
        // Each camera keeps its own newest frame: one frame per camera.
        let snapshot = Latest::with_streams(&pre_cfg, &cameras.names());
        let streams = Mutex::new(StreamTable::new(cfg.max_streams, cfg.stream_idle));
        Ok(Pipeline {
            outputs: LocalOutputs::new(&cfg.name, &cfg.outputs),
            cfg,
            model: RwLock::new(model),
            stats: PipelineStats {
                camera,
                cameras,
                ..PipelineStats::default()
            },
            main_input,
            constants,
            pre,
            post,
            states: Mutex::new(StreamStates::new()),
            streams,
            mode,
            hook,
            sink,
            ids,
            log: RateLimitedLog::new(Duration::from_secs(5)),
            cascade,
            snapshot,
            tracking: None,
            motion,
        })
    }

    /// A pipeline of a config with `[pipelines.track]`: its tracking as the
    /// stream hook (see `tracking.rs`), reachable for counts and snapshots.
    pub fn tracked(
        cfg: PipelineConfig,
        model: Arc<LoadedModel>,
        model_dir: &Path,
        workers: usize,
        sink: Arc<dyn RecordSink>,
        ids: Arc<IdGen>,
        tracking: Arc<crate::track::PipelineTracking>,
    ) -> Result<Pipeline, PipelineError> {
        let hook = super::tracking::TrackingHook::new(Arc::clone(&tracking));
        let mut p = Pipeline::build(
            cfg,
            model,
            model_dir,
            workers,
            sink,
            ids,
            Some(Box::new(hook)),
        )?;
        p.tracking = Some(tracking);
        Ok(p)
    }

    /// The motion gate in front of the detector, when there is one.
    pub fn motion(&self) -> Option<&super::motion::MotionGate> {
        self.motion.as_ref()
    }

    /// The pipeline's tracking, when it tracks.
    pub fn tracking(&self) -> Option<&Arc<crate::track::PipelineTracking>> {
        self.tracking.as_ref()
    }

    /// Adds the configured stages with their loaded models (in stage order).
    pub fn with_stages(mut self, models: &[Arc<LoadedModel>]) -> Result<Pipeline, PipelineError> {
        if let Some(c) = &mut self.cascade {
            c.add_stages(&self.cfg, models)
                .map_err(|e| PipelineError::Setup {
                    pipeline: self.cfg.name.clone(),
                    detail: e.to_string(),
                })?;
        }
        Ok(self)
    }

    /// `(stage model, stats)` per stage.
    pub fn stage_stats(&self) -> Vec<(String, &StageStats)> {
        self.cascade.as_ref().map(|c| c.stats()).unwrap_or_default()
    }

    /// The latest frames, to draw as snapshots (see [`Latest`]).
    pub fn snapshot(&self) -> &Latest {
        &self.snapshot
    }

    /// Whether each stream (camera) keeps its own snapshot.
    pub fn snapshot_per_stream(&self) -> bool {
        self.snapshot.keeps_each_stream()
    }

    /// The model serving this pipeline now.
    pub fn model(&self) -> Arc<LoadedModel> {
        self.model.read().clone()
    }

    /// Replaces the model (OTA). The new one must take the same inputs and
    /// give the same outputs; stream state is reset (a new version's state
    /// is not the old one's). Returns the previous model.
    pub fn swap_model(&self, new: Arc<LoadedModel>) -> Result<Arc<LoadedModel>, SwapError> {
        let old = self.model();
        let sig = |m: &LoadedModel| {
            let io = |v: &[crate::model::manifest::ManifestIo]| {
                v.iter()
                    .map(|i| (i.name.clone(), i.dtype, i.shape.clone()))
                    .collect::<Vec<_>>()
            };
            (
                io(&m.manifest.inputs),
                io(&m.manifest.outputs),
                m.manifest.state.clone(),
            )
        };
        if sig(&old) != sig(&new) {
            return Err(SwapError {
                new: new.id(),
                old: old.id(),
                pipeline: self.cfg.name.clone(),
            });
        }
        let mut slot = self.model.write();
        *self.states.lock() = StreamStates::new();
        self.stats.runs.inference_us.reset();
        *slot = new;
        Ok(old)
    }

    pub fn name(&self) -> &str {
        &self.cfg.name
    }

    /// The pipeline's local outputs (started with the generation).
    pub fn outputs(&self) -> &LocalOutputs {
        &self.outputs
    }

    /// How this pipeline runs its frames.
    pub fn mode(&self) -> &Mode {
        &self.mode
    }

    /// Run by one worker at a time (stateful somewhere along the way).
    pub fn serial(&self) -> bool {
        self.mode.serial
    }

    /// Takes several frames at once (micro-batching, or stateful batching
    /// across streams).
    pub fn batchable(&self) -> bool {
        self.mode.batchable()
    }

    /// Whether a batch of `frames` taken so far is worth waiting on: below
    /// max_batch frames, and for stateful batching also fewer distinct
    /// streams than the pipeline has seen (a lone stream never waits, since
    /// its next frame could not join the run anyway).
    pub fn wants_more(&self, frames: &[Frame]) -> bool {
        let max = self.take_limit();
        if frames.len() >= max {
            return false;
        }
        if !matches!(self.mode.batching, Batching::AcrossStreams { .. }) {
            return true;
        }
        let known = self.streams.lock().len();
        let mut distinct: Vec<&str> = Vec::with_capacity(frames.len());
        for f in frames {
            if !distinct.contains(&&*f.stream) {
                distinct.push(&f.stream);
            }
        }
        distinct.len() < known.min(max)
    }

    /// How many frames a worker takes at once.
    pub fn take_limit(&self) -> usize {
        self.mode.take_limit()
    }

    /// The reason a frame pushed out of a full drop-oldest queue is counted under.
    pub fn drop_oldest_reason(&self) -> DropReason {
        if self.stats.camera.is_some() || !self.stats.cameras.is_empty() {
            DropReason::Stale
        } else {
            DropReason::QueueFullDropOldest
        }
    }

    /// Counts a dropped frame and logs it, at most once per 5 s per reason.
    pub fn count_drop(&self, reason: DropReason, detail: &str) {
        self.stats.add_drop(reason);
        if !reason.logged() {
            return;
        }
        if let Some(suppressed) = self.log.allow(reason.label()) {
            tracing::warn!(pipeline = %self.cfg.name, reason = reason.label(), suppressed, "frame dropped: {detail}");
        }
    }

    /// Processes frames taken together from the queue. Their streams are
    /// held (and seen) while they are processed.
    pub fn process(&self, frames: Vec<Frame>, worker: usize) {
        // Only serial pipelines keep state per stream (see `forget`): the
        // others run without touching the stream table, which keeps the
        // stateless fast path free of its lock and lookups.
        if !self.mode.serial {
            return self.run_frames(frames, worker);
        }
        let mut names: Vec<Arc<str>> = Vec::with_capacity(frames.len());
        for f in &frames {
            if !names.contains(&f.stream) {
                names.push(f.stream.clone());
            }
        }
        let ended = {
            let mut table = self.streams.lock();
            let now = Instant::now();
            let mut gone = Vec::new();
            for s in &names {
                gone.extend(table.begin(s, now, || None));
            }
            // Under the table's lock: no frame of a stream can begin between
            // its eviction and its reset.
            self.forget(gone)
        };
        self.end_streams(ended);
        self.run_frames(frames, worker);
        let ended = {
            let mut table = self.streams.lock();
            let now = Instant::now();
            let mut gone = Vec::new();
            for s in &names {
                gone.extend(table.end(s, now));
            }
            self.forget(gone)
        };
        self.end_streams(ended);
    }

    /// Expires the streams not seen for `stream_idle` (run periodically by
    /// the scheduler, so it happens without new frames); returns how many.
    pub fn expire_idle_streams(&self) -> usize {
        let (n, ended) = {
            let mut table = self.streams.lock();
            let gone = table.expire(Instant::now());
            (gone.len(), self.forget(gone))
        };
        self.end_streams(ended);
        n
    }

    /// Streams held now, the bound, and the evictions by reason.
    pub fn streams_held(&self) -> StreamsHeld {
        let t = self.streams.lock();
        StreamsHeld {
            held: t.len(),
            max: t.max(),
            evicted_lru: t.evicted(Reason::Lru),
            evicted_idle: t.evicted(Reason::Idle),
        }
    }

    /// Resets evicted streams wherever state is kept per stream; returns
    /// their hook states, to be ended once the table's lock is released.
    /// Only serial pipelines keep any (the scheduler's invariant: stateful
    /// processing is run by one worker at a time), so the others skip the
    /// locks.
    fn forget(&self, gone: Vec<Evicted<Option<AnyState>>>) -> Vec<Ended> {
        if gone.is_empty() || !self.mode.serial {
            return Vec::new();
        }
        let mut states = self.states.lock();
        for e in &gone {
            states.reset(&e.stream);
        }
        drop(states);
        for pre in &self.pre {
            let mut pre = pre.lock();
            for e in &gone {
                pre.reset(&e.stream);
            }
        }
        for post in &self.post {
            let mut post = post.lock();
            for e in &gone {
                post.reset(&e.stream);
            }
        }
        if let Some(c) = &self.cascade {
            for e in &gone {
                c.reset(&e.stream);
            }
        }
        if let Some(m) = &self.motion {
            for e in &gone {
                m.reset(&e.stream);
            }
        }
        gone.into_iter()
            .filter_map(|e| Some((e.stream, e.value?, e.reason.into())))
            .collect()
    }

    /// Takes every stream's hook state out of the table: `(stream, state,
    /// last seen)`, least recently seen first. The streams go with them
    /// (uncounted), so run this on a pipeline that no longer runs.
    pub fn take_stream_states(&self) -> Vec<(String, AnyState, Instant)> {
        self.streams
            .lock()
            .drain()
            .into_iter()
            .filter_map(|(s, v, seen)| Some((s, v?, seen)))
            .collect()
    }

    /// Takes over the hook states of `old`, this pipeline's predecessor in
    /// the previous generation (stopped: its workers are done), when its
    /// config is the same; otherwise `old`'s streams end
    /// ([`StreamEnd::Closed`]) and their last events are stored. Returns
    /// the streams taken over.
    pub fn adopt_streams(&self, old: &Pipeline) -> usize {
        // A pipeline over several cameras whose list alone changed keeps
        // the cameras it still reads: their trackers go on, open tracks and
        // their ids with them; the streams of cameras it no longer reads end.
        let kept = self.cameras_kept_from(old);
        if (self.cfg != old.cfg && kept.is_none()) || self.hook.is_none() {
            old.close_streams();
            return 0;
        }
        let (taken, left): (Vec<_>, Vec<_>) =
            old.take_stream_states()
                .into_iter()
                .partition(|(stream, ..)| {
                    kept.as_ref()
                        .is_none_or(|k| k.iter().any(|c| **c == **stream))
                });
        old.end_streams(
            left.into_iter()
                .map(|(s, st, _)| (s, st, StreamEnd::Closed))
                .collect(),
        );
        let n = taken.len();
        let ended = {
            let mut table = self.streams.lock();
            let mut gone = Vec::new();
            for (stream, state, seen) in taken {
                gone.extend(table.adopt(stream, Some(state), seen));
            }
            self.forget(gone)
        };
        self.end_streams(ended);
        n
    }

    /// The cameras both read, when this pipeline and `old` read several
    /// cameras and differ only in which (and in the zones and lines of
    /// cameras only one of them reads); `None` otherwise.
    fn cameras_kept_from(&self, old: &Pipeline) -> Option<Vec<Arc<str>>> {
        let (new_cams, old_cams) = (self.stats.cameras.names(), old.stats.cameras.names());
        if new_cams.is_empty() || old_cams.is_empty() {
            return None;
        }
        let both: Vec<Arc<str>> = new_cams
            .into_iter()
            .filter(|c| old_cams.contains(c))
            .collect();
        let bare = |cfg: &PipelineConfig| {
            let mut c = cfg.clone();
            if let SourceConfig::Camera(cam) = &mut c.source {
                cam.cameras = None;
                cam.resolved_many.clear();
            }
            let on_both = |camera: &Option<String>| {
                camera
                    .as_deref()
                    .is_none_or(|n| both.iter().any(|b| &**b == n))
            };
            c.zones.retain(|z| on_both(&z.camera));
            c.lines.retain(|l| on_both(&l.camera));
            c
        };
        (bare(&self.cfg) == bare(&old.cfg)).then_some(both)
    }

    /// Ends every stream's hook state ([`StreamEnd::Closed`]): the pipeline
    /// is replaced by another config, or removed.
    pub fn close_streams(&self) {
        let ended = self
            .take_stream_states()
            .into_iter()
            .map(|(s, st, _)| (s, st, StreamEnd::Closed))
            .collect();
        self.end_streams(ended);
    }
}

#[cfg(test)]
mod cascade_tests;
#[cfg(test)]
pub(crate) mod testkit;
#[cfg(test)]
mod tests;
