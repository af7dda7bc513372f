//! Frame sources: where a pipeline's frames come from. One file per kind,
//! each behind the [`Source`] trait, chosen by the closed [`SourceConfig`]
//! enum (`type = "mqtt" | "udp" | "unix" | "http" | "watch" | "replay" | "camera" | "modbus"`).

pub mod acks;
pub mod camera;
pub mod framing;
pub mod http;
pub mod modbus;
pub mod mqtt;
mod qos1;
pub mod replay;
pub mod udp;
pub mod unix;
pub mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use tokio::sync::Notify;

use crate::preprocess::raw::RawImage;
use crate::record::ResultRecord;

/// One frame as it arrives: which stream it belongs to and its bytes.
pub struct Frame {
    pub stream: Arc<str>,
    pub payload: Bytes,
    pub received: Instant,
    /// Answered with the records the frame produced (http source, watch source).
    pub reply: Option<oneshot::Sender<Result<Vec<ResultRecord>, FrameError>>>,
    /// The payload is a decoded frame of this size and layout (cameras:
    /// RGB or I420): image preprocessing takes it as is, whatever its
    /// configured format.
    pub raw: Option<RawImage>,
    /// When the frame was captured (cameras); records carry it, and the
    /// frame-age metric runs from it.
    pub captured: Option<SystemTime>,
}

/// Why a frame gave no records, sorted by who can do something about it
/// (the HTTP source answers by it; the watch source keeps a file for a
/// later scan when the condition passes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameErrorKind {
    /// The payload cannot be decoded or does not fit the model: the sender's.
    Malformed,
    /// Inference or postprocessing failed: the model's or the engine's.
    Engine,
    /// The record cannot be stored now (outbox full, disk full): try later.
    Unavailable,
    /// The record cannot be stored, and waiting will not change that.
    Store,
    /// Dropped from the pipeline's full queue by its `when_full` policy
    /// (counted under that reason).
    Dropped,
}

/// A frame's failure with its kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{detail}")]
pub struct FrameError {
    pub kind: FrameErrorKind,
    pub detail: String,
}

impl FrameError {
    pub fn new(kind: FrameErrorKind, detail: impl Into<String>) -> FrameError {
        FrameError {
            kind,
            detail: detail.into(),
        }
    }
}

impl Frame {
    pub fn new(stream: impl Into<Arc<str>>, payload: Bytes) -> Frame {
        Frame {
            stream: stream.into(),
            payload,
            received: Instant::now(),
            reply: None,
            raw: None,
            captured: None,
        }
    }
}

