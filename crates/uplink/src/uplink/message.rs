//! Outbox entries to MQTT messages, free of I/O: topic templates, batching
//! and payload encoding.
//!
//! Invariants:
//! - Every entry handed to [`Batcher::build`] comes back exactly once,
//!   either in one message's `keys` or in `rejected` (with a reason), so
//!   nothing is acknowledged that was not sent and nothing is dropped.
//! - Messages of one topic come out in key order (the order of the
//!   entries), so the fleet sees each stream oldest first.
//! - No payload exceeds `max_payload` bytes: a batch is closed before it
//!   would, and a single record that is larger on its own is rejected.

use std::borrow::Cow;
use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::outbox::{Entry, Key};

/// How records are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadFormat {
    /// The stored JSON bytes as they are (a JSON array when batching).
    #[default]
    Json,
    /// CBOR (RFC 8949) of the same value (a CBOR array when batching).
    Cbor,
    /// Sparkplug B (protobuf, `spBv1.0/{group}/...` topics; see
    /// `sparkplug.rs`). Messages carry the stored JSON until the publish,
    /// where the connection's Sparkplug session encodes them.
    SparkplugB,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Lit(String),
    Device,
    Pipeline,
    Stream,
}

/// A topic template with `{device}`, `{pipeline}` and `{stream}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    parts: Vec<Part>,
}

/// A topic template that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", match .what {
    TemplateProblem::Empty => "the topic is empty".to_string(),
    TemplateProblem::Wildcard => format!("`{}`: a publish topic cannot hold the wildcards + or #", .topic),
    TemplateProblem::Unclosed => format!("`{}`: unclosed `{{`", .topic),
    TemplateProblem::Stray => format!("`{}`: stray `}}`", .topic),
    TemplateProblem::Unknown { name, known } => format!("`{}`: unknown placeholder `{{{name}}}` (known: {known})", .topic),
})]
pub struct TemplateError {
    pub topic: String,
    pub what: TemplateProblem,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateProblem {
    Empty,
    Wildcard,
    Unclosed,
    Stray,
    Unknown { name: String, known: String },
}

impl Template {
    /// Parses a template; `allowed` lists the placeholders it may use.
    pub fn parse(s: &str, allowed: &[&str]) -> Result<Template, TemplateError> {
        let bad = |what: TemplateProblem| TemplateError {
            topic: s.to_string(),
            what,
        };
        if s.is_empty() {
            return Err(bad(TemplateProblem::Empty));
        }
        if s.contains(['+', '#']) {
            return Err(bad(TemplateProblem::Wildcard));
        }
        let mut parts = Vec::new();
        let mut rest = s;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(Part::Lit(rest[..open].to_string()));
            }
            let Some(close) = rest[open..].find('}') else {
                return Err(bad(TemplateProblem::Unclosed));
            };
            let name = &rest[open + 1..open + close];
            if !allowed.contains(&name) {
                return Err(bad(TemplateProblem::Unknown {
                    name: name.to_string(),
                    known: allowed
                        .iter()
                        .map(|a| format!("{{{a}}}"))
                        .collect::<Vec<_>>()
                        .join(" "),
                }));
            }
            parts.push(match name {
                "device" => Part::Device,
                "pipeline" => Part::Pipeline,
                _ => Part::Stream,
            });
            rest = &rest[open + close + 1..];
        }
        if rest.contains('}') {
            return Err(bad(TemplateProblem::Stray));
        }
        if !rest.is_empty() {
            parts.push(Part::Lit(rest.to_string()));
        }
        Ok(Template { parts })
    }

    pub fn uses_pipeline(&self) -> bool {
        self.parts.contains(&Part::Pipeline)
    }

    /// The topic for one record. Wildcards and NUL in the names are
    /// replaced by `_`: a publish to such a topic makes the broker drop the
    /// connection, and the uplink would retry it forever.
    pub fn render(&self, device: &str, pipeline: &str, stream: &str) -> String {
        let mut out = String::new();
        for p in &self.parts {
            let v = match p {
                Part::Lit(s) => {
                    out.push_str(s);
                    continue;
                }
                Part::Device => device,
                Part::Pipeline => pipeline,
                Part::Stream => stream,
            };
            out.extend(v.chars().map(|c| {
                if matches!(c, '+' | '#' | '\0') {
                    '_'
                } else {
                    c
                }
            }));
        }
        out
    }
}

