//! The daemon's metrics collector: reads the pipelines, the outbox and the
//! machine at scrape time (components keep their own counters; nothing is
//! kept twice), plus every registered [`MetricSource`]. Served at `/metrics`.

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::registry::Registry;

use crate::outbox::Outbox;
use crate::pipeline::{LatencyHistogram, PipelineStats, Scheduler};
use crate::telemetry::device;
use crate::telemetry::metrics::{Labels, MetricSource, counter, gauge};

/// Latency buckets, seconds: 50 µs .. 10 s.
const BUCKETS_S: [f64; 17] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
];

/// Batch-size buckets.
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

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
        let pipes = sched.pipelines();
        let pl =
            |p: &crate::pipeline::Pipeline| -> Labels { vec![("pipeline", p.name().to_string())] };
        let plm = |p: &crate::pipeline::Pipeline| -> Labels {
            vec![
                ("pipeline", p.name().to_string()),
                ("model", p.model().id()),
                ("provider", p.model().provider.as_str().to_string()),
            ]
        };
        let get = PipelineStats::get;
        counter(
            &mut enc,
            "outpost_frames_in",
            "Frames received by the pipeline's source",
            &pipes
                .iter()
                .map(|p| (pl(p), get(&p.stats.frames_in)))
                .collect::<Vec<_>>(),
        )?;
        counter(
            &mut enc,
            "outpost_frames_processed",
            "Frames taken through decode, inference and postprocessing",
            &pipes
                .iter()
                .map(|p| (pl(p), get(&p.stats.frames_done)))
                .collect::<Vec<_>>(),
        )?;
        counter(
            &mut enc,
            "outpost_records",
            "Result records stored in the outbox",
            &pipes
                .iter()
                .map(|p| (pl(p), get(&p.stats.records)))
                .collect::<Vec<_>>(),
        )?;
        let mut drops = Vec::new();
        for p in pipes {
            for (reason, n) in p.stats.drops() {
                drops.push((
                    vec![
                        ("pipeline", p.name().to_string()),
                        ("reason", reason.to_string()),
                    ],
                    n,
                ));
            }
        }
        counter(
            &mut enc,
            "outpost_frames_dropped",
            "Frames dropped, by reason",
            &drops,
        )?;
        let (mut sent, mut dropped, mut connected) = (Vec::new(), Vec::new(), Vec::new());
        for p in pipes {
            for (output, _, up, st) in p.outputs().stats() {
                let l = vec![
                    ("pipeline", p.name().to_string()),
                    ("output", output.to_string()),
                ];
                sent.push((
                    l.clone(),
                    st.sent.load(std::sync::atomic::Ordering::Relaxed),
                ));
                connected.push((l.clone(), if up { 1.0 } else { 0.0 }));
                for (reason, n) in st.drops() {
                    let mut l = l.clone();
                    l.push(("reason", reason.to_string()));
                    dropped.push((l, n));
                }
            }
        }
        counter(
            &mut enc,
            "outpost_output_sent",
            "Records handed to a local output (MQTT queued, UDP sent, unix written to a reader)",
            &sent,
        )?;
        counter(
            &mut enc,
            "outpost_output_dropped",
            "Records a local output dropped, by reason",
            &dropped,
        )?;
        gauge(
            &mut enc,
            "outpost_output_connected",
            "1 while a local output has its peer (MQTT connected, UDP open, a unix reader)",
            &connected,
        )?;
        gauge(
            &mut enc,
            "outpost_queue_depth",
            "Frames waiting in the pipeline's queue",
            &pipes
                .iter()
                .enumerate()
                .map(|(i, p)| (pl(p), sched.queue_depth(i) as f64))
                .collect::<Vec<_>>(),
        )?;
        gauge(
            &mut enc,
            "outpost_queue_capacity",
            "Capacity of the pipeline's queue",
            &pipes
                .iter()
                .map(|p| (pl(p), p.cfg.queue as f64))
                .collect::<Vec<_>>(),
        )?;
        histogram(
            &mut enc,
            "outpost_inference_latency_seconds",
            "Inference time per run (a batch counts once)",
            &pipes
                .iter()
                .map(|p| (plm(p), &p.stats.inference_us))
                .collect::<Vec<_>>(),
            1e-6,
            &BUCKETS_S,
        )?;
        histogram(
            &mut enc,
            "outpost_e2e_latency_seconds",
            "Frame arrival to result record",
            &pipes
                .iter()
                .map(|p| (plm(p), &p.stats.e2e_us))
                .collect::<Vec<_>>(),
            1e-6,
            &BUCKETS_S,
        )?;
        histogram(
            &mut enc,
            "outpost_queue_wait_seconds",
            "Frame arrival until an inference worker takes it",
            &pipes
                .iter()
                .map(|p| (plm(p), &p.stats.queue_us))
                .collect::<Vec<_>>(),
            1e-6,
            &BUCKETS_S,
        )?;
        // Cascade stages, per pipeline and stage model.
        let stage_rows: Vec<(Labels, &crate::pipeline::stages::StageStats)> = pipes
            .iter()
            .flat_map(|p| {
                p.stage_stats().into_iter().map(|(model, st)| {
                    (
                        vec![("pipeline", p.name().to_string()), ("stage", model)],
                        st,
                    )
                })
            })
            .collect();
        histogram(
            &mut enc,
            "outpost_stage_latency_seconds",
            "A cascade stage's work on one frame (crops, inference, postprocessing)",
            &stage_rows
                .iter()
                .map(|(l, st)| (l.clone(), &st.latency_us))
                .collect::<Vec<_>>(),
            1e-6,
            &BUCKETS_S,
        )?;
        for (name, help, f) in [
            (
                "outpost_stage_crops",
                "Crops a cascade stage ran through its model",
                (|st: &crate::pipeline::stages::StageStats| PipelineStats::get(&st.crops))
                    as fn(&crate::pipeline::stages::StageStats) -> u64,
            ),
            (
                "outpost_stage_boxes_capped",
                "Boxes a cascade stage left out (more than its max_boxes)",
                |st| PipelineStats::get(&st.capped),
            ),
            (
                "outpost_stage_errors",
                "Frames on which a cascade stage failed",
                |st| PipelineStats::get(&st.errors),
            ),
        ] {
            counter(
                &mut enc,
                name,
                help,
                &stage_rows
                    .iter()
                    .map(|(l, st)| (l.clone(), f(st)))
                    .collect::<Vec<_>>(),
            )?;
        }
        histogram(
            &mut enc,
            "outpost_batch_size",
            "Items per inference run",
            &pipes
                .iter()
                .map(|p| (plm(p), &p.stats.batch_sizes))
                .collect::<Vec<_>>(),
            1.0,
            &BATCH_BUCKETS,
        )?;

        histogram(
            &mut enc,
            "outpost_frame_age_seconds",
            "Frame capture to result record (cameras)",
            &pipes
                .iter()
                .filter(|p| p.stats.camera.is_some())
                .map(|p| (pl(p), &p.stats.frame_age_us))
                .collect::<Vec<_>>(),
            1e-6,
            &BUCKETS_S,
        )?;
        camera_metrics(&mut enc, pipes)?;

        // Models: one info row per loaded model.
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
            &mut enc,
            "outpost_model_info",
            "Loaded models with their version and execution provider",
            &info,
        )?;

        // Outbox.
        let o = self.outbox.stats();
        let none: Labels = Vec::new();
        gauge(
            &mut enc,
            "outpost_outbox_records",
            "Unacknowledged records in the outbox",
            &[(none.clone(), o.records as f64)],
        )?;
        gauge(
            &mut enc,
            "outpost_outbox_bytes",
            "Bytes of unacknowledged records in the outbox",
            &[(none.clone(), o.bytes as f64)],
        )?;
        gauge(
            &mut enc,
            "outpost_outbox_max_bytes",
            "Outbox size bound",
            &[(none.clone(), o.max_bytes as f64)],
        )?;
        if let Some(age) = o.oldest_age {
            gauge(
                &mut enc,
                "outpost_outbox_oldest_age_seconds",
                "Age of the oldest unacknowledged record",
                &[(none.clone(), age.as_secs_f64())],
            )?;
        }
        gauge(
            &mut enc,
            "outpost_outbox_dead_letters",
            "Records in the dead-letter tree",
            &[(none.clone(), o.dead_letters as f64)],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_appended",
            "Records appended since start",
            &[(none.clone(), o.appended_total)],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_acked",
            "Records acknowledged by the fleet and deleted since start",
            &[(none.clone(), o.acked_total)],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_dropped",
            "Records dropped by the outbox's size bound, by reason",
            &o.dropped
                .by_reason()
                .iter()
                .map(|(r, n)| (vec![("reason", r.to_string())], *n))
                .collect::<Vec<_>>(),
        )?;
        counter(
            &mut enc,
            "outpost_outbox_flushes",
            "Group commits (flush and fsync)",
            &[(none.clone(), o.flushes_total)],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_flush_errors",
            "Failed group commits",
            &[(none.clone(), o.flush_errors_total)],
        )?;
        gauge(
            &mut enc,
            "outpost_outbox_unavailable",
            "1 while the outbox refuses records (disk full, I/O error) and recovers",
            &[(none.clone(), f64::from(u8::from(o.unavailable.is_some())))],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_reopens",
            "Outbox databases reopened after a write error",
            &[(none.clone(), o.reopens_total)],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_lost",
            "Records appended before a write error that a reopen could not put back",
            &[(none.clone(), o.lost_total)],
        )?;
        counter(
            &mut enc,
            "outpost_outbox_quarantined",
            "Damaged databases moved aside at start",
            &[(none.clone(), o.quarantined_total)],
        )?;

        for s in &self.extra {
            s.encode(&mut enc)?;
        }

        // Process and device.
        let p = device::process();
        if let Some(rss) = p.resident_bytes {
            gauge(
                &mut enc,
                "outpost_process_resident_memory_bytes",
                "Resident memory of the daemon",
                &[(none.clone(), rss as f64)],
            )?;
        }
        if let Some(cpu) = p.cpu_seconds {
            let mut m = enc.encode_descriptor(
                "outpost_process_cpu_seconds",
                "CPU time used by the daemon",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(m.encode_family(&none)?)?;
        }
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
        if !d.gpus.is_empty() {
            let lab =
                |g: &device::Gpu| vec![("gpu", g.index.to_string()), ("name", g.name.clone())];
            let util: Vec<_> = d
                .gpus
                .iter()
                .filter_map(|g| g.utilization.map(|u| (lab(g), u)))
                .collect();
            if !util.is_empty() {
                gauge(
                    &mut enc,
                    "outpost_gpu_utilization_ratio",
                    "GPU utilisation, 0..1",
                    &util,
                )?;
            }
            let used: Vec<_> = d
                .gpus
                .iter()
                .filter_map(|g| g.memory_used_bytes.map(|u| (lab(g), u as f64)))
                .collect();
            if !used.is_empty() {
                gauge(
                    &mut enc,
                    "outpost_gpu_memory_used_bytes",
                    "GPU memory in use",
                    &used,
                )?;
            }
            let free: Vec<_> = d
                .gpus
                .iter()
                .filter_map(|g| g.memory_free_bytes.map(|u| (lab(g), u as f64)))
                .collect();
            if !free.is_empty() {
                gauge(
                    &mut enc,
                    "outpost_gpu_memory_free_bytes",
                    "GPU memory free",
                    &free,
                )?;
            }
            let total: Vec<_> = d
                .gpus
                .iter()
                .filter_map(|g| g.memory_total_bytes.map(|u| (lab(g), u as f64)))
                .collect();
            if !total.is_empty() {
                gauge(
                    &mut enc,
                    "outpost_gpu_memory_total_bytes",
                    "GPU memory in all",
                    &total,
                )?;
            }
            let temp: Vec<_> = d
                .gpus
                .iter()
                .filter_map(|g| g.temperature_celsius.map(|t| (lab(g), t)))
                .collect();
            if !temp.is_empty() {
                gauge(
                    &mut enc,
                    "outpost_gpu_temperature_celsius",
                    "GPU temperature",
                    &temp,
                )?;
            }
        }
        Ok(())
    }
}

