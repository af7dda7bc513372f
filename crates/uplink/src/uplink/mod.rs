//! Uplinks to the fleet: drain the outbox, delete what the fleet acknowledged.
//!
//! Invariants (both uplinks):
//! - A record leaves the outbox only through `ack` after the fleet
//!   acknowledged the message or request that carried it (MQTT: the PUBACK
//!   of its QoS 1 publish; HTTP: a 2xx), or through `dead_letter` when the
//!   fleet refused it for good (HTTP 4xx other than 408/429, or a record
//!   that can never be encoded). Nothing else deletes.
//! - Delivery is at least once: anything not acknowledged is sent again
//!   (after a reconnect, a failed request, a restart), with the same `id`,
//!   so the fleet drops duplicates. Losses are not allowed; duplicates are.
//! - Oldest first per stream: records are read in outbox key order and a
//!   connection (or the single HTTP request in flight) carries them in
//!   that order.
//! - Inference never waits on the uplink: the uplink only reads the outbox
//!   (on the daemon's tokio runtime), the pipelines only append.
//! - Every wait is bounded or interruptible by `shutdown`; reconnects and
//!   retries back off exponentially with jitter.

mod http;
mod inflight;
mod message;
mod mqtt;
mod pace;
pub mod sparkplug;
mod stats;
pub mod tls;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use crate::outbox::Outbox;

pub use crate::backoff::Backoff;
pub use http::{Verdict, classify, idempotency_key, ndjson_gzip, parse_retry_after};
pub use inflight::{BookError, InFlight};
pub use message::{Batcher, Built, Message, PayloadFormat, Template, cbor_array_head};
pub use mqtt::{BrokerError, StateError};
pub use pace::TokenBucket;
pub use stats::UplinkStats;

/// `[uplink]` in the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum UplinkConfig {
    Mqtt(MqttConfig),
    Http(HttpConfig),
}

/// `[uplink] type = "mqtt"`: QoS 1 publishes to the fleet broker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MqttConfig {
    pub host: String,
    /// Default 1883, or 8883 with TLS.
    #[serde(default)]
    pub port: Option<u16>,
    /// Stable across restarts so the broker keeps the session; default `outpost-{device}`.
    #[serde(default)]
    pub client_id: Option<String>,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password: Option<String>,
    /// TLS through rustls; `ca`, `cert` and `key` need it.
    #[serde(default)]
    pub tls: bool,
    /// PEM CA bundle (default: the system's roots).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain and key, for mTLS.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// Topic of each message: `{device}`, `{pipeline}`, `{stream}`.
    #[serde(default = "default_topic")]
    pub topic: String,
    /// Retained "online" on connect, "offline" as last will and at stop: `{device}`.
    #[serde(default = "default_status_topic")]
    pub status_topic: String,
    /// Signed update commands for this device arrive here (subscribed at
    /// QoS 1 when `[ota]` is configured): `{device}`; "" = none.
    #[serde(default = "default_command_topic")]
    pub command_topic: String,
    /// Records of one topic per message (a JSON/CBOR array when > 1).
    #[serde(default = "default_batch")]
    pub batch: usize,
    /// `json`, `cbor`, or `sparkplug_b` (Sparkplug B births, data and death
    /// on `spBv1.0/{sparkplug_group}/...`; needs batch = 1).
    #[serde(default)]
    pub payload: PayloadFormat,
    /// Sparkplug B group id (with `payload = "sparkplug_b"`).
    #[serde(default = "default_sparkplug_group")]
    pub sparkplug_group: String,
    /// Sparkplug B: metrics one device (pipeline) declares at most. A birth
    /// that would go past it (or past `max_packet_bytes`) drops the least
    /// recently seen streams from the set (DDEATH, then the new DBIRTH);
    /// their next record declares them again.
    #[serde(default = "default_sparkplug_max_metrics")]
    pub sparkplug_max_metrics_per_device: usize,
    /// Sparkplug B: a device is born again (new streams, changed types, an
    /// NCMD rebirth) at most this often; a record that needs the new birth
    /// waits for it, and one birth then declares the new streams of every
    /// record queued behind it.
    #[serde(
        default = "default_sparkplug_rebirth_interval",
        with = "humantime_serde"
    )]
    pub sparkplug_rebirth_interval: Duration,
    /// Payload bytes per second at most (metered links); Sparkplug B births
    /// and deaths count too; 0 = no cap.
    #[serde(default, with = "crate::bytesize")]
    pub max_bytes_per_s: u64,
    /// Messages published and not yet acknowledged, at most.
    #[serde(default = "default_max_inflight")]
    pub max_inflight: u16,
    /// Largest message; a record larger than this is dead-lettered.
    #[serde(default = "default_max_packet", with = "crate::bytesize::usize")]
    pub max_packet_bytes: usize,
    #[serde(default = "default_keep_alive", with = "humantime_serde")]
    pub keep_alive: Duration,
    /// TCP + TLS + CONNECT/CONNACK must finish within this.
    #[serde(default = "default_connect_timeout", with = "humantime_serde")]
    pub connect_timeout: Duration,
    #[serde(default = "default_backoff_min", with = "humantime_serde")]
    pub backoff_min: Duration,
    #[serde(default = "default_backoff_max", with = "humantime_serde")]
    pub backoff_max: Duration,
}

