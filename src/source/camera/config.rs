//! A camera's config in its two forms: a `[[cameras]]` entry (`CameraDef`:
//! where the frames come from and how they are decoded), and a pipeline's
//! `source = { type = "camera", ... }` (`CameraConfig`: either names such
//! an entry and says only how many frames it wants, or is a camera of its
//! own written inline).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{CameraUrl, Scrubber};

/// `[[cameras]]`: one camera, decoded once for every pipeline that names it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraDef {
    /// What pipelines call it: `source = { type = "camera", camera = "gate" }`.
    pub name: String,
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
    /// Which frames are decoded: `auto` (default: keyframes only while every
    /// pipeline on the camera wants at most the stream's keyframe rate),
    /// `all`, or `keyframes`.
    #[serde(default)]
    pub decode: Decode,
    /// The largest compressed frame, and RTSP message body, the camera may
    /// send (`rtsp://` over TCP, read by outpost's own client): more is
    /// counted (`oversize`) and closes the connection. The default holds
    /// a 4K H.265 keyframe at a high bitrate with room to spare.
    #[serde(default = "default_max_frame_bytes", with = "crate::bytesize")]
    pub max_frame_bytes: u64,
    /// Frames per second a pipeline reading this camera among others
    /// (`cameras = [...]`) takes of it; absent: the pipeline's `fps`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fps: Option<f64>,
}

/// `cameras = ["gate", "yard"]`, or `cameras = "*"` for every `[[cameras]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum CameraList {
    Names(Vec<String>),
    /// Must be `"*"` (checked by `validate`).
    All(String),
}

/// Which frames of a compressed stream reach the decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decode {
    /// Keyframes only while every consumer's `fps` is at or below the
    /// keyframe rate observed on the stream; every frame otherwise.
    #[default]
    Auto,
    /// Every frame.
    All,
    /// Keyframes only (delta frames are dropped before the decoder).
    Keyframes,
}

impl Decode {
    pub fn as_str(self) -> &'static str {
        match self {
            Decode::Auto => "auto",
            Decode::All => "all",
            Decode::Keyframes => "keyframes",
        }
    }
}

/// `source = { type = "camera", ... }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CameraConfig {
    /// The `[[cameras]]` entry this pipeline reads (decoded once for all
    /// that name it). Without it the source is a camera of its own, set
    /// here with the keys of a `[[cameras]]` entry (`url` or `pipeline`,
    /// size, transport, stall_timeout, decode).
    #[serde(default)]
    pub camera: Option<String>,
    /// The `[[cameras]]` entries this pipeline reads, each a stream of it
    /// named after the camera (`"*"`: every entry). Not with `camera`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cameras: Option<CameraList>,
    #[serde(default)]
    pub url: Option<String>,
    #[serde(default)]
    pub pipeline: Option<String>,
    /// Frames per second handed to the pipeline (subsampled at the source,
    /// by the stream's timestamps); absent: every frame the camera sends.
    #[serde(default)]
    pub fps: Option<f64>,
    #[serde(default)]
    pub width: Option<u32>,
    #[serde(default)]
    pub height: Option<u32>,
    #[serde(default)]
    pub transport: Option<Transport>,
    #[serde(default, with = "humantime_serde")]
    pub stall_timeout: Option<Duration>,
    #[serde(default)]
    pub decode: Option<Decode>,
    #[serde(default, with = "crate::bytesize::option")]
    pub max_frame_bytes: Option<u64>,
    /// Frames waiting for inference, at most; the oldest is dropped
    /// (`stale`) for a new one. Replaces the pipeline's `queue`.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// The named camera's entry, filled in when the config is read.
    #[serde(skip)]
    pub resolved: Option<CameraDef>,
    /// With `cameras`: their entries, in the list's order (every entry in
    /// config order for `"*"`), filled in when the config is read.
    #[serde(skip)]
    pub resolved_many: Vec<CameraDef>,
}

pub(super) fn default_stall_timeout() -> Duration {
    Duration::from_secs(5)
}

/// 8 MiB: a 4K H.265 keyframe is 1-3 MB at the bitrates cameras use.
pub(super) fn default_max_frame_bytes() -> u64 {
    8 << 20
}

/// The bounds of `max_frame_bytes`: below the smallest keyframes, or
/// beyond any camera's, a setting is a mistake.
const MIN_FRAME_BYTES: u64 = 64 << 10;
const MAX_FRAME_BYTES: u64 = 1 << 30;

