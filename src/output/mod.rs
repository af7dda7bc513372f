//! Local outputs: a pipeline's records straight to consumers on the site (a
//! PLC gateway, a valve controller, a light), apart from the outbox and the
//! fleet uplink.
//!
//! ```toml
//! outputs = [
//!   { type = "mqtt", topic = "site/{pipeline}/{stream}" },  # the site broker (or the embedded one), QoS 0
//!   { type = "udp", to = "127.0.0.1:9500" },                # one datagram per record
//!   { type = "unix", path = "/run/outpost/vad.sock" },      # u32 LE length + record, to every connected reader
//!   { type = "modbus", target = "10.0.0.5:502", registers = [    # fields written into a PLC's registers
//!       { field = "/top/0/index", address = 100, kind = "u16" } ] },
//! ]
//! ```
//!
//! A modbus output (feature `modbus`, crates/modbus) takes the record's
//! `outputs`, not its bytes: the inference thread only updates the output's
//! pending values (newest wins per register) and wakes its task, which
//! writes them; a slow or absent PLC replaces values, it never blocks.
//! `[modbus_server]` is fed the same way, through each pipeline's outputs.
//!
//! Invariants:
//! - Sending never blocks the inference thread and never waits for the
//!   outbox or the uplink: the worker hands the record over right after it
//!   is made (before it is stored). UDP datagrams and unix frames are
//!   written from the worker itself with non-blocking calls; MQTT publishes
//!   go to the output's client queue with `try_publish`.
//! - A slow or absent peer drops the record for that output, counted by
//!   output and reason (`outpost_output_dropped_total`); nothing is retried
//!   (the outbox is where a result is kept).
//! - Each output recovers by itself: the MQTT client reconnects with
//!   backoff, a UDP peer that comes back gets the next datagram, unix readers
//!   connect and disconnect at any time.
//! - The payload is the record the outbox stores (same id), as the same
//!   JSON bytes, or its CBOR encoding with `payload = "cbor"`.
//! - A unix reader always sees whole frames: a frame written in part is
//!   finished before any later one, and later records drop (`slow`) meanwhile.
//! - A unix output serves at most `max_readers` readers, and never takes a
//!   descriptor when fewer than `api.reserved_fds` would be left: one more
//!   reader is closed and counted (`outpost_output_readers_refused_total`).
//!   The API's connection cap leaves room for every output's `max_readers`,
//!   so readers and API connections together never take what storage needs.
//! - Taps (the OPC UA server's latest-value slot, `tap.rs`) get each record
//!   right after the outputs, under the same rule: they never block.

mod mqtt;
#[cfg(feature = "opcua")]
pub mod opcua;
mod tap;
mod udp;
mod unix;

pub use tap::{RecordTap, ServerStatus};

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::record::ResultRecord;
use crate::source::mqtt::BrokerAddr;
use crate::telemetry::logging::RateLimitedLog;
use crate::uplink::PayloadFormat;

/// One entry of a pipeline's `outputs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum OutputConfig {
    /// Publish each record at QoS 0 to the site broker (`[site_broker]`, or
    /// the embedded one). `{device}`, `{pipeline}` and `{stream}` are
    /// replaced in the topic.
    Mqtt {
        topic: String,
        #[serde(default)]
        payload: PayloadFormat,
    },
    /// One datagram per record to this address.
    Udp {
        to: SocketAddr,
        #[serde(default)]
        payload: PayloadFormat,
    },
    /// A Unix stream socket outpost listens on; every connected reader gets
    /// each record as a u32 little-endian length followed by the record.
    Unix {
        path: PathBuf,
        #[serde(default)]
        payload: PayloadFormat,
        /// Readers served at once; one more is closed and counted
        /// (`max_readers`), as is one that would leave fewer than
        /// `api.reserved_fds` descriptors free (`descriptors`).
        #[serde(default = "default_max_readers")]
        max_readers: usize,
    },
    /// Fields written into a PLC's registers and coils over Modbus TCP
    /// (outpost is the client). See crates/modbus and docs/floor.md.
    Modbus(crate::floor::ModbusOutputConfig),
}

