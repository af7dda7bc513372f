//! The daemon's metrics collector: reads the pipelines, the outbox and the
//! machine at scrape time (components keep their own counters; nothing is
//! kept twice), plus every registered [`MetricSource`]. Served at `/metrics`.
//!
//! Families that read one figure per pipeline, stage, GPU or outbox are
//! tables of (name, help, accessor); `encode` walks the tables.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::registry::Registry;

use crate::outbox::{Outbox, OutboxStats};
use crate::pipeline::stages::StageStats;
use crate::pipeline::{LatencyHistogram, Pipeline, Scheduler};
use crate::source::camera::CameraState;
use crate::telemetry::device;
use crate::telemetry::metrics::{Labels, MetricSource, counter, gauge};

/// Latency buckets, seconds: 50 µs .. 10 s.
const BUCKETS_S: [f64; 17] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

/// Batch-size buckets.
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// µs to seconds.
const US: f64 = 1e-6;

/// One family: its name, its help text and how a row's value is read.
type Family<F> = (&'static str, &'static str, F);
type PipelineCounter = Family<fn(&Pipeline) -> u64>;
type PipelineGauge = Family<fn(&Scheduler, usize) -> f64>;
type StageCounter = Family<fn(&StageStats) -> u64>;
type StageHistogram = (
    &'static str,
    &'static str,
    fn(&StageStats) -> &LatencyHistogram,
    f64,
    &'static [f64],
);
type CameraCounter = Family<fn(&Pipeline, &CameraState) -> u64>;
type OutboxGauge = Family<fn(&OutboxStats) -> Option<f64>>;
type OutboxCounter = Family<fn(&OutboxStats) -> u64>;
type GpuGauge = Family<fn(&device::Gpu) -> Option<f64>>;

fn get(a: &AtomicU64) -> u64 {
    a.load(Ordering::Relaxed)
}

/// Counters with one row per pipeline, labelled `pipeline`.
const PIPELINE_COUNTERS: &[PipelineCounter] = &[
    (
        "outpost_frames_in",
        "Frames received by the pipeline's source",
        |p| get(&p.stats.frames_in),
    ),
    (
        "outpost_frames_processed",
        "Frames taken through decode, inference and postprocessing",
        |p| get(&p.stats.frames_done),
    ),
    (
        "outpost_records",
        "Result records stored in the outbox",
        |p| get(&p.stats.records),
    ),
    (
        "outpost_snapshot_renders",
        "Snapshots drawn (each frame once at most; the requests for it share the drawing)",
        |p| get(&p.snapshot().stats().renders),
    ),
    (
        "outpost_snapshot_renders_refused",
        "Snapshot requests answered 503: the daemon was drawing its most snapshots at once",
        |p| get(&p.snapshot().stats().refused),
    ),
];

/// Gauges with one row per pipeline (by its index in the scheduler), labelled `pipeline`.
const PIPELINE_GAUGES: &[PipelineGauge] = &[
    (
        "outpost_queue_depth",
        "Frames waiting in the pipeline's queue",
        |s, i| s.queue_depth(i) as f64,
    ),
    (
        "outpost_queue_capacity",
        "Capacity of the pipeline's queue",
        |s, i| s.pipelines()[i].cfg.queue as f64,
    ),
    (
        "outpost_streams",
        "Streams the pipeline holds state for",
        |s, i| s.pipelines()[i].streams_held().held as f64,
    ),
    (
        "outpost_streams_max",
        "Streams the pipeline holds state for, at most (max_streams)",
        |s, i| s.pipelines()[i].streams_held().max as f64,
    ),
];

/// A histogram family with one row per pipeline that has one.
struct PipelineHistogram {
    name: &'static str,
    help: &'static str,
    labels: fn(&Pipeline) -> Labels,
    /// None: the pipeline has no row in this family.
    histogram: fn(&Pipeline) -> Option<&LatencyHistogram>,
    /// Multiplies the recorded values (µs to seconds).
    scale: f64,
    buckets: &'static [f64],
}

