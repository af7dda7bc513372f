//! `/v1/status`: the daemon's state as one JSON document (the console's
//! ticks carry the same). Every field is always there; a figure the daemon
//! does not have is `null` (no uplink, no OTA, no camera, no meminfo), and an
//! empty latency summary is `{"count": 0}`.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use serde::Serialize;

use crate::backend::Provider;
use crate::backend::ort::Fallback;
use crate::ota::stats::OtaSummary;
use crate::output::OutputStatus;
use crate::pipeline::{LatencySummary, Pipeline, PipelineStats, Scheduler, StreamsHeld};
use crate::preprocess::PreprocessConfig;
use crate::source::camera::CameraReport;
use crate::uplink::UplinkStats;

use super::ApiState;

#[derive(Debug, Serialize)]
pub struct Status {
    pub device: String,
    pub daemon: DaemonStatus,
    pub boot: u64,
    pub ready: bool,
    pub pipelines: Vec<PipelineStatus>,
    /// Each camera once (a camera read by several pipelines is decoded
    /// once): its state, decoder and keyframe figures.
    pub cameras: Vec<CameraReport>,
    pub outbox: OutboxStatus,
    /// None: no uplink configured.
    pub uplink: Option<UplinkStatus>,
    /// None: OTA not configured.
    pub ota: Option<OtaStatus>,
    pub system: SystemStatus,
    /// Whether the system clock is trusted, and the last known good time.
    pub clock: crate::clock::ClockStatus,
    /// `[modbus_server]` and the modbus sources' PLC connections; None
    /// when the config has neither.
    pub modbus: Option<crate::floor::FloorStatus>,
    /// The OPC UA server: its address, sessions, logins and records (None:
    /// no `[opcua]`).
    pub opcua: Option<serde_json::Value>,
}

/// The running daemon: version and OTA slot (`package`: not from a slot).
#[derive(Debug, Clone, Serialize)]
pub struct DaemonStatus {
    pub version: String,
    pub slot: String,
}

#[derive(Debug, Serialize)]
pub struct PipelineStatus {
    pub name: String,
    /// The source's kind (`http`, `camera`, ...).
    pub source: &'static str,
    /// What the source says of itself (`started`, `streaming`, ...).
    pub source_state: &'static str,
    /// `image`, `audio`, `sensor`, or empty (no preprocessing).
    pub input: &'static str,
    pub priority: &'static str,
    /// `name@version`.
    pub model: String,
    pub provider: Provider,
    pub provider_fallbacks: Vec<Fallback>,
    pub queue_depth: usize,
    pub paused: bool,
    pub queue_capacity: usize,
    pub frames_in: u64,
    pub frames_done: u64,
    pub items: u64,
    pub records: u64,
    pub batches: u64,
    pub batch_items: u64,
    pub inference_us_total: u64,
    pub drops: BTreeMap<&'static str, u64>,
    /// Streams with state held, `max_streams`, and the evictions by reason.
    pub streams: StreamsHeld,
    pub outputs: Vec<OutputStatus>,
    pub e2e_latency: LatencySummary,
    pub inference_latency: LatencySummary,
    pub stage_latency: StageLatency,
    pub stages: Vec<StageStatus>,
    pub frame_age: LatencySummary,
    /// None: not a camera pipeline.
    pub camera: Option<CameraReport>,
    /// A pipeline reading several cameras: each one, in config order (its
    /// frames in and done, fps achieved, frame age, drops, last error,
    /// open tracks, and the camera itself).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cameras: Vec<crate::pipeline::cameras::CameraFeedReport>,
    /// Tracks, zone and line counts, the zones' and lines' geometry and the
    /// newest frame's tracked boxes; absent without `[pipelines.track]`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tracking: Option<TrackingStatus>,
    /// The motion gate's counts: frames still (the detector did not run),
    /// detector runs, crops run (`regions`); absent without a gate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub motion: Option<crate::pipeline::motion::MotionReport>,
}