/// Default `max_readers` of a unix output.
pub const DEFAULT_MAX_READERS: usize = 64;

fn default_max_readers() -> usize {
    DEFAULT_MAX_READERS
}

/// The largest record a UDP output sends (bigger ones drop as `too_large`).
const MAX_DATAGRAM: usize = 65_507;

/// The largest record every one of these outputs sends whole, where one
/// of them has a limit (a UDP datagram): what a producer of large records
/// (a busy frame's tracking events) splits them to fit, as it does for the
/// uplink's packet. MQTT outputs publish up to the client's 16 MiB and unix
/// frames have a 32-bit length: no lower limit of their own.
pub fn largest_record(outputs: &[OutputConfig]) -> Option<usize> {
    outputs
        .iter()
        .filter_map(|o| match o {
            OutputConfig::Udp { .. } => Some(MAX_DATAGRAM),
            // Registers and coils, never a whole record.
            OutputConfig::Modbus(_) => None,
            OutputConfig::Mqtt { .. } | OutputConfig::Unix { .. } => None,
        })
        .min()
}

impl OutputConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            OutputConfig::Mqtt { .. } => "mqtt",
            OutputConfig::Udp { .. } => "udp",
            OutputConfig::Unix { .. } => "unix",
            OutputConfig::Modbus(_) => "modbus",
        }
    }

    /// Descriptors the output's readers may hold at most (0 but for unix outputs).
    pub fn max_readers(&self) -> usize {
        match self {
            OutputConfig::Unix { max_readers, .. } => *max_readers,
            _ => 0,
        }
    }

    pub fn payload(&self) -> PayloadFormat {
        match self {
            OutputConfig::Mqtt { payload, .. }
            | OutputConfig::Udp { payload, .. }
            | OutputConfig::Unix { payload, .. } => *payload,
            // Registers, not bytes: the record is never encoded for it.
            OutputConfig::Modbus(_) => PayloadFormat::Json,
        }
    }

    /// The `output` label in metrics and status: `kind:target`.
    pub fn label(&self) -> String {
        match self {
            OutputConfig::Mqtt { topic, .. } => format!("mqtt:{topic}"),
            OutputConfig::Udp { to, .. } => format!("udp:{to}"),
            OutputConfig::Unix { path, .. } => format!("unix:{}", path.display()),
            OutputConfig::Modbus(m) => crate::floor::output_label(m),
        }
    }

    /// Every problem, prefixed with `at` (e.g. `pipelines[0].outputs[1]`).
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        if self.payload() == PayloadFormat::SparkplugB {
            p.push(format!(
                "{at}.payload: sparkplug_b is an uplink format (a session with births and deaths); a local output sends \"json\" or \"cbor\""
            ));
        }
        match self {
            OutputConfig::Mqtt { topic, .. } => {
                if topic.is_empty() {
                    p.push(format!("{at}.topic: empty"));
                }
                if topic.contains(['+', '#']) {
                    p.push(format!(
                        "{at}.topic: `{topic}` has a wildcard ('+' or '#'): a publish topic cannot"
                    ));
                }
                let mut rest = topic.as_str();
                while let Some(i) = rest.find('{') {
                    let Some(end) = rest[i..].find('}') else {
                        p.push(format!("{at}.topic: unterminated `{{` in `{topic}`"));
                        break;
                    };
                    let name = &rest[i + 1..i + end];
                    if !["device", "pipeline", "stream"].contains(&name) {
                        p.push(format!(
                            "{at}.topic: unknown placeholder `{{{name}}}` (use {{device}}, {{pipeline}}, {{stream}})"
                        ));
                    }
                    rest = &rest[i + end + 1..];
                }
            }
            OutputConfig::Udp { to, .. } => {
                if to.port() == 0 {
                    p.push(format!("{at}.to: port 0"));
                }
            }
            OutputConfig::Unix {
                path, max_readers, ..
            } => {
                if path.as_os_str().is_empty() {
                    p.push(format!("{at}.path: empty"));
                }
                if *max_readers == 0 {
                    p.push(format!("{at}.max_readers: must be at least 1"));
                }
                // sun_path holds 108 bytes with the terminating NUL.
                if path.as_os_str().len() > 107 {
                    p.push(format!(
                        "{at}.path: {} is longer than a Unix socket path may be (107 bytes)",
                        path.display()
                    ));
                }
            }
            OutputConfig::Modbus(m) => p.extend(crate::floor::output_problems(m, at)),
        }
        p
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    #[error("pipeline `{pipeline}`, output {output}: {detail}")]
    Setup {
        pipeline: String,
        output: String,
        detail: String,
    },
}

