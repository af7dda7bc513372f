//! Sparkplug B (Eclipse Sparkplug 3.0) for the MQTT uplink, free of I/O:
//! the protobuf payload, topics, births, sequence numbers.
//!
//! outpost is the edge node `{device}` of group `{group}`; each pipeline is
//! a Sparkplug device. Messages:
//! - `spBv1.0/{group}/NBIRTH/{device}` on every connect: seq 0, metrics
//!   `bdSeq` and `Node Control/Rebirth`;
//! - `spBv1.0/{group}/DBIRTH/{device}/{pipeline}` before a pipeline's first
//!   data on a connection, and again when a record brings a metric the last
//!   birth did not declare (every metric of the set, with its last value;
//!   metrics of records further on in the uplink's queue are declared in
//!   the same birth, without a value, so one birth covers many new
//!   streams);
//! - `spBv1.0/{group}/DDEATH/{device}/{pipeline}` right before a DBIRTH
//!   that drops metrics from the set (streams evicted, see below), so the
//!   host forgets the old set instead of merging it;
//! - `spBv1.0/{group}/DDATA/{device}/{pipeline}`: one per record, its metrics;
//! - `spBv1.0/{group}/NDEATH/{device}`: the MQTT will (and published before
//!   a clean disconnect), with the `bdSeq` of the NBIRTH it ends.
//! - `spBv1.0/{group}/NCMD/{device}` is subscribed to: a command with
//!   `Node Control/Rebirth` = true brings a fresh NBIRTH (the same bdSeq,
//!   seq 0) and a DBIRTH for every pipeline that has data, before any more
//!   DDATA; other commands are ignored (logged and counted).
//!
//! Invariants:
//! - `seq` is 0 on NBIRTH and goes up by one (mod 256) with every DBIRTH,
//!   DDEATH and DDATA of the connection; NDEATH carries none.
//! - `bdSeq` goes up by one (mod 256) with every MQTT connect; the will set
//!   at CONNECT and the NBIRTH after it carry the same value.
//! - A record's metrics are named `{stream}/{path}`, where `path` walks its
//!   `outputs` (`probs/0`, `boxes/1/score`): numbers are Double, booleans
//!   Boolean, strings String; plus `{stream}/id` (String, the record id the
//!   fleet drops duplicates by), `{stream}/seq` and `{stream}/latency_us`
//!   (UInt64) and `{stream}/model` (String).
//! - Every metric of a DDATA was declared, with its type, by the last
//!   DBIRTH of its device on the connection.
//! - A device's set holds at most `max_metrics` metrics and its DBIRTH is
//!   at most `max_payload` bytes; streams leave it least recently seen
//!   first, all their metrics at once ([`device`]). No payload built here
//!   is above `max_payload`: a record that cannot fit is an error (the
//!   caller dead-letters it).
//! - After the first birth of a device on a connection, it is born again
//!   at most once per `rebirth_interval`; a record that needs a new birth
//!   before then waits ([`Step::Wait`]), and the records behind it wait
//!   with it (the uplink keeps outbox order). NCMD rebirths are paced the
//!   same way by the last NBIRTH.

mod command;
mod device;
mod proto;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use prost::Message as _;

pub use command::{NodeCommand, REBIRTH, node_command};
pub use device::{Evicted, Limits, MetricSet};
use proto::metric;
pub use proto::{Metric, Payload, Value, datatype};

/// Topics of one edge node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    pub group: String,
    pub node: String,
}

impl Topics {
    pub fn node(&self, kind: &str) -> String {
        format!("spBv1.0/{}/{kind}/{}", self.group, self.node)
    }

    pub fn device(&self, kind: &str, device: &str) -> String {
        format!("spBv1.0/{}/{kind}/{}/{device}", self.group, self.node)
    }
}

/// A Sparkplug id element (group, node or device) must not hold these.
pub fn bad_id(s: &str) -> bool {
    s.is_empty() || s.contains(['/', '+', '#'])
}

/// One message to publish; `data` is true for the DDATA that carries the record.
#[derive(Debug, Clone, PartialEq)]
pub struct Out {
    pub topic: String,
    pub payload: Vec<u8>,
    pub data: bool,
    /// `NBIRTH`, `DBIRTH`, `DDEATH` or `DDATA`.
    pub kind: &'static str,
}

