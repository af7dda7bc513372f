//! Motion-gated detection (`[pipelines.motion]`): a cheap motion detector
//! on a small grey frame decides whether, and where, a camera pipeline's
//! detector runs.
//!
//! Per camera frame: no motion and no moving tracks -> the detector does not
//! run; the frame's result is the camera's latest detections again
//! (`"motion": "still"` in it), so tracks carry on and stationary objects
//! stay. Motion -> the detector runs on the frame, or with `regions = true`
//! on crops of the moving regions at full resolution (their boxes mapped
//! back to the frame).
//!
//! Invariants:
//! - A camera's first frame (and the first after its size changed) always
//!   runs the detector: there is no background and no detections to carry.
//! - The state per stream (background, latest detections) is bounded by
//!   the pipeline's cameras (streams of a camera pipeline are its cameras)
//!   and reset with the stream's other state.
//! - Every frame the gate sees is counted once: still, or a detector run
//!   (with the crops it ran on under `regions`).

pub mod detect;
pub mod regions;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use self::detect::{Motion, MotionDetector};
use crate::preprocess::raw::RawImage;

/// `[pipelines.motion]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MotionConfig {
    /// Gate the model on motion (camera pipelines only). Absent: on for a
    /// camera pipeline whose model is a detector (`detections`
    /// postprocessing), off otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Rows of the grey frame motion is looked for in.
    #[serde(default = "default_frame_height")]
    pub frame_height: u32,
    /// A pixel moves when its grey differs from the background by more
    /// than this (0..=255).
    #[serde(default = "default_threshold")]
    pub threshold: u8,
    /// Blobs smaller than this many pixels of the grey frame are noise.
    #[serde(default = "default_min_area")]
    pub min_area: u32,
    /// How fast the background learns a pixel that changed since the
    /// previous frame (0..1): the share of the new frame in it. A pixel
    /// steady since the previous frame learns at 0.25 a frame.
    #[serde(default = "default_alpha")]
    pub alpha: f32,
    /// Blobs closer than this many pixels of the grey frame are one mover.
    #[serde(default = "default_merge_distance")]
    pub merge_distance: u32,
    /// Areas whose motion never counts (trees, a clock, a road beyond the
    /// fence): one polygon `[[x, y], ...]` or a list of them, in source-frame
    /// pixels.
    #[serde(default, skip_serializing_if = "Mask::is_empty")]
    pub mask: Mask,
    /// Run the detector on crops of the moving regions (full resolution,
    /// the model's input aspect) instead of the whole frame.
    #[serde(default)]
    pub regions: bool,
    /// At most this many crops a frame; more run the whole frame.
    #[serde(default = "default_max_regions")]
    pub max_regions: usize,
}

impl Default for MotionConfig {
    fn default() -> Self {
        MotionConfig {
            enabled: None,
            frame_height: default_frame_height(),
            threshold: default_threshold(),
            min_area: default_min_area(),
            alpha: default_alpha(),
            merge_distance: default_merge_distance(),
            mask: Mask::default(),
            regions: false,
            max_regions: default_max_regions(),
        }
    }
}

fn default_frame_height() -> u32 {
    100
}
fn default_threshold() -> u8 {
    30
}
fn default_min_area() -> u32 {
    10
}
fn default_alpha() -> f32 {
    0.02
}
fn default_merge_distance() -> u32 {
    5
}
fn default_max_regions() -> usize {
    4
}

/// `mask`: one polygon or several.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Mask {
    One(Vec<[f32; 2]>),
    Many(Vec<Vec<[f32; 2]>>),
}

impl Default for Mask {
    fn default() -> Self {
        Mask::Many(Vec::new())
    }
}