/// Counters of one output.
#[derive(Default)]
pub struct OutputStats {
    pub sent: AtomicU64,
    drops: Mutex<BTreeMap<&'static str, u64>>,
    /// Unix readers connected now.
    pub readers: AtomicU64,
    /// Unix readers closed at once, by reason (`max_readers`, `descriptors`).
    readers_refused: Mutex<BTreeMap<&'static str, u64>>,
}

impl OutputStats {
    pub fn drops(&self) -> BTreeMap<&'static str, u64> {
        self.drops.lock().clone()
    }

    pub fn readers_refused(&self) -> BTreeMap<&'static str, u64> {
        self.readers_refused.lock().clone()
    }

    fn refuse_reader(&self, reason: &'static str) {
        *self.readers_refused.lock().entry(reason).or_default() += 1;
    }

    fn add_drop(&self, reason: &'static str) {
        *self.drops.lock().entry(reason).or_default() += 1;
    }
}

/// One output in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct OutputStatus {
    /// The output's label (`udp:127.0.0.1:9000`, ...).
    pub output: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub connected: bool,
    pub sent: u64,
    pub drops: BTreeMap<&'static str, u64>,
    /// Unix outputs: readers connected now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub readers: Option<u64>,
    /// Unix outputs: readers closed at once, by reason.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub readers_refused: BTreeMap<&'static str, u64>,
    /// Modbus outputs: the PLC connection, requests, exceptions by code,
    /// values replaced while the PLC was slower than the records.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub modbus: Option<crate::floor::ModbusOutputReport>,
}