/// A pipeline's tracking: its counts, and what the console draws.
#[derive(Debug, Serialize)]
pub struct TrackingStatus {
    #[serde(flatten)]
    pub counts: crate::track::TrackCounts,
    #[serde(flatten)]
    pub view: crate::track::TrackingView,
}

/// A frame's way through a pipeline, step by step.
#[derive(Debug, Serialize)]
pub struct StageLatency {
    pub queue: LatencySummary,
    pub decode: LatencySummary,
    pub inference: LatencySummary,
    pub output: LatencySummary,
}

/// One cascade stage.
#[derive(Debug, Serialize)]
pub struct StageStatus {
    /// `name@version` of the stage's model.
    pub model: String,
    pub crops: u64,
    pub boxes_capped: u64,
    pub errors: u64,
    /// The stage's work on one set of frames (crops, inference, postprocessing).
    pub latency: LatencySummary,
    /// The stage model's inference runs (batches of crops, of every frame
    /// of a set), the crops they held, and their time.
    pub batches: u64,
    pub batch_items: u64,
    pub inference_us_total: u64,
    pub inference_latency: LatencySummary,
}

#[derive(Debug, Serialize)]
pub struct OutboxStatus {
    pub records: u64,
    pub bytes: u64,
    /// None: no record waits.
    pub oldest_age_s: Option<f64>,
    pub dead_letters: u64,
    pub appended_total: u64,
    pub acked_total: u64,
    pub max_bytes: u64,
    /// Why records are refused now; None: storing.
    pub unavailable: Option<String>,
    pub reopens_total: u64,
    pub lost_total: u64,
    /// The disk refuses writes (read-only, I/O errors): new records are
    /// held in memory, stored ones still sent.
    pub read_only: bool,
    pub held_records: u64,
    pub held_bytes: u64,
    /// `memory_when_read_only`.
    pub held_max_bytes: u64,
    /// Records dropped beyond `held_max_bytes` since start.
    pub held_dropped_total: u64,
    /// The database is closed while read-only (every stored record was
    /// sent): the file system can be unmounted, checked and mounted again.
    pub store_closed: bool,
}

#[derive(Debug, Serialize)]
pub struct UplinkStatus {
    pub kind: &'static str,
    pub connected: bool,
    pub sent_total: u64,
    pub acked_total: u64,
    pub retries_total: u64,
    pub bytes_total: u64,
    pub dead_letters_total: u64,
    pub connects_total: u64,
    pub disconnects_total: u64,
    pub inflight: u64,
    pub errors_total: u64,
    /// None: no error yet.
    pub last_error: Option<UplinkError>,
}

#[derive(Debug, Serialize)]
pub struct UplinkError {
    pub message: String,
    /// Seconds since the error.
    pub age_s: f64,
}

/// The OTA agent's figures and the daemon it runs.
#[derive(Debug, Serialize)]
pub struct OtaStatus {
    #[serde(flatten)]
    pub summary: OtaSummary,
    pub daemon: DaemonStatus,
}

/// The machine: memory, load, temperatures, GPUs, and this process.
#[derive(Debug, Serialize)]
pub struct SystemStatus {
    pub cpus: usize,
    pub load1: Option<f64>,
    pub memory_total_bytes: Option<u64>,
    pub memory_available_bytes: Option<u64>,
    pub process_resident_bytes: Option<u64>,
    pub process_cpu_seconds: Option<f64>,
    pub temperatures: Vec<Temperature>,
    pub gpus: Vec<GpuStatus>,
}

#[derive(Debug, Serialize)]
pub struct Temperature {
    pub zone: String,
    pub celsius: f64,
}

#[derive(Debug, Serialize)]
pub struct GpuStatus {
    pub index: u32,
    pub name: String,
    pub utilization: Option<f64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_total_bytes: Option<u64>,
    pub temperature_celsius: Option<f64>,
}