/// Where a pipeline gets its frames.
// One per pipeline, read once at start: the camera variant's size is of no matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceConfig {
    /// Subscribe to topics on the site's broker (or the embedded one).
    Mqtt {
        topics: Vec<String>,
        /// 0 or 1. With 1 the session is persistent (a stable client id,
        /// clean_session = false): the broker keeps what is published while
        /// the daemon restarts, and a message is acknowledged only once its
        /// records are durable in the outbox (or it gave none, or a policy
        /// the config chose dropped it, counted). The pipeline's
        /// `when_full` then defaults to `block`.
        #[serde(default)]
        qos: u8,
        /// How a message's stream is named.
        #[serde(default)]
        stream: StreamName,
        /// Larger messages are read, counted (`too_large`) and dropped; the
        /// connection and the messages after them are kept.
        #[serde(default = "default_max_message_bytes")]
        max_message_bytes: usize,
        /// QoS 1: messages held unacknowledged at most. At the bound the
        /// source reads nothing more from the broker until acknowledgements
        /// go out (the broker's own in-flight window is not relied on:
        /// mosquitto 2.0 sends past it).
        #[serde(default = "default_max_inflight")]
        max_inflight: usize,
    },
    /// One frame per datagram.
    Udp {
        listen: SocketAddr,
        #[serde(default)]
        framing: Framing,
        /// The socket's receive buffer (SO_RCVBUF), which holds datagrams
        /// while the pipeline is busy; a datagram that finds it full is
        /// dropped by the kernel and counted (`kernel_overflow`). Unset: the
        /// system's default (net.core.rmem_default); above net.core.rmem_max
        /// only with CAP_NET_ADMIN. The size granted is logged at start.
        #[serde(default)]
        recv_buffer_bytes: Option<usize>,
    },
    /// A Unix-domain stream socket with length-prefixed frames
    /// (u32 little-endian length, then that many bytes).
    Unix {
        path: PathBuf,
        #[serde(default)]
        framing: Framing,
        /// Connections served at once; one more is closed and counted
        /// (`too_many_connections`).
        #[serde(default = "default_unix_max_connections")]
        max_connections: usize,
        /// Bytes of frames being read, all connections together. Half of it
        /// is one share per connection (a frame that fits is read at once,
        /// whatever the others do); larger frames wait for room in the other
        /// half before they are read (their bytes are never allocated
        /// ahead). A frame larger than that half is refused (`frame_too_large`).
        #[serde(default = "default_unix_max_buffered")]
        max_buffered_bytes: usize,
        /// Once a frame's first byte is in, the rest of it must arrive within
        /// this; a writer that stalls inside a frame is closed and counted
        /// (`frame_read_timeout`), and the room its frame held goes back.
        #[serde(default = "default_unix_frame_read_timeout", with = "humantime_serde")]
        frame_read_timeout: Duration,
    },
    /// `POST /v1/pipelines/{name}/infer` on the local API; answers with the result.
    Http {},
    /// A directory of files dropped by another system; each processed once,
    /// then moved to `done/` or `failed/` (with the reason beside it).
    Watch {
        dir: PathBuf,
        /// How often the directory is scanned.
        #[serde(default = "default_poll", with = "humantime_serde")]
        poll_interval: Duration,
        /// File extensions taken (lowercase, without the dot); empty = every file.
        #[serde(default)]
        extensions: Vec<String>,
    },
    /// A recorded file of frames (see `replay.rs` for the format).
    Replay {
        file: PathBuf,
        /// `recorded` keeps the recorded timing, `max` replays as fast as the pipeline takes it.
        #[serde(default)]
        speed: ReplaySpeed,
        /// Start over at the end.
        #[serde(default)]
        repeat: bool,
    },
    /// A camera through GStreamer (feature `camera`): `url` (rtsp, v4l2,
    /// csi) or `pipeline`; see `camera.rs`.
    Camera(camera::CameraConfig),
    /// Registers (or coils) of a PLC polled over Modbus TCP (feature
    /// `modbus`): each poll is one sensor frame, a JSON array of the values.
    Modbus(crate::floor::ModbusSourceConfig),
}

fn default_poll() -> Duration {
    Duration::from_millis(500)
}

fn default_unix_max_connections() -> usize {
    64
}
fn default_unix_max_buffered() -> usize {
    128 << 20
}
/// A local writer sends a whole frame in milliseconds; seconds of silence
/// inside one mean it stalled.
fn default_unix_frame_read_timeout() -> Duration {
    Duration::from_secs(5)
}

/// Default `max_message_bytes` of an mqtt source: 16 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

fn default_max_message_bytes() -> usize {
    DEFAULT_MAX_MESSAGE_BYTES
}

/// Default `max_inflight` of a QoS 1 mqtt source.
pub const DEFAULT_MAX_INFLIGHT: usize = 100;

fn default_max_inflight() -> usize {
    DEFAULT_MAX_INFLIGHT
}

/// How an MQTT message names its stream.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamName {
    /// The whole topic.
    #[default]
    Topic,
    /// One `/`-separated segment of the topic (0-based), e.g. `sensors/{id}/audio` -> 1.
    TopicSegment(usize),
}

/// Datagram / frame body layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Framing {
    /// The body is the payload; the stream is the peer (datagram sender, or `conn-N`).
    #[default]
    Raw,
    /// The body starts with the stream name: one length byte, then the name.
    Named,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplaySpeed {
    #[default]
    Recorded,
    Max,
}