/// Per camera: state, frames in / processed / dropped by reason, reconnects.
fn camera_metrics(
    enc: &mut DescriptorEncoder,
    pipes: &[Arc<crate::pipeline::Pipeline>],
) -> Result<(), std::fmt::Error> {
    let cams: Vec<_> = pipes
        .iter()
        .filter_map(|p| p.stats.camera.as_ref().map(|c| (p, c)))
        .collect();
    if cams.is_empty() {
        return Ok(());
    }
    let pl = |p: &crate::pipeline::Pipeline| -> Labels { vec![("pipeline", p.name().to_string())] };
    let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    gauge(
        enc,
        "outpost_camera_up",
        "1 while the camera streams, 0 while it reconnects",
        &cams
            .iter()
            .map(|(p, c)| (pl(p), if c.is_up() { 1.0 } else { 0.0 }))
            .collect::<Vec<_>>(),
    )?;
    counter(
        enc,
        "outpost_camera_frames_in",
        "Decoded frames out of the camera (before fps subsampling)",
        &cams
            .iter()
            .map(|(p, c)| (pl(p), get(&c.frames_in)))
            .collect::<Vec<_>>(),
    )?;
    counter(
        enc,
        "outpost_camera_frames_processed",
        "Camera frames taken through inference",
        &cams
            .iter()
            .map(|(p, _)| (pl(p), get(&p.stats.frames_done)))
            .collect::<Vec<_>>(),
    )?;
    let mut drops = Vec::new();
    for (p, c) in &cams {
        for (reason, n) in c.drops(&p.stats.drops()) {
            drops.push((
                vec![("pipeline", p.name().to_string()), ("reason", reason)],
                n,
            ));
        }
    }
    counter(
        enc,
        "outpost_camera_frames_dropped",
        "Camera frames not processed, by reason (fps: subsampled; stale: replaced by a newer frame)",
        &drops,
    )?;
    counter(
        enc,
        "outpost_camera_reconnects",
        "Camera pipelines torn down and rebuilt",
        &cams
            .iter()
            .map(|(p, c)| (pl(p), get(&c.reconnects)))
            .collect::<Vec<_>>(),
    )
}

/// A registry with the daemon's collector.
pub fn registry(collector: DaemonCollector) -> Registry {
    let mut r = Registry::default();
    r.register_collector(Box::new(collector));
    r
}