const PIPELINE_HISTOGRAMS: &[PipelineHistogram] = &[
    PipelineHistogram {
        name: "outpost_inference_latency_seconds",
        help: "Inference time per run (a batch counts once)",
        labels: pipeline_model_labels,
        histogram: |p| Some(&p.stats.runs.inference_us),
        scale: US,
        buckets: &BUCKETS_S,
    },
    PipelineHistogram {
        name: "outpost_e2e_latency_seconds",
        help: "Frame arrival to result record",
        labels: pipeline_model_labels,
        histogram: |p| Some(&p.stats.e2e_us),
        scale: US,
        buckets: &BUCKETS_S,
    },
    PipelineHistogram {
        name: "outpost_queue_wait_seconds",
        help: "Frame arrival until an inference worker takes it",
        labels: pipeline_model_labels,
        histogram: |p| Some(&p.stats.queue_us),
        scale: US,
        buckets: &BUCKETS_S,
    },
    PipelineHistogram {
        name: "outpost_batch_size",
        help: "Items per inference run",
        labels: pipeline_model_labels,
        histogram: |p| Some(&p.stats.runs.batch_sizes),
        scale: 1.0,
        buckets: &BATCH_BUCKETS,
    },
    PipelineHistogram {
        name: "outpost_frame_age_seconds",
        help: "Frame capture to result record (cameras)",
        labels: pipeline_labels,
        histogram: |p| p.stats.camera.is_some().then_some(&p.stats.frame_age_us),
        scale: US,
        buckets: &BUCKETS_S,
    },
];

/// Counters with one row per cascade stage, labelled `pipeline` and `stage`.
const STAGE_COUNTERS: &[StageCounter] = &[
    (
        "outpost_stage_crops",
        "Crops a cascade stage ran through its model",
        |st| get(&st.crops),
    ),
    (
        "outpost_stage_boxes_capped",
        "Boxes a cascade stage left out (more than its max_boxes)",
        |st| get(&st.capped),
    ),
    (
        "outpost_stage_errors",
        "Frames on which a cascade stage failed",
        |st| get(&st.errors),
    ),
    (
        "outpost_stage_batches",
        "Inference runs of a cascade stage's model (batches of crops)",
        |st| get(&st.runs.batches),
    ),
];

/// Histograms with one row per cascade stage, labelled `pipeline` and
/// `stage`: (name, help, the histogram, its scale, its buckets).
const STAGE_HISTOGRAMS: &[StageHistogram] = &[
    (
        "outpost_stage_latency_seconds",
        "A cascade stage's work on one set of frames taken together (crops, inference, postprocessing)",
        |st| &st.latency_us,
        US,
        &BUCKETS_S,
    ),
    (
        "outpost_stage_inference_latency_seconds",
        "Inference time per run of a cascade stage's model (a batch counts once)",
        |st| &st.runs.inference_us,
        US,
        &BUCKETS_S,
    ),
    (
        "outpost_stage_batch_size",
        "Crops per inference run of a cascade stage's model",
        |st| &st.runs.batch_sizes,
        1.0,
        &BATCH_BUCKETS,
    ),
];

/// Counters with one row per camera pipeline, labelled `pipeline`.
const CAMERA_COUNTERS: &[CameraCounter] = &[
    (
        "outpost_camera_frames_in",
        "Decoded frames out of the camera (before fps subsampling)",
        |_, c| get(&c.frames_in),
    ),
    (
        "outpost_camera_frames_processed",
        "Camera frames taken through inference",
        |p, _| get(&p.stats.frames_done),
    ),
    (
        "outpost_camera_reconnects",
        "Camera pipelines torn down and rebuilt",
        |_, c| get(&c.reconnects),
    ),
    (
        "outpost_camera_decoder_frames_in",
        "Compressed frames handed to the camera's decoder",
        |_, c| get(&c.decoder_frames_in),
    ),
    (
        "outpost_camera_delta_frames_skipped",
        "Delta frames dropped before the decoder (keyframe-only decoding)",
        |_, c| get(&c.delta_frames_skipped),
    ),
    (
        "outpost_camera_oversize",
        "RTSP messages and frames over the camera's max_frame_bytes (each closed the connection)",
        |_, c| get(&c.oversize),
    ),
    (
        "outpost_camera_relay_refused",
        "Connections to the camera's loopback relay port from another process than the daemon's RTSP client (refused)",
        |_, c| get(&c.relay_refused),
    ),
];

