//! Cascaded stages: after the pipeline's model, each stage takes the boxes
//! of the stage before, crops them from the original frame (padding, a
//! rotation by the box's `angle` from an earlier classifier, resized to the
//! stage model's input), runs the crops in batches through its model and
//! merges its postprocessing's result into each box (`text`, `angle`, a
//! refined `box` and `score`, `landmarks`...). A stage's result `None`
//! drops the box; the stage's `finish_boxes` may drop or merge more (NMS).
//!
//! The results of a set of frames taken together (several cameras) pass
//! the stages together: a stage's batches hold the crops of every frame of
//! the set, and run through the one inference path ([`run_batch`]),
//! counted in the stage's own [`StageStats::runs`].
//!
//! Invariants:
//! - a frame's boxes pass the stages in order; a stage sees at most
//!   `max_boxes` of them (the highest scores; the rest are left out of the
//!   record and counted);
//! - each crop's result goes to its own box, postprocessed with its own
//!   frame's stream;
//! - a failing stage (model error, bad output) leaves the boxes as the stage
//!   before gave them, marks the record with `stage_error`, is counted and
//!   logged; the pipeline keeps serving. It fails only the frames whose
//!   crops it could not take (a bad box) or whose crops were in the failed
//!   run; the other frames of the set go on;
//! - boxes outside the frame crop black pixels, never panic.

mod config;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use ndarray::{ArrayD, IxDyn};
use parking_lot::Mutex;
use serde_json::{Map, Value};

pub use self::config::{StageConfig, ThumbnailConfig};
use super::infer::{RunStats, run_batch};
use super::snapshot;
use super::{LatencyHistogram, PipelineConfig};
use crate::backend::{Dim, Tensor};
use crate::model::registry::LoadedModel;
use crate::postprocess::Postprocessor;
use crate::preprocess::crop::{Normalizer, Rgb, decode_frame};
use crate::preprocess::{DecodeError, ItemMeta, Layout, OutputDType, PreprocessConfig, ResizeMode};
use crate::source::Frame;

/// A free-width stage input grows to fit long crops, up to this many times
/// its declared width (a 48 px high text line up to 3200 px).
const MAX_WIDTH_FACTOR: u32 = 10;

/// Counters of one stage.
#[derive(Default)]
pub struct StageStats {
    /// The stage's whole work on one set of frames taken together (crops,
    /// inference, postprocessing; one frame unless the pipeline takes
    /// several at once), µs.
    pub latency_us: LatencyHistogram,
    /// The stage model's inference runs (batches of crops).
    pub runs: RunStats,
    /// Crops run through the model.
    pub crops: AtomicU64,
    /// Boxes left out by `max_boxes`.
    pub capped: AtomicU64,
    /// Frames on which the stage failed.
    pub errors: AtomicU64,
}

struct Stage {
    cfg: StageConfig,
    /// The crop's margin (the config's, else the manifest's), in box heights.
    padding: f32,
    model: Arc<LoadedModel>,
    input: String,
    norm: Normalizer,
    width: u32,
    height: u32,
    resize: ResizeMode,
    /// The model's width axis is free: `pad_right` batches grow to the widest crop.
    free_width: bool,
    post: Mutex<Box<dyn Postprocessor>>,
    stats: StageStats,
}

/// The stages of a pipeline and how its frames are decoded for cropping.
pub struct Cascade {
    stages: Vec<Stage>,
    frame_pre: PreprocessConfig,
    thumbnails: Option<ThumbnailConfig>,
}

/// One result of a set of frames, on its way through the stages.
pub struct Refine<'a> {
    /// Its frame's picture; `None`: the stages leave it as it is.
    pub picture: Option<&'a Rgb>,
    /// Its frame's stream (the stages' postprocessing keeps state per stream).
    pub stream: &'a str,
    /// The result (`boxes`, ...), refined in place.
    pub value: &'a mut Value,
}

/// Why a cascade cannot be built: every problem, each naming its stage.
#[derive(Debug, thiserror::Error)]
#[error("{}", .problems.join("; "))]
pub struct CascadeError {
    pub problems: Vec<String>,
}

impl CascadeError {
    fn one(problem: impl Into<String>) -> CascadeError {
        CascadeError {
            problems: vec![problem.into()],
        }
    }
}