impl SourceConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            SourceConfig::Mqtt { .. } => "mqtt",
            SourceConfig::Udp { .. } => "udp",
            SourceConfig::Unix { .. } => "unix",
            SourceConfig::Http {} => "http",
            SourceConfig::Watch { .. } => "watch",
            SourceConfig::Replay { .. } => "replay",
            SourceConfig::Camera(_) => "camera",
            SourceConfig::Modbus(_) => "modbus",
        }
    }

    /// Every problem, prefixed with `at` (e.g. `pipelines[0].source`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        match self {
            SourceConfig::Mqtt {
                topics,
                qos,
                max_message_bytes,
                max_inflight,
                ..
            } => {
                if topics.is_empty() {
                    p.push(format!("{at}.topics: at least one topic"));
                }
                if *qos > 1 {
                    p.push(format!("{at}.qos: {qos} (0 or 1)"));
                }
                if *max_message_bytes == 0 || *max_message_bytes > mqtt::MQTT_MAX_PACKET {
                    p.push(format!(
                        "{at}.max_message_bytes: {max_message_bytes} (1 to {})",
                        mqtt::MQTT_MAX_PACKET
                    ));
                }
                // Packet ids are 16 bits: no broker has more in flight.
                if *max_inflight == 0 || *max_inflight > usize::from(u16::MAX) {
                    p.push(format!("{at}.max_inflight: {max_inflight} (1 to 65535)"));
                }
            }
            SourceConfig::Watch {
                dir, poll_interval, ..
            } => {
                if dir.as_os_str().is_empty() {
                    p.push(format!("{at}.dir: empty"));
                }
                if poll_interval.is_zero() {
                    p.push(format!("{at}.poll_interval: must be > 0"));
                }
            }
            // A replay file is opened (and its absence reported) when the pipeline starts:
            // a config is often checked on another machine than the one that runs it.
            SourceConfig::Replay { file, .. } if file.as_os_str().is_empty() => {
                p.push(format!("{at}.file: empty"));
            }
            SourceConfig::Unix {
                path,
                max_connections,
                max_buffered_bytes,
                frame_read_timeout,
                ..
            } => {
                if frame_read_timeout.is_zero() {
                    p.push(format!("{at}.frame_read_timeout: must be above 0"));
                }
                if path.as_os_str().is_empty() {
                    p.push(format!("{at}.path: empty"));
                }
                if *max_connections == 0 {
                    p.push(format!("{at}.max_connections: must be at least 1"));
                }
                if *max_buffered_bytes < 1024 || *max_buffered_bytes > u32::MAX as usize {
                    p.push(format!(
                        "{at}.max_buffered_bytes: {max_buffered_bytes} (1024 to {})",
                        u32::MAX
                    ));
                }
            }
            SourceConfig::Udp {
                recv_buffer_bytes: Some(n),
                ..
            } if *n == 0 || *n > i32::MAX as usize => {
                p.push(format!("{at}.recv_buffer_bytes: {n} (1 to {})", i32::MAX));
            }
            SourceConfig::Camera(c) => p.extend(c.validate(at)),
            SourceConfig::Modbus(m) => p.extend(crate::floor::source_problems(m, at)),
            _ => {}
        }
        p
    }

    pub fn build(&self) -> Box<dyn Source> {
        match self.clone() {
            SourceConfig::Mqtt {
                topics,
                qos,
                stream,
                max_message_bytes,
                max_inflight,
            } => Box::new(mqtt::MqttSource {
                topics,
                qos,
                stream,
                max_message_bytes,
                max_inflight,
            }),
            SourceConfig::Udp {
                listen,
                framing,
                recv_buffer_bytes,
            } => Box::new(udp::UdpSource {
                listen,
                framing,
                recv_buffer_bytes,
            }),
            SourceConfig::Unix {
                path,
                framing,
                max_connections,
                max_buffered_bytes,
                frame_read_timeout,
            } => Box::new(unix::UnixSource {
                path,
                framing,
                max_connections,
                max_buffered_bytes,
                frame_read_timeout,
            }),
            SourceConfig::Http {} => Box::new(http::HttpSource),
            SourceConfig::Watch {
                dir,
                poll_interval,
                extensions,
            } => Box::new(watch::WatchSource {
                dir,
                poll_interval,
                extensions,
            }),
            SourceConfig::Replay {
                file,
                speed,
                repeat,
            } => Box::new(replay::ReplaySource {
                file,
                speed,
                repeat,
            }),
            SourceConfig::Camera(cfg) => Box::new(camera::CameraSource { cfg }),
            SourceConfig::Modbus(cfg) => Box::new(modbus::ModbusSource { cfg }),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("pipeline `{pipeline}` ({kind} source): {detail}")]
    Setup {
        pipeline: String,
        kind: &'static str,
        detail: String,
    },
}