/// Outbox gauges, no labels; a None value leaves the family out.
const OUTBOX_GAUGES: &[OutboxGauge] = &[
    (
        "outpost_outbox_records",
        "Unacknowledged records in the outbox",
        |o| Some(o.records as f64),
    ),
    (
        "outpost_outbox_bytes",
        "Bytes of unacknowledged records in the outbox",
        |o| Some(o.bytes as f64),
    ),
    ("outpost_outbox_max_bytes", "Outbox size bound", |o| {
        Some(o.max_bytes as f64)
    }),
    (
        "outpost_outbox_oldest_age_seconds",
        "Age of the oldest unacknowledged record",
        |o| o.oldest_age.map(|a| a.as_secs_f64()),
    ),
    (
        "outpost_outbox_dead_letters",
        "Records in the dead-letter tree",
        |o| Some(o.dead_letters as f64),
    ),
    (
        "outpost_outbox_unavailable",
        "1 while the outbox cannot write (disk full, read-only, I/O error) and recovers",
        |o| Some(f64::from(u8::from(o.unavailable.is_some()))),
    ),
    (
        "outpost_outbox_read_only",
        "1 while the disk refuses writes (read-only, I/O errors) and new records are held in memory",
        |o| Some(f64::from(u8::from(o.held.holding))),
    ),
    (
        "outpost_outbox_held_records",
        "Records held in memory while the disk refuses writes",
        |o| Some(o.held.records as f64),
    ),
    (
        "outpost_outbox_held_bytes",
        "Bytes of the records held in memory while the disk refuses writes",
        |o| Some(o.held.bytes as f64),
    ),
];

/// Outbox counters, no labels.
const OUTBOX_COUNTERS: &[OutboxCounter] = &[
    (
        "outpost_outbox_appended",
        "Records appended since start",
        |o| o.appended_total,
    ),
    (
        "outpost_outbox_acked",
        "Records acknowledged by the fleet and deleted since start",
        |o| o.acked_total,
    ),
    (
        "outpost_outbox_flushes",
        "Group commits (flush and fsync)",
        |o| o.flushes_total,
    ),
    ("outpost_outbox_flush_errors", "Failed group commits", |o| {
        o.flush_errors_total
    }),
    (
        "outpost_outbox_reopens",
        "Outbox databases reopened after a write error",
        |o| o.reopens_total,
    ),
    (
        "outpost_outbox_lost",
        "Records appended before a write error that a reopen could not put back",
        |o| o.lost_total,
    ),
    (
        "outpost_outbox_quarantined",
        "Damaged databases moved aside at start",
        |o| o.quarantined_total,
    ),
];

/// GPU gauges, labelled `gpu` and `name`; a family is written only when
/// some GPU reports its value (values the hardware does not report are absent).
const GPU_GAUGES: &[GpuGauge] = &[
    (
        "outpost_gpu_utilization_ratio",
        "GPU utilisation, 0..1",
        |g| g.utilization,
    ),
    ("outpost_gpu_memory_used_bytes", "GPU memory in use", |g| {
        g.memory_used_bytes.map(|b| b as f64)
    }),
    ("outpost_gpu_memory_free_bytes", "GPU memory free", |g| {
        g.memory_free_bytes.map(|b| b as f64)
    }),
    ("outpost_gpu_memory_total_bytes", "GPU memory in all", |g| {
        g.memory_total_bytes.map(|b| b as f64)
    }),
    ("outpost_gpu_temperature_celsius", "GPU temperature", |g| {
        g.temperature_celsius
    }),
];

fn pipeline_labels(p: &Pipeline) -> Labels {
    vec![("pipeline", p.name().to_string())]
}

fn pipeline_model_labels(p: &Pipeline) -> Labels {
    vec![
        ("pipeline", p.name().to_string()),
        ("model", p.model().id()),
        ("provider", p.model().provider.as_str().to_string()),
    ]
}

pub struct DaemonCollector {
    /// The current generation's scheduler (replaced on reload).
    pub scheduler: Arc<arc_swap::ArcSwap<Scheduler>>,
    pub outbox: Outbox,
    pub extra: Vec<Arc<dyn MetricSource>>,
}

impl std::fmt::Debug for DaemonCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DaemonCollector")
    }
}

fn histogram(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, &LatencyHistogram)],
    scale: f64,
    buckets: &[f64],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Histogram)?;
    for (labels, h) in rows {
        let (sum, count, cumulative) = h.buckets(buckets, scale);
        let mut fam = m.encode_family(labels)?;
        fam.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            sum,
            count,
            &cumulative,
            None,
        )?;
    }
    Ok(())
}