impl Cascade {
    /// The cascade of `cfg` (frames decoded by `frame_pre`), without its
    /// stages yet (see [`Cascade::add_stages`]).
    pub fn new(cfg: &PipelineConfig, frame_pre: PreprocessConfig) -> Result<Cascade, CascadeError> {
        if !matches!(
            frame_pre,
            PreprocessConfig::Image { .. } | PreprocessConfig::Pyramid { .. }
        ) {
            return Err(CascadeError::one(
                "stages and thumbnails need an image pipeline (`image` or `pyramid` preprocessing)",
            ));
        }
        Ok(Cascade {
            stages: Vec::new(),
            frame_pre,
            thumbnails: cfg.thumbnails.clone(),
        })
    }

    /// Builds the stages of `cfg` with their loaded `models` (in stage order).
    pub fn add_stages(
        &mut self,
        cfg: &PipelineConfig,
        models: &[Arc<LoadedModel>],
    ) -> Result<(), CascadeError> {
        if models.len() != cfg.stages.len() {
            return Err(CascadeError::one(format!(
                "{} stages configured, {} stage models loaded",
                cfg.stages.len(),
                models.len()
            )));
        }
        let mut stages = Vec::new();
        let mut problems = Vec::new();
        for (i, (sc, model)) in cfg.stages.iter().zip(models).enumerate() {
            match Stage::new(sc, model.clone()) {
                Ok(s) => stages.push(s),
                Err(e) => problems.push(format!("stage {} (`{}`): {e}", i + 1, sc.model)),
            }
        }
        if !problems.is_empty() {
            return Err(CascadeError { problems });
        }
        self.stages = stages;
        Ok(())
    }

    /// Forgets `stream` in every stage's postprocessor (the pipeline's stream
    /// table let it go).
    pub fn reset(&self, stream: &str) {
        for s in &self.stages {
            s.post.lock().reset(stream);
        }
    }

    /// `(stage model, stats)` per stage, in order.
    pub fn stats(&self) -> Vec<(String, &StageStats)> {
        self.stages
            .iter()
            .map(|s| (s.model.id(), &s.stats))
            .collect()
    }

    /// The frame's picture, for the stages' crops and the thumbnails; None
    /// when neither is configured.
    pub fn picture(&self, f: &Frame) -> Result<Option<Rgb>, DecodeError> {
        if self.stages.is_empty() && self.thumbnails.is_none() {
            return Ok(None);
        }
        match f.raw {
            Some(raw) => raw.to_rgb(&f.payload),
            None => decode_frame(&f.payload, &self.frame_pre),
        }
        .map(Some)
    }