/// The narrow way into a pipeline, all a source may do with its frames:
/// offer one, wait for room, count one it could not hand in. The scheduler
/// implements it; sources never hold the scheduler itself.
pub trait FrameSink: Send + Sync {
    /// Queues a frame. `Err(frame)` only when the pipeline's queue is full
    /// and its policy is to block: wait on [`FrameSink::space`], then retry.
    fn offer(&self, frame: Frame) -> Result<(), Frame>;
    /// Notified when the queue has room again.
    fn space(&self) -> Arc<Notify>;
    /// Counts (and logs, rate-limited) a frame dropped before it reached the queue.
    fn count_drop(&self, reason: &'static str, detail: &str);
    /// Says what the source is doing (`connected`, `reconnecting`, ...),
    /// shown by `/v1/status` and the console.
    fn set_state(&self, state: &'static str);
}

/// What a running source gets: where to put frames and when to stop.
#[derive(Clone)]
pub struct SourceCtx {
    pub pipeline: String,
    pub sink: Arc<dyn FrameSink>,
    /// Cancelled when the source must stop.
    pub shutdown: CancellationToken,
    /// The MQTT broker the mqtt sources connect to (site broker or the embedded one).
    pub mqtt: Option<mqtt::BrokerAddr>,
    /// For the watch source: the durable store, to wait for its records to be on disk.
    pub outbox: Option<crate::outbox::Outbox>,
    /// Where a source's status records go (camera_up / camera_down).
    pub events: Option<crate::record::Events>,
    /// For a camera source: the state its pipeline shows (`/v1/status`).
    pub camera: Option<Arc<camera::CameraState>>,
    pub data_dir: PathBuf,
    /// The generation's connections to PLCs, shared by its modbus sources
    /// (one per target).
    pub modbus: Arc<crate::floor::Hub>,
}

impl SourceCtx {
    /// Hands a frame to the pipeline's queue; with `when_full = "block"`, waits for room.
    /// Returns false when the daemon is stopping.
    pub async fn submit(&self, mut frame: Frame) -> bool {
        loop {
            match self.sink.offer(frame) {
                Ok(()) => return true,
                Err(back) => {
                    frame = back;
                    let space = self.sink.space();
                    tokio::select! {
                        _ = space.notified() => {}
                        // Bounded wait: a notification may race with the retry.
                        _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                        _ = self.shutdown.cancelled() => return false,
                    }
                    if self.shutdown.is_cancelled() {
                        return false;
                    }
                }
            }
        }
    }

    /// Counts (and logs, rate-limited) a frame dropped before it reached the queue.
    pub fn count_drop(&self, reason: &'static str, detail: &str) {
        self.sink.count_drop(reason, detail);
    }

    pub fn stopping(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Says what the source is doing (`connected`, `reconnecting`, ...),
    /// shown by `/v1/status` and the console.
    pub fn set_state(&self, state: &'static str) {
        self.sink.set_state(state);
    }

    /// Resolves when the daemon begins to stop.
    pub async fn stopped(&self) {
        self.shutdown.cancelled().await
    }
}

/// A running source.
pub trait Source: Send {
    /// Starts the source; it runs until `ctx.shutdown` is cancelled.
    /// Setup failures (address in use, broker unreachable at start is NOT one:
    /// it retries) are returned before anything is spawned.
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError>;
}
