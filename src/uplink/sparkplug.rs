//! Sparkplug B (Eclipse Sparkplug 3.0) for the MQTT uplink, free of I/O:
//! the protobuf payload, topics, births, sequence numbers.
//!
//! outpost is the edge node `{device}` of group `{group}`; each pipeline is
//! a Sparkplug device. Messages:
//! - `spBv1.0/{group}/NBIRTH/{device}` on every connect: seq 0, metrics
//!   `bdSeq` and `Node Control/Rebirth`;
//! - `spBv1.0/{group}/DBIRTH/{device}/{pipeline}` before a pipeline's first
//!   data on a connection, and again when a record brings a metric the last
//!   birth did not declare (every metric known so far, with its last value);
//! - `spBv1.0/{group}/DDATA/{device}/{pipeline}`: one per record, its metrics;
//! - `spBv1.0/{group}/NDEATH/{device}`: the MQTT will (and published before
//!   a clean disconnect), with the `bdSeq` of the NBIRTH it ends.
//! - `spBv1.0/{group}/NCMD/{device}` is subscribed to: a command with
//!   `Node Control/Rebirth` = true brings a fresh NBIRTH (the same bdSeq,
//!   seq 0) and a DBIRTH for every pipeline that has data, before any more
//!   DDATA; other commands are ignored (logged and counted).
//!
//! Invariants:
//! - `seq` is 0 on NBIRTH and goes up by one (mod 256) with every DBIRTH
//!   and DDATA of the connection; NDEATH carries none.
//! - `bdSeq` goes up by one (mod 256) with every MQTT connect; the will set
//!   at CONNECT and the NBIRTH after it carry the same value.
//! - A record's metrics are named `{stream}/{path}`, where `path` walks its
//!   `outputs` (`probs/0`, `boxes/1/score`): numbers are Double, booleans
//!   Boolean, strings String; plus `{stream}/id` (String, the record id the
//!   fleet drops duplicates by), `{stream}/seq` and `{stream}/latency_us`
//!   (UInt64) and `{stream}/model` (String).
//!
//! The protobuf messages below follow the field numbers of the published
//! `sparkplug_b.proto` (package `org.eclipse.tahu.protobuf`); only the parts
//! outpost writes are declared (DataSet, Template, MetaData and properties
//! are never sent).

use std::collections::BTreeMap;

use prost::Message as _;

/// Sparkplug B data types (the `DataType` enum of sparkplug_b.proto).
pub mod datatype {
    pub const UINT64: u32 = 8;
    pub const DOUBLE: u32 = 10;
    pub const BOOLEAN: u32 = 11;
    pub const STRING: u32 = 12;
}

/// `Payload` of sparkplug_b.proto (proto2).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payload {
    #[prost(uint64, optional, tag = "1")]
    pub timestamp: Option<u64>,
    #[prost(message, repeated, tag = "2")]
    pub metrics: Vec<Metric>,
    #[prost(uint64, optional, tag = "3")]
    pub seq: Option<u64>,
    #[prost(string, optional, tag = "4")]
    pub uuid: Option<String>,
    #[prost(bytes = "vec", optional, tag = "5")]
    pub body: Option<Vec<u8>>,
}

/// `Payload.Metric` of sparkplug_b.proto.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(uint64, optional, tag = "2")]
    pub alias: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "4")]
    pub datatype: Option<u32>,
    #[prost(bool, optional, tag = "5")]
    pub is_historical: Option<bool>,
    #[prost(bool, optional, tag = "6")]
    pub is_transient: Option<bool>,
    #[prost(bool, optional, tag = "7")]
    pub is_null: Option<bool>,
    #[prost(oneof = "Value", tags = "10, 11, 12, 13, 14, 15, 16")]
    pub value: Option<Value>,
}

/// The `value` oneof of `Payload.Metric` (the scalar members).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    #[prost(uint32, tag = "10")]
    Int(u32),
    #[prost(uint64, tag = "11")]
    Long(u64),
    #[prost(float, tag = "12")]
    Float(f32),
    #[prost(double, tag = "13")]
    Double(f64),
    #[prost(bool, tag = "14")]
    Boolean(bool),
    #[prost(string, tag = "15")]
    String(String),
    #[prost(bytes = "vec", tag = "16")]
    Bytes(Vec<u8>),
}

fn datatype_of(v: &Value) -> u32 {
    match v {
        Value::Long(_) => datatype::UINT64,
        Value::Boolean(_) => datatype::BOOLEAN,
        Value::String(_) => datatype::STRING,
        _ => datatype::DOUBLE,
    }
}

fn metric(name: &str, ts: u64, v: Value) -> Metric {
    Metric {
        name: Some(name.to_string()),
        timestamp: Some(ts),
        datatype: Some(datatype_of(&v)),
        value: Some(v),
        ..Metric::default()
    }
}

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
}