/// `[uplink] type = "http"`: batched NDJSON POSTs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    pub url: String,
    /// Records per request, at most.
    #[serde(default = "default_batch_records")]
    pub batch_records: usize,
    /// Whole request, connect to the end of the response.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Extra request headers (e.g. Authorization).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub ca: Option<PathBuf>,
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// Compressed bytes per second at most; 0 = no cap.
    #[serde(default, with = "crate::bytesize")]
    pub max_bytes_per_s: u64,
    #[serde(default = "default_backoff_min", with = "humantime_serde")]
    pub backoff_min: Duration,
    #[serde(default = "default_backoff_max", with = "humantime_serde")]
    pub backoff_max: Duration,
}

fn default_topic() -> String {
    "outpost/{device}/{pipeline}/{stream}".into()
}
fn default_sparkplug_group() -> String {
    "outpost".into()
}
fn default_sparkplug_max_metrics() -> usize {
    4096
}
fn default_sparkplug_rebirth_interval() -> Duration {
    Duration::from_secs(2)
}

fn default_status_topic() -> String {
    "outpost/{device}/status".into()
}
fn default_command_topic() -> String {
    "outpost/{device}/cmd".into()
}
fn default_batch() -> usize {
    1
}
fn default_max_inflight() -> u16 {
    256
}
fn default_max_packet() -> usize {
    1 << 20
}

/// The largest record the uplink sends whole: MQTT's `max_packet_bytes`;
/// the HTTP uplink (no packet limit of its own) and no uplink take the same
/// default. What a producer of large records (a busy frame's tracking
/// events) splits them to fit.
pub fn max_record_bytes(uplink: Option<&UplinkConfig>) -> usize {
    match uplink {
        Some(UplinkConfig::Mqtt(m)) => m.max_packet_bytes,
        Some(UplinkConfig::Http(_)) | None => default_max_packet(),
    }
}
fn default_keep_alive() -> Duration {
    Duration::from_secs(30)
}
fn default_connect_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_backoff_min() -> Duration {
    Duration::from_millis(200)
}
fn default_backoff_max() -> Duration {
    Duration::from_secs(30)
}
fn default_batch_records() -> usize {
    500
}
fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

const TOPIC_VARS: &[&str] = &["device", "pipeline", "stream"];
const STATUS_VARS: &[&str] = &["device"];

fn check_backoff(min: Duration, max: Duration, p: &mut Vec<String>) {
    if min.is_zero() {
        p.push("uplink.backoff_min must be above 0".into());
    }
    if min > max {
        p.push(format!(
            "uplink.backoff_min ({min:?}) is above uplink.backoff_max ({max:?})"
        ));
    }
}