/// The result of handing one payload to one output.
enum Sent {
    Ok,
    Dropped(&'static str),
}

/// The running half of an output (set when the generation starts).
enum Sink {
    Mqtt(mqtt::MqttSink),
    Udp(udp::UdpSink),
    Unix(unix::UnixSink),
    #[cfg(feature = "modbus")]
    Modbus(crate::floor::ModbusOutput),
}

struct Output {
    cfg: OutputConfig,
    label: String,
    /// Shared with a unix output's accept loop (its readers).
    stats: Arc<OutputStats>,
    sink: OnceLock<Sink>,
}

impl Output {
    /// A modbus output's report (None for the other kinds).
    fn modbus_report(&self) -> Option<crate::floor::ModbusOutputReport> {
        match self.sink.get() {
            #[cfg(feature = "modbus")]
            Some(Sink::Modbus(s)) => Some(s.status()),
            _ => None,
        }
    }
}

/// What starting the outputs needs from the daemon.
pub struct OutputCtx {
    pub device: String,
    pub pipeline: String,
    /// The site broker (or the embedded one), for mqtt outputs.
    pub mqtt: Option<BrokerAddr>,
    /// Cancelled when the outputs must stop.
    pub shutdown: tokio_util::sync::CancellationToken,
    /// `api.reserved_fds`: a unix reader is refused when taking it would
    /// leave fewer descriptors free.
    pub reserved_fds: u64,
    /// The descriptors every unix output's readers share
    /// ([`reader_fd_budget`] permits, for the daemon's life).
    pub reader_fds: Arc<tokio::sync::Semaphore>,
    /// `[modbus_server]`: records of the pipelines it maps update it.
    pub modbus_server: Option<crate::floor::ServerHandle>,
    /// What takes the pipeline's records besides its outputs (the OPC UA
    /// server's latest-value slot).
    pub taps: Vec<Arc<dyn RecordTap>>,
}

/// Descriptors all unix output readers may hold together: what their
/// `max_readers` ask (`asked`), at most half of what the descriptor limit
/// leaves once `reserved` (storage) and the descriptors held now are set
/// aside. The API's connection cap is lowered by as many, so readers and
/// connections together never take what storage needs, and neither can
/// squeeze the other out.
pub fn reader_fd_budget(asked: u64, reserved: u64) -> u64 {
    use rustix::process::{Resource, getrlimit};
    let Some(soft) = getrlimit(Resource::Nofile).current else {
        return asked;
    };
    let held = std::fs::read_dir("/proc/self/fd").map_or(32, |d| d.count() as u64);
    split_fds(asked, soft, reserved, held)
}

fn split_fds(asked: u64, soft: u64, reserved: u64, held: u64) -> u64 {
    asked.min(soft.saturating_sub(reserved.saturating_add(held)) / 2)
}

/// A pipeline's local outputs.
pub struct LocalOutputs {
    outputs: Vec<Output>,
    /// `[modbus_server]`, when it maps fields of this pipeline.
    server: OnceLock<crate::floor::ServerHandle>,
    /// Set when the generation starts (see [`OutputCtx::taps`]).
    taps: OnceLock<Vec<Arc<dyn RecordTap>>>,
    log: RateLimitedLog,
    pipeline: String,
}

impl LocalOutputs {
    /// Builds the outputs of a config (no I/O: [`LocalOutputs::start`] opens them).
    pub fn new(pipeline: &str, cfgs: &[OutputConfig]) -> LocalOutputs {
        LocalOutputs {
            outputs: cfgs
                .iter()
                .map(|c| Output {
                    cfg: c.clone(),
                    label: c.label(),
                    stats: Arc::default(),
                    sink: OnceLock::new(),
                })
                .collect(),
            server: OnceLock::new(),
            taps: OnceLock::new(),
            log: RateLimitedLog::new(Duration::from_secs(5)),
            pipeline: pipeline.to_string(),
        }
    }

    /// No output, no server and no tap: nothing to hand a record to.
    pub fn is_empty(&self) -> bool {
        self.outputs.is_empty()
            && self.server.get().is_none()
            && self.taps.get().is_none_or(Vec::is_empty)
    }

    /// (label, kind, connected, stats) of each output. Connected: the MQTT
    /// client is; a UDP socket is open; a unix reader is there.
    pub fn stats(&self) -> impl Iterator<Item = (&str, &'static str, bool, &OutputStats)> {
        self.outputs.iter().map(|o| {
            let up = match o.sink.get() {
                None => false,
                Some(Sink::Mqtt(s)) => s.connected(),
                Some(Sink::Udp(_)) => true,
                Some(Sink::Unix(s)) => s.readers() > 0,
                #[cfg(feature = "modbus")]
                Some(Sink::Modbus(s)) => s.connected(),
            };
            (o.label.as_str(), o.cfg.kind(), up, &*o.stats)
        })
    }

    /// Each output's part of `/v1/status`.
    pub fn status(&self) -> Vec<OutputStatus> {
        self.stats()
            .zip(self.outputs.iter())
            .map(|((label, kind, up, st), o)| OutputStatus {
                output: label.to_string(),
                kind,
                connected: up,
                sent: st.sent.load(Ordering::Relaxed),
                drops: st.drops(),
                readers: (kind == "unix").then(|| st.readers.load(Ordering::Relaxed)),
                readers_refused: st.readers_refused(),
                modbus: o.modbus_report(),
            })
            .collect()
    }

    /// Each modbus output's label and report.
    pub fn modbus_reports(&self) -> Vec<(&str, crate::floor::ModbusOutputReport)> {
        self.outputs
            .iter()
            .filter_map(|o| Some((o.label.as_str(), o.modbus_report()?)))
            .collect()
    }

