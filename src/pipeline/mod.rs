//! Pipelines: one source + preprocessing + one model + postprocessing, and
//! the scheduler that runs them. A daemon runs many; they share loaded models.

pub mod cameras;
pub mod drops;
pub mod hook;
pub mod infer;
pub mod mode;
pub mod motion;
pub mod queue;
pub mod recent;
/// The result record is a leaf room of its own; `pipeline::record` stays as
/// a path to it.
pub use crate::record;
pub mod realtime;
pub mod scheduler;
pub mod snapshot;
pub mod stages;
pub mod tracking;
pub mod worker;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

pub use self::drops::DropReason;
pub use self::hook::{DynStreamHook, FrameMeta, HookOutput, StreamEnd, StreamHook};
pub use self::infer::RunStats;
pub use self::mode::{Batching, Mode};
pub use self::queue::WhenFull;
pub use self::scheduler::{Priority, Scheduler, SchedulerConfig};
pub use self::stages::{StageConfig, ThumbnailConfig};
pub use self::worker::{Pipeline, StreamsHeld};
use crate::output::OutputConfig;
use crate::postprocess::PostprocessConfig;
use crate::preprocess::PreprocessConfig;
pub use crate::record::{IdGen, ResultRecord};
use crate::source::SourceConfig;
pub use crate::telemetry::logging::RateLimitedLog;

/// `[[pipelines]]` in the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineConfig {
    /// Unique name; appears in records, metrics and the HTTP path.
    pub name: String,
    /// A model name in the model directory.
    pub model: String,
    pub source: SourceConfig,
    /// Overrides the model's default preprocessing.
    #[serde(default)]
    pub preprocess: Option<PreprocessConfig>,
    /// Overrides the model's default postprocessing.
    #[serde(default)]
    pub postprocess: Option<PostprocessConfig>,
    /// The model input the payload feeds (default: the first input that is neither state nor constant).
    #[serde(default)]
    pub input: Option<String>,
    #[serde(default)]
    pub priority: Priority,
    /// Frames waiting for a worker, at most.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// What a frame arriving at a full queue does; unset: `block` for a
    /// QoS 1 mqtt source (the broker keeps what waits, nothing it was told
    /// is stored is lost), `drop_oldest` for every other source. See
    /// [`PipelineConfig::when_full`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when_full: Option<WhenFull>,
    /// Items run together when the model has a batch axis (1 = no batching).
    #[serde(default = "default_max_batch")]
    pub max_batch: usize,
    /// How long a worker waits for a batch to fill. By default it never
    /// waits: a worker that comes free runs what is queued (up to
    /// `max_batch`) at once, as Triton's dynamic batcher with no queue delay
    /// does, so batching costs an idle pipeline no latency.
    #[serde(default = "default_max_delay", with = "humantime_serde")]
    pub max_delay: Duration,
    /// Local consumers that get each record straight from the inference
    /// thread (site MQTT, UDP, unix socket), apart from the outbox.
    #[serde(default)]
    pub outputs: Vec<OutputConfig>,
    /// Models run on each box of the stage before (`[[pipelines.stages]]`).
    #[serde(default)]
    pub stages: Vec<StageConfig>,
    /// Per-box JPEG thumbnails in records (off by default).
    #[serde(default)]
    pub thumbnails: Option<ThumbnailConfig>,
    /// Streams this pipeline holds state for (model state, audio windows,
    /// events), at most: stream names come from the senders, so a new one
    /// beyond this evicts the least recently seen, which starts over if it
    /// comes back.
    #[serde(default = "default_max_streams")]
    pub max_streams: usize,
    /// A stream not seen this long is forgotten (its state reset), whether
    /// other frames arrive or not.
    #[serde(default = "default_stream_idle", with = "humantime_serde")]
    pub stream_idle: Duration,
    /// What reaches the outbox: `events` (the default with `track`) or
    /// `frames` (a record per frame, as without tracking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emit: Option<crate::track::Emit>,
    /// Multi-object tracking per stream (`[pipelines.track]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub track: Option<crate::track::TrackConfig>,
    /// Zones objects enter, leave and loiter in (`[[pipelines.zones]]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub zones: Vec<crate::track::ZoneConfig>,
    /// Lines objects cross (`[[pipelines.lines]]`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lines: Vec<crate::track::LineConfig>,
    /// Motion-gated detection (`[pipelines.motion]`); on by default for a
    /// camera pipeline with a detector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub motion: Option<motion::MotionConfig>,
}