/// The fields of a stored record the uplink needs.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    pipeline: Option<Cow<'a, str>>,
}

/// Stored bytes that are not one JSON record.
#[derive(Debug, thiserror::Error)]
#[error("not a JSON record: {0}")]
pub struct NotARecord(#[from] serde_json::Error);

/// The record's pipeline name. Parsing also checks the bytes are one JSON
/// value: a record that is not cannot go into a JSON array or CBOR.
pub fn record_pipeline(record: &[u8]) -> Result<String, NotARecord> {
    let h: Head = serde_json::from_slice(record).map_err(NotARecord)?;
    Ok(h.pipeline.map(|p| p.into_owned()).unwrap_or_default())
}

/// One MQTT message: the keys it carries are acknowledged by its PUBACK.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    pub topic: String,
    pub keys: Vec<Key>,
    pub payload: Vec<u8>,
}

/// What [`Batcher::build`] made of a page of entries.
#[derive(Debug, Default)]
pub struct Built {
    pub messages: Vec<Message>,
    /// Entries that can never be sent, with the reason (to the dead letters).
    pub rejected: Vec<(Key, String)>,
}

/// Turns outbox entries into messages.
#[derive(Debug, Clone)]
pub struct Batcher {
    pub topic: Template,
    pub device: String,
    /// Records per message; 1 sends each record alone (not in an array).
    pub batch: usize,
    pub format: PayloadFormat,
    pub max_payload: usize,
}

/// Why a record cannot be encoded for the wire.
#[derive(Debug, thiserror::Error)]
enum EncodeError {
    #[error("not a JSON record: {0}")]
    NotJson(serde_json::Error),
    #[error("CBOR encoding: {0}")]
    Cbor(ciborium::ser::Error<std::io::Error>),
}

/// One record, encoded for the wire on its own.
fn encode_one(format: PayloadFormat, record: &[u8]) -> Result<Vec<u8>, EncodeError> {
    match format {
        PayloadFormat::Json | PayloadFormat::SparkplugB => Ok(record.to_vec()),
        PayloadFormat::Cbor => {
            let v: serde_json::Value =
                serde_json::from_slice(record).map_err(EncodeError::NotJson)?;
            let mut out = Vec::with_capacity(record.len());
            ciborium::into_writer(&v, &mut out).map_err(EncodeError::Cbor)?;
            Ok(out)
        }
    }
}

/// The head of a definite-length CBOR array of `n` items (RFC 8949 §3.1).
pub fn cbor_array_head(n: usize) -> Vec<u8> {
    match n {
        0..=23 => vec![0x80 | n as u8],
        24..=0xff => vec![0x98, n as u8],
        0x100..=0xffff => {
            let b = (n as u16).to_be_bytes();
            vec![0x99, b[0], b[1]]
        }
        _ => {
            let mut v = vec![0x9a];
            v.extend_from_slice(&(n as u32).to_be_bytes());
            v
        }
    }
}

/// An open batch: encoded records of one topic.
struct Open {
    topic: String,
    keys: Vec<Key>,
    items: Vec<Vec<u8>>,
    bytes: usize,
}

impl Batcher {
    /// Bytes a batch of `n` items of `bytes` in all takes once framed.
    fn framed_len(&self, n: usize, bytes: usize) -> usize {
        if self.batch <= 1 {
            return bytes;
        }
        match self.format {
            // [a,b,c]
            PayloadFormat::Json | PayloadFormat::SparkplugB => bytes + n.saturating_sub(1) + 2,
            PayloadFormat::Cbor => bytes + cbor_array_head(n).len(),
        }
    }