/// How big births may grow and how often they may come (from `[uplink]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// Metrics one device declares at most.
    pub max_metrics: usize,
    /// Any payload (a DBIRTH, a DDATA) at most, in bytes.
    pub max_payload: usize,
    /// A device is born again at most this often.
    pub rebirth_interval: Duration,
}

impl Bounds {
    fn limits(&self) -> Limits {
        Limits {
            max_metrics: self.max_metrics,
            max_birth_bytes: self.max_payload,
        }
    }
}

/// What to do with one record.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Publish these in order; the last is the record's DDATA.
    Send { out: Vec<Out>, evicted: Evicted },
    /// The record needs a new birth of its device, which may not go
    /// before this long; nothing changed.
    Wait(Duration),
}

/// The node's state over one MQTT connection.
#[derive(Debug)]
pub struct Session {
    topics: Topics,
    bd_seq: u64,
    /// The seq of the next message.
    next_seq: u64,
    bounds: Bounds,
    /// Per Sparkplug device (pipeline).
    devices: BTreeMap<String, Device>,
    /// When the last NBIRTH was built (paces NCMD rebirths).
    last_nbirth: Option<Instant>,
}

#[derive(Debug, Default)]
struct Device {
    set: MetricSet,
    /// Its DBIRTH went out on this connection since the last NBIRTH.
    born: bool,
    last_birth: Option<Instant>,
}

/// A stored record, read for Sparkplug.
struct Parsed {
    pipeline: String,
    stream: String,
    /// The record's time (unix ms).
    ts: u64,
    values: Vec<(String, Value)>,
}

/// Why a record cannot go out as Sparkplug B.
#[derive(Debug, thiserror::Error)]
pub enum RecordRefused {
    #[error("not a JSON record: {0}")]
    NotJson(serde_json::Error),
    #[error("pipeline `{0}` cannot be a Sparkplug device id")]
    DeviceId(String),
    #[error("as Sparkplug B DDATA the record takes {bytes} bytes, above max_packet_bytes ({max})")]
    TooLarge { bytes: usize, max: usize },
    #[error(
        "the record has {metrics} metrics ({bytes} bytes in a birth); a Sparkplug device declares \
         at most {max_metrics} (sparkplug_max_metrics_per_device) in a birth of at most \
         {max_birth_bytes} bytes (max_packet_bytes)"
    )]
    TooManyMetrics {
        metrics: usize,
        bytes: usize,
        max_metrics: usize,
        max_birth_bytes: usize,
    },
}