/// The node's state over one MQTT connection.
#[derive(Debug)]
pub struct Session {
    topics: Topics,
    bd_seq: u64,
    /// The seq of the next message.
    next_seq: u64,
    /// Per Sparkplug device (pipeline): every metric known, with its last
    /// value, and whether the last DBIRTH declared all of them.
    devices: BTreeMap<String, Device>,
}

#[derive(Debug, Default)]
struct Device {
    metrics: BTreeMap<String, Value>,
    born: bool,
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
    pub fn new(topics: Topics, bd_seq: u64) -> Session {
        Session {
            topics,
            bd_seq: bd_seq % 256,
            next_seq: 0,
            devices: BTreeMap::new(),
        }
    }

    fn seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq = (self.next_seq + 1) % 256;
        s
    }

    /// The NBIRTH that opens the connection (seq 0).
    pub fn nbirth(&mut self, now_ms: u64) -> Out {
        self.next_seq = 0;
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
        }
    }

    /// The messages for one stored record: a DBIRTH when needed, then its DDATA.
    pub fn record(&mut self, record: &[u8], now_ms: u64) -> Result<Vec<Out>, String> {
        let r: serde_json::Value =
            serde_json::from_slice(record).map_err(|e| format!("not a JSON record: {e}"))?;
        let pipeline = r["pipeline"].as_str().unwrap_or_default().to_string();
        if bad_id(&pipeline) {
            return Err(format!(
                "pipeline `{pipeline}` cannot be a Sparkplug device id"
            ));
        }
        let stream = r["stream"].as_str().unwrap_or_default();
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
        let dev = self.devices.entry(pipeline.clone()).or_default();
        for (name, v) in &values {
            match dev.metrics.get(name) {
                Some(old) if datatype_of(old) == datatype_of(v) => {}
                _ => dev.born = false,
            }
            dev.metrics.insert(name.clone(), v.clone());
        }
        let mut out = Vec::new();
        if !dev.born {
            dev.born = true;
            let metrics = dev
                .metrics
                .iter()
                .map(|(n, v)| metric(n, ts, v.clone()))
                .collect();
            let seq = self.seq();
            out.push(Out {
                topic: self.topics.device("DBIRTH", &pipeline),
                payload: Payload {
                    timestamp: Some(now_ms),
                    seq: Some(seq),
                    metrics,
                    ..Payload::default()
                }
                .encode_to_vec(),
                data: false,
            });
        }
        let seq = self.seq();
        out.push(Out {
            topic: self.topics.device("DDATA", &pipeline),
            payload: Payload {
                timestamp: Some(now_ms),
                seq: Some(seq),
                metrics: values.into_iter().map(|(n, v)| metric(&n, ts, v)).collect(),
                ..Payload::default()
            }
            .encode_to_vec(),
            data: true,
        });
        Ok(out)
    }
}

/// The metric of a rebirth request (and of NBIRTH's control).
pub const REBIRTH: &str = "Node Control/Rebirth";

/// What an NCMD asks of the node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeCommand {
    /// `Node Control/Rebirth` = true.
    pub rebirth: bool,
    /// The metrics outpost does not act on, each with why.
    pub ignored: Vec<String>,
}

/// Reads an NCMD payload; Err when it is no Sparkplug B payload at all.
pub fn node_command(payload: &[u8]) -> Result<NodeCommand, String> {
    let p = Payload::decode(payload).map_err(|e| format!("not a Sparkplug B payload: {e}"))?;
    let mut c = NodeCommand::default();
    for m in &p.metrics {
        match (m.name.as_deref(), &m.value) {
            (Some(REBIRTH), Some(Value::Boolean(true))) => c.rebirth = true,
            (Some(REBIRTH), Some(Value::Boolean(false))) => {
                c.ignored.push(format!("{REBIRTH} = false: nothing to do"));
            }
            (Some(REBIRTH), v) => c.ignored.push(format!(
                "{REBIRTH} with a value that is not a boolean: {v:?}"
            )),
            (Some(n), _) => c
                .ignored
                .push(format!("{n}: not a command this node takes")),
            (None, _) => c
                .ignored
                .push(format!("a metric without a name (alias {:?})", m.alias)),
        }
    }
    if p.metrics.is_empty() {
        c.ignored.push("no metrics".into());
    }
    Ok(c)
}