impl Mask {
    pub fn polygons(&self) -> Vec<&[[f32; 2]]> {
        match self {
            Mask::One(p) if p.is_empty() => Vec::new(),
            Mask::One(p) => vec![p.as_slice()],
            Mask::Many(ps) => ps.iter().map(Vec::as_slice).collect(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.polygons().is_empty()
    }
}

impl MotionConfig {
    /// Every problem, each naming its key under `at` (`pipelines[0].motion`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        if !(8..=1080).contains(&self.frame_height) {
            p.push(format!(
                "{at}.frame_height: {} is out of range 8..=1080",
                self.frame_height
            ));
        }
        if self.threshold == 0 {
            p.push(format!(
                "{at}.threshold: must be at least 1 (0 makes every pixel move)"
            ));
        }
        if !(self.alpha > 0.0 && self.alpha < 1.0) {
            p.push(format!(
                "{at}.alpha: {} is out of range (0, 1) (the background would never learn, or forget at once)",
                self.alpha
            ));
        }
        if self.max_regions == 0 || self.max_regions > 64 {
            p.push(format!(
                "{at}.max_regions: {} is out of range 1..=64",
                self.max_regions
            ));
        }
        for (i, poly) in self.mask.polygons().into_iter().enumerate() {
            let pts: Vec<_> = poly
                .iter()
                .map(|[x, y]| crate::track::geometry::Point::new(*x, *y))
                .collect();
            if let Err(e) = crate::track::geometry::check_polygon(&pts) {
                p.push(format!("{at}.mask[{i}]: {e}"));
            }
        }
        p
    }

    /// Whether the gate is on for a pipeline: a camera's with `enabled =
    /// true`, or, without `enabled`, a camera's with a detector.
    pub fn gates(cfg: Option<&MotionConfig>, camera: bool, detector: bool) -> bool {
        camera && cfg.and_then(|c| c.enabled).unwrap_or(detector)
    }
}

/// The gate's counts (a pipeline's, and each of its cameras').
#[derive(Debug, Default)]
pub struct MotionCounts {
    /// Frames without motion or moving tracks: the detector did not run.
    pub frames_still: AtomicU64,
    /// Frames the detector ran on (on the whole frame or on crops).
    pub detector_runs: AtomicU64,
    /// Crops the detector ran on (`regions = true`).
    pub regions: AtomicU64,
}

/// The counts in `/v1/status`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MotionReport {
    pub frames_still: u64,
    pub detector_runs: u64,
    pub regions: u64,
}

impl MotionCounts {
    pub fn report(&self) -> MotionReport {
        MotionReport {
            frames_still: self.frames_still.load(Ordering::Relaxed),
            detector_runs: self.detector_runs.load(Ordering::Relaxed),
            regions: self.regions.load(Ordering::Relaxed),
        }
    }

    fn count(&self, d: &Decision) {
        match d {
            Decision::Still(_) => {
                self.frames_still.fetch_add(1, Ordering::Relaxed);
            }
            Decision::Run => {
                self.detector_runs.fetch_add(1, Ordering::Relaxed);
            }
            Decision::Regions(r) => {
                self.detector_runs.fetch_add(1, Ordering::Relaxed);
                self.regions.fetch_add(r.len() as u64, Ordering::Relaxed);
            }
        }
    }
}

/// What a frame gets.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// The detector runs on the whole frame.
    Run,
    /// The detector runs on these crops (`[x0, y0, x1, y1]`, source pixels).
    Regions(Vec<[u32; 4]>),
    /// Nothing moves: this result (the stream's latest detections) again.
    Still(Value),
}

struct StreamMotion {
    detector: MotionDetector,
    /// The latest detections the detector gave (before the stream hook).
    last: Option<Value>,
}

/// A pipeline's gate: a motion detector and the latest detections per stream.
pub struct MotionGate {
    cfg: MotionConfig,
    /// The model's input size (crops are grown to its aspect).
    input: (u32, u32),
    streams: Mutex<HashMap<Arc<str>, StreamMotion>>,
    pub counts: MotionCounts,
}