fn parse(record: &[u8], now_ms: u64) -> Result<Parsed, RecordRefused> {
    let r: serde_json::Value = serde_json::from_slice(record).map_err(RecordRefused::NotJson)?;
    let pipeline = r["pipeline"].as_str().unwrap_or_default().to_string();
    if bad_id(&pipeline) {
        return Err(RecordRefused::DeviceId(pipeline));
    }
    let stream = r["stream"].as_str().unwrap_or_default().to_string();
    let ts = r["ts"]
        .as_str()
        .and_then(|t| humantime_serde::re::humantime::parse_rfc3339_weak(t).ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(now_ms, |d| d.as_millis() as u64);
    let mut values: Vec<(String, Value)> = Vec::new();
    let prefix = if stream.is_empty() {
        String::new()
    } else {
        format!("{stream}/")
    };
    if let Some(id) = r["id"].as_str() {
        values.push((format!("{prefix}id"), Value::String(id.to_string())));
    }
    for k in ["seq", "latency_us"] {
        if let Some(n) = r[k].as_u64() {
            values.push((format!("{prefix}{k}"), Value::Long(n)));
        }
    }
    if let Some(m) = r["model"].as_str() {
        values.push((format!("{prefix}model"), Value::String(m.to_string())));
    }
    // Records without `outputs` (e.g. OTA status events) carry their
    // `event` fields instead.
    let body = if r.get("outputs").is_some() {
        &r["outputs"]
    } else {
        &r["event"]
    };
    flatten(
        body,
        &mut prefix.trim_end_matches('/').to_string(),
        &mut values,
    );
    Ok(Parsed {
        pipeline,
        stream,
        ts,
        values,
    })
}

/// The NDEATH payload for `bd_seq` (the will set at CONNECT).
pub fn ndeath(bd_seq: u64, now_ms: u64) -> Vec<u8> {
    Payload {
        timestamp: Some(now_ms),
        metrics: vec![metric("bdSeq", now_ms, Value::Long(bd_seq))],
        ..Payload::default()
    }
    .encode_to_vec()
}

impl Session {
    /// A new connection's session; `bd_seq` as in its will.
    pub fn new(topics: Topics, bd_seq: u64, bounds: Bounds) -> Session {
        Session {
            topics,
            bd_seq: bd_seq % 256,
            next_seq: 0,
            bounds,
            devices: BTreeMap::new(),
            last_nbirth: None,
        }
    }

    fn seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq = (self.next_seq + 1) % 256;
        s
    }

    /// Metrics declared, over all devices.
    pub fn metrics(&self) -> usize {
        self.devices.values().map(|d| d.set.count()).sum()
    }

    /// The NBIRTH that opens the connection (seq 0).
    pub fn nbirth(&mut self, now: Instant, now_ms: u64) -> Out {
        self.next_seq = 0;
        self.last_nbirth = Some(now);
        for d in self.devices.values_mut() {
            d.born = false;
        }
        let seq = self.seq();
        Out {
            topic: self.topics.node("NBIRTH"),
            payload: Payload {
                timestamp: Some(now_ms),
                seq: Some(seq),
                metrics: vec![
                    metric("bdSeq", now_ms, Value::Long(self.bd_seq)),
                    metric(REBIRTH, now_ms, Value::Boolean(false)),
                ],
                ..Payload::default()
            }
            .encode_to_vec(),
            data: false,
            kind: "NBIRTH",
        }
    }

    fn device_out(
        &mut self,
        kind: &'static str,
        device: &str,
        now_ms: u64,
        metrics: Vec<Metric>,
    ) -> Out {
        let seq = self.seq();
        Out {
            topic: self.topics.device(kind, device),
            payload: Payload {
                timestamp: Some(now_ms),
                seq: Some(seq),
                metrics,
                ..Payload::default()
            }
            .encode_to_vec(),
            data: kind == "DDATA",
            kind,
        }
    }

    /// The messages for one stored record: its DDATA, after a DBIRTH (and
    /// a DDEATH) when its device's set must change first. `ahead` are the
    /// records queued behind it (oldest first): a birth declares their new
    /// metrics too, as far as the bounds allow.
    pub fn record<'a>(
        &mut self,
        record: &[u8],
        ahead: impl IntoIterator<Item = &'a [u8]>,
        now: Instant,
        now_ms: u64,
    ) -> Result<Step, RecordRefused> {
        let p = parse(record, now_ms)?;
        let limits = self.bounds.limits();
        let data: Vec<Metric> = p
            .values
            .iter()
            .map(|(n, v)| metric(n, p.ts, v.clone()))
            .collect();
        // The widest seq (255 takes two bytes) for the bound.
        let data_len = Payload {
            timestamp: Some(now_ms),
            seq: Some(255),
            metrics: data.clone(),
            ..Payload::default()
        }
        .encoded_len();
        if data_len > self.bounds.max_payload {
            return Err(RecordRefused::TooLarge {
                bytes: data_len,
                max: self.bounds.max_payload,
            });
        }
        let (n, bytes) = MetricSet::alone(&p.values);
        if n > limits.max_metrics || bytes > limits.max_birth_bytes {
            return Err(RecordRefused::TooManyMetrics {
                metrics: n,
                bytes,
                max_metrics: limits.max_metrics,
                max_birth_bytes: limits.max_birth_bytes,
            });
        }
        let interval = self.bounds.rebirth_interval;
        let dev = self.devices.entry(p.pipeline.clone()).or_default();
        if dev.born && dev.set.covers(&p.stream, &p.values) {
            dev.set.update(&p.stream, &p.values);
            let out = self.device_out("DDATA", &p.pipeline, now_ms, data);
            return Ok(Step::Send {
                out: vec![out],
                evicted: Evicted::default(),
            });
        }
        if dev.born
            && let Some(at) = dev.last_birth
        {
            let due = at + interval;
            if now < due {
                return Ok(Step::Wait(due - now));
            }
        }
        // A (new) birth: this record's metrics, then those of the records
        // behind it as long as they fit beside what is kept, then the least
        // recently seen streams out until the set is within its bounds.
        let keep_from = dev.set.now();
        dev.set.declare(&p.stream, &p.values, true);
        let (mut kept_n, mut kept_b) = dev.set.size_with(&p.stream, &[]).0;
        kept_b += proto::PAYLOAD_HEAD_MAX;
        for r in ahead {
            let Ok(q) = parse(r, now_ms) else { continue };
            if q.pipeline != p.pipeline {
                continue;
            }
            let (now_size, with) = dev.set.size_with(&q.stream, &q.values);
            let kept = dev.set.seen(&q.stream).is_some_and(|t| t >= keep_from);
            let (add_n, add_b) = if kept {
                (with.0 - now_size.0, with.1.saturating_sub(now_size.1))
            } else {
                with
            };
            if kept_n + add_n > limits.max_metrics || kept_b + add_b > limits.max_birth_bytes {
                break;
            }
            kept_n += add_n;
            kept_b += add_b;
            dev.set.declare(&q.stream, &q.values, false);
        }
        let evicted = dev.set.evict(limits, keep_from);
        let mut out = Vec::new();
        let was_born = dev.born;
        dev.born = true;
        dev.last_birth = Some(now);
        let birth = dev.set.birth(p.ts);
        if was_born && evicted.metrics > 0 {
            out.push(self.device_out("DDEATH", &p.pipeline, now_ms, Vec::new()));
        }
        out.push(self.device_out("DBIRTH", &p.pipeline, now_ms, birth));
        out.push(self.device_out("DDATA", &p.pipeline, now_ms, data));
        Ok(Step::Send { out, evicted })
    }

    /// How long until an NCMD rebirth may go (zero: now).
    pub fn rebirth_wait(&self, now: Instant) -> Duration {
        self.last_nbirth.map_or(Duration::ZERO, |at| {
            (at + self.bounds.rebirth_interval).saturating_duration_since(now)
        })
    }
}

