//! The cameras of a pipeline that reads several (`cameras = [...]`), each
//! a stream of it: what each one got and lost, for `/v1/status` and
//! `/metrics`.
//!
//! Invariants: the list is fixed when the pipeline is built (its names
//! come from the config, never from the frames), so it is bounded and read
//! without a lock; every frame of a camera that is taken in, done or
//! dropped is counted on its camera as well as on the pipeline.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime};

use parking_lot::Mutex;
use serde::Serialize;

use super::motion::{MotionCounts, MotionReport};
use super::{LatencyHistogram, LatencySummary};
use crate::source::camera::{CameraReport, CameraState};

/// Completions kept to tell a camera's achieved rate: enough to smooth a
/// 30 fps camera over half a second, few enough to follow a change.
const RATE_WINDOW: usize = 16;

/// One camera of a pipeline.
pub struct CameraFeed {
    /// The `[[cameras]]` name: the stream's name.
    pub name: Arc<str>,
    /// The camera itself (decoder, connection, its own counters).
    pub state: Arc<CameraState>,
    /// Frames of this camera offered to the pipeline's queue.
    pub frames_in: AtomicU64,
    /// Frames of this camera the pipeline finished.
    pub frames_done: AtomicU64,
    drops: Mutex<BTreeMap<&'static str, u64>>,
    /// Capture -> done, µs.
    pub frame_age_us: LatencyHistogram,
    done_at: Mutex<VecDeque<Instant>>,
    /// The pipeline's motion gate on this camera's frames.
    pub motion: MotionCounts,
}

/// A camera of a pipeline in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct CameraFeedReport {
    pub name: String,
    pub frames_in: u64,
    pub frames_done: u64,
    /// Frames done per second over the last few (`null` before two).
    pub fps: Option<f64>,
    pub frame_age: LatencySummary,
    /// Drops by reason (`fps` is the camera's subsampling, not a loss).
    pub drops: BTreeMap<String, u64>,
    pub last_error: Option<String>,
    /// Confirmed tracks open now (pipelines that track).
    pub tracks_open: Option<usize>,
    /// Frames still and detector runs (pipelines with a motion gate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub motion: Option<MotionReport>,
    /// The camera itself: state, decoder, its counters.
    pub camera: CameraReport,
}

impl CameraFeed {
    pub fn new(name: &str, state: Arc<CameraState>) -> CameraFeed {
        CameraFeed {
            name: Arc::from(name),
            state,
            frames_in: AtomicU64::new(0),
            frames_done: AtomicU64::new(0),
            drops: Mutex::new(BTreeMap::new()),
            frame_age_us: LatencyHistogram::default(),
            done_at: Mutex::new(VecDeque::with_capacity(RATE_WINDOW)),
            motion: MotionCounts::default(),
        }
    }

    pub fn add_drop(&self, reason: &'static str) {
        *self.drops.lock().entry(reason).or_default() += 1;
    }

    /// Drops by reason, the camera's `fps` subsampling among them.
    pub fn drops(&self) -> BTreeMap<&'static str, u64> {
        let mut d = self.drops.lock().clone();
        d.insert("fps", self.state.subsampled.load(Ordering::Relaxed));
        d
    }

    /// A frame of this camera is done (captured at `captured`).
    pub fn done(&self, captured: Option<SystemTime>) {
        self.frames_done.fetch_add(1, Ordering::Relaxed);
        if let Some(age) = captured.and_then(|c| SystemTime::now().duration_since(c).ok()) {
            self.frame_age_us.record(age.as_micros() as u64);
        }
        let mut d = self.done_at.lock();
        if d.len() == RATE_WINDOW {
            d.pop_front();
        }
        d.push_back(Instant::now());
    }

    /// Frames done per second over the last few; `None` before two.
    pub fn fps(&self) -> Option<f64> {
        let d = self.done_at.lock();
        let (first, last) = (d.front()?, d.back()?);
        let span = last.duration_since(*first).as_secs_f64();
        (d.len() >= 2 && span > 0.0).then(|| (d.len() - 1) as f64 / span)
    }

    /// `gated`: the pipeline has a motion gate (its counts are reported).
    pub fn report(&self, tracks_open: Option<usize>, gated: bool) -> CameraFeedReport {
        let camera = self.state.status();
        CameraFeedReport {
            name: self.name.to_string(),
            frames_in: self.frames_in.load(Ordering::Relaxed),
            frames_done: self.frames_done.load(Ordering::Relaxed),
            fps: self.fps(),
            frame_age: self.frame_age_us.summary(),
            drops: self
                .drops()
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            last_error: camera.last_error().map(String::from),
            tracks_open,
            motion: gated.then(|| self.motion.report()),
            camera,
        }
    }
}

/// The cameras of one pipeline, in config order.
#[derive(Default)]
pub struct CameraFeeds(pub Vec<Arc<CameraFeed>>);

impl CameraFeeds {
    /// The camera of a stream (its name), if the stream is one.
    pub fn get(&self, stream: &str) -> Option<&Arc<CameraFeed>> {
        self.0.iter().find(|c| &*c.name == stream)
    }

    /// Its place in the list.
    pub fn index(&self, stream: &str) -> Option<usize> {
        self.0.iter().position(|c| &*c.name == stream)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn names(&self) -> Vec<Arc<str>> {
        self.0.iter().map(|c| c.name.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_camera_counts_its_frames_drops_and_rate() {
        let c = CameraFeed::new("gate", Arc::new(CameraState::new("rtsp://h/x".into())));
        assert_eq!(c.fps(), None);
        c.add_drop("stale");
        c.add_drop("stale");
        c.done(Some(SystemTime::now()));
        c.done(None);
        let r = c.report(Some(3), false);
        assert_eq!((r.frames_done, r.tracks_open), (2, Some(3)));
        assert_eq!(r.drops.get("stale"), Some(&2));
        assert_eq!(r.drops.get("fps"), Some(&0));
        assert_eq!(r.frame_age.count, 1);
        let feeds = CameraFeeds(vec![Arc::new(c)]);
        assert_eq!(feeds.index("gate"), Some(0));
        assert!(feeds.get("yard").is_none());
    }
}