impl MotionGate {
    pub fn new(cfg: MotionConfig, input: (u32, u32)) -> MotionGate {
        MotionGate {
            cfg,
            input,
            streams: Mutex::new(HashMap::new()),
            counts: MotionCounts::default(),
        }
    }

    pub fn regions(&self) -> bool {
        self.cfg.regions
    }

    /// Decides for one decoded frame of `stream`; `tracked` are the boxes
    /// of the stream's tracks that moved at its latest frame (`[x0, y0, x1,
    /// y1]`, source pixels). A frame the detector cannot read runs the
    /// detector (whose decoding reports it). `camera` gets the same count.
    pub fn decide(
        &self,
        stream: &Arc<str>,
        payload: &[u8],
        raw: RawImage,
        tracked: &[[f32; 4]],
        camera: Option<&MotionCounts>,
    ) -> Decision {
        let d = self.decision(stream, payload, raw, tracked);
        self.counts.count(&d);
        if let Some(c) = camera {
            c.count(&d);
        }
        d
    }

    fn decision(
        &self,
        stream: &Arc<str>,
        payload: &[u8],
        raw: RawImage,
        tracked: &[[f32; 4]],
    ) -> Decision {
        let mut streams = self.streams.lock();
        let s = streams
            .entry(stream.clone())
            .or_insert_with(|| StreamMotion {
                detector: MotionDetector::new(&self.cfg),
                last: None,
            });
        let Ok(motion) = s.detector.detect(payload, raw) else {
            return Decision::Run;
        };
        if motion.is_still()
            && tracked.is_empty()
            && let Some(last) = &s.last
        {
            return Decision::Still(still(last));
        }
        if !self.cfg.regions || motion.whole {
            return Decision::Run;
        }
        let clamp = |v: f32, max: u32| (v.max(0.0) as u32).min(max);
        let mut boxes = motion.boxes;
        boxes.extend(tracked.iter().map(|b| {
            [
                clamp(b[0].floor(), raw.width),
                clamp(b[1].floor(), raw.height),
                clamp(b[2].ceil(), raw.width),
                clamp(b[3].ceil(), raw.height),
            ]
        }));
        boxes.retain(|b| b[2] > b[0] && b[3] > b[1]);
        match regions::plan(
            &boxes,
            (raw.width, raw.height),
            self.input,
            self.cfg.max_regions,
        ) {
            Some(r) => Decision::Regions(r),
            None => Decision::Run,
        }
    }

    /// The detections the detector just gave for `stream`, to carry over
    /// still frames.
    pub fn remember(&self, stream: &str, value: &Value) {
        if let Some(s) = self.streams.lock().get_mut(stream) {
            s.last = Some(value.clone());
        }
    }

    /// Forgets a stream that left the pipeline.
    pub fn reset(&self, stream: &str) {
        self.streams.lock().remove(stream);
    }
}

/// `last` marked as a still frame's.
fn still(last: &Value) -> Value {
    let mut v = last.clone();
    if let Some(o) = v.as_object_mut() {
        o.insert("motion".into(), Value::from("still"));
    }
    v
}

/// A region run's results (one per crop, boxes in crop pixels) as one
/// result in the frame's pixels.
pub fn merge_regions(results: Vec<Value>, offsets: &[[f32; 2]]) -> Value {
    let mut all = Vec::new();
    for (mut v, [dx, dy]) in results.into_iter().zip(offsets) {
        let Some(Value::Array(dets)) = v.get_mut("detections").map(Value::take) else {
            continue;
        };
        for mut d in dets {
            if let Some(Value::Array(b)) = d.get_mut("box") {
                for (i, c) in b.iter_mut().enumerate() {
                    if let Some(x) = c.as_f64() {
                        let off = if i % 2 == 0 { dx } else { dy };
                        *c = Value::from(x + f64::from(*off));
                    }
                }
            }
            all.push(d);
        }
    }
    serde_json::json!({ "detections": all, "motion": "regions" })
}

#[cfg(test)]
mod tests;