impl Status {
    /// The daemon's state now.
    pub fn read(s: &ApiState) -> Status {
        let sched = s.scheduler();
        let pipelines = sched
            .pipelines()
            .iter()
            .enumerate()
            .map(|(i, p)| PipelineStatus::read(&sched, i, p))
            .collect();
        let mut cameras: Vec<CameraReport> = Vec::new();
        for c in sched.pipelines().iter().flat_map(|p| {
            p.stats
                .camera
                .iter()
                .chain(p.stats.cameras.0.iter().map(|f| &f.state))
        }) {
            let r = c.camera_status();
            if !cameras.iter().any(|k| k.same_camera(&r)) {
                cameras.push(r);
            }
        }
        let daemon = DaemonStatus {
            version: s.daemon.0.clone(),
            slot: s.daemon.1.clone(),
        };
        Status {
            device: s.device.clone(),
            daemon: daemon.clone(),
            boot: s.boot,
            ready: s.ready.load(Ordering::SeqCst),
            pipelines,
            cameras,
            outbox: OutboxStatus::read(&s.outbox.stats()),
            uplink: s.uplink.as_deref().map(UplinkStatus::read),
            ota: s.ota.as_ref().map(|o| OtaStatus {
                summary: o.summary(),
                daemon,
            }),
            system: SystemStatus::read(),
            clock: crate::clock::status(),
            modbus: s.floor.status(),
            opcua: s.opcua.as_ref().map(|o| o.status()),
        }
    }
}

impl PipelineStatus {
    fn read(sched: &Scheduler, i: usize, p: &Pipeline) -> PipelineStatus {
        let st = &p.stats;
        let get = PipelineStats::get;
        let model = p.model();
        let input = match p
            .cfg
            .preprocess
            .as_ref()
            .or(model.manifest.preprocess.as_ref())
        {
            Some(PreprocessConfig::Image { .. } | PreprocessConfig::Pyramid { .. }) => "image",
            Some(PreprocessConfig::Audio { .. }) => "audio",
            Some(PreprocessConfig::Sensor { .. }) => "sensor",
            Some(PreprocessConfig::None) | None => "",
        };
        PipelineStatus {
            name: p.name().to_string(),
            source: p.cfg.source.kind(),
            source_state: st.source_state(),
            input,
            priority: p.cfg.priority.as_str(),
            model: model.id(),
            provider: model.provider,
            provider_fallbacks: model.fallbacks.clone(),
            queue_depth: sched.queue_depth(i),
            paused: sched.is_paused(i),
            queue_capacity: p.cfg.queue,
            frames_in: get(&st.frames_in),
            frames_done: get(&st.frames_done),
            items: get(&st.items),
            records: get(&st.records),
            batches: get(&st.runs.batches),
            batch_items: get(&st.runs.batch_items),
            inference_us_total: get(&st.runs.inference_us_total),
            drops: st.drops(),
            streams: p.streams_held(),
            outputs: p.outputs().status(),
            e2e_latency: st.e2e_us.summary(),
            inference_latency: st.runs.inference_us.summary(),
            stage_latency: StageLatency {
                queue: st.queue_us.summary(),
                decode: st.decode_us.summary(),
                inference: st.runs.inference_us.summary(),
                output: st.output_us.summary(),
            },
            stages: p
                .stage_stats()
                .into_iter()
                .map(|(model, ss)| StageStatus {
                    model,
                    crops: get(&ss.crops),
                    boxes_capped: get(&ss.capped),
                    errors: get(&ss.errors),
                    latency: ss.latency_us.summary(),
                    batches: get(&ss.runs.batches),
                    batch_items: get(&ss.runs.batch_items),
                    inference_us_total: get(&ss.runs.inference_us_total),
                    inference_latency: ss.runs.inference_us.summary(),
                })
                .collect(),
            frame_age: st.frame_age_us.summary(),
            camera: st.camera.as_ref().map(|c| c.status()),
            cameras: st
                .cameras
                .0
                .iter()
                .map(|c| {
                    c.report(
                        p.tracking().map(|t| t.open_tracks(&c.name)),
                        p.motion().is_some(),
                    )
                })
                .collect(),
            tracking: p.tracking().map(|t| TrackingStatus {
                counts: t.counts(),
                view: t.view(),
            }),
            motion: p.motion().map(|m| m.counts.report()),
        }
    }
}