impl Collector for DaemonCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sched = self.scheduler.load_full();
        pipeline_metrics(&mut enc, &sched)?;
        stage_metrics(&mut enc, sched.pipelines())?;
        camera_metrics(&mut enc, sched.pipelines())?;
        feed_metrics(&mut enc, sched.pipelines())?;
        motion_metrics(&mut enc, sched.pipelines())?;
        model_info(&mut enc, sched.pipelines())?;
        outbox_metrics(&mut enc, &self.outbox.stats())?;
        crate::clock::ClockMetrics.encode(&mut enc)?;
        for s in &self.extra {
            s.encode(&mut enc)?;
        }
        process_metrics(&mut enc)?;
        let d = device::sample();
        if !d.temperatures.is_empty() {
            gauge(
                &mut enc,
                "outpost_device_temperature_celsius",
                "Thermal zones reported by the device",
                &d.temperatures
                    .iter()
                    .map(|(z, t)| (vec![("zone", z.clone())], *t))
                    .collect::<Vec<_>>(),
            )?;
        }
        gpu_metrics(&mut enc, &d.gpus)
    }
}

/// Per pipeline: frames, drops, local outputs, queues, latencies.
fn pipeline_metrics(enc: &mut DescriptorEncoder, sched: &Scheduler) -> Result<(), std::fmt::Error> {
    let pipes = sched.pipelines();
    for (name, help, value) in PIPELINE_COUNTERS {
        let rows: Vec<_> = pipes
            .iter()
            .map(|p| (pipeline_labels(p), value(p)))
            .collect();
        counter(enc, name, help, &rows)?;
    }
    let mut drops = Vec::new();
    for p in pipes {
        for (reason, n) in p.stats.drops() {
            let mut l = pipeline_labels(p);
            l.push(("reason", reason.to_string()));
            drops.push((l, n));
        }
    }
    counter(
        enc,
        "outpost_frames_dropped",
        "Frames dropped, by reason",
        &drops,
    )?;
    let mut evicted = Vec::new();
    for p in pipes {
        let h = p.streams_held();
        for (reason, n) in [("lru", h.evicted_lru), ("idle", h.evicted_idle)] {
            let mut l = pipeline_labels(p);
            l.push(("reason", reason.to_string()));
            evicted.push((l, n));
        }
    }
    counter(
        enc,
        "outpost_streams_evicted",
        "Streams whose state was reset: lru = least recently seen when a new one needed room, idle = not seen for stream_idle",
        &evicted,
    )?;
    super::track_metrics::encode(enc, pipes)?;
    let (mut sent, mut dropped, mut connected) = (Vec::new(), Vec::new(), Vec::new());
    let (mut readers, mut readers_refused) = (Vec::new(), Vec::new());
    for p in pipes {
        for (output, kind, up, st) in p.outputs().stats() {
            let mut l = pipeline_labels(p);
            l.push(("output", output.to_string()));
            sent.push((l.clone(), get(&st.sent)));
            connected.push((l.clone(), if up { 1.0 } else { 0.0 }));
            for (reason, n) in st.drops() {
                let mut l = l.clone();
                l.push(("reason", reason.to_string()));
                dropped.push((l, n));
            }
            if kind == "unix" {
                readers.push((l.clone(), get(&st.readers) as f64));
                for reason in ["max_readers", "descriptors"] {
                    let n = st.readers_refused().get(reason).copied().unwrap_or(0);
                    let mut l = l.clone();
                    l.push(("reason", reason.to_string()));
                    readers_refused.push((l, n));
                }
            }
        }
    }
    #[cfg(feature = "modbus")]
    {
        let mut rows = Vec::new();
        for p in pipes {
            for (output, report) in p.outputs().modbus_reports() {
                let mut l = pipeline_labels(p);
                l.push(("output", output.to_string()));
                rows.push((l, report));
            }
        }
        crate::floor::output_metrics(enc, &rows)?;
    }
    gauge(
        enc,
        "outpost_output_readers",
        "Readers connected to a unix output",
        &readers,
    )?;
    counter(
        enc,
        "outpost_output_readers_refused",
        "Readers a unix output closed at once, by reason (max_readers, descriptors)",
        &readers_refused,
    )?;
    counter(
        enc,
        "outpost_output_sent",
        "Records handed to a local output (MQTT queued, UDP sent, unix written to a reader)",
        &sent,
    )?;
    counter(
        enc,
        "outpost_output_dropped",
        "Records a local output dropped, by reason",
        &dropped,
    )?;
    gauge(
        enc,
        "outpost_output_connected",
        "1 while a local output has its peer (MQTT connected, UDP open, a unix reader)",
        &connected,
    )?;
    for (name, help, value) in PIPELINE_GAUGES {
        let rows: Vec<_> = (0..pipes.len())
            .map(|i| (pipeline_labels(&pipes[i]), value(sched, i)))
            .collect();
        gauge(enc, name, help, &rows)?;
    }
    for h in PIPELINE_HISTOGRAMS {
        let rows: Vec<_> = pipes
            .iter()
            .filter_map(|p| (h.histogram)(p).map(|v| ((h.labels)(p), v)))
            .collect();
        histogram(enc, h.name, h.help, &rows, h.scale, h.buckets)?;
    }
    Ok(())
}