impl Session {
    /// A rebirth asked for by NCMD: a new NBIRTH (same bdSeq, seq 0), then a
    /// DBIRTH for each device seen on this connection, with every metric
    /// known and its last value, in that order before any further DDATA.
    /// A set whose values grew past the birth bound since its last birth
    /// loses its least recently seen streams first.
    pub fn rebirth(&mut self, now: Instant, now_ms: u64) -> (Vec<Out>, Evicted) {
        let mut out = vec![self.nbirth(now, now_ms)];
        let limits = self.bounds.limits();
        let mut evicted = Evicted::default();
        let names: Vec<String> = self
            .devices
            .iter()
            .filter(|(_, d)| !d.set.is_empty())
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let Some(dev) = self.devices.get_mut(&name) else {
                continue;
            };
            let keep_from = dev.set.now();
            let e = dev.set.evict(limits, keep_from);
            evicted.metrics += e.metrics;
            evicted.streams += e.streams;
            dev.born = true;
            dev.last_birth = Some(now);
            let birth = dev.set.birth(now_ms);
            out.push(self.device_out("DBIRTH", &name, now_ms, birth));
        }
        (out, evicted)
    }
}

/// Leaves of a JSON value as metrics named by their path.
fn flatten(v: &serde_json::Value, path: &mut String, out: &mut Vec<(String, Value)>) {
    use serde_json::Value as J;
    let leaf = |path: &str| path.to_string();
    match v {
        J::Null => {}
        J::Bool(b) => out.push((leaf(path), Value::Boolean(*b))),
        J::Number(n) => {
            if let Some(f) = n.as_f64() {
                out.push((leaf(path), Value::Double(f)));
            }
        }
        J::String(s) => out.push((leaf(path), Value::String(s.clone()))),
        J::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let len = path.len();
                if !path.is_empty() {
                    path.push('/');
                }
                path.push_str(&i.to_string());
                flatten(x, path, out);
                path.truncate(len);
            }
        }
        J::Object(m) => {
            for (k, x) in m {
                let len = path.len();
                if !path.is_empty() {
                    path.push('/');
                }
                path.push_str(k);
                flatten(x, path, out);
                path.truncate(len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn topics() -> Topics {
        Topics {
            group: "plant".into(),
            node: "gw-1".into(),
        }
    }

    fn rec(stream: &str, seq: u64, outputs: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "id": format!("gw-1/1/{seq}"), "device": "gw-1", "pipeline": "sensors",
            "stream": stream, "seq": seq, "ts": "2026-11-30T12:00:00.250Z",
            "model": "sensor_mlp@1.0.0", "ep": "cpu", "latency_us": 80, "outputs": outputs
        }))
        .unwrap()
    }

    /// No rebirth pacing: each record's birth goes at once.
    const BOUNDS: Bounds = Bounds {
        max_metrics: 4096,
        max_payload: 1 << 20,
        rebirth_interval: Duration::ZERO,
    };

    fn session(bd_seq: u64) -> Session {
        Session::new(topics(), bd_seq, BOUNDS)
    }

    /// The messages of a record that needs no wait, with nothing queued behind it.
    fn send(s: &mut Session, r: &[u8], ms: u64) -> Result<Vec<Out>, RecordRefused> {
        match s.record(r, [], Instant::now(), ms)? {
            Step::Send { out, .. } => Ok(out),
            Step::Wait(w) => panic!("waits {w:?}"),
        }
    }

    fn decode(o: &Out) -> Payload {
        Payload::decode(&o.payload[..]).unwrap()
    }

    fn names(p: &Payload) -> Vec<String> {
        p.metrics.iter().map(|m| m.name.clone().unwrap()).collect()
    }

    #[test]
    fn births_then_data_with_seq_and_metrics_from_outputs() {
        let mut s = session(7);
        let nb = s.nbirth(Instant::now(), 1000);
        assert_eq!(nb.topic, "spBv1.0/plant/NBIRTH/gw-1");
        let p = decode(&nb);
        assert_eq!(p.seq, Some(0));
        assert_eq!(p.metrics[0].name.as_deref(), Some("bdSeq"));
        assert_eq!(p.metrics[0].value, Some(Value::Long(7)));
        assert_eq!(p.metrics[0].datatype, Some(datatype::UINT64));
        let out = send(
            &mut s,
            &rec(
                "s0",
                1,
                serde_json::json!({"probs": [0.25, 0.75], "alarm": true}),
            ),
            2000,
        )
        .unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].topic, "spBv1.0/plant/DBIRTH/gw-1/sensors");
        assert!(!out[0].data);
        assert_eq!(out[1].topic, "spBv1.0/plant/DDATA/gw-1/sensors");
        assert!(out[1].data);
        let (b, d) = (decode(&out[0]), decode(&out[1]));
        assert_eq!((b.seq, d.seq), (Some(1), Some(2)));
        let mut n = names(&d);
        n.sort();
        assert_eq!(
            n,
            [
                "s0/alarm",
                "s0/id",
                "s0/latency_us",
                "s0/model",
                "s0/probs/0",
                "s0/probs/1",
                "s0/seq"
            ]
        );
        let probs1 = d
            .metrics
            .iter()
            .find(|m| m.name.as_deref() == Some("s0/probs/1"))
            .unwrap();
        assert_eq!(probs1.value, Some(Value::Double(0.75)));
        assert_eq!(probs1.datatype, Some(datatype::DOUBLE));
        // The record's time: 2026-11-30T12:00:00.250Z.
        assert_eq!(probs1.timestamp, Some(1_796_040_000_250));
        // Same metrics: no new birth.
        let out = send(
            &mut s,
            &rec(
                "s0",
                2,
                serde_json::json!({"probs": [0.5, 0.5], "alarm": false}),
            ),
            3000,
        )
        .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(decode(&out[0]).seq, Some(3));
        // A new stream brings new metrics: a DBIRTH with all of them.
        let out = send(
            &mut s,
            &rec(
                "s1",
                3,
                serde_json::json!({"probs": [0.1, 0.9], "alarm": false}),
            ),
            4000,
        )
        .unwrap();
        assert_eq!(out.len(), 2);
        let b = decode(&out[0]);
        assert_eq!(b.metrics.len(), 14);
        // A new connection: NBIRTH again at seq 0, and births again.
        let mut s2 = session(8);
        assert_eq!(decode(&s2.nbirth(Instant::now(), 5000)).seq, Some(0));
        let out = send(
            &mut s2,
            &rec("s0", 4, serde_json::json!({"probs": [0.5, 0.5]})),
            6000,
        )
        .unwrap();
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn seq_wraps_at_256_and_bdseq_rides_in_the_will() {
        let mut s = session(300);
        assert_eq!(
            decode(&s.nbirth(Instant::now(), 0)).metrics[0].value,
            Some(Value::Long(44))
        );
        let mut last = 0;
        for i in 0..600u64 {
            let out = send(&mut s, &rec("s0", i, serde_json::json!({"x": 1})), 0).unwrap();
            let p = decode(out.last().unwrap());
            let seq = p.seq.unwrap();
            assert!(seq < 256);
            if i > 0 {
                assert_eq!(seq, (last + 1) % 256);
            }
            last = seq;
        }
        let d = Payload::decode(&ndeath(44, 9)[..]).unwrap();
        assert_eq!(d.seq, None);
        assert_eq!(d.metrics[0].name.as_deref(), Some("bdSeq"));
        assert_eq!(d.metrics[0].value, Some(Value::Long(44)));
    }

    #[test]
    fn a_rebirth_command_births_the_node_and_its_devices_again() {
        let mut s = session(5);
        s.nbirth(Instant::now(), 0);
        for (i, p) in ["sensors", "cams"].iter().enumerate() {
            let r = serde_json::to_vec(&serde_json::json!({
                "id": format!("gw-1/1/{i}"), "pipeline": p, "stream": "s0", "seq": i,
                "outputs": {"x": 1.5}
            }))
            .unwrap();
            send(&mut s, &r, 0).unwrap();
        }
        // NCMD: Node Control/Rebirth = true.
        let c = node_command(
            &Payload {
                timestamp: Some(1),
                metrics: vec![metric(REBIRTH, 1, Value::Boolean(true))],
                ..Payload::default()
            }
            .encode_to_vec(),
        )
        .unwrap();
        assert_eq!(
            c,
            NodeCommand {
                rebirth: true,
                ignored: vec![]
            }
        );
        let out = s.rebirth(Instant::now(), 9000).0;
        let topics: Vec<&str> = out.iter().map(|o| o.topic.as_str()).collect();
        assert_eq!(
            topics,
            [
                "spBv1.0/plant/NBIRTH/gw-1",
                "spBv1.0/plant/DBIRTH/gw-1/cams",
                "spBv1.0/plant/DBIRTH/gw-1/sensors"
            ]
        );
        let nb = decode(&out[0]);
        assert_eq!(nb.seq, Some(0));
        assert_eq!(nb.metrics[0].value, Some(Value::Long(5)), "the same bdSeq");
        assert_eq!(decode(&out[1]).seq, Some(1));
        let db = decode(&out[2]);
        assert_eq!(db.seq, Some(2));
        assert!(names(&db).contains(&"s0/x".to_string()));
        assert!(out.iter().all(|o| !o.data));
        // Born already: the next record is DDATA only, seq 3.
        let r = serde_json::to_vec(&serde_json::json!({
            "id": "gw-1/1/9", "pipeline": "sensors", "stream": "s0", "seq": 9, "outputs": {"x": 2.0}
        }))
        .unwrap();
        let next = send(&mut s, &r, 0).unwrap();
        assert_eq!(next.len(), 1);
        assert_eq!(decode(&next[0]).seq, Some(3));
    }

    #[test]
    fn a_changed_type_is_born_again_and_bad_records_are_errors() {
        let mut s = session(0);
        s.nbirth(Instant::now(), 0);
        assert_eq!(
            send(&mut s, &rec("s0", 1, serde_json::json!({"x": 1})), 0)
                .unwrap()
                .len(),
            2
        );
        assert_eq!(
            send(&mut s, &rec("s0", 2, serde_json::json!({"x": "a"})), 0)
                .unwrap()
                .len(),
            2
        );
        assert!(send(&mut s, b"nope", 0).is_err());
        let bad =
            serde_json::to_vec(&serde_json::json!({"pipeline": "a/b", "outputs": {}})).unwrap();
        assert!(send(&mut s, &bad, 0).is_err());
    }

    fn kinds(out: &[Out]) -> Vec<&'static str> {
        out.iter().map(|o| o.kind).collect()
    }

    fn flood_rec(i: usize) -> Vec<u8> {
        rec(
            &format!("flood-{i:05}"),
            i as u64,
            serde_json::json!({"probs": [0.25, 0.75]}),
        )
    }

    #[test]
    fn new_streams_wait_for_the_rebirth_interval_and_one_birth_covers_the_records_behind() {
        let t0 = Instant::now();
        let mut s = Session::new(
            topics(),
            0,
            Bounds {
                rebirth_interval: Duration::from_secs(2),
                ..BOUNDS
            },
        );
        s.nbirth(t0, 0);
        // The first birth of the device goes at once.
        let Step::Send { out, .. } = s.record(&flood_rec(0), [], t0, 0).unwrap() else {
            panic!()
        };
        assert_eq!(kinds(&out), ["DBIRTH", "DDATA"]);
        // A new stream right after: it waits for the interval, nothing changed.
        let ahead: Vec<Vec<u8>> = (2..40).map(flood_rec).collect();
        let later = t0 + Duration::from_millis(500);
        let step = s
            .record(&flood_rec(1), ahead.iter().map(Vec::as_slice), later, 0)
            .unwrap();
        assert_eq!(step, Step::Wait(Duration::from_millis(1500)));
        // The stream already born still goes.
        let Step::Send { out, .. } = s.record(&flood_rec(0), [], later, 0).unwrap() else {
            panic!()
        };
        assert_eq!(kinds(&out), ["DDATA"]);
        // Once due: one DBIRTH declares it and every stream queued behind it.
        let due = t0 + Duration::from_secs(2);
        let Step::Send { out, evicted } = s
            .record(&flood_rec(1), ahead.iter().map(Vec::as_slice), due, 0)
            .unwrap()
        else {
            panic!()
        };
        assert_eq!(kinds(&out), ["DBIRTH", "DDATA"]);
        assert_eq!(evicted, Evicted::default());
        let birth = decode(&out[0]);
        assert_eq!(birth.metrics.len(), 40 * 6);
        let ahead_one = birth
            .metrics
            .iter()
            .find(|m| m.name.as_deref() == Some("flood-00039/probs/1"))
            .unwrap();
        assert_eq!(
            ahead_one.is_null,
            Some(true),
            "declared ahead, no value yet"
        );
        assert_eq!(ahead_one.datatype, Some(datatype::DOUBLE));
        // The records behind go without another birth, right away.
        for r in &ahead {
            let Step::Send { out, .. } = s.record(r, [], due, 0).unwrap() else {
                panic!()
            };
            assert_eq!(kinds(&out), ["DDATA"]);
        }
        // An NCMD rebirth is paced by the last NBIRTH.
        assert_eq!(
            s.rebirth_wait(t0 + Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        assert_eq!(s.rebirth_wait(due), Duration::ZERO);
    }

    #[test]
    fn the_metric_set_is_bounded_least_recently_seen_out_after_a_ddeath() {
        let bounds = Bounds {
            max_metrics: 50,
            max_payload: 1 << 20,
            rebirth_interval: Duration::ZERO,
        };
        let mut s = Session::new(topics(), 0, bounds);
        let now = Instant::now();
        s.nbirth(now, 0);
        let mut declared: std::collections::HashSet<String> = Default::default();
        let (mut evicted, mut ddeaths) = (0, 0);
        for i in 0..100 {
            // Stream 0 comes back every time: it stays, the others rotate out.
            for r in [flood_rec(0), flood_rec(i)] {
                let Step::Send { out, evicted: e } = s.record(&r, [], now, 0).unwrap() else {
                    panic!()
                };
                evicted += e.metrics;
                for o in &out {
                    let p = decode(o);
                    match o.kind {
                        "DDEATH" => {
                            ddeaths += 1;
                            assert!(p.metrics.is_empty());
                            assert!(p.seq.is_some());
                            declared.clear();
                        }
                        "DBIRTH" => {
                            assert!(p.metrics.len() <= 50, "{}", p.metrics.len());
                            declared = names(&p).into_iter().collect();
                        }
                        "DDATA" => {
                            for n in names(&p) {
                                assert!(declared.contains(&n), "{n} not declared");
                            }
                        }
                        k => panic!("{k}"),
                    }
                }
                if e.metrics > 0 {
                    assert_eq!(kinds(&out), ["DDEATH", "DBIRTH", "DDATA"]);
                }
            }
        }
        // 6 metrics a stream: 8 streams fit; 99 streams came.
        assert!(s.metrics() <= 50);
        assert_eq!(evicted, (99 - 7) * 6);
        assert_eq!(ddeaths, 99 - 7);
        assert!(
            declared.contains("flood-00000/id"),
            "the stream seen most stays"
        );
    }

    #[test]
    fn births_stay_under_the_payload_bound_and_oversized_records_are_refused() {
        let bounds = Bounds {
            max_metrics: 100_000,
            max_payload: 2048,
            rebirth_interval: Duration::ZERO,
        };
        let mut s = Session::new(topics(), 0, bounds);
        let now = Instant::now();
        s.nbirth(now, 0);
        let mut largest = 0;
        for i in 0..300 {
            let name = format!("a-rather-long-stream-name-{i:05}-{}", "x".repeat(i % 40));
            let r = rec(&name, i as u64, serde_json::json!({"probs": [0.25, 0.75]}));
            let ahead: Vec<Vec<u8>> = (1..5)
                .map(|j| rec(&format!("{name}-{j}"), 0, serde_json::json!({"p": 1})))
                .collect();
            let Step::Send { out, .. } = s
                .record(&r, ahead.iter().map(Vec::as_slice), now, 0)
                .unwrap()
            else {
                panic!()
            };
            for o in out {
                assert!(o.payload.len() <= 2048, "{} {}", o.kind, o.payload.len());
                if o.kind == "DBIRTH" {
                    largest = largest.max(o.payload.len());
                }
            }
        }
        assert!(largest > 1024, "the bound was reached: {largest}");
        // A record larger than a birth may be, or whose DDATA is: an error.
        let many: serde_json::Map<String, serde_json::Value> = (0..200)
            .map(|i| (format!("k{i}"), serde_json::json!(i)))
            .collect();
        let e = send(&mut s, &rec("s", 1, serde_json::Value::Object(many)), 0).unwrap_err();
        assert!(e.to_string().contains("max_packet_bytes"), "{e}");
        let mut s = Session::new(
            topics(),
            0,
            Bounds {
                max_metrics: 5,
                ..BOUNDS
            },
        );
        s.nbirth(now, 0);
        let e = send(
            &mut s,
            &rec("s", 1, serde_json::json!({"probs": [1, 2, 3]})),
            0,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("sparkplug_max_metrics_per_device"),
            "{e}"
        );
    }

    #[test]
    fn an_ncmd_rebirth_keeps_births_within_the_bound() {
        let bounds = Bounds {
            max_metrics: 100_000,
            max_payload: 4096,
            rebirth_interval: Duration::ZERO,
        };
        let mut s = Session::new(topics(), 0, bounds);
        let now = Instant::now();
        s.nbirth(now, 0);
        for i in 0..40 {
            send(&mut s, &flood_rec(i), 0).unwrap();
        }
        // The ids grow longer than they were at the last birth.
        for i in 0..40 {
            let r = serde_json::to_vec(&serde_json::json!({
                "id": format!("gw-1/1/{}", "9".repeat(60)), "pipeline": "sensors",
                "stream": format!("flood-{i:05}"), "outputs": {"probs": [0.5, 0.5]}
            }))
            .unwrap();
            send(&mut s, &r, 0).unwrap();
        }
        let (out, _) = s.rebirth(now, 0);
        assert_eq!(kinds(&out), ["NBIRTH", "DBIRTH"]);
        assert!(out[1].payload.len() <= 4096, "{}", out[1].payload.len());
    }
}
