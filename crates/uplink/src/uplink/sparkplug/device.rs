//! The metric set of one Sparkplug device (a pipeline), bounded, free of I/O.
//!
//! Sparkplug B wants every metric of a DDATA declared by the device's last
//! DBIRTH, and a DBIRTH carries the device's whole set. Metrics are named
//! by stream, and stream names come from outside (topic segments, datagram
//! prefixes, query strings), so the set is bounded: at most `max_metrics`
//! metrics, and a DBIRTH of at most `max_birth_bytes`. When a birth would
//! go past either, the least recently seen streams leave the set, each
//! with all its metrics; their next record brings them back with a birth.
//!
//! Invariants:
//! - After [`MetricSet::evict`], `count() <= max_metrics` and
//!   `birth_len() <= max_birth_bytes`, as long as the streams it must keep
//!   fit on their own (the caller checks that before declaring them).
//! - `birth_len()` is never below the encoded size of the DBIRTH that
//!   [`MetricSet::birth`] builds (timestamps are counted at their widest).
//! - Streams leave whole, least recently seen first; a stream seen (or
//!   declared) since the tick the caller keeps from is never evicted.

use std::collections::BTreeMap;

use super::proto::{
    Metric, PAYLOAD_HEAD_MAX, Value, datatype_of, metric, metric_len_max, null_metric,
};

/// The bounds of one device's metric set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_metrics: usize,
    /// The DBIRTH payload, in bytes, at most.
    pub max_birth_bytes: usize,
}

/// One declared metric: its type and its last value (`None`: declared
/// ahead of its first record, sent as `is_null`).
#[derive(Debug, Clone, PartialEq)]
struct Slot {
    datatype: u32,
    value: Option<Value>,
}

#[derive(Debug, Default)]
struct Stream {
    metrics: BTreeMap<String, Slot>,
    /// The tick it was last seen at (its key in `by_seen`).
    seen: u64,
    /// The bytes its metrics take in a birth, at most.
    bytes: usize,
}

fn slot_len(name: &str, s: &Slot) -> usize {
    metric_len_max(name, s.datatype, s.value.as_ref())
}

impl Stream {
    fn size(&self) -> (usize, usize) {
        (self.metrics.len(), self.bytes)
    }
}

/// A device's declared metrics, grouped by stream, least recently seen first.
#[derive(Debug, Default)]
pub struct MetricSet {
    streams: BTreeMap<String, Stream>,
    by_seen: BTreeMap<u64, String>,
    tick: u64,
    count: usize,
    bytes: usize,
}

/// What an eviction took out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    pub metrics: usize,
    pub streams: usize,
}