/// Cascade stages, per pipeline and stage model.
fn stage_metrics(
    enc: &mut DescriptorEncoder,
    pipes: &[Arc<Pipeline>],
) -> Result<(), std::fmt::Error> {
    let stages: Vec<(Labels, &StageStats)> = pipes
        .iter()
        .flat_map(|p| {
            p.stage_stats().into_iter().map(|(model, st)| {
                let mut l = pipeline_labels(p);
                l.push(("stage", model));
                (l, st)
            })
        })
        .collect();
    for (name, help, h, scale, buckets) in STAGE_HISTOGRAMS {
        let rows: Vec<_> = stages.iter().map(|(l, st)| (l.clone(), h(st))).collect();
        histogram(enc, name, help, &rows, *scale, buckets)?;
    }
    for (name, help, value) in STAGE_COUNTERS {
        let rows: Vec<_> = stages
            .iter()
            .map(|(l, st)| (l.clone(), value(st)))
            .collect();
        counter(enc, name, help, &rows)?;
    }
    Ok(())
}

/// Per camera: state, frames in / processed / dropped by reason, reconnects.
/// No camera pipeline: no camera family.
fn camera_metrics(
    enc: &mut DescriptorEncoder,
    pipes: &[Arc<Pipeline>],
) -> Result<(), std::fmt::Error> {
    let cams: Vec<_> = pipes
        .iter()
        .filter_map(|p| p.stats.camera.as_ref().map(|c| (p, c)))
        .collect();
    if cams.is_empty() {
        return Ok(());
    }
    gauge(
        enc,
        "outpost_camera_up",
        "1 while the camera streams, 0 while it reconnects",
        &cams
            .iter()
            .map(|(p, c)| (pipeline_labels(p), if c.is_up() { 1.0 } else { 0.0 }))
            .collect::<Vec<_>>(),
    )?;
    for (name, help, value) in CAMERA_COUNTERS {
        let rows: Vec<_> = cams
            .iter()
            .map(|(p, c)| (pipeline_labels(p), value(p, c)))
            .collect();
        counter(enc, name, help, &rows)?;
    }
    let mut drops = Vec::new();
    for (p, c) in &cams {
        for (reason, n) in c.drops(&p.stats.drops()) {
            let mut l = pipeline_labels(p);
            l.push(("reason", reason));
            drops.push((l, n));
        }
    }
    counter(
        enc,
        "outpost_camera_frames_dropped",
        "Camera frames not processed, by reason (fps: subsampled; stale: replaced by a newer frame)",
        &drops,
    )
}

