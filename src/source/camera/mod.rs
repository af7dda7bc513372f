//! Cameras: RTSP, V4L2 (USB), Jetson CSI, or a custom GStreamer pipeline,
//! decoded to RGB frames that go straight to image preprocessing.
//!
//! Invariants:
//! - One camera, one decode: every pipeline that names a `[[cameras]]`
//!   entry reads the same GStreamer pipeline (one RTSP session), and each
//!   decoded frame is handed to each of them that wants it (the payload is
//!   shared, not copied). An inline camera is a camera with one reader.
//! - Latest frame wins: each reading pipeline's queue holds at most its
//!   `queue` frames; a new frame pushes the oldest out (counted `stale`), so
//!   a slow model sees fresh frames, never a backlog, and never holds back
//!   the other pipelines on the camera. Each pipeline's `fps` subsamples
//!   (by the stream's timestamps) before colour conversion, so a frame no pipeline wants costs only its
//!   decode; with keyframe-only decoding (`decode.rs`) most frames are not
//!   even decoded.
//! - Self-healing: an error, end of stream, or no frame for `stall_timeout`
//!   tears the GStreamer pipeline down (state NULL: sockets and buffers
//!   released) and builds a new one after a jittered, growing backoff,
//!   forever. Each transition is in `/v1/status`, in the log, and in the
//!   outbox as one `camera_down` / `camera_up` status record per camera
//!   (not per pipeline).
//! - `rtsp://` cameras are received by the daemon's RTSP client
//!   (`rtsp.rs`, retina) and fed through an appsrc to the parser and
//!   decoder; `rtsps://` by rtspsrc.
//! - A camera is untrusted input: what it sends to the RTSP client passes
//!   a bound first (`guard.rs`, `relay.rs`): no message head over 64 KiB,
//!   no declared body and no frame over the camera's `max_frame_bytes`;
//!   the excess is counted (`oversize`) and the connection closed with
//!   that as the camera's error. A panic on a camera's threads is that
//!   camera's error and a reconnect, never the daemon's.
//! - The loopback port a camera's bytes are relayed through serves the
//!   daemon's own RTSP client only (`peer.rs`): a connection from any other
//!   process is refused, counted (`relay_refused`) and logged, and the
//!   daemon's session goes on.
//! - A camera that sends but decodes nothing is down: while only keyframes
//!   are decoded, no keyframe for twice the keyframe interval (at least
//!   `stall_timeout`) is a stall, however many delta frames come, and the
//!   rebuilt pipeline decodes every frame until keyframes come again.
//! - Credentials never leave this module: they go to the RTSP client (or
//!   `rtspsrc`'s properties), never in the location, and every string shown (log, status,
//!   records, errors; a hand-written pipeline too) is scrubbed of them,
//!   in every form a message may quote them (`scrub.rs`).
//! - A URL is only ever data: each part must be plain (a device path, a
//!   host, a port, a path; `url.rs`) or the config is refused, and the
//!   built-in pipelines are made from elements and typed properties
//!   (`plan.rs`), never from a launch string with URL text in it. A
//!   hand-written `pipeline` is the one launch description parsed.
//!
//! This file is the part every build has (state, the grouping of sources
//! by camera, the pure helpers; `config.rs` the config, `decode.rs` the
//! keyframe choice); `run.rs` drives GStreamer and exists with the
//! `camera` feature.

mod config;
pub mod decode;
#[cfg(feature = "camera")]
mod elements;
#[cfg(feature = "camera")]
mod error;
#[cfg(feature = "camera")]
mod fanout;
#[cfg(feature = "camera")]
mod guard;
mod host;
#[cfg(feature = "camera")]
mod keyframe_check;
#[cfg(feature = "camera")]
mod keyframe_line;
#[cfg(feature = "camera")]
mod keyframes;
#[cfg(feature = "camera")]
mod peer;
pub mod plan;
#[cfg(feature = "camera")]
mod relay;
#[cfg(feature = "camera")]
mod rtsp;
#[cfg(feature = "camera")]
mod rtspsrc;
#[cfg(feature = "camera")]
mod run;
#[cfg(feature = "camera")]
mod said;
mod scrub;
mod url;

#[cfg(feature = "camera")]
pub use run::bounded_malloc;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use parking_lot::Mutex;
use serde::Serialize;

use super::{Source, SourceCtx, SourceError};