    fn close(&self, o: Open) -> Message {
        let payload = if self.batch <= 1 {
            o.items.into_iter().next().unwrap_or_default()
        } else {
            let mut p = Vec::with_capacity(self.framed_len(o.items.len(), o.bytes));
            match self.format {
                PayloadFormat::Json | PayloadFormat::SparkplugB => {
                    p.push(b'[');
                    for (i, it) in o.items.iter().enumerate() {
                        if i > 0 {
                            p.push(b',');
                        }
                        p.extend_from_slice(it);
                    }
                    p.push(b']');
                }
                PayloadFormat::Cbor => {
                    p.extend(cbor_array_head(o.items.len()));
                    for it in &o.items {
                        p.extend_from_slice(it);
                    }
                }
            }
            p
        };
        Message {
            topic: o.topic,
            keys: o.keys,
            payload,
        }
    }

    /// Makes messages of a page of entries (oldest first).
    pub fn build(&self, entries: Vec<Entry>) -> Built {
        let mut built = Built::default();
        // Slots in the order batches were opened: that is key order per
        // topic, because a topic's next batch opens only after its
        // previous one closed.
        let mut slots: Vec<Option<Message>> = Vec::new();
        let mut open: HashMap<String, (usize, Open)> = HashMap::new();
        let batch = self.batch.max(1);
        for e in entries {
            let pipeline = match record_pipeline(&e.record) {
                Ok(p) => p,
                Err(reason) => {
                    built.rejected.push((e.key, reason.to_string()));
                    continue;
                }
            };
            // An unsynced record goes with its time recomputed, once known.
            let item = match encode_one(self.format, &crate::clock::for_sending(&e.record)) {
                Ok(i) => i,
                Err(reason) => {
                    built.rejected.push((e.key, reason.to_string()));
                    continue;
                }
            };
            if self.framed_len(1, item.len()) > self.max_payload {
                built.rejected.push((
                    e.key,
                    format!(
                        "record of {} bytes exceeds max_packet_bytes ({})",
                        item.len(),
                        self.max_payload
                    ),
                ));
                continue;
            }
            let topic = self.topic.render(&self.device, &pipeline, &e.stream);
            if topic.is_empty() {
                // MQTT has no empty topic; the broker would drop the connection.
                built
                    .rejected
                    .push((e.key, "the topic renders empty".into()));
                continue;
            }
            if let Some((slot, o)) = open.remove(&topic) {
                let fits = o.items.len() < batch
                    && self.framed_len(o.items.len() + 1, o.bytes + item.len()) <= self.max_payload;
                if fits {
                    let mut o = o;
                    o.keys.push(e.key);
                    o.bytes += item.len();
                    o.items.push(item);
                    open.insert(topic, (slot, o));
                    continue;
                }
                slots[slot] = Some(self.close(o));
            }
            slots.push(None);
            open.insert(
                topic.clone(),
                (
                    slots.len() - 1,
                    Open {
                        topic,
                        keys: vec![e.key],
                        bytes: item.len(),
                        items: vec![item],
                    },
                ),
            );
        }
        for (_, (slot, o)) in open {
            slots[slot] = Some(self.close(o));
        }
        built.messages = slots.into_iter().flatten().collect();
        built
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    const ALL: &[&str] = &["device", "pipeline", "stream"];

    fn entry(seq: u64, pipeline: &str, stream: &str) -> Entry {
        Entry {
            key: Key(1, seq),
            stream: stream.into(),
            appended_at: SystemTime::UNIX_EPOCH,
            record: format!(
                r#"{{"id":"d/1/{seq}","device":"d","pipeline":"{pipeline}","stream":"{stream}","seq":{seq},"outputs":{{"x":[1.5,2]}}}}"#
            )
            .into_bytes(),
        }
    }

    fn batcher(batch: usize, format: PayloadFormat) -> Batcher {
        Batcher {
            topic: Template::parse("outpost/{device}/{pipeline}/{stream}", ALL).unwrap(),
            device: "gw1".into(),
            batch,
            format,
            max_payload: 1 << 20,
        }
    }

    #[test]
    fn topic_template_renders_the_placeholders() {
        let t = Template::parse("outpost/{device}/{pipeline}/{stream}", ALL).unwrap();
        assert_eq!(t.render("gw1", "vad", "mic-1"), "outpost/gw1/vad/mic-1");
        assert!(t.uses_pipeline());
        let t = Template::parse("fleet/{stream}-x", ALL).unwrap();
        assert_eq!(t.render("a", "b", "c"), "fleet/c-x");
        assert!(!t.uses_pipeline());
        let t = Template::parse("plain", ALL).unwrap();
        assert_eq!(t.render("a", "b", "c"), "plain");
        // Wildcards in names would get the connection dropped.
        let t = Template::parse("o/{stream}", ALL).unwrap();
        assert_eq!(t.render("a", "b", "s+1#\0"), "o/s_1__");
    }

    #[test]
    fn topic_template_refuses_bad_templates() {
        for bad in ["", "o/{nope}", "o/{device", "o/device}", "o/+/x", "o/#"] {
            assert!(Template::parse(bad, ALL).is_err(), "{bad}");
        }
        assert!(Template::parse("o/{stream}", &["device"]).is_err());
        assert!(Template::parse("o/{device}/status", &["device"]).is_ok());
    }

    #[test]
    fn record_pipeline_reads_the_field_and_checks_json() {
        assert_eq!(
            record_pipeline(&entry(1, "vad", "s").record).unwrap(),
            "vad"
        );
        assert_eq!(record_pipeline(br#"{"a":1}"#).unwrap(), "");
        assert!(record_pipeline(br#"{"pipeline":"x""#).is_err());
        assert!(record_pipeline(b"not json").is_err());
        // Escapes in the name are decoded.
        assert_eq!(record_pipeline(br#"{"pipeline":"a\"b"}"#).unwrap(), "a\"b");
    }

    #[test]
    fn batch_one_sends_each_record_as_stored() {
        let es: Vec<Entry> = (0..5).map(|i| entry(i, "p", "s")).collect();
        let b = batcher(1, PayloadFormat::Json).build(es.clone());
        assert!(b.rejected.is_empty());
        assert_eq!(b.messages.len(), 5);
        for (m, e) in b.messages.iter().zip(&es) {
            assert_eq!(m.payload, e.record);
            assert_eq!(m.keys, vec![e.key]);
            assert_eq!(m.topic, "outpost/gw1/p/s");
        }
    }

    #[test]
    fn batching_groups_by_topic_in_key_order() {
        let es: Vec<Entry> = (0..10)
            .map(|i| entry(i, "p", if i % 3 == 0 { "a" } else { "b" }))
            .collect();
        let b = batcher(3, PayloadFormat::Json).build(es);
        // a: 0 3 6 9 -> [0,3,6] [9]; b: 1 2 4 5 7 8 -> [1,2,4] [5,7,8]
        let got: Vec<(String, Vec<u64>)> = b
            .messages
            .iter()
            .map(|m| (m.topic.clone(), m.keys.iter().map(|k| k.1).collect()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("outpost/gw1/p/a".into(), vec![0, 3, 6]),
                ("outpost/gw1/p/b".into(), vec![1, 2, 4]),
                ("outpost/gw1/p/b".into(), vec![5, 7, 8]),
                ("outpost/gw1/p/a".into(), vec![9]),
            ]
        );
        for m in &b.messages {
            let v: Vec<serde_json::Value> = serde_json::from_slice(&m.payload).unwrap();
            let seqs: Vec<u64> = v.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
            assert_eq!(seqs, m.keys.iter().map(|k| k.1).collect::<Vec<_>>());
        }
    }

    #[test]
    fn batching_respects_the_payload_limit_and_rejects_oversized_records() {
        let mut es: Vec<Entry> = (0..6).map(|i| entry(i, "p", "s")).collect();
        let one = es[0].record.len();
        let mut big = entry(6, "p", "s");
        big.record = format!(r#"{{"pipeline":"p","pad":"{}"}}"#, "x".repeat(4 * one)).into_bytes();
        es.insert(2, big);
        es.push(Entry {
            key: Key(1, 99),
            stream: "s".into(),
            appended_at: SystemTime::UNIX_EPOCH,
            record: b"{broken".to_vec(),
        });
        let mut bt = batcher(100, PayloadFormat::Json);
        bt.max_payload = 2 * one + 3 + 2; // two records and the brackets
        let b = bt.build(es);
        let rejected: Vec<u64> = b.rejected.iter().map(|(k, _)| k.1).collect();
        assert_eq!(rejected, vec![6, 99]);
        assert!(
            b.rejected[0].1.contains("exceeds max_packet_bytes"),
            "{:?}",
            b.rejected
        );
        assert!(b.rejected[1].1.contains("not a JSON record"));
        let keys: Vec<Vec<u64>> = b
            .messages
            .iter()
            .map(|m| m.keys.iter().map(|k| k.1).collect())
            .collect();
        assert_eq!(keys, vec![vec![0, 1], vec![2, 3], vec![4, 5]]);
        for m in &b.messages {
            assert!(m.payload.len() <= bt.max_payload);
        }
    }

    #[test]
    fn cbor_payload_decodes_to_the_same_value() {
        let es: Vec<Entry> = (0..30).map(|i| entry(i, "p", "s")).collect();
        let one = batcher(1, PayloadFormat::Cbor).build(es.clone());
        let v: serde_json::Value = ciborium::from_reader(&one.messages[0].payload[..]).unwrap();
        let want: serde_json::Value = serde_json::from_slice(&es[0].record).unwrap();
        assert_eq!(v, want);
        // 30 items: the array head takes two bytes (0x98, 30).
        let many = batcher(30, PayloadFormat::Cbor).build(es.clone());
        assert_eq!(many.messages.len(), 1);
        assert_eq!(&many.messages[0].payload[..2], &[0x98, 30]);
        let v: Vec<serde_json::Value> =
            ciborium::from_reader(&many.messages[0].payload[..]).unwrap();
        assert_eq!(v.len(), 30);
        assert_eq!(
            v[29],
            serde_json::from_slice::<serde_json::Value>(&es[29].record).unwrap()
        );
    }

    #[test]
    fn cbor_array_heads_decode() {
        for n in [0usize, 1, 23, 24, 255, 256, 65535, 65536] {
            let mut bytes = cbor_array_head(n);
            bytes.extend(std::iter::repeat_n(0xf6, n)); // n nulls
            let v: Vec<Option<u8>> = ciborium::from_reader(&bytes[..]).unwrap();
            assert_eq!(v.len(), n);
        }
    }

    #[test]
    fn every_entry_comes_back_exactly_once() {
        let es: Vec<Entry> = (0..200)
            .map(|i| entry(i, ["p", "q"][(i % 2) as usize], &format!("s{}", i % 7)))
            .collect();
        for batch in [1, 2, 5, 64] {
            let b = batcher(batch, PayloadFormat::Json).build(es.clone());
            let mut keys: Vec<Key> = b.messages.iter().flat_map(|m| m.keys.clone()).collect();
            keys.sort();
            assert_eq!(keys, es.iter().map(|e| e.key).collect::<Vec<_>>());
            // Per topic, key order.
            let mut last: HashMap<&str, Key> = HashMap::new();
            for m in &b.messages {
                for k in &m.keys {
                    if let Some(p) = last.insert(&m.topic, *k) {
                        assert!(p < *k);
                    }
                }
            }
        }
    }
}
