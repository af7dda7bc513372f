//! Cameras: RTSP, V4L2 (USB), Jetson CSI, or a custom GStreamer pipeline,
//! decoded to RGB frames that go straight to image preprocessing.
//!
//! Invariants:
//! - Latest frame wins: a camera pipeline's queue holds at most `queue`
//!   frames; a new frame pushes the oldest out (counted `stale`), so a slow
//!   model sees fresh frames, never a backlog. `fps` subsamples before colour
//!   conversion, so skipped frames cost only their decode.
//! - Self-healing: an error, end of stream, or no frame for `stall_timeout`
//!   tears the GStreamer pipeline down (state NULL: sockets and buffers
//!   released) and builds a new one after a jittered, growing backoff,
//!   forever. Each transition is in `/v1/status`, in the log, and in the
//!   outbox as a `camera_down` / `camera_up` status record.
//! - Credentials never leave this module: they go to `rtspsrc` as
//!   properties, never in the location, and every string shown (log, status,
//!   records, errors; a hand-written pipeline too) is scrubbed of them,
//!   in every form a message may quote them (`scrub.rs`).
//! - A URL is only ever data: each part must be plain (a device path, a
//!   host, a port, a path; `url.rs`) or the config is refused, and the
//!   built-in pipelines are made from elements and typed properties
//!   (`plan.rs`), never from a launch string with URL text in it. A
//!   hand-written `pipeline` is the one launch description parsed.
//!
//! This file is the part every build has (config, state, the pure
//! helpers); `run.rs` drives GStreamer and exists with the `camera` feature.

pub mod plan;
#[cfg(feature = "camera")]
mod run;
mod scrub;
mod url;

#[cfg(feature = "camera")]
pub use run::bounded_malloc;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use super::{Source, SourceCtx, SourceError};

pub use scrub::Scrubber;
pub use url::CameraUrl;

/// `source = { type = "camera", ... }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraConfig {
    /// `rtsp://[user:pass@]host[:port]/path`, `v4l2:///dev/videoN` or
    /// `csi://N` (Jetson, nvarguscamerasrc). Exactly one of `url` and
    /// `pipeline`. Each part must be plain: a device path of letters,
    /// digits and `/._-:+`; a host name or address; a port number; a path
    /// and query without spaces, quotes or `!` (percent-encode the rest).
    #[serde(default)]
    pub url: Option<String>,
    /// A GStreamer pipeline whose frames reach an `appsink name=outpost`
    /// (I420 or RGB is negotiated there: end with `videoconvert` when in doubt).
    #[serde(default)]
    pub pipeline: Option<String>,
    /// Frames per second handed to the pipeline (subsampled at the source);
    /// absent: every frame the camera sends.
    #[serde(default)]
    pub fps: Option<f64>,
    /// Frame size: asked of V4L2 and CSI cameras, scaled to for RTSP;
    /// absent: the camera's own size.
    #[serde(default)]
    pub width: Option<u32>,
    #[serde(default)]
    pub height: Option<u32>,
    /// RTSP transport: `tcp` (default: no loss, passes firewalls) or `udp`.
    #[serde(default)]
    pub transport: Transport,
    /// No frame for this long counts as a failure: the pipeline is rebuilt.
    #[serde(default = "default_stall_timeout", with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Frames waiting for inference, at most; the oldest is dropped
    /// (`stale`) for a new one. Replaces the pipeline's `queue`.
    #[serde(default = "default_queue")]
    pub queue: usize,
}

fn default_stall_timeout() -> Duration {
    Duration::from_secs(5)
}

/// One frame waiting: its age stays under one inference plus one frame interval.
fn default_queue() -> usize {
    1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    #[default]
    Tcp,
    Udp,
}

/// Largest `queue`: a camera that queues more is not "latest frame" any more.
const MAX_QUEUE: usize = 64;
/// Largest `width` or `height` (GStreamer caps hold them as 32-bit ints;
/// no camera comes near).
const MAX_SIDE: u32 = 16384;