impl OutboxStatus {
    fn read(o: &crate::outbox::OutboxStats) -> OutboxStatus {
        OutboxStatus {
            records: o.records,
            bytes: o.bytes,
            oldest_age_s: o.oldest_age.map(|d| d.as_secs_f64()),
            dead_letters: o.dead_letters,
            appended_total: o.appended_total,
            acked_total: o.acked_total,
            max_bytes: o.max_bytes,
            unavailable: o.unavailable.clone(),
            reopens_total: o.reopens_total,
            lost_total: o.lost_total,
            read_only: o.held.holding,
            held_records: o.held.records,
            held_bytes: o.held.bytes,
            held_max_bytes: o.held.max_bytes,
            held_dropped_total: o.held.dropped,
            store_closed: o.held.store_closed,
        }
    }
}

impl UplinkStatus {
    fn read(u: &UplinkStats) -> UplinkStatus {
        let g = UplinkStats::get;
        UplinkStatus {
            kind: u.kind,
            connected: u.is_connected(),
            sent_total: g(&u.sent_total),
            acked_total: g(&u.acked_total),
            retries_total: g(&u.retries_total),
            bytes_total: g(&u.bytes_total),
            dead_letters_total: g(&u.dead_letters_total),
            connects_total: g(&u.connects_total),
            disconnects_total: g(&u.disconnects_total),
            inflight: g(&u.inflight),
            errors_total: g(&u.errors_total),
            last_error: u.last_error().map(|(at, message)| UplinkError {
                message,
                age_s: at.elapsed().map(|d| d.as_secs_f64()).unwrap_or(0.0),
            }),
        }
    }
}

impl SystemStatus {
    fn read() -> SystemStatus {
        let d = crate::telemetry::device::sample();
        let p = crate::telemetry::device::process();
        let m = crate::telemetry::system::memory();
        SystemStatus {
            cpus: crate::telemetry::system::cpus(),
            load1: crate::telemetry::system::load1(),
            memory_total_bytes: m.as_ref().map(|m| m.total_bytes),
            memory_available_bytes: m.as_ref().map(|m| m.available_bytes),
            process_resident_bytes: p.resident_bytes,
            process_cpu_seconds: p.cpu_seconds,
            temperatures: d
                .temperatures
                .into_iter()
                .map(|(zone, celsius)| Temperature { zone, celsius })
                .collect(),
            gpus: d
                .gpus
                .into_iter()
                .map(|g| GpuStatus {
                    index: g.index,
                    name: g.name,
                    utilization: g.utilization,
                    memory_used_bytes: g.memory_used_bytes,
                    memory_total_bytes: g.memory_total_bytes,
                    temperature_celsius: g.temperature_celsius,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_latency_summary_is_its_count_alone() {
        let h = crate::pipeline::LatencyHistogram::default();
        assert_eq!(
            serde_json::to_value(h.summary()).unwrap(),
            serde_json::json!({"count": 0})
        );
        h.record(100);
        let v = serde_json::to_value(h.summary()).unwrap();
        let keys: Vec<_> = v.as_object().unwrap().keys().cloned().collect();
        assert_eq!(keys, ["count", "max_us", "p50_us", "p90_us", "p99_us"]);
        assert_eq!(v["count"], 1);
    }

    #[test]
    fn ota_status_is_the_agent_summary_with_the_daemon_beside_it() {
        let stats = crate::ota::stats::OtaStats::default();
        let v = serde_json::to_value(OtaStatus {
            summary: stats.summary(),
            daemon: DaemonStatus {
                version: "1.2.3".into(),
                slot: "b".into(),
            },
        })
        .unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "phase": "idle",
                "model_probation": false,
                "daemon_trial": false,
                "download_bytes": 0,
                "download_size": 0,
                "recent": [],
                "commands": {},
                "daemon": {"version": "1.2.3", "slot": "b"},
            })
        );
    }
}