fn check_files(
    ca: &Option<PathBuf>,
    cert: &Option<PathBuf>,
    key: &Option<PathBuf>,
    p: &mut Vec<String>,
) {
    if cert.is_some() != key.is_some() {
        p.push("uplink.cert and uplink.key go together (mTLS)".into());
    }
    for (name, f) in [("ca", ca), ("cert", cert), ("key", key)] {
        if let Some(f) = f
            && !f.is_file()
        {
            p.push(format!("uplink.{name}: {} does not exist", f.display()));
        }
    }
}

impl UplinkConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            UplinkConfig::Mqtt(_) => "mqtt",
            UplinkConfig::Http(_) => "http",
        }
    }

    /// Every problem at once.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        match self {
            UplinkConfig::Mqtt(c) => {
                if c.host.trim().is_empty() {
                    p.push("uplink.host is empty".into());
                }
                if let Err(e) = Template::parse(&c.topic, TOPIC_VARS) {
                    p.push(format!("uplink.topic: {e}"));
                }
                if !c.command_topic.is_empty()
                    && let Err(e) = Template::parse(&c.command_topic, STATUS_VARS)
                {
                    p.push(format!("uplink.command_topic: {e}"));
                }
                if let Err(e) = Template::parse(&c.status_topic, STATUS_VARS) {
                    p.push(format!("uplink.status_topic: {e}"));
                }
                if c.payload == PayloadFormat::SparkplugB {
                    if c.batch != 1 {
                        p.push(format!(
                            "uplink.batch must be 1 with payload = \"sparkplug_b\" (one DDATA per record), not {}",
                            c.batch
                        ));
                    }
                    if sparkplug::bad_id(&c.sparkplug_group) {
                        p.push(format!(
                            "uplink.sparkplug_group: `{}` must be non-empty without '/', '+' or '#'",
                            c.sparkplug_group
                        ));
                    }
                    if !(1..=1_000_000).contains(&c.sparkplug_max_metrics_per_device) {
                        p.push(format!(
                            "uplink.sparkplug_max_metrics_per_device must be 1..=1000000, not {}",
                            c.sparkplug_max_metrics_per_device
                        ));
                    }
                    if c.sparkplug_rebirth_interval > Duration::from_secs(3600) {
                        p.push(format!(
                            "uplink.sparkplug_rebirth_interval must be at most 1h, not {:?}",
                            c.sparkplug_rebirth_interval
                        ));
                    }
                }
                if !(1..=10_000).contains(&c.batch) {
                    p.push(format!("uplink.batch must be 1..=10000, not {}", c.batch));
                }
                if c.max_inflight == 0 {
                    p.push("uplink.max_inflight must be at least 1".into());
                }
                if c.max_packet_bytes < 1024 || c.max_packet_bytes > 256 << 20 {
                    p.push(format!(
                        "uplink.max_packet_bytes must be 1 KiB..256 MiB, not {}",
                        c.max_packet_bytes
                    ));
                }
                if !c.keep_alive.is_zero() && c.keep_alive < Duration::from_secs(1) {
                    p.push("uplink.keep_alive must be 0 or at least 1s".into());
                }
                if c.connect_timeout < Duration::from_secs(1) {
                    p.push("uplink.connect_timeout must be at least 1s".into());
                }
                if c.client_id.as_deref() == Some("") {
                    p.push("uplink.client_id is empty (a persistent session needs one)".into());
                }
                if !c.tls && (c.ca.is_some() || c.cert.is_some() || c.key.is_some()) {
                    p.push("uplink.ca/cert/key need uplink.tls = true".into());
                }
                check_files(&c.ca, &c.cert, &c.key, &mut p);
                check_backoff(c.backoff_min, c.backoff_max, &mut p);
            }
            UplinkConfig::Http(c) => {
                match reqwest::Url::parse(&c.url) {
                    Ok(u) if matches!(u.scheme(), "http" | "https") => {}
                    Ok(u) => p.push(format!(
                        "uplink.url: scheme `{}` is not http or https",
                        u.scheme()
                    )),
                    Err(e) => p.push(format!("uplink.url `{}`: {e}", c.url)),
                }
                if !(1..=100_000).contains(&c.batch_records) {
                    p.push(format!(
                        "uplink.batch_records must be 1..=100000, not {}",
                        c.batch_records
                    ));
                }
                if c.timeout.is_zero() {
                    p.push("uplink.timeout must be above 0".into());
                }
                for (k, v) in &c.headers {
                    if reqwest::header::HeaderName::from_bytes(k.as_bytes()).is_err() {
                        p.push(format!("uplink.headers: `{k}` is not a header name"));
                    }
                    if reqwest::header::HeaderValue::from_str(v).is_err() {
                        p.push(format!("uplink.headers.{k}: not a valid header value"));
                    }
                }
                check_files(&c.ca, &c.cert, &c.key, &mut p);
                check_backoff(c.backoff_min, c.backoff_max, &mut p);
            }
        }
        p
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error("uplink: {0}")]
    Setup(String),
    #[error("uplink: invalid config: {}", .0.join("; "))]
    Invalid(Vec<String>),
    #[error("uplink TLS: {}: {detail}", path.display())]
    Tls { path: PathBuf, detail: String },
    /// The broker connection failed: it ends and is made again after a
    /// backoff (what was in flight goes again).
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A local outbox operation failed (a full disk, an I/O error): counted,
    /// logged at a limited rate and retried after a backoff while the
    /// broker connection stays up.
    #[error("outbox {op}: {source}")]
    Outbox {
        op: OutboxOp,
        source: crate::outbox::OutboxError,
    },
}

