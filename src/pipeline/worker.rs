//! One pipeline at run time: decode -> infer -> postprocess -> record -> sink.
//!
//! A bad frame (undecodable, wrong size, failing inference) is counted under
//! its reason, logged at a limited rate, answered with the error when
//! someone waits for it, and skipped; the pipeline keeps running.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::context::FrameContext;
use super::snapshot::Latest;
use super::stages::{Cascade, StageStats, needs_cascade};
use super::{IdGen, PipelineConfig, PipelineStats, RateLimitedLog, RecordSink};
use crate::backend::{Dim, Tensor, is_batch_name};
use crate::model::registry::LoadedModel;
use crate::model::state::StreamStates;
use crate::output::LocalOutputs;
use crate::pipeline::WhenFull;
use crate::postprocess::{PostprocessConfig, Postprocessor};
use crate::preprocess::{Item, ItemMeta, PreprocessConfig, Preprocessor};
use crate::record::{ResultRecord, rfc3339};
use crate::source::camera::CameraState;
use crate::source::{Frame, FrameError, FrameErrorKind, SourceConfig};
use crate::stream_table::{Evicted, Reason, StreamTable};

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

/// One item's outputs: (frame index, item meta, outputs, inference µs).
type Inferred = (usize, ItemMeta, Vec<(String, Tensor)>, u64);

/// A pipeline ready to run.
pub struct Pipeline {
    pub cfg: PipelineConfig,
    /// Swapped atomically by OTA updates: each batch takes the model once, so
    /// frames in flight finish on the version they started with.
    model: std::sync::RwLock<Arc<LoadedModel>>,
    pub stats: PipelineStats,
    pub(super) main_input: String,
    pub(super) constants: Vec<(String, Tensor)>,
    /// One pre/postprocessor per worker for stateless pipelines; serial
    /// pipelines use the first only (their per-stream state lives there).
    pub(super) pre: Vec<Mutex<Box<dyn Preprocessor>>>,
    pub(super) post: Vec<Mutex<Box<dyn Postprocessor>>>,
    states: Mutex<StreamStates>,
    /// The streams that may hold state here (bounded, least recently seen
    /// evicted, idle ones expired); a stream it lets go is reset in `pre`,
    /// `post`, `states` and the stages. Taken before any of those locks,
    /// never while one is held.
    streams: Mutex<StreamTable<()>>,
    serial: bool,
    batchable: bool,
    /// Stateful batching across streams: the batch axis of each state input.
    stateful_axes: Option<Vec<usize>>,
    pub(super) sink: Arc<dyn RecordSink>,
    outputs: LocalOutputs,
    pub(super) ids: Arc<IdGen>,
    log: RateLimitedLog,
    /// Stages, pyramids and thumbnails (see stages.rs); `None`: the plain path.
    cascade: Option<Cascade>,
    /// The latest frame and outputs, for annotated snapshots.
    pub(super) snapshot: Latest,
}

pub(super) use super::context::lock;