    /// Runs the stages on the merged results of a set of frames, stage by
    /// stage over the whole set (each stage's crops of every frame share its
    /// runs), and takes the crop rectangles (for the stages only) out of
    /// their boxes. A stage failing on a result leaves its boxes as the
    /// stage before gave them, marks it with `stage_error` and ends the
    /// cascade for it; the others go on. Returns each result's error, in
    /// order, to be counted.
    pub fn refine(&self, set: &mut [Refine<'_>]) -> Vec<Option<String>> {
        let mut failed: Vec<Option<String>> = vec![None; set.len()];
        for stage in &self.stages {
            let live: Vec<usize> = (0..set.len())
                .filter(|&i| failed[i].is_none() && set[i].picture.is_some())
                .collect();
            if live.is_empty() {
                break;
            }
            let t0 = Instant::now();
            let errors = stage.run(set, &live);
            stage
                .stats
                .latency_us
                .record(t0.elapsed().as_micros() as u64);
            for (i, e) in errors {
                stage.stats.errors.fetch_add(1, Ordering::Relaxed);
                let e = format!("stage `{}`: {e}", stage.model.id());
                set[i].value["stage_error"] = Value::String(e.clone());
                failed[i] = Some(e);
            }
        }
        for r in set.iter_mut() {
            if let Some(boxes) = r.value.get_mut("boxes").and_then(Value::as_array_mut) {
                for b in boxes.iter_mut() {
                    if let Some(o) = b.as_object_mut() {
                        o.remove("crop");
                    }
                }
            }
        }
        failed
    }

    /// Each box gets a JPEG of its crop, when configured.
    pub fn attach_thumbnails(&self, picture: Option<&Rgb>, value: &mut Value) {
        if let (Some(t), Some(frame)) = (&self.thumbnails, picture) {
            snapshot::attach_thumbnails(frame, value, t.max_bytes);
        }
    }
}

/// Why a stage cannot be made of its config and model.
#[derive(Debug, thiserror::Error)]
enum StageError {
    #[error("model `{0}` declares no preprocessing")]
    NoPreprocessing(String),
    #[error("a stage's preprocessing must be of type `image`")]
    NotImage,
    #[error("model `{0}` has no input a crop could feed")]
    NoInput(String),
    /// Every problem the config and the model have together.
    #[error("{}", .0.join("; "))]
    Problems(Vec<String>),
    #[error(transparent)]
    Postprocess(#[from] crate::postprocess::PostError),
}

/// Why a box gives no crop.
#[derive(Debug, thiserror::Error)]
enum CropError {
    #[error("a box is not an object")]
    NotAnObject,
    #[error("box without 4 finite corners: {0}")]
    NoCorners(Value),
    #[error("box [{x0}, {y0}, {x1}, {y1}] lies far outside the frame")]
    FarOutside { x0: f64, y0: f64, x1: f64, y1: f64 },
}

impl Stage {
    fn new(sc: &StageConfig, model: Arc<LoadedModel>) -> Result<Stage, StageError> {
        let m = &model.manifest;
        let pre = sc
            .preprocess
            .clone()
            .or_else(|| m.preprocess.clone())
            .ok_or_else(|| StageError::NoPreprocessing(m.name.clone()))?;
        let post_cfg = sc
            .postprocess
            .clone()
            .or_else(|| m.postprocess.clone())
            .unwrap_or_default();
        let padding = sc.padding.or(m.stage.padding).unwrap_or(0.0);
        let mut problems = pre.validate();
        if !padding.is_finite() || !(0.0..=2.0).contains(&padding) {
            problems.push(format!("padding {padding} must be in 0..=2"));
        }
        problems.extend(post_cfg.validate());
        let PreprocessConfig::Image {
            width,
            height,
            mean,
            std,
            scale,
            layout,
            channel_order,
            resize,
            dtype,
            ..
        } = &pre
        else {
            return Err(StageError::NotImage);
        };
        if *dtype != OutputDType::F32 {
            problems.push("stage crops are f32 tensors: set `dtype = \"f32\"`".into());
        }
        let input = m
            .inputs
            .iter()
            .find(|i| i.fill.is_none() && !m.is_state_input(&i.name))
            .ok_or_else(|| StageError::NoInput(m.name.clone()))?;
        if m.inputs.len() != 1 {
            problems.push(format!(
                "model `{}` has {} inputs; a stage feeds exactly one",
                m.name,
                m.inputs.len()
            ));
        }
        if let Some(out) = post_cfg.output()
            && !m.outputs.iter().any(|o| o.name == out)
        {
            problems.push(format!(
                "postprocessing reads output `{out}`, which model `{}` does not have",
                m.name
            ));
        }
        let width_axis = match layout {
            Layout::Nchw => 3,
            Layout::Nhwc => 2,
            Layout::Nwhc => 1,
        };
        let free_width = *resize == ResizeMode::PadRight
            && matches!(input.shape.get(width_axis), Some(Dim::Symbolic(_)));
        if !problems.is_empty() {
            return Err(StageError::Problems(problems));
        }
        let base = model
            .path
            .parent()
            .map(|p| p.to_path_buf())
            .unwrap_or_default();
        let post = post_cfg.build(&base)?;
        Ok(Stage {
            cfg: sc.clone(),
            padding,
            input: input.name.clone(),
            norm: Normalizer::new(*mean, *std, *scale, *channel_order, *layout),
            width: *width,
            height: *height,
            resize: *resize,
            free_width,
            post: Mutex::new(post),
            stats: StageStats::default(),
            model,
        })
    }

    /// The pixels of one box: its `crop` rectangle when a postprocessor set
    /// one, else its `box` grown by the padding; then the rotation.
    fn crop(&self, frame: &Rgb, b: &Map<String, Value>) -> Result<Rgb, CropError> {
        let four = |key: &str| -> Option<[f64; 4]> {
            let a = b.get(key)?.as_array()?;
            let v: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
            (v.len() == 4 && v.iter().all(|x| x.is_finite())).then(|| [v[0], v[1], v[2], v[3]])
        };
        // Far outside any frame: a broken box, not a crop.
        let limit = 4.0 * (frame.width.max(frame.height) as f64 + 1.0);
        let (x0, y0, x1, y1) = if let Some(c) = four("crop") {
            (c[0], c[1], c[2], c[3])
        } else if let Some(r) = four("box") {
            let pad = self.padding as f64 * (r[3] - r[1]);
            (
                (r[0] - pad).floor(),
                (r[1] - pad).floor(),
                (r[2] + pad).ceil(),
                (r[3] + pad).ceil(),
            )
        } else {
            return Err(CropError::NoCorners(Value::Object(b.clone())));
        };
        if [x0, y0, x1, y1].iter().any(|v| v.abs() > limit) {
            return Err(CropError::FarOutside { x0, y0, x1, y1 });
        }
        // At least one pixel: a degenerate box still gets an answer.
        let (x0, y0) = (x0 as i64, y0 as i64);
        let (x1, y1) = ((x1 as i64).max(x0 + 1), (y1 as i64).max(y0 + 1));
        let mut img = frame.crop(x0, y0, x1, y1);
        if self.cfg.rotate
            && let Some(a) = b.get("angle").and_then(Value::as_u64)
        {
            img = img.rotate((a % 360) as u16);
        }
        Ok(img)
    }