impl MetricSet {
    /// Metrics declared.
    pub fn count(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The DBIRTH payload's size at most, in bytes.
    pub fn birth_len(&self) -> usize {
        PAYLOAD_HEAD_MAX + self.bytes
    }

    /// The next tick: everything seen from now on counts as newer.
    pub fn now(&self) -> u64 {
        self.tick + 1
    }

    /// (metrics, bytes) the values of one record take as a birth of their own.
    pub fn alone(values: &[(String, Value)]) -> (usize, usize) {
        // A name given twice is declared once, with its last value (as `set` does).
        let last: BTreeMap<&str, &Value> = values.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let bytes: usize = last
            .iter()
            .map(|(n, v)| metric_len_max(n, datatype_of(v), Some(*v)))
            .sum();
        (last.len(), PAYLOAD_HEAD_MAX + bytes)
    }

    /// True when the last birth declared every metric of these values,
    /// each with the same type.
    pub fn covers(&self, stream: &str, values: &[(String, Value)]) -> bool {
        let Some(s) = self.streams.get(stream) else {
            return values.is_empty();
        };
        values.iter().all(|(n, v)| {
            s.metrics
                .get(n)
                .is_some_and(|slot| slot.datatype == datatype_of(v))
        })
    }

    /// The tick `stream` was last seen at, if it is in the set.
    pub fn seen(&self, stream: &str) -> Option<u64> {
        self.streams.get(stream).map(|s| s.seen)
    }

    /// (metrics, bytes) of `stream` now, and once `values` are declared in
    /// it ahead of their record (new names without a value).
    pub fn size_with(
        &self,
        stream: &str,
        values: &[(String, Value)],
    ) -> ((usize, usize), (usize, usize)) {
        let empty = BTreeMap::new();
        let (metrics, now) = match self.streams.get(stream) {
            Some(s) => (&s.metrics, s.size()),
            None => (&empty, (0, 0)),
        };
        let (mut n, mut b) = now;
        let mut seen = std::collections::BTreeSet::new();
        for (name, v) in values {
            if !seen.insert(name.as_str()) {
                continue;
            }
            let new = Slot {
                datatype: datatype_of(v),
                value: None,
            };
            match metrics.get(name) {
                Some(old) if old.datatype == new.datatype => {}
                Some(old) => b = b - slot_len(name, old) + slot_len(name, &new),
                None => {
                    n += 1;
                    b += slot_len(name, &new);
                }
            }
        }
        (now, (n, b))
    }

    fn touch(&mut self, stream: &str) -> &mut Stream {
        // Ticks start at 1: a stream seen at tick 0 was never seen.
        self.tick += 1;
        let tick = self.tick;
        let s = self.streams.entry(stream.to_string()).or_default();
        if s.seen != 0 {
            self.by_seen.remove(&s.seen);
        }
        s.seen = tick;
        self.by_seen.insert(tick, stream.to_string());
        s
    }

    /// A record of a covered stream: its values become the last ones, and
    /// the stream the most recently seen.
    pub fn update(&mut self, stream: &str, values: &[(String, Value)]) {
        self.set(stream, values, true);
    }

    /// Declares `values` in `stream` (new names, changed types) and marks
    /// it seen. `with_values`: the values become the last ones (the record
    /// about to go); otherwise new names are declared without a value (a
    /// record further on, declared ahead so one birth covers it too).
    pub fn declare(&mut self, stream: &str, values: &[(String, Value)], with_values: bool) {
        self.set(stream, values, with_values);
    }

    fn set(&mut self, stream: &str, values: &[(String, Value)], with_values: bool) {
        let s = self.touch(stream);
        let (mut dn, mut db) = (0isize, 0isize);
        for (name, v) in values {
            let dt = datatype_of(v);
            let new = match s.metrics.get(name) {
                Some(old) if !with_values && old.datatype == dt => continue,
                _ => Slot {
                    datatype: dt,
                    value: with_values.then(|| v.clone()),
                },
            };
            db += slot_len(name, &new) as isize;
            match s.metrics.insert(name.clone(), new) {
                Some(old) => db -= slot_len(name, &old) as isize,
                None => dn += 1,
            }
        }
        s.bytes = (s.bytes as isize + db) as usize;
        self.count = (self.count as isize + dn) as usize;
        self.bytes = (self.bytes as isize + db) as usize;
    }

    /// Takes out the least recently seen streams seen before tick `keep_from`
    /// until the set is within `limits`.
    pub fn evict(&mut self, limits: Limits, keep_from: u64) -> Evicted {
        let mut out = Evicted::default();
        while self.count > limits.max_metrics || self.birth_len() > limits.max_birth_bytes {
            let Some((&tick, _)) = self.by_seen.first_key_value() else {
                break;
            };
            if tick >= keep_from {
                break;
            }
            let Some(name) = self.by_seen.remove(&tick) else {
                break;
            };
            if let Some(s) = self.streams.remove(&name) {
                self.count -= s.metrics.len();
                self.bytes -= s.bytes;
                out.metrics += s.metrics.len();
                out.streams += 1;
            }
        }
        out
    }

    /// Every metric, for a DBIRTH at `ts`, by stream and name.
    pub fn birth(&self, ts: u64) -> Vec<Metric> {
        let mut out = Vec::with_capacity(self.count);
        for s in self.streams.values() {
            for (name, slot) in &s.metrics {
                out.push(match &slot.value {
                    Some(v) => metric(name, ts, v.clone()),
                    None => null_metric(name, ts, slot.datatype),
                });
            }
        }
        out
    }

    /// Streams in the set.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uplink::sparkplug::proto::Payload;
    use prost::Message as _;

    fn vals(stream: &str, n: usize) -> Vec<(String, Value)> {
        (0..n)
            .map(|i| (format!("{stream}/m{i}"), Value::Double(i as f64)))
            .collect()
    }

    fn encoded(set: &MetricSet) -> usize {
        Payload {
            timestamp: Some(1_796_040_000_250),
            seq: Some(255),
            metrics: set.birth(1_796_040_000_250),
            ..Payload::default()
        }
        .encoded_len()
    }

    #[test]
    fn the_count_bound_evicts_the_least_recently_seen_streams_whole() {
        let lim = Limits {
            max_metrics: 10,
            max_birth_bytes: 1 << 20,
        };
        let mut set = MetricSet::default();
        for s in ["a", "b", "c"] {
            set.declare(s, &vals(s, 3), true);
        }
        // `a` seen again: `b` is now the least recently seen.
        set.update("a", &vals("a", 3));
        assert_eq!(set.evict(lim, set.now()), Evicted::default());
        let keep = set.now();
        set.declare("d", &vals("d", 3), true);
        assert_eq!(set.count(), 12);
        assert_eq!(
            set.evict(lim, keep),
            Evicted {
                metrics: 3,
                streams: 1
            }
        );
        assert_eq!(set.count(), 9);
        assert!(set.seen("b").is_none());
        assert!(set.seen("a").is_some() && set.seen("c").is_some() && set.seen("d").is_some());
        let names: Vec<String> = set.birth(0).into_iter().map(|m| m.name.unwrap()).collect();
        assert!(!names.iter().any(|n| n.starts_with("b/")), "{names:?}");
    }

    #[test]
    fn the_byte_bound_holds_for_the_encoded_birth() {
        let lim = Limits {
            max_metrics: 100_000,
            max_birth_bytes: 4096,
        };
        let mut set = MetricSet::default();
        for i in 0..500 {
            let s = format!("stream-{i:04}");
            let keep = set.now();
            let mut v = vals(&s, 4);
            v.push((format!("{s}/id"), Value::String(format!("gw-1/1/{i}"))));
            set.declare(&s, &v, true);
            set.evict(lim, keep);
            assert!(set.birth_len() <= lim.max_birth_bytes);
            assert!(
                encoded(&set) <= set.birth_len(),
                "{} > {}",
                encoded(&set),
                set.birth_len()
            );
        }
        assert!(
            set.streams() < 500 && set.streams() > 10,
            "{}",
            set.streams()
        );
        // The newest streams stayed.
        assert!(set.seen("stream-0499").is_some());
        assert!(set.seen("stream-0000").is_none());
    }

    #[test]
    fn what_is_kept_is_never_evicted_and_values_ahead_are_declared_null() {
        let lim = Limits {
            max_metrics: 4,
            max_birth_bytes: 1 << 20,
        };
        let mut set = MetricSet::default();
        set.declare("old", &vals("old", 2), true);
        let keep = set.now();
        set.declare("x", &vals("x", 3), true);
        set.declare("y", &vals("y", 3), false);
        // Over the bound with only kept streams left: it stops there.
        let e = set.evict(lim, keep);
        assert_eq!(e.streams, 1);
        assert_eq!(set.count(), 6);
        let b = set.birth(5);
        let y0 = b
            .iter()
            .find(|m| m.name.as_deref() == Some("y/m0"))
            .unwrap();
        assert_eq!((y0.is_null, &y0.value), (Some(true), &None));
        let x1 = b
            .iter()
            .find(|m| m.name.as_deref() == Some("x/m1"))
            .unwrap();
        assert_eq!(x1.value, Some(Value::Double(1.0)));
        // Declared ahead without a value does not clear a value already there.
        set.declare("x", &vals("x", 3), false);
        let b = set.birth(5);
        let x1 = b
            .iter()
            .find(|m| m.name.as_deref() == Some("x/m1"))
            .unwrap();
        assert_eq!(x1.value, Some(Value::Double(1.0)));
    }

    #[test]
    fn covers_and_sizes_follow_names_and_types() {
        let mut set = MetricSet::default();
        let v = vals("s", 2);
        assert!(!set.covers("s", &v));
        set.declare("s", &v, true);
        assert!(set.covers("s", &v));
        assert!(set.covers("s", &v[..1]));
        let mut changed = v.clone();
        changed[0].1 = Value::String("now a string".into());
        assert!(!set.covers("s", &changed));
        let ((n0, b0), (n1, b1)) = set.size_with("s", &changed);
        assert_eq!((n0, n1), (2, 2));
        assert_ne!(b0, b1);
        let mut more = v.clone();
        more.push(("s/new".into(), Value::Boolean(true)));
        let (_, (n, _)) = set.size_with("s", &more);
        assert_eq!(n, 3);
        let (now, (n, b)) = set.size_with("t", &more);
        assert_eq!(now, (0, 0));
        assert_eq!(n, 3);
        assert!(b > 0);
        // Bytes stay exact through updates of string values.
        let mut set = MetricSet::default();
        for i in 0..50 {
            let v = vec![("s/id".to_string(), Value::String("x".repeat(i)))];
            set.update("s", &v);
            assert!(encoded(&set) <= set.birth_len());
        }
        assert_eq!(set.count(), 1);
    }
}