/// Why a camera source at `at` cannot run, when this build (`has_camera`:
/// built with the `camera` feature) has no camera support.
pub fn needs_camera_build(at: &str, has_camera: bool) -> Option<String> {
    (!has_camera).then(|| {
        format!(
            "{at}: a camera source needs outpost built with the `camera` feature \
             (GStreamer); this build has no camera support"
        )
    })
}

impl CameraConfig {
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        p.extend(needs_camera_build(at, cfg!(feature = "camera")));
        match (&self.url, &self.pipeline) {
            (Some(_), Some(_)) => p.push(format!("{at}: set `url` or `pipeline`, not both")),
            (None, None) => p.push(format!("{at}: set `url` or `pipeline`")),
            (Some(u), None) => {
                if let Err(e) = CameraUrl::parse(u) {
                    p.push(format!("{at}.url: {e}"));
                }
            }
            (None, Some(pl)) => {
                if !pl.contains("appsink") || !pl.contains("name=outpost") {
                    p.push(format!(
                        "{at}.pipeline: must end in `appsink name=outpost` (where outpost takes the frames)"
                    ));
                }
            }
        }
        if let Some(f) = self.fps
            && !(f.is_finite() && f > 0.0 && f <= 1000.0)
        {
            p.push(format!("{at}.fps: {f} is out of range (0, 1000]"));
        }
        match (self.width, self.height) {
            (Some(0), _) | (_, Some(0)) => p.push(format!("{at}.width/height: must be positive")),
            (Some(w), Some(h)) if w > MAX_SIDE || h > MAX_SIDE => p.push(format!(
                "{at}.width/height: at most {MAX_SIDE} pixels a side"
            )),
            (Some(_), None) | (None, Some(_)) => {
                p.push(format!("{at}.width/height: set both or neither"))
            }
            _ => {}
        }
        if self.stall_timeout < Duration::from_millis(100) {
            p.push(format!("{at}.stall_timeout: at least 100ms"));
        }
        if self.queue == 0 || self.queue > MAX_QUEUE {
            p.push(format!(
                "{at}.queue: {} is out of range 1..={MAX_QUEUE}",
                self.queue
            ));
        }
        p
    }

    /// What the camera is called in logs, status and records (no credentials).
    pub fn shown(&self) -> String {
        match (&self.url, &self.pipeline) {
            (Some(u), _) => match CameraUrl::parse(u) {
                Ok(c) => c.shown(),
                Err(_) => "(invalid url)".into(),
            },
            (None, Some(p)) => format!("pipeline: {}", Scrubber::for_camera(self).scrub(p)),
            (None, None) => "(none)".into(),
        }
    }
}