fn default_queue() -> usize {
    256
}
fn default_max_batch() -> usize {
    1
}
fn default_max_delay() -> Duration {
    Duration::ZERO
}
/// A few KiB of state each (silero VAD: ~4 KiB): some MiB per pipeline at most.
pub const DEFAULT_MAX_STREAMS: usize = 4096;
fn default_max_streams() -> usize {
    DEFAULT_MAX_STREAMS
}
fn default_stream_idle() -> Duration {
    Duration::from_secs(600)
}

impl PipelineConfig {
    /// The cameras this pipeline reads as streams of its own (`cameras =
    /// [...]`: each stream is named after its camera), given every
    /// `[[cameras]]` entry; `None` when its streams are not cameras.
    pub fn stream_cameras(&self, all: &[crate::source::camera::CameraDef]) -> Option<Vec<String>> {
        match &self.source {
            SourceConfig::Camera(c) if c.is_many() => {
                Some(c.names(all).into_iter().map(String::from).collect())
            }
            _ => None,
        }
    }

    /// The camera names of a pipeline reading several, as resolved when
    /// the config was read (empty otherwise).
    pub fn camera_streams(&self) -> Vec<String> {
        match &self.source {
            SourceConfig::Camera(c) if c.is_many() => {
                c.resolved_many.iter().map(|d| d.name.clone()).collect()
            }
            _ => Vec::new(),
        }
    }

    /// The queue's policy: the configured one, else `block` for a QoS 1
    /// mqtt source (its broker's in-flight window is the back-pressure, so
    /// a restart's redelivery burst waits instead of being dropped), else
    /// `drop_oldest`.
    pub fn when_full(&self) -> WhenFull {
        match (self.when_full, &self.source) {
            (Some(w), _) => w,
            (None, SourceConfig::Mqtt { qos: 1, .. }) => WhenFull::Block,
            (None, _) => WhenFull::DropOldest,
        }
    }

    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            p.push(format!(
                "{at}.name: `{}` must be non-empty letters, digits, '_' or '-'",
                self.name
            ));
        }
        if self.model.is_empty() {
            p.push(format!("{at}.model: empty"));
        }
        if self.queue == 0 {
            p.push(format!("{at}.queue: must be at least 1"));
        }
        if self.max_batch == 0 || self.max_batch > 1024 {
            p.push(format!(
                "{at}.max_batch: {} is out of range 1..=1024",
                self.max_batch
            ));
        }
        if self.max_streams == 0 {
            p.push(format!("{at}.max_streams: must be at least 1"));
        }
        if self.stream_idle.is_zero() {
            p.push(format!("{at}.stream_idle: must be longer than 0s"));
        }
        p.extend(self.source.validate(&format!("{at}.source")));
        for (i, o) in self.outputs.iter().enumerate() {
            p.extend(o.validate(&format!("{at}.outputs[{i}]")));
            if self.outputs[..i].contains(o) {
                p.push(format!("{at}.outputs[{i}]: listed twice"));
            }
        }
        for (i, st) in self.stages.iter().enumerate() {
            p.extend(st.validate(&format!("{at}.stages[{i}]")));
        }
        if let Some(t) = &self.thumbnails {
            p.extend(t.validate(&format!("{at}.thumbnails")));
        }
        if let Some(m) = &self.motion {
            p.extend(m.validate(&format!("{at}.motion")));
            if m.enabled == Some(true) && !matches!(self.source, SourceConfig::Camera(_)) {
                p.push(format!(
                    "{at}.motion.enabled: motion gating needs a camera source (its frames are decoded pictures)"
                ));
            }
        }
        if let Some(pre) = &self.preprocess {
            p.extend(
                pre.validate()
                    .into_iter()
                    .map(|e| format!("{at}.preprocess: {e}")),
            );
        }
        if let Some(post) = &self.postprocess {
            p.extend(
                post.validate()
                    .into_iter()
                    .map(|e| format!("{at}.postprocess: {e}")),
            );
        }
        p.extend(crate::track::config::validate(
            at,
            self.track.as_ref(),
            &self.zones,
            &self.lines,
            self.emit,
        ));
        p
    }
}