/// The outbox operations of an uplink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutboxOp {
    Read,
    Ack,
    DeadLetter,
}

impl std::fmt::Display for OutboxOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            OutboxOp::Read => "read",
            OutboxOp::Ack => "ack",
            OutboxOp::DeadLetter => "dead letter",
        })
    }
}

/// A running uplink.
pub struct Uplink {
    pub stats: Arc<UplinkStats>,
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts the uplink on the current tokio runtime; it drains `outbox` until
/// `shutdown` is cancelled.
pub fn start(
    cfg: &UplinkConfig,
    outbox: Outbox,
    device: &str,
    shutdown: CancellationToken,
) -> Result<Uplink, UplinkError> {
    start_with_commands(cfg, outbox, device, None, shutdown)
}

/// [`start`], and for an MQTT uplink with a `command_topic`: subscribes to
/// it and hands each message's payload to `commands` (a full channel drops
/// the message, counted and logged; the broker's QoS 1 delivery is already
/// acknowledged, the fleet sends again when the device says nothing).
pub fn start_with_commands(
    cfg: &UplinkConfig,
    outbox: Outbox,
    device: &str,
    commands: Option<tokio::sync::mpsc::Sender<Vec<u8>>>,
    shutdown: CancellationToken,
) -> Result<Uplink, UplinkError> {
    let problems = cfg.validate();
    if !problems.is_empty() {
        return Err(UplinkError::Invalid(problems));
    }
    let stats = Arc::new(UplinkStats::new(cfg.kind()));
    let task = match cfg {
        UplinkConfig::Mqtt(c) => mqtt::spawn(
            c.clone(),
            outbox,
            device,
            stats.clone(),
            commands,
            Time::real(),
            shutdown,
        )?,
        UplinkConfig::Http(c) => http::spawn(
            c.clone(),
            outbox,
            device,
            stats.clone(),
            Time::real(),
            shutdown,
        )?,
    };
    Ok(Uplink { stats, task })
}

/// What an uplink reads the time from and draws its backoff from: handed
/// in, so the sessions run on simulated clocks and a seed in tests.
pub struct Time {
    pub clocks: Arc<dyn crate::clock::clocks::Clocks>,
    pub jitter: Box<dyn crate::backoff::Jitter>,
}

impl Time {
    /// The machine's clocks and the thread's random generator.
    pub fn real() -> Time {
        Time {
            clocks: Arc::new(crate::clock::clocks::RealClocks),
            jitter: Box::new(crate::backoff::ThreadJitter),
        }
    }
}

/// Sleeps `d` unless `shutdown` is cancelled first; true when it was.
async fn sleep_or_stop(d: Duration, shutdown: &CancellationToken) -> bool {
    if shutdown.is_cancelled() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = shutdown.cancelled() => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<UplinkConfig, toml::de::Error> {
        #[derive(Deserialize)]
        struct W {
            uplink: UplinkConfig,
        }
        toml::from_str::<W>(s).map(|w| w.uplink)
    }

    #[test]
    fn mqtt_config_defaults() {
        let c = parse("[uplink]\ntype = \"mqtt\"\nhost = \"fleet\"").unwrap();
        let UplinkConfig::Mqtt(m) = &c else {
            panic!("{c:?}")
        };
        assert_eq!(m.topic, "outpost/{device}/{pipeline}/{stream}");
        assert_eq!(m.status_topic, "outpost/{device}/status");
        assert_eq!((m.batch, m.max_inflight, m.max_bytes_per_s), (1, 256, 0));
        assert_eq!(m.backoff_min, Duration::from_millis(200));
        assert_eq!(m.backoff_max, Duration::from_secs(30));
        assert_eq!(m.payload, PayloadFormat::Json);
        assert_eq!(m.sparkplug_max_metrics_per_device, 4096);
        assert_eq!(m.sparkplug_rebirth_interval, Duration::from_secs(2));
        assert!(!m.tls);
        assert!(c.validate().is_empty(), "{:?}", c.validate());
    }

    #[test]
    fn http_config_defaults_and_headers() {
        let c = parse(
            "[uplink]\ntype = \"http\"\nurl = \"https://fleet.example/ingest\"\n[uplink.headers]\nAuthorization = \"Bearer x\"",
        )
        .unwrap();
        let UplinkConfig::Http(h) = &c else {
            panic!("{c:?}")
        };
        assert_eq!(h.batch_records, 500);
        assert_eq!(h.timeout, Duration::from_secs(10));
        assert_eq!(h.headers["Authorization"], "Bearer x");
        assert!(c.validate().is_empty(), "{:?}", c.validate());
    }

    #[test]
    fn unknown_keys_are_refused() {
        let e = parse("[uplink]\ntype = \"mqtt\"\nhost = \"h\"\nbatchh = 3").unwrap_err();
        assert!(e.to_string().contains("batchh"), "{e}");
        assert!(parse("[uplink]\ntype = \"http\"\nurl = \"http://h\"\nbatch = 3").is_err());
        assert!(parse("[uplink]\ntype = \"carrier_pigeon\"").is_err());
    }

    #[test]
    fn validate_lists_every_problem() {
        let c = parse(
            r#"[uplink]
type = "mqtt"
host = ""
topic = "o/{nope}/#"
status_topic = "o/{stream}"
batch = 0
max_inflight = 0
ca = "/nonexistent/ca.pem"
cert = "/nonexistent/c.pem"
backoff_min = "2s"
backoff_max = "1s"
"#,
        )
        .unwrap();
        let p = c.validate();
        for want in [
            "uplink.host",
            "uplink.topic",
            "uplink.status_topic",
            "uplink.batch",
            "uplink.max_inflight",
            "need uplink.tls",
            "cert and uplink.key",
            "/nonexistent/ca.pem",
            "backoff_min",
        ] {
            assert!(p.iter().any(|x| x.contains(want)), "{want} missing: {p:#?}");
        }
        let c = parse(
            "[uplink]\ntype = \"http\"\nurl = \"ftp://x\"\nbatch_records = 0\ntimeout = \"0s\"\n[uplink.headers]\n\"bad name\" = \"v\"",
        )
        .unwrap();
        let p = c.validate();
        assert_eq!(p.len(), 4, "{p:#?}");
    }
}