    /// Opens every output (binds the unix sockets, connects the UDP
    /// sockets, starts the MQTT clients); returns the tasks that run until
    /// `ctx.shutdown`. Must run inside the daemon's runtime.
    pub fn start(&self, ctx: &OutputCtx) -> Result<Vec<tokio::task::JoinHandle<()>>, OutputError> {
        // Each generation builds its own outputs, so this is the first set.
        let _ = self.taps.set(ctx.taps.clone());
        let mut tasks = Vec::new();
        if let Some(s) = &ctx.modbus_server
            && s.serves(&ctx.pipeline)
        {
            let _ = self.server.set(s.clone());
        }
        for o in &self.outputs {
            let err = |detail: String| OutputError::Setup {
                pipeline: ctx.pipeline.clone(),
                output: o.label.clone(),
                detail,
            };
            let sink = match &o.cfg {
                OutputConfig::Mqtt { topic, .. } => {
                    let broker = ctx.mqtt.clone().ok_or_else(|| {
                        err("no broker: set [site_broker] or [embedded_broker]".into())
                    })?;
                    let index = self.outputs.iter().position(|x| std::ptr::eq(x, o));
                    let (sink, task) = mqtt::MqttSink::start(
                        &broker,
                        &format!("{}-out{}", ctx.pipeline, index.unwrap_or(0)),
                        topic,
                        &ctx.device,
                        &ctx.pipeline,
                        ctx.shutdown.clone(),
                    );
                    tasks.push(task);
                    Sink::Mqtt(sink)
                }
                OutputConfig::Udp { to, .. } => {
                    Sink::Udp(udp::UdpSink::open(*to).map_err(|e| err(e.to_string()))?)
                }
                OutputConfig::Unix {
                    path, max_readers, ..
                } => {
                    let limits = unix::ReaderLimits {
                        max_readers: *max_readers,
                        reserved_fds: ctx.reserved_fds,
                        budget: ctx.reader_fds.clone(),
                    };
                    let (sink, task) =
                        unix::UnixSink::listen(path, limits, o.stats.clone(), ctx.shutdown.clone())
                            .map_err(|e| err(format!("{}: {e}", path.display())))?;
                    tasks.push(task);
                    Sink::Unix(sink)
                }
                #[cfg(feature = "modbus")]
                OutputConfig::Modbus(m) => {
                    let (sink, task) = crate::floor::ModbusOutput::start(m, ctx.shutdown.clone());
                    tasks.push(task);
                    Sink::Modbus(sink)
                }
                #[cfg(not(feature = "modbus"))]
                OutputConfig::Modbus(_) => {
                    return Err(err(crate::floor::needs_modbus_build("output")));
                }
            };
            // Each generation builds its own outputs, so this is the first set.
            let _ = o.sink.set(sink);
            tracing::info!(pipeline = %ctx.pipeline, output = %o.label, "local output started");
        }
        Ok(tasks)
    }