/// Counters of one pipeline.
#[derive(Default)]
pub struct PipelineStats {
    pub frames_in: AtomicU64,
    pub frames_done: AtomicU64,
    pub items: AtomicU64,
    pub records: AtomicU64,
    /// The model's inference runs.
    pub runs: RunStats,
    drops: Mutex<BTreeMap<&'static str, u64>>,
    /// Frame arrival -> record produced (or the frame finished without one), µs.
    pub e2e_us: LatencyHistogram,
    /// Frame arrival -> an inference worker takes it, µs.
    pub queue_us: LatencyHistogram,
    /// Decoding and preprocessing of one taken set of frames, µs.
    pub decode_us: LatencyHistogram,
    /// Postprocessing, record building and storing of one set, µs.
    pub output_us: LatencyHistogram,
    /// Capture -> record, µs (frames that carry a capture time: cameras).
    pub frame_age_us: LatencyHistogram,
    /// The camera feeding this pipeline (state, decoder, its counters).
    pub camera: Option<std::sync::Arc<crate::source::camera::CameraState>>,
    /// The cameras of a pipeline reading several, each a stream of it.
    pub cameras: cameras::CameraFeeds,
    /// What the source says of itself (`started`, `connected`,
    /// `reconnecting`, ...), for the status and the console.
    source_state: Mutex<&'static str>,
}

/// Latency percentiles (HDR histogram, 1 µs .. 60 s, 3 significant digits).
pub struct LatencyHistogram(Mutex<Option<hdrhistogram::Histogram<u64>>>);

impl Default for LatencyHistogram {
    fn default() -> Self {
        LatencyHistogram(Mutex::new(
            hdrhistogram::Histogram::new_with_bounds(1, 60_000_000, 3).ok(),
        ))
    }
}

/// A histogram's figures in `/v1/status`: `{"count": 0}` while empty,
/// else `{count, p50_us, p90_us, p99_us, max_us}`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p90_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_us: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_us: Option<u64>,
}

impl LatencyHistogram {
    pub fn record(&self, us: u64) {
        if let Some(h) = self.0.lock().as_mut() {
            h.saturating_record(us.max(1));
        }
    }

    /// The recorded buckets as (highest value of the bucket, count), in
    /// ascending order: two of these taken apart give the latencies recorded
    /// in between (the console's p99 over time).
    pub fn recorded(&self) -> Vec<(u64, u64)> {
        match self.0.lock().as_ref() {
            Some(h) => h
                .iter_recorded()
                .map(|v| (v.value_iterated_to(), v.count_at_value()))
                .collect(),
            None => Vec::new(),
        }
    }

    /// The count and the quantiles (none while empty).
    pub fn summary(&self) -> LatencySummary {
        match self.0.lock().as_ref() {
            Some(h) if !h.is_empty() => LatencySummary {
                count: h.len(),
                p50_us: Some(h.value_at_quantile(0.50)),
                p90_us: Some(h.value_at_quantile(0.90)),
                p99_us: Some(h.value_at_quantile(0.99)),
                max_us: Some(h.max()),
            },
            _ => LatencySummary::default(),
        }
    }

    /// (sum, count, per-bucket counts) with values scaled by `scale` (1e-6:
    /// µs to seconds), for a Prometheus histogram. Bucket counts are per
    /// bucket, not cumulative (the encoder accumulates them); the last bucket
    /// is +Inf, so they add up to the count.
    pub fn buckets(&self, bounds: &[f64], scale: f64) -> (f64, u64, Vec<(f64, u64)>) {
        let g = self.0.lock();
        let Some(h) = g.as_ref() else {
            return (
                0.0,
                0,
                bounds
                    .iter()
                    .map(|b| (*b, 0))
                    .chain([(f64::INFINITY, 0)])
                    .collect(),
            );
        };
        let count = h.len();
        let sum = h.mean() * count as f64 * scale;
        let mut out = Vec::with_capacity(bounds.len() + 1);
        let mut below = 0u64;
        for b in bounds {
            let raw = (b / scale).floor().max(0.0) as u64;
            let cum = if raw == 0 { 0 } else { h.count_between(0, raw) };
            out.push((*b, cum.saturating_sub(below)));
            below = below.max(cum);
        }
        out.push((f64::INFINITY, count.saturating_sub(below)));
        (sum, count, out)
    }

    pub fn reset(&self) {
        if let Some(h) = self.0.lock().as_mut() {
            h.reset();
        }
    }
}

impl PipelineStats {
    pub fn add_drop(&self, reason: DropReason) {
        *self.drops.lock().entry(reason.label()).or_default() += 1;
    }