/// One frame waiting: its age stays under one inference plus one frame interval.
pub(super) fn default_queue() -> usize {
    1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Transport {
    #[default]
    Tcp,
    Udp,
}

/// The slowest `fps`: a frame every 1000 s.
const MIN_FPS: f64 = 0.001;

/// Largest `queue`: a camera that queues more is not "latest frame" any more.
const MAX_QUEUE: usize = 64;
/// Largest `width` or `height` (GStreamer caps hold them as 32-bit ints;
/// no camera comes near).
const MAX_SIDE: u32 = 16384;
/// The element a hand-written pipeline names its parser for keyframe-only
/// decoding: delta units are dropped at its source pad.
pub const PARSER_NAME: &str = "outpost_parse";

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

impl CameraDef {
    /// Every problem, each starting with `at` (`cameras[0]`, `pipelines[1].source`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        p.extend(needs_camera_build(at, cfg!(feature = "camera")));
        let mut url = None;
        match (&self.url, &self.pipeline) {
            (Some(_), Some(_)) => p.push(format!("{at}: set `url` or `pipeline`, not both")),
            (None, None) => p.push(format!("{at}: set `url` or `pipeline`")),
            (Some(u), None) => match CameraUrl::parse(u) {
                Ok(u) => url = Some(u),
                Err(e) => p.push(format!("{at}.url: {e}")),
            },
            (None, Some(pl)) => {
                if !pl.contains("appsink") || !pl.contains("name=outpost") {
                    p.push(format!(
                        "{at}.pipeline: must end in `appsink name=outpost` (where outpost takes the frames)"
                    ));
                }
            }
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
        if let Some(f) = self.fps
            && !(f.is_finite() && (MIN_FPS..=1000.0).contains(&f))
        {
            p.push(format!("{at}.fps: {f:?} is out of range 0.001..=1000"));
        }
        if !(MIN_FRAME_BYTES..=MAX_FRAME_BYTES).contains(&self.max_frame_bytes) {
            p.push(format!(
                "{at}.max_frame_bytes: {} is out of range 64 KiB..=1 GiB",
                self.max_frame_bytes
            ));
        }
        if self.decode == Decode::Keyframes {
            let compressed = match (&url, &self.pipeline) {
                (Some(CameraUrl::Rtsp { .. }), _) => true,
                (Some(_), _) => false,
                (None, Some(pl)) => pl.contains(&format!("name={PARSER_NAME}")),
                (None, None) => true,
            };
            if !compressed {
                p.push(format!(
                    "{at}.decode: `keyframes` needs a compressed stream: an rtsp url, or a \
                     pipeline whose parser is named `{PARSER_NAME}` (h264parse name={PARSER_NAME})"
                ));
            }
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

impl CameraConfig {
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        let named = match (&self.camera, &self.cameras) {
            (Some(_), Some(_)) => {
                p.push(format!(
                    "{at}.cameras: set `camera` (one camera) or `cameras` (several), not both"
                ));
                self.camera.as_ref().map(|n| format!("the camera `{n}`"))
            }
            (Some(n), None) => Some(format!("the camera `{n}`")),
            (None, Some(list)) => {
                match list {
                    CameraList::All(s) if s != "*" => p.push(format!(
                        "{at}.cameras: `{s}`: a list of camera names, or \"*\" for every [[cameras]] entry"
                    )),
                    CameraList::All(_) => {}
                    CameraList::Names(v) => {
                        if v.is_empty() {
                            p.push(format!("{at}.cameras: at least one camera"));
                        }
                        for (i, n) in v.iter().enumerate() {
                            if v[..i].contains(n) {
                                p.push(format!("{at}.cameras: `{n}` is listed twice"));
                            }
                        }
                    }
                }
                Some("the cameras'".to_string())
            }
            (None, None) => None,
        };
        match &named {
            Some(name) => {
                // The camera's own keys live on its entry: one place says
                // where a shared camera is and how it is decoded.
                let set = [
                    ("url", self.url.is_some()),
                    ("pipeline", self.pipeline.is_some()),
                    ("width", self.width.is_some()),
                    ("height", self.height.is_some()),
                    ("transport", self.transport.is_some()),
                    ("stall_timeout", self.stall_timeout.is_some()),
                    ("decode", self.decode.is_some()),
                    ("max_frame_bytes", self.max_frame_bytes.is_some()),
                ];
                for (key, _) in set.iter().filter(|(_, s)| *s) {
                    p.push(format!(
                        "{at}.{key}: set it on {name} entry ([[cameras]]), not on a pipeline that names it"
                    ));
                }
            }
            None => p.extend(self.inline_def("").validate(at)),
        }
        // Below one frame in 1000 s a pipeline would wait for its first
        // frame practically for ever (`1e-300` was accepted).
        if let Some(f) = self.fps
            && !(f.is_finite() && (MIN_FPS..=1000.0).contains(&f))
        {
            p.push(format!("{at}.fps: {f:?} is out of range 0.001..=1000"));
        }
        if self.queue == 0 || self.queue > MAX_QUEUE {
            p.push(format!(
                "{at}.queue: {} is out of range 1..={MAX_QUEUE}",
                self.queue
            ));
        }
        p
    }

    /// The camera an inline source describes, called `name`.
    pub fn inline_def(&self, name: &str) -> CameraDef {
        CameraDef {
            name: name.to_string(),
            url: self.url.clone(),
            pipeline: self.pipeline.clone(),
            width: self.width,
            height: self.height,
            transport: self.transport.unwrap_or_default(),
            stall_timeout: self.stall_timeout.unwrap_or_else(default_stall_timeout),
            decode: self.decode.unwrap_or_default(),
            max_frame_bytes: self.max_frame_bytes.unwrap_or_else(default_max_frame_bytes),
            fps: None,
        }
    }

    /// Whether the pipeline reads its cameras as streams of its own
    /// (`cameras = [...]`), each stream named after its camera.
    pub fn is_many(&self) -> bool {
        self.cameras.is_some()
    }

    /// The `[[cameras]]` entries this source names, by name, given every
    /// entry of the config (`all`): the one of `camera`, the list of
    /// `cameras`, or every entry for `"*"`; none for an inline camera.
    pub fn names<'a>(&'a self, all: &'a [CameraDef]) -> Vec<&'a str> {
        match (&self.camera, &self.cameras) {
            (Some(n), _) => vec![n.as_str()],
            (None, Some(CameraList::Names(v))) => v.iter().map(String::as_str).collect(),
            (None, Some(CameraList::All(_))) => all.iter().map(|c| c.name.as_str()).collect(),
            (None, None) => Vec::new(),
        }
    }

    /// The frames per second taken of `def` by a pipeline reading several
    /// cameras: the entry's own `fps`, else the pipeline's.
    pub fn fps_of(&self, def: &CameraDef) -> Option<f64> {
        def.fps.or(self.fps)
    }

    /// The camera this source reads: its `[[cameras]]` entry (once the
    /// config resolved it), or the inline one (called `pipeline`).
    pub fn def(&self, pipeline: &str) -> Option<CameraDef> {
        match &self.camera {
            Some(_) => self.resolved.clone(),
            None => Some(self.inline_def(pipeline)),
        }
    }

    /// What the camera is called in logs, status and records (no credentials).
    pub fn shown(&self) -> String {
        match self.def("") {
            Some(d) => d.shown(),
            None => format!("camera `{}`", self.camera.as_deref().unwrap_or("")),
        }
    }
}

/// The problems of a config's cameras as a whole: each entry, their names,
/// the names pipelines give (`named`: each pipeline's index and the camera
/// it names: `camera`, or each of its `cameras`), and entries no pipeline reads.
pub fn validate_cameras(cameras: &[CameraDef], named: &[(usize, &str, &str)]) -> Vec<String> {
    let mut p = Vec::new();
    for (i, c) in cameras.iter().enumerate() {
        let at = format!("cameras[{i}]");
        p.extend(c.validate(&at));
        if c.name.is_empty() || c.name.contains(['/', '+', '#', ' ']) {
            p.push(format!(
                "{at}.name: `{}` must be non-empty without '/', '+', '#' or spaces",
                c.name
            ));
        }
        if cameras[..i].iter().any(|o| o.name == c.name) {
            p.push(format!(
                "{at}.name: `{}` is the name of an earlier camera too",
                c.name
            ));
        }
        // An entry nothing reads would never be started: most likely a
        // pipeline meant it and misspelt it, or it was left behind.
        if !named.iter().any(|(_, _, n)| *n == c.name) {
            p.push(format!(
                "{at}.name: no pipeline reads camera `{}` (name it with source = {{ type = \"camera\", camera = \"{}\" }} or in a pipeline's `cameras`, or remove the entry)",
                c.name, c.name
            ));
        }
    }
    for (i, key, n) in named {
        if !cameras.iter().any(|c| c.name == *n) {
            let mut known: Vec<&str> = Vec::new();
            for c in cameras {
                if !known.contains(&c.name.as_str()) {
                    known.push(&c.name);
                }
            }
            p.push(format!(
                "pipelines[{i}].source.{}: no camera `{n}` in [[cameras]] ({})",
                key,
                if known.is_empty() {
                    "there is none".to_string()
                } else {
                    format!("cameras: {}", known.join(", "))
                }
            ));
        }
    }
    p
}