    /// Hands a record to every output. `json` is the record's JSON (the
    /// bytes the outbox stores); CBOR is encoded once when an output asks
    /// for it.
    pub fn send(&self, rec: &ResultRecord, json: &[u8]) {
        if let Some(s) = self.server.get() {
            s.update(&rec.pipeline, &rec.stream, &rec.outputs);
        }
        let mut cbor: Option<Option<Vec<u8>>> = None;
        for o in &self.outputs {
            #[cfg(feature = "modbus")]
            if let Some(Sink::Modbus(s)) = o.sink.get() {
                s.send(&rec.outputs);
                o.stats.sent.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let payload: &[u8] = match o.cfg.payload() {
                // sparkplug_b is refused by validate(): an uplink format only.
                PayloadFormat::Json | PayloadFormat::SparkplugB => json,
                PayloadFormat::Cbor => {
                    let c = cbor.get_or_insert_with(|| {
                        let mut out = Vec::with_capacity(json.len());
                        ciborium::into_writer(rec, &mut out).ok().map(|_| out)
                    });
                    match c {
                        Some(c) => c,
                        None => {
                            self.drop_one(o, "encode_error");
                            continue;
                        }
                    }
                }
            };
            let outcome = match o.sink.get() {
                None => Sent::Dropped("not_started"),
                Some(Sink::Mqtt(s)) => s.send(&rec.stream, payload),
                Some(Sink::Udp(s)) => s.send(payload),
                Some(Sink::Unix(s)) => s.send(payload),
                #[cfg(feature = "modbus")]
                Some(Sink::Modbus(_)) => Sent::Ok,
            };
            match outcome {
                Sent::Ok => {
                    o.stats.sent.fetch_add(1, Ordering::Relaxed);
                }
                Sent::Dropped(reason) => self.drop_one(o, reason),
            }
        }
        for t in self.taps.get().into_iter().flatten() {
            t.offer(rec, json);
        }
    }

    fn drop_one(&self, o: &Output, reason: &'static str) {
        o.stats.add_drop(reason);
        if let Some(suppressed) = self.log.allow(reason) {
            tracing::warn!(pipeline = %self.pipeline, output = %o.label, reason, suppressed, "local output dropped a record");
        }
    }
}

/// Replaces `{device}`, `{pipeline}` and `{stream}` in a topic template.
pub fn render_topic(template: &str, device: &str, pipeline: &str, stream: &str) -> String {
    template
        .replace("{device}", device)
        .replace("{pipeline}", pipeline)
        .replace("{stream}", stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct P {
        outputs: Vec<OutputConfig>,
    }

    #[test]
    fn the_issue_snippet_parses_and_validates() {
        let p: P = toml::from_str(
            r#"
outputs = [
  { type = "mqtt", topic = "site/{pipeline}/{stream}" },
  { type = "udp", to = "127.0.0.1:9500" },
  { type = "unix", path = "/run/outpost/vad.sock", payload = "cbor" },
]
"#,
        )
        .unwrap();
        assert_eq!(p.outputs.len(), 3);
        assert_eq!(p.outputs[2].payload(), PayloadFormat::Cbor);
        assert_eq!(p.outputs[0].payload(), PayloadFormat::Json);
        for (i, o) in p.outputs.iter().enumerate() {
            assert!(o.validate(&format!("o[{i}]")).is_empty(), "{o:?}");
        }
        assert_eq!(p.outputs[1].label(), "udp:127.0.0.1:9500");
    }

    #[test]
    fn bad_outputs_are_refused_with_their_key() {
        assert!(toml::from_str::<P>(r#"outputs = [{ type = "tcp", to = "x" }]"#).is_err());
        assert!(
            toml::from_str::<P>(r#"outputs = [{ type = "udp", to = "127.0.0.1:1", qos = 1 }]"#)
                .is_err()
        );
        let o = OutputConfig::Mqtt {
            topic: "site/+/{strem}".into(),
            payload: PayloadFormat::Json,
        };
        let p = o.validate("o");
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p.iter().all(|x| x.starts_with("o.topic")));
    }

    #[test]
    fn readers_get_what_they_ask_up_to_half_the_free_descriptors() {
        assert_eq!(split_fds(64, 65536, 64, 40), 64);
        // 256 descriptors, 64 reserved, 40 held: 152 free, half for readers.
        assert_eq!(split_fds(1000, 256, 64, 40), 76);
        assert_eq!(split_fds(0, 256, 64, 40), 0);
        assert_eq!(split_fds(64, 64, 64, 40), 0);
    }

    #[test]
    fn a_udp_output_bounds_the_largest_record() {
        let udp = OutputConfig::Udp {
            to: "127.0.0.1:9500".parse().unwrap(),
            payload: PayloadFormat::Json,
        };
        let unix = OutputConfig::Unix {
            path: "/run/x.sock".into(),
            payload: PayloadFormat::Json,
            max_readers: 1,
        };
        assert_eq!(largest_record(&[]), None);
        assert_eq!(largest_record(std::slice::from_ref(&unix)), None);
        assert_eq!(largest_record(&[unix, udp]), Some(MAX_DATAGRAM));
    }

    #[test]
    fn topics_render_placeholders() {
        assert_eq!(
            render_topic("site/{device}/{pipeline}/{stream}", "gw", "vad", "mic-1"),
            "site/gw/vad/mic-1"
        );
    }
}