    /// Drops by reason label (`/v1/status` `drops`, `outpost_frames_dropped_total`).
    pub fn drops(&self) -> BTreeMap<&'static str, u64> {
        self.drops.lock().clone()
    }

    /// Drops counted under `reason`.
    pub fn drop_count(&self, reason: DropReason) -> u64 {
        self.drops.lock().get(reason.label()).copied().unwrap_or(0)
    }

    pub fn get(a: &AtomicU64) -> u64 {
        a.load(Ordering::Relaxed)
    }

    /// Sets what the source says of itself (see [`PipelineStats::source_state`]).
    pub fn set_source_state(&self, state: &'static str) {
        *self.source_state.lock() = state;
    }

    /// `started` once the daemon started the source, then what the source
    /// reports (`connected`, `reconnecting`, `streaming`, ...); empty before.
    pub fn source_state(&self) -> &'static str {
        *self.source_state.lock()
    }
}

/// Where records go once made: the outbox (and, for demos, stdout).
pub trait RecordSink: Send + Sync {
    /// Stores a record; `json` is its JSON encoding (made once per record
    /// and shared with the local outputs). `Unavailable` when the store may
    /// take it later (full, disk full).
    fn store(&self, record: &ResultRecord, json: &[u8]) -> Result<(), crate::source::FrameError>;

    /// Stores records made together (one batch of frames), each as `store`
    /// would, in order, each with its own result. A store that wakes a
    /// reader per record (the uplink) wakes it once for all of them.
    fn store_all(
        &self,
        records: &[(ResultRecord, Vec<u8>)],
    ) -> Vec<Result<(), crate::source::FrameError>> {
        records.iter().map(|(r, j)| self.store(r, j)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limited_log_counts_suppressed() {
        let l = RateLimitedLog::new(Duration::from_secs(3600));
        assert_eq!(l.allow("bad"), Some(0));
        assert_eq!(l.allow("bad"), None);
        assert_eq!(l.allow("bad"), None);
        assert_eq!(l.allow("other"), Some(0));
        let l = RateLimitedLog::new(Duration::ZERO);
        l.allow("x");
        assert_eq!(l.allow("x"), Some(0));
    }

    #[test]
    fn ids_are_sequential_per_boot() {
        let g = IdGen::new("gw".into(), 7);
        assert_eq!(g.next(), ("gw/7/1".to_string(), 1));
        assert_eq!(g.next(), ("gw/7/2".to_string(), 2));
    }

    #[test]
    fn pipeline_config_defaults_and_validation() {
        let c: PipelineConfig = toml::from_str(
            r#"
name = "vad"
model = "silero_vad"
source = { type = "udp", listen = "127.0.0.1:9000" }
"#,
        )
        .unwrap();
        assert_eq!(
            (c.queue, c.max_batch, c.priority, c.when_full()),
            (256, 1, Priority::Normal, WhenFull::DropOldest)
        );
        assert_eq!(
            (c.max_streams, c.stream_idle),
            (4096, Duration::from_secs(600))
        );
        assert!(c.validate("p").is_empty());
        let bad = PipelineConfig {
            name: "a b".into(),
            queue: 0,
            max_batch: 0,
            max_streams: 0,
            stream_idle: Duration::ZERO,
            ..c
        };
        let problems = bad.validate("p");
        assert_eq!(problems.len(), 5, "{problems:?}");
        assert!(problems.contains(&"p.max_streams: must be at least 1".to_string()));
        assert!(problems.contains(&"p.stream_idle: must be longer than 0s".to_string()));
    }

    #[test]
    fn a_qos1_mqtt_source_blocks_unless_the_config_says_otherwise() {
        let cfg = |qos: u8, extra: &str| -> PipelineConfig {
            toml::from_str(&format!(
                "name = \"p\"\nmodel = \"m\"\n{extra}\nsource = {{ type = \"mqtt\", topics = [\"a\"], qos = {qos} }}\n"
            ))
            .unwrap()
        };
        assert_eq!(cfg(1, "").when_full(), WhenFull::Block);
        assert_eq!(cfg(0, "").when_full(), WhenFull::DropOldest);
        assert_eq!(
            cfg(1, "when_full = \"drop_oldest\"").when_full(),
            WhenFull::DropOldest
        );
        assert_eq!(
            cfg(1, "when_full = \"drop_newest\"").when_full(),
            WhenFull::DropNewest
        );
    }
}