/// Per camera of a pipeline reading several, labelled `pipeline` and
/// `camera`: frames in, done and dropped (by reason), fps achieved, frame
/// age, state, open tracks. No such pipeline: no family.
/// The motion gates' counts: per pipeline that has one, and per camera of
/// such a pipeline.
fn motion_metrics(
    enc: &mut DescriptorEncoder,
    pipes: &[Arc<Pipeline>],
) -> Result<(), std::fmt::Error> {
    type Pick = fn(&crate::pipeline::motion::MotionCounts) -> u64;
    const FAMILIES: [(&str, &str, Pick); 3] = [
        (
            "motion_frames_still",
            "Camera frames without motion or moving tracks: the detector did not run",
            |m| get(&m.frames_still),
        ),
        (
            "motion_detector_runs",
            "Camera frames the motion gate let the detector run on (whole or as crops)",
            |m| get(&m.detector_runs),
        ),
        (
            "motion_regions",
            "Crops of moving regions the detector ran on (regions = true)",
            |m| get(&m.regions),
        ),
    ];
    let gated: Vec<_> = pipes
        .iter()
        .filter_map(|p| Some((p, p.motion()?)))
        .collect();
    if gated.is_empty() {
        return Ok(());
    }
    for (name, help, pick) in FAMILIES {
        let rows: Vec<(Labels, u64)> = gated
            .iter()
            .map(|(p, m)| (pipeline_labels(p), pick(&m.counts)))
            .collect();
        counter(enc, &format!("outpost_{name}"), help, &rows)?;
        let rows: Vec<(Labels, u64)> = gated
            .iter()
            .flat_map(|(p, _)| {
                p.stats.cameras.0.iter().map(move |c| {
                    (
                        vec![
                            ("pipeline", p.name().to_string()),
                            ("camera", c.name.to_string()),
                        ],
                        pick(&c.motion),
                    )
                })
            })
            .collect();
        if !rows.is_empty() {
            counter(
                enc,
                &format!("outpost_pipeline_camera_{name}"),
                &format!("{help}, per camera of a pipeline reading several"),
                &rows,
            )?;
        }
    }
    Ok(())
}

fn feed_metrics(
    enc: &mut DescriptorEncoder,
    pipes: &[Arc<Pipeline>],
) -> Result<(), std::fmt::Error> {
    let feeds: Vec<_> = pipes
        .iter()
        .flat_map(|p| p.stats.cameras.0.iter().map(move |c| (p, c)))
        .collect();
    if feeds.is_empty() {
        return Ok(());
    }
    let labels = |p: &Pipeline, c: &crate::pipeline::cameras::CameraFeed| {
        vec![
            ("pipeline", p.name().to_string()),
            ("camera", c.name.to_string()),
        ]
    };
    let rows = |f: &dyn Fn(&Pipeline, &crate::pipeline::cameras::CameraFeed) -> u64| {
        feeds
            .iter()
            .map(|(p, c)| (labels(p, c), f(p, c)))
            .collect::<Vec<_>>()
    };
    counter(
        enc,
        "outpost_pipeline_camera_frames_in",
        "Frames of a camera offered to the pipeline reading it among others",
        &rows(&|_, c| get(&c.frames_in)),
    )?;
    counter(
        enc,
        "outpost_pipeline_camera_frames_done",
        "Frames of a camera the pipeline finished",
        &rows(&|_, c| get(&c.frames_done)),
    )?;
    let mut drops = Vec::new();
    for (p, c) in &feeds {
        for (reason, n) in c.drops() {
            let mut l = labels(p, c);
            l.push(("reason", reason.to_string()));
            drops.push((l, n));
        }
    }
    counter(
        enc,
        "outpost_pipeline_camera_frames_dropped",
        "Frames of a camera not processed, by reason (fps: subsampled; stale: replaced by its newer frame)",
        &drops,
    )?;
    gauge(
        enc,
        "outpost_pipeline_camera_fps",
        "Frames of a camera done per second, over its last few",
        &feeds
            .iter()
            .map(|(p, c)| (labels(p, c), c.fps().unwrap_or(0.0)))
            .collect::<Vec<_>>(),
    )?;
    gauge(
        enc,
        "outpost_pipeline_camera_up",
        "1 while the camera streams, 0 otherwise",
        &feeds
            .iter()
            .map(|(p, c)| (labels(p, c), if c.state.is_up() { 1.0 } else { 0.0 }))
            .collect::<Vec<_>>(),
    )?;
    let tracked: Vec<_> = feeds
        .iter()
        .filter_map(|(p, c)| {
            let t = p.tracking()?;
            Some((labels(p, c), t.open_tracks(&c.name) as f64))
        })
        .collect();
    if !tracked.is_empty() {
        gauge(
            enc,
            "outpost_pipeline_camera_tracks_open",
            "Confirmed tracks open now on a camera",
            &tracked,
        )?;
    }
    histogram(
        enc,
        "outpost_pipeline_camera_frame_age_seconds",
        "Frame capture to done, per camera",
        &feeds
            .iter()
            .map(|(p, c)| (labels(p, c), &c.frame_age_us))
            .collect::<Vec<_>>(),
        US,
        &BUCKETS_S,
    )
}