    /// The size a crop is resized to, within a batch `batch_w` wide.
    fn fit(&self, img: &Rgb, batch_w: u32) -> (u32, u32) {
        match self.resize {
            ResizeMode::Stretch => (self.width, self.height),
            ResizeMode::PadRight | ResizeMode::Letterbox => {
                let ratio = img.width as f64 / img.height.max(1) as f64;
                let w = (self.height as f64 * ratio).ceil() as u32;
                (w.clamp(1, batch_w), self.height)
            }
        }
    }

    /// This stage on the results `live` of `set` (each with its picture):
    /// the crops of all of them in shared runs, each result's boxes merged
    /// and finished on their own. Returns the results it failed on, each
    /// with its error; their boxes are left as they came.
    fn run(&self, set: &mut [Refine<'_>], live: &[usize]) -> Vec<(usize, String)> {
        let mut parts: Vec<Part<'_>> = Vec::with_capacity(live.len());
        for &at in live {
            let r = &mut set[at];
            let Some(picture) = r.picture else {
                continue;
            };
            let Some(boxes) = self.take_boxes(r.value) else {
                continue;
            };
            parts.push(Part {
                at,
                picture,
                stream: r.stream,
                results: vec![None; boxes.len()],
                boxes,
                error: None,
            });
        }
        // The crops of every result: (its part, its box, its pixels). A
        // result with a box that gives no crop fails here, alone.
        let mut crops: Vec<(usize, usize, Rgb)> = Vec::new();
        for (p, part) in parts.iter_mut().enumerate() {
            let mine: Result<Vec<_>, CropError> = part
                .boxes
                .iter()
                .enumerate()
                .map(|(b, v)| {
                    let o = v.as_object().ok_or(CropError::NotAnObject)?;
                    Ok((p, b, self.crop(part.picture, o)?))
                })
                .collect();
            match mine {
                Ok(mine) => crops.extend(mine),
                Err(e) => part.error = Some(e.to_string()),
            }
        }
        // Sorting by aspect ratio keeps batches of similar widths (less padding).
        let mut order: Vec<usize> = (0..crops.len()).collect();
        if self.free_width {
            let ratio = |c: &Rgb| c.width as f64 / c.height.max(1) as f64;
            order.sort_by(|a, b| ratio(&crops[*a].2).total_cmp(&ratio(&crops[*b].2)));
        }
        let mut post = self.post.lock();
        for chunk in order.chunks(self.cfg.max_batch.max(1)) {
            self.run_chunk(chunk, &crops, &mut parts, &mut **post);
        }
        let mut failed = Vec::new();
        for part in parts {
            let boxes = match part.error {
                Some(e) => {
                    failed.push((part.at, e));
                    part.boxes
                }
                None => {
                    let merged: Vec<Value> = part
                        .boxes
                        .into_iter()
                        .zip(part.results)
                        .filter_map(|(mut b, r)| {
                            let r = r?;
                            if let (Some(o), Value::Object(add)) = (b.as_object_mut(), r) {
                                o.extend(add);
                            }
                            Some(b)
                        })
                        .collect();
                    post.finish_boxes(merged)
                }
            };
            set[part.at].value["boxes"] = Value::Array(boxes);
        }
        failed
    }

    /// The boxes of `value` this stage takes (at most `max_boxes`, the
    /// highest scores in their order; the others counted in `capped`),
    /// taken out of it; `None` without a box list.
    fn take_boxes(&self, value: &mut Value) -> Option<Vec<Value>> {
        let list = value.get_mut("boxes").and_then(Value::as_array_mut)?;
        let mut boxes: Vec<Value> = std::mem::take(list);
        if boxes.len() > self.cfg.max_boxes {
            // Keep the highest scores, in their original order.
            let mut idx: Vec<usize> = (0..boxes.len()).collect();
            let score = |v: &Value| v.get("score").and_then(Value::as_f64).unwrap_or(0.0);
            idx.sort_by(|a, b| score(&boxes[*b]).total_cmp(&score(&boxes[*a])));
            let mut keep = vec![false; boxes.len()];
            for i in idx.into_iter().take(self.cfg.max_boxes) {
                keep[i] = true;
            }
            let capped = boxes.len() - self.cfg.max_boxes;
            self.stats
                .capped
                .fetch_add(capped as u64, Ordering::Relaxed);
            let mut k = keep.into_iter();
            boxes.retain(|_| k.next().unwrap_or(false));
            let prev = value.get("capped").and_then(Value::as_u64).unwrap_or(0);
            value["capped"] = Value::from(prev + capped as u64);
        }
        Some(boxes)
    }

    /// One run of the crops `chunk` (indices into `crops`), less those of
    /// results that failed meanwhile; each crop's result goes to its box,
    /// postprocessed with its result's stream. A failed run fails the
    /// results whose crops were in it.
    fn run_chunk(
        &self,
        chunk: &[usize],
        crops: &[(usize, usize, Rgb)],
        parts: &mut [Part<'_>],
        post: &mut dyn Postprocessor,
    ) {
        let (tensor, ran) = loop {
            let ran: Vec<usize> = chunk
                .iter()
                .copied()
                .filter(|&k| parts[crops[k].0].error.is_none())
                .collect();
            if ran.is_empty() {
                return;
            }
            match self.batch(ran.iter().map(|&k| &crops[k].2)) {
                Ok(t) => break (t, ran),
                // A crop that cannot be resized fails its own result; the
                // run goes on without it.
                Err((i, e)) => parts[crops[ran[i]].0].error = Some(e),
            }
        };
        let per_item = match run_batch(
            &self.model,
            &[(self.input.as_str(), &tensor)],
            ran.len(),
            &self.stats.runs,
        ) {
            Ok(per_item) => per_item,
            Err(e) => {
                let e = e.to_string();
                for &k in &ran {
                    parts[crops[k].0].error.get_or_insert_with(|| e.clone());
                }
                return;
            }
        };
        self.stats
            .crops
            .fetch_add(ran.len() as u64, Ordering::Relaxed);
        for (&k, item) in ran.iter().zip(per_item) {
            let (p, b, _) = crops[k];
            let part = &mut parts[p];
            if part.error.is_some() {
                continue;
            }
            match post.process(part.stream, &ItemMeta::default(), &item.outputs) {
                Ok(r) => part.results[b] = r,
                Err(e) => part.error = Some(e.to_string()),
            }
        }
    }

    /// The input tensor of one run of `crops`: each resized to the stage's
    /// input (free-width stages: the batch as wide as its widest crop);
    /// else the index of the crop that failed, and why.
    fn batch<'c>(
        &self,
        crops: impl ExactSizeIterator<Item = &'c Rgb> + Clone,
    ) -> Result<Tensor, (usize, String)> {
        let n = crops.len();
        let batch_w = if self.free_width {
            crops
                .clone()
                .map(|c| {
                    (self.height as f64 * c.width as f64 / c.height.max(1) as f64).ceil() as u32
                })
                .max()
                .unwrap_or(self.width)
                .clamp(self.width, self.width * MAX_WIDTH_FACTOR)
        } else {
            self.width
        };
        let (w, h) = (batch_w as usize, self.height as usize);
        let per = 3 * w * h;
        let mut data = vec![0f32; per * n];
        for (k, c) in crops.enumerate() {
            let (rw, rh) = self.fit(c, batch_w);
            let img = c.resize(rw, rh).map_err(|e| (k, e.to_string()))?;
            self.norm
                .write(&img, &mut data[k * per..(k + 1) * per], w, h);
        }
        let shape = self.norm.shape(n, w, h);
        // The data is as long as the shape says: this cannot fail.
        ArrayD::from_shape_vec(IxDyn(&shape), data)
            .map(Tensor::F32)
            .map_err(|e| (0, e.to_string()))
    }
}

/// One result's boxes in a stage's run over a set.
struct Part<'a> {
    /// Its index in the set.
    at: usize,
    picture: &'a Rgb,
    stream: &'a str,
    boxes: Vec<Value>,
    /// The stage's result for each box (`None`: drop the box).
    results: Vec<Option<Value>>,
    /// Why the stage failed on this result.
    error: Option<String>,
}