/// Which decoder elements serve an RTP video encoding, hardware first.
/// `has` tells whether an element factory exists on this machine.
pub fn pick_decoder(
    encoding: &str,
    has: impl Fn(&str) -> bool,
) -> Result<Vec<&'static str>, String> {
    let (depay, parse, sw): (&'static str, &'static str, &[&'static str]) =
        match encoding.to_ascii_uppercase().as_str() {
            "H264" => (
                "rtph264depay",
                "h264parse",
                &["avdec_h264", "openh264dec", "v4l2h264dec"],
            ),
            "H265" => ("rtph265depay", "h265parse", &["avdec_h265", "v4l2h265dec"]),
            other => {
                return Err(format!(
                    "the video track is {other}: outpost decodes H.264 and H.265"
                ));
            }
        };
    for e in [depay, parse] {
        if !has(e) {
            return Err(format!(
                "GStreamer element `{e}` is missing (Debian: gstreamer1.0-plugins-good / -bad)"
            ));
        }
    }
    if has("nvv4l2decoder") && has("nvvidconv") {
        return Ok(vec![depay, parse, "nvv4l2decoder", "nvvidconv"]);
    }
    if let Some(d) = sw.iter().find(|d| has(d)) {
        return Ok(vec![depay, parse, d]);
    }
    Err(format!(
        "no {encoding} decoder: install gstreamer1.0-libav (avdec_*) or use a Jetson (nvv4l2decoder)"
    ))
}

/// Whether an element list decodes on dedicated hardware.
pub fn is_hardware(elements: &[&str]) -> bool {
    elements
        .iter()
        .any(|e| e.starts_with("nv") || e.starts_with("v4l2h"))
}

/// Subsampling to `fps`: admits a frame when its time has come, keeping the
/// cadence (not drifting by a late frame) and resynchronising after a gap.
#[derive(Debug)]
pub struct FpsGate {
    interval_ns: u64,
    next: Option<u64>,
}

impl FpsGate {
    pub fn new(fps: Option<f64>) -> FpsGate {
        FpsGate {
            interval_ns: fps.map(|f| (1e9 / f) as u64).unwrap_or(0),
            next: None,
        }
    }

    /// Whether the frame at `t_ns` (monotonic) goes on.
    pub fn admit(&mut self, t_ns: u64) -> bool {
        if self.interval_ns == 0 {
            return true;
        }
        // A frame up to an eighth of an interval early still counts as on time:
        // camera clocks jitter, and 30 -> 10 fps must keep every third frame.
        let slack = self.interval_ns / 8;
        match self.next {
            Some(due) if t_ns + slack < due => false,
            Some(due) => {
                self.next = Some(if t_ns > due + self.interval_ns {
                    t_ns + self.interval_ns
                } else {
                    due + self.interval_ns
                });
                true
            }
            None => {
                self.next = Some(t_ns + self.interval_ns);
                true
            }
        }
    }
}

/// Reconnect delays: from 0.25 s, a ceiling of 0.5 s doubling to 8 s, each
/// a random draw up to its ceiling, so cameras that failed together do not
/// retry in step.
pub fn reconnect_backoff() -> crate::backoff::Backoff {
    crate::backoff::Backoff::new(Duration::from_millis(250), Duration::from_secs(8))
}

/// What `/v1/status` and `/metrics` read about a camera.
#[derive(Debug)]
pub struct CameraState {
    /// The camera without credentials.
    pub camera: String,
    /// Decoded frames out of the camera (before `fps` subsampling).
    pub frames_in: AtomicU64,
    /// Frames skipped by `fps` subsampling.
    pub subsampled: AtomicU64,
    /// Pipelines torn down and rebuilt.
    pub reconnects: AtomicU64,
    status: Mutex<CameraStatus>,
}

#[derive(Debug, Clone, Serialize)]
struct CameraStatus {
    state: &'static str,
    since: String,
    last_error: Option<String>,
    last_error_at: Option<String>,
    elements: Vec<String>,
    hardware_decode: bool,
    width: Option<u32>,
    height: Option<u32>,
}

/// A camera in `/v1/status`: its state and its counters, in one object.
#[derive(Debug, Clone, Serialize)]
pub struct CameraReport {
    /// The camera without credentials.
    camera: String,
    frames_in: u64,
    subsampled: u64,
    reconnects: u64,
    #[serde(flatten)]
    status: CameraStatus,
}

impl CameraState {
    pub fn new(camera: String) -> CameraState {
        CameraState {
            camera,
            frames_in: AtomicU64::new(0),
            subsampled: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            status: Mutex::new(CameraStatus {
                state: "starting",
                since: crate::record::rfc3339(SystemTime::now()),
                last_error: None,
                last_error_at: None,
                elements: Vec::new(),
                hardware_decode: false,
                width: None,
                height: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CameraStatus> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `starting`, `streaming` or `reconnecting`.
    pub fn state(&self) -> &'static str {
        self.lock().state
    }

    pub fn is_up(&self) -> bool {
        self.state() == "streaming"
    }

    pub fn set_state(&self, state: &'static str) {
        let mut s = self.lock();
        if s.state != state {
            s.state = state;
            s.since = crate::record::rfc3339(SystemTime::now());
        }
    }

    pub fn set_error(&self, error: &str) {
        let mut s = self.lock();
        s.last_error = Some(error.to_string());
        s.last_error_at = Some(crate::record::rfc3339(SystemTime::now()));
    }

    pub fn set_elements(&self, elements: &[&str]) {
        let mut s = self.lock();
        s.elements = elements.iter().map(|e| e.to_string()).collect();
        s.hardware_decode = is_hardware(elements);
    }

    pub fn set_size(&self, width: u32, height: u32) {
        let mut s = self.lock();
        s.width = Some(width);
        s.height = Some(height);
    }

    /// The camera's part of `/v1/status`.
    pub fn status(&self) -> CameraReport {
        CameraReport {
            camera: self.camera.clone(),
            frames_in: self.frames_in.load(Ordering::Relaxed),
            subsampled: self.subsampled.load(Ordering::Relaxed),
            reconnects: self.reconnects.load(Ordering::Relaxed),
            status: self.lock().clone(),
        }
    }

    /// Dropped frames by reason as the camera's counters show them.
    pub fn drops(&self, pipeline_drops: &BTreeMap<&'static str, u64>) -> Vec<(String, u64)> {
        let mut v = vec![("fps".to_string(), self.subsampled.load(Ordering::Relaxed))];
        v.extend(pipeline_drops.iter().map(|(r, n)| (r.to_string(), *n)));
        v
    }
}

/// The source object built from the config.
pub struct CameraSource {
    pub cfg: CameraConfig,
}

impl Source for CameraSource {
    #[cfg(feature = "camera")]
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        run::spawn(self.cfg, ctx)
    }

    #[cfg(not(feature = "camera"))]
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        Err(SourceError::Setup {
            pipeline: ctx.pipeline,
            kind: "camera",
            detail: "this build has no camera support (build with `--features camera`)".into(),
        })
    }
}

/// Stores a `camera_up` / `camera_down` status record (beside the results).
pub fn store_event(ctx: &SourceCtx, event: crate::record::Event) {
    let Some(events) = &ctx.events else {
        return;
    };
    let name = event.name();
    if let Err(e) = events.emit(&ctx.pipeline, &ctx.pipeline, event) {
        tracing::warn!(pipeline = %ctx.pipeline, event = name, error = %e, "camera status record not stored");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(s: &str) -> CameraConfig {
        #[derive(Deserialize)]
        struct W {
            source: super::super::SourceConfig,
        }
        let w: W = toml::from_str(&format!("source = {s}")).unwrap();
        match w.source {
            super::super::SourceConfig::Camera(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_issue_forms_parse() {
        let c =
            cfg(r#"{ type = "camera", url = "rtsp://user:pass@10.0.0.7:554/stream1", fps = 10 }"#);
        assert_eq!(c.fps, Some(10.0));
        assert_eq!(c.transport, Transport::Tcp);
        assert_eq!(c.stall_timeout, Duration::from_secs(5));
        assert_eq!(c.queue, 1);
        let c = cfg(
            r#"{ type = "camera", url = "v4l2:///dev/video0", width = 1280, height = 720, fps = 15 }"#,
        );
        assert_eq!((c.width, c.height), (Some(1280), Some(720)));
        let c =
            cfg(r#"{ type = "camera", url = "csi://0", width = 1920, height = 1080, fps = 30 }"#);
        assert_eq!(
            CameraUrl::parse(c.url.as_deref().unwrap()),
            Ok(CameraUrl::Csi { sensor: 0 })
        );
        let c = cfg(
            r#"{ type = "camera", pipeline = "videotestsrc ! video/x-raw,width=640,height=480 ! appsink name=outpost" }"#,
        );
        let problems = c.validate("s");
        assert_eq!(
            problems.len(),
            usize::from(!cfg!(feature = "camera")),
            "{problems:?}"
        );
        let c = cfg(
            r#"{ type = "camera", url = "rtsp://h/x", transport = "udp", stall_timeout = "2s", queue = 3 }"#,
        );
        assert_eq!(
            (c.transport, c.stall_timeout, c.queue),
            (Transport::Udp, Duration::from_secs(2), 3)
        );
    }

    #[test]
    fn validate_lists_every_problem() {
        let c = cfg(
            r#"{ type = "camera", url = "http://x/y", pipeline = "x", fps = 0, width = 10, queue = 0, stall_timeout = "1ms" }"#,
        );
        let p = c.validate("pipelines[0].source");
        // both url and pipeline, fps, width without height, queue, stall_timeout (+ feature)
        assert_eq!(p.len(), 5 + usize::from(!cfg!(feature = "camera")), "{p:?}");
        let c = cfg(r#"{ type = "camera", url = "ftp://x/y" }"#);
        assert!(c.validate("s").iter().any(|e| e.contains("scheme `ftp`")));
        let c = cfg(r#"{ type = "camera", pipeline = "videotestsrc ! fakesink" }"#);
        assert!(
            c.validate("s")
                .iter()
                .any(|e| e.contains("appsink name=outpost"))
        );
    }

    #[test]
    fn decoder_choice_prefers_hardware() {
        let all = |_: &str| true;
        assert_eq!(
            pick_decoder("H264", all).unwrap(),
            ["rtph264depay", "h264parse", "nvv4l2decoder", "nvvidconv"]
        );
        let sw = |e: &str| !e.starts_with("nv");
        assert_eq!(
            pick_decoder("h264", sw).unwrap(),
            ["rtph264depay", "h264parse", "avdec_h264"]
        );
        assert_eq!(
            pick_decoder("H265", sw).unwrap(),
            ["rtph265depay", "h265parse", "avdec_h265"]
        );
        assert!(pick_decoder("JPEG", all).unwrap_err().contains("JPEG"));
        let none = |e: &str| e.starts_with("rtp") || e.ends_with("parse");
        assert!(
            pick_decoder("H264", none)
                .unwrap_err()
                .contains("no H264 decoder")
        );
        assert!(is_hardware(&["rtph264depay", "h264parse", "nvv4l2decoder"]));
        assert!(!is_hardware(&["rtph264depay", "h264parse", "avdec_h264"]));
    }

    #[test]
    fn fps_gate_keeps_every_third_frame_of_30() {
        let mut g = FpsGate::new(Some(10.0));
        let frame = 1_000_000_000u64 / 30;
        // A little jitter on each frame.
        let admitted: Vec<usize> = (0..30usize)
            .filter(|i| {
                let jitter = if i % 2 == 0 { 0 } else { 900_000 };
                g.admit(*i as u64 * frame + jitter)
            })
            .collect();
        assert_eq!(admitted.len(), 10, "{admitted:?}");
        // After a gap it resynchronises instead of bursting.
        let t = 10_000_000_000;
        assert!(g.admit(t));
        assert!(!g.admit(t + frame));
        let mut all = FpsGate::new(None);
        assert!((0..5).all(|i| all.admit(i)));
    }

    #[test]
    fn backoff_grows_jittered_and_bounded() {
        let mut b = reconnect_backoff();
        assert_eq!(b.clone().next_with(1.0), Duration::from_millis(500));
        assert_eq!(b.clone().next_with(0.0), Duration::from_millis(250));
        for _ in 0..3 {
            b.next_delay();
        }
        assert_eq!(b.clone().next_with(1.0), Duration::from_secs(4));
        for _ in 0..50 {
            b.next_delay();
        }
        assert_eq!(b.clone().next_with(1.0), Duration::from_secs(8));
    }
}