/// One info row per loaded model.
fn model_info(enc: &mut DescriptorEncoder, pipes: &[Arc<Pipeline>]) -> Result<(), std::fmt::Error> {
    let mut seen = std::collections::BTreeSet::new();
    let mut info = Vec::new();
    for p in pipes {
        if seen.insert(p.model().id()) {
            info.push((
                vec![
                    ("model", p.model().manifest.name.clone()),
                    ("version", p.model().manifest.version.clone()),
                    ("provider", p.model().provider.as_str().to_string()),
                ],
                1.0,
            ));
        }
    }
    gauge(
        enc,
        "outpost_model_info",
        "Loaded models with their version and execution provider",
        &info,
    )
}

fn outbox_metrics(enc: &mut DescriptorEncoder, o: &OutboxStats) -> Result<(), std::fmt::Error> {
    for (name, help, value) in OUTBOX_GAUGES {
        if let Some(v) = value(o) {
            gauge(enc, name, help, &[(Vec::new(), v)])?;
        }
    }
    for (name, help, value) in OUTBOX_COUNTERS {
        counter(enc, name, help, &[(Vec::new(), value(o))])?;
    }
    counter(
        enc,
        "outpost_outbox_dropped",
        "Records dropped by the outbox's bounds (max_bytes; memory_when_read_only while the disk is read-only), by reason",
        &o.dropped
            .by_reason()
            .iter()
            .map(|(r, n)| (vec![("reason", r.to_string())], *n))
            .collect::<Vec<_>>(),
    )
}

/// The daemon process: what the system reports of it.
fn process_metrics(enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
    let p = device::process();
    if let Some(rss) = p.resident_bytes {
        gauge(
            enc,
            "outpost_process_resident_memory_bytes",
            "Resident memory of the daemon",
            &[(Vec::new(), rss as f64)],
        )?;
    }
    if let Some(cpu) = p.cpu_seconds {
        // A float counter: `counter` writes integers.
        let mut m = enc.encode_descriptor(
            "outpost_process_cpu_seconds",
            "CPU time used by the daemon",
            None,
            MetricType::Counter,
        )?;
        ConstCounter::new(cpu).encode(m.encode_family(&Labels::new())?)?;
    }
    if let Some(bytes) = p.written_bytes {
        counter(
            enc,
            "outpost_process_written_bytes",
            "Bytes the daemon caused to be written to storage (write_bytes of /proc/self/io): the flash's wear, the outbox's log above all",
            &[(Vec::new(), bytes)],
        )?;
    }
    Ok(())
}

fn gpu_metrics(enc: &mut DescriptorEncoder, gpus: &[device::Gpu]) -> Result<(), std::fmt::Error> {
    for (name, help, value) in GPU_GAUGES {
        let rows: Vec<_> = gpus
            .iter()
            .filter_map(|g| {
                value(g).map(|v| {
                    (
                        vec![("gpu", g.index.to_string()), ("name", g.name.clone())],
                        v,
                    )
                })
            })
            .collect();
        if !rows.is_empty() {
            gauge(enc, name, help, &rows)?;
        }
    }
    Ok(())
}

