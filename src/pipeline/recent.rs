//! The most recent result records of each pipeline, for the local console
//! and `GET /v1/pipelines/{name}/records`: a small bounded ring per
//! pipeline, of the JSON text the outbox stored (nothing is serialized
//! twice). A record larger than [`MAX_RECORD_BYTES`] is kept as a short
//! stand-in that names it, so the ring's memory stays bounded whatever a
//! model outputs.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;

/// Records kept per pipeline.
pub const PER_PIPELINE: usize = 20;
/// A record's JSON above this size is replaced by a stand-in.
pub const MAX_RECORD_BYTES: usize = 4096;
/// Pipelines tracked at most (names come from the config; a bound anyway).
const MAX_PIPELINES: usize = 256;

/// The rings, by pipeline name.
#[derive(Default)]
pub struct RecentRecords {
    rings: Mutex<HashMap<String, VecDeque<Arc<str>>>>,
}

impl RecentRecords {
    /// Keeps `json` (one record as stored) as the newest of `pipeline`.
    pub fn push(&self, pipeline: &str, json: &[u8]) {
        let text: Arc<str> = match std::str::from_utf8(json) {
            Ok(s) if s.len() <= MAX_RECORD_BYTES => s.into(),
            Ok(s) => stand_in(s).into(),
            // serde_json only writes UTF-8; keep the ring consistent regardless.
            Err(_) => return,
        };
        let mut rings = self.rings.lock();
        if !rings.contains_key(pipeline) && rings.len() >= MAX_PIPELINES {
            return;
        }
        let ring = rings.entry(pipeline.to_string()).or_default();
        if ring.len() >= PER_PIPELINE {
            ring.pop_front();
        }
        ring.push_back(text);
    }

    /// Up to `n` records of `pipeline`, newest first.
    pub fn latest(&self, pipeline: &str, n: usize) -> Vec<Arc<str>> {
        let rings = self.rings.lock();
        rings
            .get(pipeline)
            .map(|r| r.iter().rev().take(n).cloned().collect())
            .unwrap_or_default()
    }

    /// A JSON array (newest first) of up to `n` records of `pipeline`.
    pub fn latest_json(&self, pipeline: &str, n: usize) -> String {
        let recs = self.latest(pipeline, n);
        let mut out = String::with_capacity(2 + recs.iter().map(|r| r.len() + 1).sum::<usize>());
        out.push('[');
        for (i, r) in recs.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(r);
        }
        out.push(']');
        out
    }
}

/// What stands for a record too large to keep: its identity and size.
fn stand_in(json: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(json).unwrap_or_default();
    let pick = |k: &str| v.get(k).cloned().unwrap_or(serde_json::Value::Null);
    serde_json::json!({
        "id": pick("id"),
        "pipeline": pick("pipeline"),
        "stream": pick("stream"),
        "seq": pick("seq"),
        "ts": pick("ts"),
        "model": pick("model"),
        "latency_us": pick("latency_us"),
        "outputs": {"truncated": true, "bytes": json.len()},
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(seq: u64, outputs: &str) -> Vec<u8> {
        format!(
            r#"{{"id":"d/1/{seq}","pipeline":"p","stream":"s","seq":{seq},"outputs":{outputs}}}"#
        )
        .into_bytes()
    }

    #[test]
    fn keeps_the_newest_records_newest_first() {
        let r = RecentRecords::default();
        for seq in 0..(PER_PIPELINE as u64 + 5) {
            r.push("p", &rec(seq, "{}"));
        }
        let got = r.latest("p", 100);
        assert_eq!(got.len(), PER_PIPELINE);
        let seqs: Vec<u64> = got
            .iter()
            .map(|t| {
                serde_json::from_str::<serde_json::Value>(t).unwrap()["seq"]
                    .as_u64()
                    .unwrap()
            })
            .collect();
        assert_eq!(seqs[0], PER_PIPELINE as u64 + 4);
        assert_eq!(*seqs.last().unwrap(), 5);
        let arr: serde_json::Value = serde_json::from_str(&r.latest_json("p", 3)).unwrap();
        assert_eq!(arr.as_array().unwrap().len(), 3);
        assert_eq!(r.latest_json("nope", 3), "[]");
    }

    #[test]
    fn a_large_record_is_kept_as_a_stand_in() {
        let r = RecentRecords::default();
        let big = format!("[{}]", vec!["1.5"; 2000].join(","));
        r.push("p", &rec(7, &big));
        let got: serde_json::Value = serde_json::from_str(&r.latest("p", 1)[0]).unwrap();
        assert_eq!(got["seq"], 7);
        assert_eq!(got["outputs"]["truncated"], true);
        assert!(got["outputs"]["bytes"].as_u64().unwrap() > MAX_RECORD_BYTES as u64);
    }
}
