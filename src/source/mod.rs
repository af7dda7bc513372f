//! Frame sources: where a pipeline's frames come from. One file per kind,
//! each behind the [`Source`] trait, chosen by the closed [`SourceConfig`]
//! enum (`type = "mqtt" | "udp" | "unix" | "http" | "watch" | "replay"`).

pub mod framing;
pub mod http;
pub mod mqtt;
pub mod replay;
pub mod udp;
pub mod unix;
pub mod watch;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, watch as tokio_watch};

use tokio::sync::Notify;

use crate::record::ResultRecord;

/// One frame as it arrives: which stream it belongs to and its bytes.
pub struct Frame {
    pub stream: Arc<str>,
    pub payload: Bytes,
    pub received: Instant,
    /// Answered with the records the frame produced (http source, watch source).
    pub reply: Option<oneshot::Sender<Result<Vec<ResultRecord>, String>>>,
}

impl Frame {
    pub fn new(stream: impl Into<Arc<str>>, payload: Bytes) -> Frame {
        Frame {
            stream: stream.into(),
            payload,
            received: Instant::now(),
            reply: None,
        }
    }
}

/// Where a pipeline gets its frames.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum SourceConfig {
    /// Subscribe to topics on the site's broker (or the embedded one).
    Mqtt {
        topics: Vec<String>,
        /// 0 or 1.
        #[serde(default)]
        qos: u8,
        /// How a message's stream is named.
        #[serde(default)]
        stream: StreamName,
    },
    /// One frame per datagram.
    Udp {
        listen: SocketAddr,
        #[serde(default)]
        framing: Framing,
    },
    /// A Unix-domain stream socket with length-prefixed frames
    /// (u32 little-endian length, then that many bytes).
    Unix {
        path: PathBuf,
        #[serde(default)]
        framing: Framing,
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
}

fn default_poll() -> Duration {
    Duration::from_millis(500)
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
        }
    }

    /// Every problem, prefixed with `at` (e.g. `pipelines[0].source`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        match self {
            SourceConfig::Mqtt { topics, qos, .. } => {
                if topics.is_empty() {
                    p.push(format!("{at}.topics: at least one topic"));
                }
                if *qos > 1 {
                    p.push(format!("{at}.qos: {qos} (0 or 1)"));
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
            SourceConfig::Unix { path, .. } if path.as_os_str().is_empty() => {
                p.push(format!("{at}.path: empty"));
            }
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
            } => Box::new(mqtt::MqttSource {
                topics,
                qos,
                stream,
            }),
            SourceConfig::Udp { listen, framing } => Box::new(udp::UdpSource { listen, framing }),
            SourceConfig::Unix { path, framing } => Box::new(unix::UnixSource { path, framing }),
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
    pub shutdown: tokio_watch::Receiver<bool>,
    /// The MQTT broker the mqtt sources connect to (site broker or the embedded one).
    pub mqtt: Option<mqtt::BrokerAddr>,
    /// For the watch source: the durable store, to wait for its records to be on disk.
    pub outbox: Option<crate::outbox::Outbox>,
    pub data_dir: PathBuf,
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
                    let mut stop = self.shutdown.clone();
                    tokio::select! {
                        _ = space.notified() => {}
                        // Bounded wait: a notification may race with the retry.
                        _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                        _ = stop.changed() => return false,
                    }
                    if *self.shutdown.borrow() {
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
        *self.shutdown.borrow()
    }

    /// Says what the source is doing (`connected`, `reconnecting`, ...),
    /// shown by `/v1/status` and the console.
    pub fn set_state(&self, state: &'static str) {
        self.sink.set_state(state);
    }

    /// Resolves when the daemon begins to stop.
    pub async fn stopped(&self) {
        let mut s = self.shutdown.clone();
        while !*s.borrow() {
            if s.changed().await.is_err() {
                return;
            }
        }
    }
}

/// A running source.
pub trait Source: Send {
    /// Starts the source; it runs until `ctx.shutdown` turns true.
    /// Setup failures (address in use, broker unreachable at start is NOT one:
    /// it retries) are returned before anything is spawned.
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError>;
}