impl Session {
    /// A rebirth asked for by NCMD: a new NBIRTH (same bdSeq, seq 0), then a
    /// DBIRTH for each device seen on this connection, with every metric
    /// known and its last value, in that order before any further DDATA.
    pub fn rebirth(&mut self, now_ms: u64) -> Vec<Out> {
        let mut out = vec![self.nbirth(now_ms)];
        let names: Vec<String> = self
            .devices
            .iter()
            .filter(|(_, d)| !d.metrics.is_empty())
            .map(|(n, _)| n.clone())
            .collect();
        for name in names {
            let seq = self.seq();
            let Some(dev) = self.devices.get_mut(&name) else {
                continue;
            };
            dev.born = true;
            out.push(Out {
                topic: self.topics.device("DBIRTH", &name),
                payload: Payload {
                    timestamp: Some(now_ms),
                    seq: Some(seq),
                    metrics: dev
                        .metrics
                        .iter()
                        .map(|(n, v)| metric(n, now_ms, v.clone()))
                        .collect(),
                    ..Payload::default()
                }
                .encode_to_vec(),
                data: false,
            });
        }
        out
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

    fn decode(o: &Out) -> Payload {
        Payload::decode(&o.payload[..]).unwrap()
    }

    fn names(p: &Payload) -> Vec<String> {
        p.metrics.iter().map(|m| m.name.clone().unwrap()).collect()
    }

    #[test]
    fn births_then_data_with_seq_and_metrics_from_outputs() {
        let mut s = Session::new(topics(), 7);
        let nb = s.nbirth(1000);
        assert_eq!(nb.topic, "spBv1.0/plant/NBIRTH/gw-1");
        let p = decode(&nb);
        assert_eq!(p.seq, Some(0));
        assert_eq!(p.metrics[0].name.as_deref(), Some("bdSeq"));
        assert_eq!(p.metrics[0].value, Some(Value::Long(7)));
        assert_eq!(p.metrics[0].datatype, Some(datatype::UINT64));
        let out = s
            .record(
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
        let out = s
            .record(
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
        let out = s
            .record(
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
        let mut s2 = Session::new(topics(), 8);
        assert_eq!(decode(&s2.nbirth(5000)).seq, Some(0));
        let out = s2
            .record(
                &rec("s0", 4, serde_json::json!({"probs": [0.5, 0.5]})),
                6000,
            )
            .unwrap();
        assert_eq!(out.len(), 2);
    }

    #[test]
    fn seq_wraps_at_256_and_bdseq_rides_in_the_will() {
        let mut s = Session::new(topics(), 300);
        assert_eq!(decode(&s.nbirth(0)).metrics[0].value, Some(Value::Long(44)));
        let mut last = 0;
        for i in 0..600u64 {
            let out = s
                .record(&rec("s0", i, serde_json::json!({"x": 1})), 0)
                .unwrap();
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

    fn ncmd(metrics: Vec<Metric>) -> Vec<u8> {
        Payload {
            timestamp: Some(1),
            metrics,
            ..Payload::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn a_rebirth_command_births_the_node_and_its_devices_again() {
        let mut s = Session::new(topics(), 5);
        s.nbirth(0);
        for (i, p) in ["sensors", "cams"].iter().enumerate() {
            let r = serde_json::to_vec(&serde_json::json!({
                "id": format!("gw-1/1/{i}"), "pipeline": p, "stream": "s0", "seq": i,
                "outputs": {"x": 1.5}
            }))
            .unwrap();
            s.record(&r, 0).unwrap();
        }
        // NCMD: Node Control/Rebirth = true.
        let c = node_command(&ncmd(vec![metric(REBIRTH, 1, Value::Boolean(true))])).unwrap();
        assert_eq!(
            c,
            NodeCommand {
                rebirth: true,
                ignored: vec![]
            }
        );
        let out = s.rebirth(9000);
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
        let next = s.record(&r, 0).unwrap();
        assert_eq!(next.len(), 1);
        assert_eq!(decode(&next[0]).seq, Some(3));
    }

    #[test]
    fn other_and_malformed_node_commands_are_told_apart() {
        assert!(node_command(b"\xff\xff\xff").is_err());
        let c = node_command(&ncmd(vec![
            metric(REBIRTH, 1, Value::Boolean(false)),
            metric("Node Control/Reboot", 1, Value::Boolean(true)),
            metric(REBIRTH, 1, Value::Long(1)),
        ]))
        .unwrap();
        assert!(!c.rebirth);
        assert_eq!(c.ignored.len(), 3, "{:?}", c.ignored);
        assert!(c.ignored[1].starts_with("Node Control/Reboot"));
        assert_eq!(node_command(&ncmd(vec![])).unwrap().ignored, ["no metrics"]);
    }

    #[test]
    fn a_changed_type_is_born_again_and_bad_records_are_errors() {
        let mut s = Session::new(topics(), 0);
        s.nbirth(0);
        assert_eq!(
            s.record(&rec("s0", 1, serde_json::json!({"x": 1})), 0)
                .unwrap()
                .len(),
            2
        );
        assert_eq!(
            s.record(&rec("s0", 2, serde_json::json!({"x": "a"})), 0)
                .unwrap()
                .len(),
            2
        );
        assert!(s.record(b"nope", 0).is_err());
        let bad =
            serde_json::to_vec(&serde_json::json!({"pipeline": "a/b", "outputs": {}})).unwrap();
        assert!(s.record(&bad, 0).is_err());
    }
}