impl Pipeline {
    /// Builds a pipeline from its config and its loaded model. `workers` is
    /// the size of the worker pool (stateless pipelines get a pre/post
    /// processor per worker so decoding runs in parallel).
    pub fn new(
        mut cfg: PipelineConfig,
        model: Arc<LoadedModel>,
        model_dir: &Path,
        workers: usize,
        sink: Arc<dyn RecordSink>,
        ids: Arc<IdGen>,
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
        let camera = match &cfg.source {
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
                (
                    i.name.clone(),
                    Tensor::filled(i.dtype, &i.spec().concrete_shape(1), i.fill.unwrap_or(0.0)),
                )
            })
            .collect();
        let serial = !m.state.is_empty()
            || matches!(pre_cfg, PreprocessConfig::Audio { .. })
            || matches!(post_cfg, PostprocessConfig::Threshold { .. });
        let has_batch_axis = m
            .inputs
            .iter()
            .find(|i| i.name == main_input)
            .and_then(|i| i.shape.first())
            .is_some_and(|d| matches!(d, Dim::Symbolic(s) if is_batch_name(s)));
        let batchable = !serial && cfg.max_batch > 1 && has_batch_axis && constants.is_empty();
        // A stateful model batches across streams when its main input and
        // every state have a batch axis and no constant has one (constants
        // are fed once per run, as they are).
        let constants_unbatched = m.inputs.iter().all(|i| {
            i.name == main_input
                || m.is_state_input(&i.name)
                || !i
                    .shape
                    .iter()
                    .any(|d| matches!(d, Dim::Symbolic(s) if is_batch_name(s)))
        });
        let stateful_axes =
            if !m.state.is_empty() && cfg.max_batch > 1 && has_batch_axis && constants_unbatched {
                StreamStates::batch_axes(&model)
            } else {
                None
            };
        let copies = if serial { 1 } else { workers.max(1) };
        let base = model.path.parent().unwrap_or(model_dir).to_path_buf();
        let mut pre = Vec::with_capacity(copies);
        let mut post = Vec::with_capacity(copies);
        for _ in 0..copies {
            pre.push(Mutex::new(pre_cfg.build()));
            post.push(Mutex::new(
                post_cfg.build(&base).map_err(|e| setup(e.to_string()))?,
            ));
        }
        let snapshot = Latest::new(&pre_cfg);
        let streams = Mutex::new(StreamTable::new(cfg.max_streams, cfg.stream_idle));
        Ok(Pipeline {
            outputs: LocalOutputs::new(&cfg.name, &cfg.outputs),
            cfg,
            model: std::sync::RwLock::new(model),
            stats: PipelineStats {
                camera,
                ..PipelineStats::default()
            },
            main_input,
            constants,
            pre,
            post,
            states: Mutex::new(StreamStates::new()),
            streams,
            serial,
            batchable,
            stateful_axes,
            sink,
            ids,
            log: RateLimitedLog::new(Duration::from_secs(5)),
            cascade: None,
            snapshot,
        })
    }

    /// Adds the configured stages with their loaded models (in stage order);
    /// pipelines with stages, an image pyramid or thumbnails run frame by
    /// frame through the cascade.
    pub fn with_stages(mut self, models: &[Arc<LoadedModel>]) -> Result<Pipeline, PipelineError> {
        let m = self.model();
        let Some(pre) = self
            .cfg
            .preprocess
            .clone()
            .or_else(|| m.manifest.preprocess.clone())
        else {
            return Ok(self);
        };
        if !needs_cascade(&self.cfg, &pre) {
            return Ok(self);
        }
        let cascade =
            Cascade::new(&self.cfg, pre, models).map_err(|detail| PipelineError::Setup {
                pipeline: self.cfg.name.clone(),
                detail,
            })?;
        self.cascade = Some(cascade);
        self.batchable = false;
        Ok(self)
    }

    /// `(stage model, stats)` per stage.
    pub fn stage_stats(&self) -> Vec<(String, &StageStats)> {
        self.cascade.as_ref().map(|c| c.stats()).unwrap_or_default()
    }

    /// Makes the record of one frame's result and hands it on: to the local
    /// outputs first (they never wait for the outbox), then to the store.
    /// The JSON is encoded once for both. Counts the record, or the drop.
    pub(super) fn emit(
        &self,
        f: &Frame,
        model: &LoadedModel,
        latency_us: u64,
        outputs: serde_json::Value,
    ) -> Result<ResultRecord, FrameError> {
        let stored = self
            .make_record(f, model, latency_us, outputs)
            .and_then(|(rec, json)| self.sink.store(&rec, &json).map(|()| rec));
        self.account(f, stored)
    }

    /// A frame's record and its JSON, already handed to the local outputs
    /// (they never wait for the outbox); the store comes after.
    fn make_record(
        &self,
        f: &Frame,
        model: &LoadedModel,
        latency_us: u64,
        outputs: serde_json::Value,
    ) -> Result<(ResultRecord, Vec<u8>), FrameError> {
        let (id, seq) = self.ids.next();
        let stamp = crate::clock::stamp();
        let rec = ResultRecord {
            id,
            device: self.ids.device.clone(),
            pipeline: self.cfg.name.clone(),
            stream: f.stream.to_string(),
            seq,
            ts: stamp.ts,
            model: model.id(),
            ep: model.provider.as_str().to_string(),
            latency_us,
            outputs,
            captured: f.captured.map(rfc3339),
            clock: stamp.mark,
        };
        let json = serde_json::to_vec(&rec)
            .map_err(|e| FrameError::new(FrameErrorKind::Store, e.to_string()))?;
        if !self.outputs.is_empty() {
            self.outputs.send(&rec, &json);
        }
        if let Some(age) = f
            .captured
            .and_then(|c| SystemTime::now().duration_since(c).ok())
        {
            self.stats.frame_age_us.record(age.as_micros() as u64);
        }
        Ok((rec, json))
    }

    /// Counts a stored record, or the drop of one the store refused.
    fn account<T>(&self, f: &Frame, stored: Result<T, FrameError>) -> Result<T, FrameError> {
        match stored {
            Ok(v) => {
                self.stats.records.fetch_add(1, Ordering::Relaxed);
                Ok(v)
            }
            Err(e) => Err(self.refused(f, e)),
        }
    }

    /// Counts a record that could not be stored (or encoded) as a drop.
    fn refused(&self, f: &Frame, e: FrameError) -> FrameError {
        self.count_drop("store_error", &format!("stream {}: {e}", f.stream));
        e
    }

    /// The latest frame with its boxes drawn, as JPEG; `None` before the
    /// first frame or for pipelines that take no images.
    pub fn snapshot_jpeg(&self) -> Option<Result<Vec<u8>, super::snapshot::SnapshotError>> {
        self.snapshot.render()
    }

    /// The model serving this pipeline now.
    pub fn model(&self) -> Arc<LoadedModel> {
        self.model.read().unwrap_or_else(|p| p.into_inner()).clone()
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
        let mut slot = self.model.write().unwrap_or_else(|p| p.into_inner());
        *lock(&self.states) = StreamStates::new();
        self.stats.inference_us.reset();
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

    /// Run by one worker at a time (stateful somewhere along the way).
    pub fn serial(&self) -> bool {
        self.serial
    }

    /// Takes several frames at once (micro-batching, or stateful batching
    /// across streams).
    pub fn batchable(&self) -> bool {
        self.batchable || self.stateful_axes.is_some()
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
        if self.stateful_axes.is_none() {
            return true;
        }
        let known = lock(&self.streams).len();
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
        if self.batchable() {
            self.cfg.max_batch
        } else {
            1
        }
    }

    /// The reason a frame pushed out of a full drop-oldest queue is counted under.
    pub fn drop_oldest_reason(&self) -> &'static str {
        if self.stats.camera.is_some() {
            "stale"
        } else {
            "queue_full_drop_oldest"
        }
    }

    /// Counts a dropped frame and logs it, at most once per 5 s per reason.
    pub fn count_drop(&self, reason: &'static str, detail: &str) {
        self.stats.add_drop(reason);
        // A camera outrunning its model is the design, not a fault: counted, not logged.
        if reason == "stale" {
            return;
        }
        if let Some(suppressed) = self.log.allow(reason) {
            tracing::warn!(pipeline = %self.cfg.name, reason, suppressed, "frame dropped: {detail}");
        }
    }

    /// Processes frames taken together from the queue. Their streams are
    /// held (and seen) while they are processed.
    pub fn process(&self, frames: Vec<Frame>, worker: usize) {
        // Only serial pipelines keep state per stream (see `forget`): the
        // others run without touching the stream table, which keeps the
        // stateless fast path free of its lock and lookups.
        if !self.serial {
            return self.run_frames(frames, worker);
        }
        let mut names: Vec<std::sync::Arc<str>> = Vec::with_capacity(frames.len());
        for f in &frames {
            if !names.contains(&f.stream) {
                names.push(f.stream.clone());
            }
        }
        {
            let mut table = lock(&self.streams);
            let now = Instant::now();
            let mut gone = Vec::new();
            for s in &names {
                gone.extend(table.begin(s, now, || ()));
            }
            // Under the table's lock: no frame of a stream can begin between
            // its eviction and its reset.
            self.forget(&gone);
        }
        self.run_frames(frames, worker);
        let mut table = lock(&self.streams);
        let now = Instant::now();
        let mut gone = Vec::new();
        for s in &names {
            gone.extend(table.end(s, now));
        }
        self.forget(&gone);
    }

    /// Expires the streams not seen for `stream_idle` (run periodically by
    /// the scheduler, so it happens without new frames); returns how many.
    pub fn expire_idle_streams(&self) -> usize {
        let mut table = lock(&self.streams);
        let gone = table.expire(Instant::now());
        self.forget(&gone);
        gone.len()
    }

    /// Streams held now, the bound, and the evictions by reason.
    pub fn streams_held(&self) -> StreamsHeld {
        let t = lock(&self.streams);
        StreamsHeld {
            held: t.len(),
            max: t.max(),
            evicted_lru: t.evicted(Reason::Lru),
            evicted_idle: t.evicted(Reason::Idle),
        }
    }

    /// Resets evicted streams wherever state is kept per stream. Only serial
    /// pipelines keep any (the scheduler's invariant: stateful processing is
    /// run by one worker at a time), so the others skip the locks.
    fn forget(&self, gone: &[Evicted<()>]) {
        if gone.is_empty() || !self.serial {
            return;
        }
        let mut states = lock(&self.states);
        for e in gone {
            states.reset(&e.stream);
        }
        drop(states);
        for pre in &self.pre {
            let mut pre = lock(pre);
            for e in gone {
                pre.reset(&e.stream);
            }
        }
        for post in &self.post {
            let mut post = lock(post);
            for e in gone {
                post.reset(&e.stream);
            }
        }
        if let Some(c) = &self.cascade {
            for e in gone {
                c.reset(&e.stream);
            }
        }
    }

    fn run_frames(&self, frames: Vec<Frame>, worker: usize) {
        if let Some(c) = &self.cascade {
            let slot = worker % self.pre.len().max(1);
            let (Some(pre), Some(post)) = (self.pre.get(slot), self.post.get(slot)) else {
                // Built with one pre/postprocessor at least (Pipeline::new).
                return;
            };
            let count_drop = |reason: &'static str, detail: &str| self.count_drop(reason, detail);
            let emit =
                |f: &Frame, m: &LoadedModel, us: u64, v: serde_json::Value| self.emit(f, m, us, v);
            let cx = FrameContext {
                model: self.model(),
                stats: &self.stats,
                pre,
                post,
                main_input: &self.main_input,
                constants: &self.constants,
                snapshot: &self.snapshot,
                count_drop: &count_drop,
                emit: &emit,
            };
            return c.process(&cx, frames);
        }
        let taken = Instant::now();
        for f in &frames {
            self.stats
                .queue_us
                .record(taken.saturating_duration_since(f.received).as_micros() as u64);
        }
        let model = self.model();
        let slot = if self.serial {
            0
        } else {
            worker % self.pre.len()
        };
        let mut answers: Vec<Result<Vec<ResultRecord>, FrameError>> =
            frames.iter().map(|_| Ok(Vec::new())).collect();
        // Decode.
        let mut work: Vec<(usize, Item)> = Vec::with_capacity(frames.len());
        {
            let mut pre = lock(&self.pre[slot]);
            for (i, f) in frames.iter().enumerate() {
                let decoded = match f.raw {
                    Some(raw) => pre.process_raw(&f.stream, &f.payload, raw),
                    None => pre.process(&f.stream, &f.payload),
                };
                match decoded {
                    Ok(items) => work.extend(items.into_iter().map(|it| (i, it))),
                    Err(e) => {
                        self.count_drop(e.reason(), &format!("stream {}: {e}", f.stream));
                        answers[i] = Err(FrameError::new(FrameErrorKind::Malformed, e.to_string()));
                    }
                }
            }
        }
        self.stats
            .decode_us
            .record(taken.elapsed().as_micros() as u64);
        self.stats
            .items
            .fetch_add(work.len() as u64, Ordering::Relaxed);
        // Infer.
        let mut results: Vec<Inferred> = Vec::with_capacity(work.len());
        if self.batchable && work.len() > 1 {
            for chunk in work.chunks(self.cfg.max_batch.max(1)) {
                self.infer_batch(&model, chunk, &frames, &mut results, &mut answers);
            }
        } else if let Some(axes) = self.stateful_axes.as_ref().filter(|_| work.len() > 1) {
            self.infer_across_streams(&model, axes, &work, &frames, &mut results, &mut answers);
        } else {
            for (i, item) in &work {
                let f = &frames[*i];
                let t0 = Instant::now();
                let inputs: Vec<(&str, &Tensor)> =
                    std::iter::once((self.main_input.as_str(), &item.tensor))
                        .chain(self.constants.iter().map(|(n, t)| (n.as_str(), t)))
                        .collect();
                let out = if model.manifest.state.is_empty() {
                    model.run(&inputs)
                } else {
                    lock(&self.states).run(&model, &f.stream, &inputs)
                };
                let us = t0.elapsed().as_micros() as u64;
                self.stats
                    .inference_us_total
                    .fetch_add(us, Ordering::Relaxed);
                self.stats.inference_us.record(us);
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
                self.stats.batch_items.fetch_add(1, Ordering::Relaxed);
                self.stats.batch_sizes.record(1);
                match out {
                    Ok(o) => results.push((*i, item.meta.clone(), o, us)),
                    Err(e) => {
                        self.count_drop("inference_error", &format!("stream {}: {e}", f.stream));
                        answers[*i] = Err(FrameError::new(FrameErrorKind::Engine, e.to_string()));
                    }
                }
            }
        }
        // Postprocess and record (the local outputs get each record at
        // once), then store the batch's records together.
        let output_start = Instant::now();
        let mut idx: Vec<usize> = Vec::with_capacity(results.len());
        let mut records: Vec<(ResultRecord, Vec<u8>)> = Vec::with_capacity(results.len());
        {
            let mut post = lock(&self.post[slot]);
            for (i, meta, outputs, us) in results {
                let f = &frames[i];
                let value = match post.process(&f.stream, &meta, &outputs) {
                    Ok(Some(v)) => v,
                    Ok(None) => continue,
                    Err(e) => {
                        self.count_drop("postprocess_error", &format!("stream {}: {e}", f.stream));
                        answers[i] = Err(FrameError::new(FrameErrorKind::Engine, e.to_string()));
                        continue;
                    }
                };
                self.snapshot.keep(&f.payload, f.raw, &value);
                match self.make_record(f, &model, us, value) {
                    Ok(made) => {
                        idx.push(i);
                        records.push(made);
                    }
                    Err(e) => answers[i] = Err(self.refused(f, e)),
                }
            }
        }
        let stored = self.sink.store_all(&records);
        for ((i, (rec, _)), r) in idx.into_iter().zip(records).zip(stored) {
            match self.account(&frames[i], r) {
                Ok(()) => {
                    if let Ok(v) = &mut answers[i] {
                        v.push(rec);
                    }
                }
                Err(e) => answers[i] = Err(e),
            }
        }
        self.stats
            .output_us
            .record(output_start.elapsed().as_micros() as u64);
        for (f, a) in frames.into_iter().zip(answers) {
            self.stats.frames_done.fetch_add(1, Ordering::Relaxed);
            self.stats
                .e2e_us
                .record(f.received.elapsed().as_micros() as u64);
            if let Some(tx) = f.reply {
                let _ = tx.send(a);
            }
        }
    }

    /// Stateful batching: the k-th item of each stream goes to run k, so a
    /// run never holds two items of one stream and each stream's items run
    /// in order; runs go in order; results come back in the items' order.
    fn infer_across_streams(
        &self,
        model: &LoadedModel,
        axes: &[usize],
        work: &[(usize, Item)],
        frames: &[Frame],
        results: &mut Vec<Inferred>,
        answers: &mut [Result<Vec<ResultRecord>, FrameError>],
    ) {
        let mut runs: Vec<Vec<usize>> = Vec::new();
        let mut seen: Vec<(&str, usize)> = Vec::new();
        for (w, (i, _)) in work.iter().enumerate() {
            let stream: &str = &frames[*i].stream;
            let k = match seen.iter_mut().find(|(s, _)| *s == stream) {
                Some((_, n)) => {
                    *n += 1;
                    *n - 1
                }
                None => {
                    seen.push((stream, 1));
                    0
                }
            };
            if runs.len() <= k {
                runs.push(Vec::new());
            }
            runs[k].push(w);
        }
        let mut done: Vec<(usize, Inferred)> = Vec::with_capacity(work.len());
        for run in &runs {
            for chunk in run.chunks(self.cfg.max_batch.max(1)) {
                let parts: Vec<&Tensor> = chunk.iter().map(|w| &work[*w].1.tensor).collect();
                let streams: Vec<&str> =
                    chunk.iter().map(|w| &*frames[work[*w].0].stream).collect();
                let fail = |answers: &mut [Result<Vec<ResultRecord>, FrameError>],
                            reason: &'static str,
                            e: String| {
                    for w in chunk {
                        let i = work[*w].0;
                        self.count_drop(reason, &format!("stream {}: {e}", frames[i].stream));
                        answers[i] = Err(FrameError::new(FrameErrorKind::Engine, e.clone()));
                    }
                };
                let batch = match Tensor::concat0(&parts) {
                    Ok(b) => b,
                    Err(e) => {
                        fail(answers, "batch_error", e.to_string());
                        continue;
                    }
                };
                let inputs: Vec<(&str, &Tensor)> =
                    std::iter::once((self.main_input.as_str(), &batch))
                        .chain(self.constants.iter().map(|(n, t)| (n.as_str(), t)))
                        .collect();
                let t0 = Instant::now();
                let out = lock(&self.states).run_batch(model, &streams, axes, &inputs);
                let us = t0.elapsed().as_micros() as u64;
                self.stats
                    .inference_us_total
                    .fetch_add(us, Ordering::Relaxed);
                self.stats.inference_us.record(us);
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .batch_items
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                self.stats.batch_sizes.record(chunk.len() as u64);
                match out {
                    Ok(per_item) => {
                        for (w, outs) in chunk.iter().zip(per_item) {
                            let (i, item) = &work[*w];
                            done.push((*w, (*i, item.meta.clone(), outs, us)));
                        }
                    }
                    Err(e) => fail(answers, "inference_error", e.to_string()),
                }
            }
        }
        done.sort_by_key(|(w, _)| *w);
        results.extend(done.into_iter().map(|(_, r)| r));
    }

    fn infer_batch(
        &self,
        model: &LoadedModel,
        chunk: &[(usize, Item)],
        frames: &[Frame],
        results: &mut Vec<Inferred>,
        answers: &mut [Result<Vec<ResultRecord>, FrameError>],
    ) {
        let parts: Vec<&Tensor> = chunk.iter().map(|(_, it)| &it.tensor).collect();
        let fail = |answers: &mut [Result<Vec<ResultRecord>, FrameError>],
                    reason: &'static str,
                    e: String| {
            for (i, _) in chunk {
                self.count_drop(reason, &format!("stream {}: {e}", frames[*i].stream));
                answers[*i] = Err(FrameError::new(FrameErrorKind::Engine, e.clone()));
            }
        };
        let batch = match Tensor::concat0(&parts) {
            Ok(b) => b,
            // Items of different shapes (e.g. images of other sizes without resize) cannot share a batch.
            Err(e) => return fail(answers, "batch_error", e.to_string()),
        };
        let t0 = Instant::now();
        let out = model.run(&[(self.main_input.as_str(), &batch)]);
        let us = t0.elapsed().as_micros() as u64;
        self.stats
            .inference_us_total
            .fetch_add(us, Ordering::Relaxed);
        self.stats.inference_us.record(us);
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats
            .batch_items
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        self.stats.batch_sizes.record(chunk.len() as u64);
        let outputs = match out {
            Ok(o) => o,
            Err(e) => return fail(answers, "inference_error", e.to_string()),
        };
        let n = chunk.len();
        let per_item = model.split_outputs(outputs, n);
        for ((i, item), outs) in chunk.iter().zip(per_item) {
            results.push((*i, item.meta.clone(), outs, us));
        }
    }
}

#[cfg(test)]
mod tests;