pub use config::{
    CameraConfig, CameraDef, CameraList, Decode, PARSER_NAME, Transport, needs_camera_build,
    validate_cameras,
};
pub use host::CameraHost;
pub use scrub::Scrubber;
pub use url::{CameraUrl, UrlError};

/// Why no decoder chain serves a stream on this machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecoderError {
    #[error("the video track is {0}: outpost decodes H.264 and H.265")]
    Encoding(String),
    #[error("GStreamer element `{0}` is missing (Debian: gstreamer1.0-plugins-good / -bad)")]
    Missing(&'static str),
    #[error("no {0} decoder: install gstreamer1.0-libav (avdec_*) or use a Jetson (nvv4l2decoder)")]
    NoDecoder(String),
}

/// Which elements serve an RTP video encoding, in link order: depayloader,
/// parser, decoder (hardware first) and, on a Jetson, the converter out
/// of device memory. `has` tells whether an element factory exists here.
pub fn pick_decoder(
    encoding: &str,
    has: impl Fn(&str) -> bool,
) -> Result<Vec<&'static str>, DecoderError> {
    let (depay, parse, sw): (&'static str, &'static str, &[&'static str]) =
        match encoding.to_ascii_uppercase().as_str() {
            "H264" => (
                "rtph264depay",
                "h264parse",
                &["avdec_h264", "openh264dec", "v4l2h264dec"],
            ),
            "H265" => ("rtph265depay", "h265parse", &["avdec_h265", "v4l2h265dec"]),
            other => return Err(DecoderError::Encoding(other.to_string())),
        };
    for e in [depay, parse] {
        if !has(e) {
            return Err(DecoderError::Missing(e));
        }
    }
    if has("nvv4l2decoder") && has("nvvidconv") {
        return Ok(vec![depay, parse, "nvv4l2decoder", "nvvidconv"]);
    }
    if let Some(d) = sw.iter().find(|d| has(d)) {
        return Ok(vec![depay, parse, d]);
    }
    Err(DecoderError::NoDecoder(encoding.to_string()))
}

/// Whether an element list decodes on dedicated hardware.
pub fn is_hardware(elements: &[&str]) -> bool {
    elements
        .iter()
        .any(|e| e.starts_with("nv") || e.starts_with("v4l2h"))
}

/// Subsampling to `fps`: admits a frame when its time has come, keeping the
/// cadence (not drifting by a late frame) and resynchronising after a gap
/// or when the clock starts over.
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
            // Far before the frame due: the clock started over (a stream's
            // timestamps after a reconnect); take this one and go on from it.
            Some(due) if t_ns.saturating_add(2 * self.interval_ns) < due => {
                self.next = Some(t_ns + self.interval_ns);
                true
            }
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

/// What `/v1/status` and `/metrics` read about a camera, as one pipeline
/// sees it: the camera's own figures (the same in every pipeline that reads
/// it) and the frames this pipeline's `fps` skipped.
#[derive(Debug)]
pub struct CameraState {
    /// The camera without credentials.
    pub camera: String,
    /// Decoded frames out of the camera (before `fps` subsampling).
    pub frames_in: AtomicU64,
    /// Frames skipped by this pipeline's `fps` subsampling.
    pub subsampled: AtomicU64,
    /// Pipelines torn down and rebuilt.
    pub reconnects: AtomicU64,
    /// Compressed frames out of the parser (streams outpost decodes itself).
    pub encoded_frames: AtomicU64,
    /// Compressed frames handed to the decoder.
    pub decoder_frames_in: AtomicU64,
    /// Delta frames dropped before the decoder (keyframe-only decoding).
    pub delta_frames_skipped: AtomicU64,
    /// RTSP messages and frames over the bound (`max_frame_bytes`): each
    /// closed the connection.
    pub oversize: AtomicU64,
    /// Connections to the camera's loopback relay port from another
    /// process than the daemon's own RTSP client: refused.
    pub relay_refused: AtomicU64,
    status: Mutex<CameraStatus>,
}

#[derive(Debug, Clone, Serialize)]
struct CameraStatus {
    /// The `[[cameras]]` name (an inline camera: its pipeline's name).
    name: Option<String>,
    /// Every pipeline that reads the camera.
    pipelines: Vec<String>,
    state: &'static str,
    since: String,
    last_error: Option<String>,
    last_error_at: Option<String>,
    /// Whether the last error is one another try cannot mend (an element
    /// or plugin missing, a pipeline GStreamer refuses): state `failed`,
    /// retried only after `retry_after_s`.
    last_error_permanent: Option<bool>,
    /// How long the camera waited after its last error before it tried again.
    retry_after_s: Option<f64>,
    elements: Vec<String>,
    hardware_decode: bool,
    width: Option<u32>,
    height: Option<u32>,
    /// As configured: `auto`, `all` or `keyframes`.
    decode: &'static str,
    /// What the decoder gets now: `all` or `keyframes`.
    decode_mode: &'static str,
    /// The keyframe interval seen on the stream (median of the last few).
    keyframe_interval_ms: Option<f64>,
}

/// A camera in `/v1/status`: its state and its counters, in one object.
#[derive(Debug, Clone, Serialize)]
pub struct CameraReport {
    /// The camera without credentials.
    camera: String,
    frames_in: u64,
    /// Frames the pipeline's `fps` skipped (`null` in the daemon's list
    /// of cameras, where no one pipeline is meant).
    subsampled: Option<u64>,
    reconnects: u64,
    encoded_frames: u64,
    decoder_frames_in: u64,
    delta_frames_skipped: u64,
    oversize: u64,
    relay_refused: u64,
    #[serde(flatten)]
    status: CameraStatus,
}

impl CameraReport {
    /// The camera's latest error, if it had one.
    pub fn last_error(&self) -> Option<&str> {
        self.status.last_error.as_deref()
    }

    /// The camera's name (`None` before its source started).
    pub fn name(&self) -> Option<&str> {
        self.status.name.as_deref()
    }

    /// Whether both are the one camera (its name and its readers: an
    /// inline camera is called after its pipeline, which a `[[cameras]]`
    /// entry may be too).
    pub fn same_camera(&self, other: &CameraReport) -> bool {
        self.name().is_some()
            && self.name() == other.name()
            && self.status.pipelines == other.status.pipelines
    }
}

impl CameraState {
    pub fn new(camera: String) -> CameraState {
        CameraState {
            camera,
            frames_in: AtomicU64::new(0),
            subsampled: AtomicU64::new(0),
            reconnects: AtomicU64::new(0),
            encoded_frames: AtomicU64::new(0),
            decoder_frames_in: AtomicU64::new(0),
            delta_frames_skipped: AtomicU64::new(0),
            oversize: AtomicU64::new(0),
            relay_refused: AtomicU64::new(0),
            status: Mutex::new(CameraStatus {
                name: None,
                pipelines: Vec::new(),
                state: "starting",
                since: crate::record::rfc3339(SystemTime::now()),
                last_error: None,
                last_error_at: None,
                last_error_permanent: None,
                retry_after_s: None,
                elements: Vec::new(),
                hardware_decode: false,
                width: None,
                height: None,
                decode: Decode::default().as_str(),
                decode_mode: "all",
                keyframe_interval_ms: None,
            }),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, CameraStatus> {
        self.status.lock()
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

    /// An error the camera runs on with (a keyframe dropped).
    pub fn set_error(&self, error: &str) {
        let mut s = self.lock();
        s.last_error = Some(error.to_string());
        s.last_error_at = Some(crate::record::rfc3339(SystemTime::now()));
    }

    /// The failure that ended a run: its text (scrubbed), whether it is
    /// permanent, and the wait before the next try.
    pub fn set_failure(&self, error: &str, permanent: bool, retry_after: Duration) {
        self.set_error(error);
        let mut s = self.lock();
        s.last_error_permanent = Some(permanent);
        s.retry_after_s = Some(retry_after.as_secs_f64());
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

    /// What another view of the same camera shows now (its state, error,
    /// elements, size and decoding): a reload's new pipeline reading a
    /// camera that ran on. Its own counters start at zero with its pipeline.
    pub fn take_over(&self, from: &CameraState) {
        if std::ptr::eq(self, from) {
            return;
        }
        let status = from.lock().clone();
        *self.lock() = status;
    }

    /// Which camera this is and who reads it.
    pub fn set_camera(&self, name: &str, pipelines: &[String], decode: Decode) {
        let mut s = self.lock();
        s.name = Some(name.to_string());
        s.pipelines = pipelines.to_vec();
        s.decode = decode.as_str();
    }

    /// What the decoder gets now, and the keyframe interval seen.
    pub fn set_decode(&self, mode: &'static str, keyframe_interval: Option<Duration>) {
        let mut s = self.lock();
        s.decode_mode = mode;
        s.keyframe_interval_ms = keyframe_interval.map(|d| d.as_secs_f64() * 1e3);
    }

    /// The camera's part of a pipeline's `/v1/status`.
    pub fn status(&self) -> CameraReport {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CameraReport {
            camera: self.camera.clone(),
            frames_in: get(&self.frames_in),
            subsampled: Some(get(&self.subsampled)),
            reconnects: get(&self.reconnects),
            encoded_frames: get(&self.encoded_frames),
            decoder_frames_in: get(&self.decoder_frames_in),
            delta_frames_skipped: get(&self.delta_frames_skipped),
            oversize: get(&self.oversize),
            relay_refused: get(&self.relay_refused),
            status: self.lock().clone(),
        }
    }

    /// The camera itself, for the daemon's list of cameras.
    pub fn camera_status(&self) -> CameraReport {
        CameraReport {
            subsampled: None,
            ..self.status()
        }
    }

    /// Dropped frames by reason as the camera's counters show them.
    pub fn drops(&self, pipeline_drops: &BTreeMap<&'static str, u64>) -> Vec<(String, u64)> {
        let mut v = vec![("fps".to_string(), self.subsampled.load(Ordering::Relaxed))];
        v.extend(pipeline_drops.iter().map(|(r, n)| (r.to_string(), *n)));
        v
    }
}

/// The source object built from the config: a camera with one reader.
pub struct CameraSource {
    pub cfg: CameraConfig,
}

impl Source for CameraSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let mut set = CameraSet::default();
        let pipeline = ctx.pipeline.clone();
        if self.cfg.is_many() {
            for def in &self.cfg.resolved_many {
                set.add_camera(&self.cfg, def, ctx.clone());
            }
            return set.spawn().map(|tasks| {
                tokio::spawn(async move {
                    for t in tasks {
                        let _ = t.await;
                    }
                })
            });
        }
        set.add(&self.cfg, ctx);
        set.spawn()?.pop().ok_or_else(|| SourceError::Setup {
            pipeline,
            kind: "camera",
            detail: "no camera was started".into(),
        })
    }
}

/// One pipeline reading a camera.
pub struct Consumer {
    pub ctx: SourceCtx,
    /// Frames per second it takes (`None`: every frame).
    pub fps: Option<f64>,
    /// The stream its frames belong to: the camera's name in a pipeline
    /// reading several; `None`: the pipeline's name.
    pub stream: Option<String>,
}

/// What a camera itself is asked for (a CSI sensor's rate): its fastest
/// reader's, `None` when one wants every frame.
fn asked_fps(consumers: &[Consumer]) -> Option<f64> {
    consumers
        .iter()
        .map(|c| c.fps)
        .collect::<Option<Vec<f64>>>()
        .and_then(|v| v.into_iter().reduce(f64::max))
}

/// Which camera a source reads: a `[[cameras]]` entry, or its own (inline).
#[derive(Debug, Clone, PartialEq, Eq)]
enum CameraKey {
    Named(String),
    Inline(String),
}

/// The camera sources of one generation grouped by the camera they read,
/// so that each camera is opened and decoded once, whatever number of
/// pipelines read it.
#[derive(Default)]
pub struct CameraSet {
    cameras: Vec<(CameraKey, Option<CameraDef>, Vec<Consumer>)>,
}

impl CameraSet {
    /// A pipeline's camera source joins its camera.
    pub fn add(&mut self, cfg: &CameraConfig, ctx: SourceCtx) {
        let key = match &cfg.camera {
            Some(n) => CameraKey::Named(n.clone()),
            None => CameraKey::Inline(ctx.pipeline.clone()),
        };
        let def = cfg.def(&ctx.pipeline);
        let consumer = Consumer {
            ctx,
            fps: cfg.fps,
            stream: None,
        };
        self.join(key, def, consumer);
    }

    /// One camera of a pipeline reading several (`cameras = [...]`) joins
    /// that camera: `ctx` is the camera's own way into the pipeline, and
    /// its frames are the stream named after it.
    pub fn add_camera(&mut self, cfg: &CameraConfig, def: &CameraDef, ctx: SourceCtx) {
        let consumer = Consumer {
            ctx,
            fps: cfg.fps_of(def),
            stream: Some(def.name.clone()),
        };
        self.join(
            CameraKey::Named(def.name.clone()),
            Some(def.clone()),
            consumer,
        );
    }

    fn join(&mut self, key: CameraKey, def: Option<CameraDef>, consumer: Consumer) {
        match self.cameras.iter_mut().find(|(k, ..)| *k == key) {
            Some((_, _, v)) => v.push(consumer),
            None => self.cameras.push((key, def, vec![consumer])),
        }
    }

    /// Starts every camera: one GStreamer pipeline (one RTSP session) each,
    /// stopped with its readers (their tokens are one generation's).
    pub fn spawn(self) -> Result<Vec<tokio::task::JoinHandle<()>>, SourceError> {
        let mut tasks = Vec::with_capacity(self.cameras.len());
        let decoders = SharedDecoders::default();
        for (_, def, consumers) in self.resolved()? {
            let stop = consumers
                .first()
                .map(|c| c.ctx.shutdown.clone())
                .unwrap_or_default();
            tasks.push(spawn_camera(def, consumers, stop, &decoders)?.task());
        }
        Ok(tasks)
    }

    /// Each camera with its definition, or the first that has none.
    fn resolved(self) -> Result<Vec<(CameraKey, CameraDef, Vec<Consumer>)>, SourceError> {
        self.cameras
            .into_iter()
            .map(|(key, def, consumers)| match def {
                Some(def) => Ok((key, def, consumers)),
                None => {
                    let name = match key {
                        CameraKey::Named(n) | CameraKey::Inline(n) => n,
                    };
                    Err(setup_error(
                        &consumers,
                        format!("no camera `{name}` in [[cameras]]"),
                    ))
                }
            })
            .collect()
    }
}

/// A camera that cannot start, in its first reader's pipeline's name.
fn setup_error(consumers: &[Consumer], detail: String) -> SourceError {
    SourceError::Setup {
        pipeline: consumers
            .first()
            .map(|c| c.ctx.pipeline.clone())
            .unwrap_or_default(),
        kind: "camera",
        detail,
    }
}

#[cfg(feature = "camera")]
use run::Running;

/// The decoders that cameras decoding keyframes only share (`keyframes.rs`).
#[derive(Clone, Default)]
struct SharedDecoders(#[cfg(feature = "camera")] std::sync::Arc<keyframes::KeyframeDecoders>);

/// A running camera; a build without cameras never has one.
#[cfg(not(feature = "camera"))]
enum Running {}

#[cfg(not(feature = "camera"))]
impl Running {
    fn swap(&self, _consumers: Vec<Consumer>) {
        match *self {}
    }

    fn park(&self) {
        match *self {}
    }

    fn cancel(&self) {
        match *self {}
    }

    async fn join(self) {
        match self {}
    }

    fn task(self) -> tokio::task::JoinHandle<()> {
        match self {}
    }
}

#[cfg(feature = "camera")]
fn spawn_camera(
    def: CameraDef,
    consumers: Vec<Consumer>,
    stop: tokio_util::sync::CancellationToken,
    decoders: &SharedDecoders,
) -> Result<Running, SourceError> {
    run::spawn(def, consumers, stop, decoders.0.clone())
}

#[cfg(not(feature = "camera"))]
fn spawn_camera(
    _def: CameraDef,
    consumers: Vec<Consumer>,
    _stop: tokio_util::sync::CancellationToken,
    _decoders: &SharedDecoders,
) -> Result<Running, SourceError> {
    Err(setup_error(
        &consumers,
        "this build has no camera support (build with `--features camera`)".into(),
    ))
}

/// A `camera_up` / `camera_down` transition, stored once per camera.
pub struct CameraEvent<'a> {
    /// The camera without credentials.
    pub camera: &'a str,
    /// Its `[[cameras]]` name (an inline camera: its pipeline's).
    pub name: &'a str,
    /// Every pipeline that reads it.
    pub pipelines: &'a [String],
}

/// Stores a `camera_up` / `camera_down` status record (beside the results),
/// under the camera's first pipeline (`ctx`), naming all that read it.
pub fn store_event(ctx: &SourceCtx, cam: &CameraEvent<'_>, error: Option<&str>) {
    let Some(events) = &ctx.events else {
        return;
    };
    let event = match error {
        None => crate::record::Event::camera_up(cam.camera),
        Some(e) => crate::record::Event::camera_down(cam.camera, e),
    }
    .of_camera(cam.name, cam.pipelines);
    let name = event.name();
    if let Err(e) = events.emit(&ctx.pipeline, &ctx.pipeline, event) {
        tracing::warn!(pipeline = %ctx.pipeline, event = name, error = %e, "camera status record not stored");
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

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
        let d = c.def("gate").unwrap();
        assert_eq!(d.name, "gate");
        assert_eq!(d.transport, Transport::Tcp);
        assert_eq!(d.stall_timeout, Duration::from_secs(5));
        assert_eq!(d.decode, Decode::Auto);
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
            r#"{ type = "camera", url = "rtsp://h/x", transport = "udp", stall_timeout = "2s", queue = 3, decode = "keyframes" }"#,
        );
        let d = c.def("x").unwrap();
        assert_eq!(
            (d.transport, d.stall_timeout, c.queue, d.decode),
            (Transport::Udp, Duration::from_secs(2), 3, Decode::Keyframes)
        );
        // A pipeline that names a camera says only how many frames it wants.
        let c = cfg(r#"{ type = "camera", camera = "gate", fps = 1, queue = 2 }"#);
        assert_eq!(
            (c.camera.as_deref(), c.fps, c.queue),
            (Some("gate"), Some(1.0), 2)
        );
        assert!(c.validate("s").is_empty(), "{:?}", c.validate("s"));
        // Its camera comes from the config (resolved when it is read).
        assert!(c.def("p").is_none());
    }

    #[test]
    fn a_pipeline_naming_a_camera_may_not_redefine_it() {
        let c = cfg(
            r#"{ type = "camera", camera = "gate", url = "rtsp://h/x", transport = "udp", decode = "all", fps = 0 }"#,
        );
        let p = c.validate("pipelines[1].source");
        assert_eq!(p.len(), 4, "{p:?}");
        for key in ["url", "transport", "decode"] {
            assert!(
                p.iter().any(|e| e.starts_with(&format!(
                    "pipelines[1].source.{key}: set it on the camera `gate`"
                ))),
                "{key}: {p:?}"
            );
        }
    }

    #[test]
    fn camera_names_are_checked_against_the_pipelines() {
        let def = |name: &str| CameraDef {
            name: name.into(),
            url: Some("rtsp://h/x".into()),
            pipeline: None,
            width: None,
            height: None,
            transport: Transport::Tcp,
            stall_timeout: Duration::from_secs(5),
            decode: Decode::Auto,
            max_frame_bytes: 8 << 20,
            fps: None,
        };
        let cams = [def("gate"), def("yard"), def("gate")];
        let p = validate_cameras(
            &cams,
            &[
                (0, "camera", "gate"),
                (1, "camera", "gate"),
                (2, "camera", "door"),
            ],
        );
        let p: Vec<String> = p
            .into_iter()
            .filter(|e| !e.contains("`camera` feature"))
            .collect();
        assert_eq!(p.len(), 3, "{p:?}");
        assert!(
            p.iter()
                .any(|e| e == "cameras[2].name: `gate` is the name of an earlier camera too"),
            "{p:?}"
        );
        assert!(
            p.iter()
                .any(|e| e.starts_with("cameras[1].name: no pipeline reads camera `yard`")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|e| e == "pipelines[2].source.camera: no camera `door` in [[cameras]] (cameras: gate, yard)"),
            "{p:?}"
        );
        // Keyframe-only decoding needs a stream outpost parses itself.
        let mut v = def("usb");
        v.url = Some("v4l2:///dev/video0".into());
        v.decode = Decode::Keyframes;
        assert!(
            v.validate("c")
                .iter()
                .any(|e| e.starts_with("c.decode: `keyframes` needs"))
        );
        v.url = None;
        v.pipeline = Some("filesrc location=a.mp4 ! qtdemux ! h264parse name=outpost_parse ! avdec_h264 ! videoconvert ! appsink name=outpost".into());
        assert!(!v.validate("c").iter().any(|e| e.contains("decode")));
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
        assert!(
            pick_decoder("JPEG", all)
                .unwrap_err()
                .to_string()
                .contains("JPEG")
        );
        let none = |e: &str| e.starts_with("rtp") || e.ends_with("parse");
        assert!(
            pick_decoder("H264", none)
                .unwrap_err()
                .to_string()
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
        // Timestamps that start over (a new connection) are followed.
        assert!(g.admit(frame));
        assert!(!g.admit(2 * frame));
        assert!(g.admit(frame + 100_000_000));
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