/// A registry with the daemon's collector.
pub fn registry(collector: DaemonCollector) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(collector));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn help_lines(text: &str) -> Vec<&str> {
        text.lines().filter(|l| l.starts_with("# HELP ")).collect()
    }

    #[test]
    fn an_empty_scheduler_and_an_outbox_write_the_outbox_families_with_their_help() {
        let dir = tempfile::tempdir().unwrap();
        let outbox = Outbox::open(dir.path(), Default::default()).unwrap();
        let r = registry(DaemonCollector {
            scheduler: Arc::new(arc_swap::ArcSwap::from_pointee(Scheduler::new(Vec::new()))),
            outbox: outbox.clone(),
            extra: Vec::new(),
        });
        let text = crate::telemetry::metrics::render(&r);
        let help = help_lines(&text);
        for want in [
            "# HELP outpost_outbox_records Unacknowledged records in the outbox",
            "# HELP outpost_outbox_bytes Bytes of unacknowledged records in the outbox",
            "# HELP outpost_outbox_max_bytes Outbox size bound",
            "# HELP outpost_outbox_dead_letters Records in the dead-letter tree",
            "# HELP outpost_outbox_appended Records appended since start",
            "# HELP outpost_outbox_acked Records acknowledged by the fleet and deleted since start",
            "# HELP outpost_outbox_dropped Records dropped by the outbox's bounds (max_bytes; memory_when_read_only while the disk is read-only), by reason",
            "# HELP outpost_outbox_flushes Group commits (flush and fsync)",
            "# HELP outpost_outbox_flush_errors Failed group commits",
            "# HELP outpost_outbox_unavailable 1 while the outbox cannot write (disk full, read-only, I/O error) and recovers",
            "# HELP outpost_outbox_read_only 1 while the disk refuses writes (read-only, I/O errors) and new records are held in memory",
            "# HELP outpost_outbox_held_records Records held in memory while the disk refuses writes",
            "# HELP outpost_outbox_reopens Outbox databases reopened after a write error",
            "# HELP outpost_outbox_lost Records appended before a write error that a reopen could not put back",
            "# HELP outpost_outbox_quarantined Damaged databases moved aside at start",
            // Pipeline families are written without rows.
            "# HELP outpost_frames_in Frames received by the pipeline's source",
            "# HELP outpost_queue_depth Frames waiting in the pipeline's queue",
            "# HELP outpost_inference_latency_seconds Inference time per run (a batch counts once)",
            "# HELP outpost_stage_crops Crops a cascade stage ran through its model",
            "# HELP outpost_model_info Loaded models with their version and execution provider",
        ] {
            assert!(help.contains(&want), "no `{want}` in\n{text}");
        }
        for (line, kind) in [
            ("outpost_outbox_records 0.0", "gauge"),
            ("outpost_outbox_appended_total 0", "counter"),
            ("outpost_outbox_unavailable 0.0", "gauge"),
            ("outpost_outbox_read_only 0.0", "gauge"),
            ("outpost_outbox_held_bytes 0.0", "gauge"),
            (
                "outpost_outbox_dropped_total{reason=\"read_only\"} 0",
                "counter",
            ),
            (
                "outpost_outbox_dropped_total{reason=\"full_reject_new\"} 0",
                "counter",
            ),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "no {kind} `{line}` in\n{text}"
            );
        }
        // No record waits: no age. No camera pipeline: no camera family.
        assert!(
            !text.contains("outpost_outbox_oldest_age_seconds"),
            "{text}"
        );
        assert!(!text.contains("outpost_camera_"), "{text}");

        outbox.append("s", b"{}").unwrap();
        let text = crate::telemetry::metrics::render(&r);
        assert!(
            help_lines(&text).contains(
                &"# HELP outpost_outbox_oldest_age_seconds Age of the oldest unacknowledged record"
            ),
            "{text}"
        );
        assert!(
            text.contains("\noutpost_outbox_appended_total 1\n"),
            "{text}"
        );
    }

    #[derive(Debug)]
    struct Gpus(Vec<device::Gpu>);

    impl Collector for Gpus {
        fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            gpu_metrics(&mut enc, &self.0)
        }
    }

    fn gpu_text(gpus: Vec<device::Gpu>) -> String {
        let mut r = Registry::default();
        r.register_collector(Box::new(Gpus(gpus)));
        crate::telemetry::metrics::render(&r)
    }

    #[test]
    fn a_gpu_family_is_written_only_when_some_gpu_reports_it() {
        let bare = |index: u32| device::Gpu {
            index,
            name: format!("gpu{index}"),
            ..Default::default()
        };
        assert!(!gpu_text(vec![bare(0)]).contains("outpost_gpu"));

        let text = gpu_text(vec![
            bare(0),
            device::Gpu {
                utilization: Some(0.5),
                memory_total_bytes: Some(1024),
                ..bare(1)
            },
        ]);
        assert_eq!(
            help_lines(&text),
            [
                "# HELP outpost_gpu_utilization_ratio GPU utilisation, 0..1",
                "# HELP outpost_gpu_memory_total_bytes GPU memory in all",
            ],
            "{text}"
        );
        assert!(
            text.contains("\noutpost_gpu_utilization_ratio{gpu=\"1\",name=\"gpu1\"} 0.5\n"),
            "{text}"
        );
        assert!(
            text.contains("\noutpost_gpu_memory_total_bytes{gpu=\"1\",name=\"gpu1\"} 1024.0\n"),
            "{text}"
        );
        assert!(!text.contains("gpu=\"0\""), "{text}");
    }
}
