//! A frame's events in records that fit: the uplink's `max_packet_bytes`
//! (and a UDP output's datagram), whatever the frame holds.
//!
//! Invariants:
//! - A record made of a part is at most `max_record_bytes` of JSON: the
//!   part's events take at most the budget, which is `max_record_bytes`
//!   less [`envelope_bytes`], everything else the record holds (its id,
//!   names, times, model, clock fields and the part's reference) with its
//!   numbers at their widest.
//! - Events keep their order across the parts.
//! - An event larger than a part on its own is shortened, never dropped:
//!   the lists of `track_end` (`zones`, `lines`) keep their first entries
//!   and say how many there were (`zones_count`, `lines_count`); if that is
//!   not enough, `text` is cut, and then `text`, `text_agreement`,
//!   `text_reads`, `snapshot`, `best_box`, `best_score`, `box` and `score`
//!   are left out, in this order, until it fits. A shortened event has
//!   `"truncated": true`. Only an event whose names alone are larger than a
//!   part still goes longer (the uplink dead-letters it, and a warning
//!   says so); `check` refuses a packet size below
//!   [`smallest_record_bytes`] for the names it knows.

use std::time::{Duration, UNIX_EPOCH};

use serde_json::{Value, json};

use super::config::{LineConfig, ZoneConfig};
use super::events::{
    Crossing, Direction, EndReason, Event, EventKind, OccupancyEvent, Speed, TrackSummary,
    ZONE_OCCUPANCY,
};
use crate::record::{ClockLabel, ClockMark, ResultRecord};

/// `ts` and `captured` of a record (RFC 3339, microseconds).
const RECORD_TIME: &str = "2026-12-01T00:00:00.000000Z";
/// The longest execution provider name a record names.
const LONGEST_EP: &str = "tensorrt";
/// `/proc/sys/kernel/random/boot_id` of a record made on an unsynced clock.
const BOOT_ID: &str = "00000000-0000-0000-0000-000000000000";

/// The lists shortening cuts, each with the key that keeps its length.
const LISTS: [(&str, &str); 2] = [("zones", "zones_count"), ("lines", "lines_count")];
/// What the shortest form leaves out, in this order, once the lists are
/// empty and `text` is cut to nothing: the event still says what happened
/// to which track, when, and how many zones and crossings it had.
const OPTIONAL: [&str; 8] = [
    "text",
    "text_agreement",
    "text_reads",
    "snapshot",
    "best_box",
    "best_score",
    "box",
    "score",
];

/// Who makes a stream's records: what their envelope holds.
#[derive(Debug, Clone, Copy)]
pub struct Envelope<'a> {
    pub device: &'a str,
    pub pipeline: &'a str,
    pub stream: &'a str,
    /// `name@version`.
    pub model: &'a str,
    /// The outbox's boot number, where known.
    pub boot: Option<u64>,
}

/// Bytes a record of events takes besides its events (the items of
/// `outputs.events`), at most: the record as the pipeline makes it, with
/// `frame`, `part` and `parts`, `captured` and the clock fields of a record
/// made on an untrusted clock (`corrected` is the longer label), every
/// number not known here at its widest.
pub fn envelope_bytes(e: &Envelope) -> usize {
    let boot = e.boot.unwrap_or(u64::MAX);
    let rec = ResultRecord {
        id: ResultRecord::make_id(e.device, boot, u64::MAX),
        device: e.device.to_string(),
        pipeline: e.pipeline.to_string(),
        stream: e.stream.to_string(),
        seq: u64::MAX,
        ts: RECORD_TIME.to_string(),
        model: e.model.to_string(),
        ep: LONGEST_EP.to_string(),
        latency_us: u64::MAX,
        outputs: json!({
            "events": [],
            "frame": format!("{boot}-{}", u64::MAX),
            "part": u64::MAX,
            "parts": u64::MAX,
        }),
        captured: Some(RECORD_TIME.to_string()),
        clock: Some(ClockMark {
            clock: ClockLabel::Corrected,
            boot_id: BOOT_ID.to_string(),
            since_boot_us: u64::MAX,
        }),
    };
    // `[]`, the empty events, is counted by the parts.
    text_len(&json!(rec)).saturating_sub(2)
}

fn text_len(v: &Value) -> usize {
    v.to_string().len()
}

/// A frame's events in parts.
#[derive(Debug, Default, PartialEq)]
pub struct Fitted {
    pub parts: Vec<Vec<Value>>,
    /// Events shortened to fit a part.
    pub shortened: usize,
    /// Events still larger than a part once shortened (their names alone).
    pub too_large: usize,
}

/// Events in order, in parts whose JSON (`[a,b,...]`) is at most `budget`
/// bytes; an event larger than that on its own is shortened ([`shorten`])
/// and, if still too large, is a part by itself.
pub fn fit(events: Vec<Value>, budget: usize) -> Fitted {
    // An event is a part by itself within the brackets (and the comma the
    // split counts for every event).
    let alone = budget.saturating_sub(3);
    let mut out = Fitted::default();
    let mut part = Vec::new();
    let mut bytes = 2;
    for mut e in events {
        let mut n = text_len(&e);
        if n > alone {
            out.shortened += 1;
            if !shorten(&mut e, alone) {
                out.too_large += 1;
            }
            n = text_len(&e);
        }
        // Its text and the comma before it.
        let n = n + 1;
        if !part.is_empty() && bytes + n > budget {
            out.parts.push(std::mem::take(&mut part));
            bytes = 2;
        }
        bytes += n;
        part.push(e);
    }
    if !part.is_empty() {
        out.parts.push(part);
    }
    out
}

/// Shortens an event to at most `max` bytes of JSON, as the module header
/// says; whether it fits now.
pub fn shorten(e: &mut Value, max: usize) -> bool {
    let mut now = text_len(e);
    if now <= max {
        return true;
    }
    let Some(o) = e.as_object_mut() else {
        return false;
    };
    let has = |o: &serde_json::Map<String, Value>, k: &str| match o.get(k) {
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::String(_)) => true,
        Some(v) => !v.is_null(),
        None => false,
    };
    if !LISTS.iter().any(|(k, _)| has(o, k)) && !OPTIONAL.iter().any(|k| has(o, k)) {
        return false;
    }
    o.insert("truncated".into(), Value::Bool(true));
    for (list, count) in LISTS {
        if let Some(n) = o.get(list).and_then(Value::as_array).map(Vec::len)
            && n > 0
        {
            o.insert(count.into(), json!(n));
        }
    }
    now = text_len(e);
    // The lists keep their first entries: the longer one gives up its last.
    while now > max {
        let Some(list) = e.as_object_mut().and_then(|o| {
            LISTS
                .iter()
                .filter_map(|(k, _)| Some((*k, o.get(*k)?.as_array()?.len())))
                .filter(|(_, n)| *n > 0)
                .max_by_key(|(_, n)| *n)
                .and_then(|(k, _)| o.get_mut(k)?.as_array_mut())
        }) else {
            break;
        };
        let Some(last) = list.pop() else {
            break;
        };
        // `,x`, or `x` when it was the only one.
        now -= text_len(&last) + usize::from(!list.is_empty());
    }
    if now > max
        && let Some(Value::String(t)) = e.get_mut("text")
    {
        cut_text(t, now - max);
        now = text_len(e);
    }
    for k in OPTIONAL {
        if now <= max {
            break;
        }
        if let Some(o) = e.as_object_mut()
            && o.remove(k).is_some()
        {
            now = text_len(e);
        }
    }
    now <= max
}

/// Cuts characters off the end of `t` until its JSON is `over` bytes shorter
/// (or it is empty).
fn cut_text(t: &mut String, over: usize) {
    let mut gone = 0;
    while gone < over {
        let Some(c) = t.pop() else {
            return;
        };
        // The character as JSON escapes it, without the quotes.
        gone += text_len(&Value::String(c.to_string())) - 2;
    }
}

/// A track id as one URL path segment (its `/` and anything unusual
/// percent-encoded).
pub fn escape_segment(id: &str) -> String {
    let mut s = String::with_capacity(id.len() + 8);
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

/// What a pipeline's events can hold, as far as its config tells.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub device: &'a str,
    pub pipeline: &'a str,
    /// The model's id, or its name with room for a version.
    pub model: &'a str,
    /// The longest stream name expected.
    pub stream: &'a str,
    /// The longest label expected.
    pub label: &'a str,
    pub zones: &'a [ZoneConfig],
    pub lines: &'a [LineConfig],
}

/// A box coordinate or score as wide as an `f32` gets in an event (its
/// `f64` digits): what the smallest record is reckoned with.
const WIDE_F32: f32 = 1_234.567_7;
/// A duration in seconds as wide as events write them.
const WIDE_SECS: f64 = 86_399.999_999_999;

/// The smallest record every event of a pipeline of this shape fits,
/// shortened as far as [`shorten`] goes, with its numbers at their widest
/// and its names at the lengths given: a packet smaller than this
/// dead-letters some event.
pub fn smallest_record_bytes(s: &Shape) -> usize {
    let envelope = envelope_bytes(&Envelope {
        device: s.device,
        pipeline: s.pipeline,
        stream: s.stream,
        model: s.model,
        boot: None,
    });
    let widest = samples(s)
        .into_iter()
        .map(|mut e| {
            let lines = e.get("lines").and_then(Value::as_array).map(Vec::len);
            shorten(&mut e, 0);
            // Crossings have no bound: their count at its widest.
            if let (Some(n), Some(o)) = (lines, e.as_object_mut())
                && n > 0
            {
                o.insert("lines_count".into(), json!(u64::MAX));
            }
            text_len(&e) + 3
        })
        .max()
        .unwrap_or(0);
    envelope + widest
}

/// One event of each kind a pipeline of this shape makes, its longest.
fn samples(s: &Shape) -> Vec<Value> {
    let ts = UNIX_EPOCH + Duration::from_millis(1_796_083_200_123);
    let track = format!(
        "{}/{}/{}/{}-{}",
        s.device,
        s.pipeline,
        s.stream,
        u64::MAX,
        u64::MAX
    );
    let longest = |names: &mut dyn Iterator<Item = String>| names.max_by_key(String::len);
    let zone = longest(&mut s.zones.iter().map(|z| z.name.clone()));
    let line = longest(&mut s.lines.iter().map(|l| l.name.clone()));
    let calibrated = s.zones.iter().any(|z| z.distances.is_some());
    let speed = calibrated.then(|| Speed {
        speed: WIDE_SECS,
        speed_unit: s
            .zones
            .iter()
            .find(|z| z.distances.is_some())
            .map(|z| z.unit())
            .unwrap_or_default(),
    });
    let event = |kind: EventKind| {
        json!(Event {
            kind,
            track: track.clone(),
            label: s.label.to_string(),
            bbox: [WIDE_F32; 4],
            score: WIDE_F32,
            ts,
        })
    };
    let mut out = vec![event(EventKind::TrackStart { first_seen: ts })];
    if let Some(zone) = &zone {
        out.push(event(EventKind::ZoneEnter {
            zone: zone.clone(),
            speed,
        }));
        out.push(event(EventKind::ZoneLeave {
            zone: zone.clone(),
            dwell_s: WIDE_SECS,
            speed,
        }));
        out.push(event(EventKind::Loiter {
            zone: zone.clone(),
            dwell_s: WIDE_SECS,
        }));
        if let Some(speed) = speed {
            out.push(event(EventKind::Speeding {
                zone: zone.clone(),
                speed,
                speed_limit: WIDE_F32,
            }));
        }
        if let Ok(v) = serde_json::to_value(OccupancyEvent {
            event: ZONE_OCCUPANCY,
            zone: zone.clone(),
            label: s.label.to_string(),
            count: u32::MAX,
            previous: u32::MAX,
            ts,
        }) {
            out.push(v);
        }
    }
    if let Some(line) = &line {
        out.push(event(EventKind::LineCross {
            line: line.clone(),
            direction: Direction::Out,
        }));
    }
    let snapshot = format!(
        "/v1/pipelines/{}/tracks/{}/snapshot.jpg",
        s.pipeline,
        escape_segment(&track)
    );
    out.push(event(EventKind::TrackEnd(Box::new(TrackSummary {
        reason: EndReason::StreamEnd,
        first_seen: ts,
        last_seen: ts,
        frames: u64::MAX,
        best_score: WIDE_F32,
        best_box: [WIDE_F32; 4],
        zones: s.zones.iter().map(|z| z.name.clone()).collect(),
        lines: line
            .iter()
            .map(|l| Crossing {
                line: l.clone(),
                direction: Direction::Out,
            })
            .collect(),
        stationary: false,
        max_speed: speed.map(|s| s.speed),
        speed_unit: speed.map(|s| s.speed_unit),
        snapshot: Some(snapshot),
        text: Some(String::new()),
        text_agreement: Some(WIDE_F32),
        text_reads: Some(u32::MAX),
        relinked: 0,
    }))));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn at(ms: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(ms)
    }

    fn end_naming(zones: usize, name_len: usize) -> Value {
        let zones: Vec<String> = (0..zones)
            .map(|i| format!("{i:0>width$}", width = name_len))
            .collect();
        json!(Event {
            kind: EventKind::TrackEnd(Box::new(TrackSummary {
                reason: EndReason::Lost,
                first_seen: at(1_000),
                last_seen: at(2_000),
                frames: 10,
                best_score: 0.9,
                best_box: [1.0, 2.0, 3.0, 4.0],
                zones,
                lines: (0..3)
                    .map(|i| Crossing {
                        line: format!("gate{i}"),
                        direction: Direction::In,
                    })
                    .collect(),
                stationary: false,
                max_speed: None,
                speed_unit: None,
                snapshot: Some("/v1/pipelines/p/tracks/x/snapshot.jpg".into()),
                text: Some("AB-1234".into()),
                text_agreement: Some(0.5),
                text_reads: Some(4),
                relinked: 0,
            })),
            track: "gw/gate/cam/4-1".into(),
            label: "object".into(),
            bbox: [1.0, 2.0, 3.0, 4.0],
            score: 0.9,
            ts: at(2_000),
        })
    }

    #[test]
    fn a_track_end_naming_many_zones_keeps_the_first_and_their_count() {
        let full = end_naming(30, 64);
        let mut e = full.clone();
        assert!(text_len(&e) > 2_000, "{}", text_len(&e));
        assert!(shorten(&mut e, 800));
        assert!(text_len(&e) <= 800, "{}", text_len(&e));
        assert_eq!(e["truncated"], true);
        assert_eq!(e["zones_count"], 30);
        assert_eq!(e["lines_count"], 3);
        let kept = e["zones"].as_array().unwrap();
        assert!(!kept.is_empty() && kept.len() < 30, "{e}");
        // The first names, in their order.
        assert_eq!(kept[..], full["zones"].as_array().unwrap()[..kept.len()]);
        // Nothing else was touched while the lists were enough.
        for k in [
            "text", "snapshot", "best_box", "track", "box", "score", "ts",
        ] {
            assert_eq!(e[k], full[k], "{k}");
        }
        // Exactly as long as the lists allow: one more name would not fit.
        let mut more = e.clone();
        let next = full["zones"][kept.len()].clone();
        more["zones"].as_array_mut().unwrap().push(next);
        assert!(text_len(&more) > 800 || e["lines"].as_array().unwrap().len() < 3);
    }

    #[test]
    fn shortening_goes_on_to_the_text_and_the_optional_fields() {
        let mut e = end_naming(5, 10);
        e["text"] = json!("\u{1}".repeat(200));
        let lists_gone = {
            let mut x = e.clone();
            x["zones"] = json!([]);
            x["lines"] = json!([]);
            x["truncated"] = json!(true);
            x["zones_count"] = json!(5);
            x["lines_count"] = json!(3);
            text_len(&x)
        };
        // Room for all but 300 bytes of the escaped text (6 bytes a char).
        let max = lists_gone - 300;
        assert!(shorten(&mut e, max));
        assert!(text_len(&e) <= max);
        let t = e["text"].as_str().unwrap();
        assert!(!t.is_empty() && t.len() >= 149, "{}", t.len());
        assert_eq!(e["zones"], json!([]));
        // The shortest form: no text, snapshot or best box.
        let mut e = end_naming(5, 10);
        assert!(!shorten(&mut e, 0));
        for k in OPTIONAL {
            assert!(e.get(k).is_none(), "{k}: {e}");
        }
        assert_eq!(e["zones_count"], 5);
        assert_eq!(e["track"], "gw/gate/cam/4-1");
        // An event with nothing to shorten is left as it is.
        let mut enter = json!({"event": "zone_enter", "zone": "z".repeat(64)});
        let before = enter.clone();
        assert!(!shorten(&mut enter, 10));
        assert_eq!(enter, before);
    }

    #[test]
    fn fit_keeps_order_shortens_what_is_too_large_alone_and_splits_the_rest() {
        let ev: Vec<Value> = (0..10).map(|i| json!({ "n": i })).collect();
        let f = fit(ev.clone(), 30);
        assert!(f.parts.len() > 1);
        assert_eq!(f.parts.concat(), ev);
        for p in &f.parts {
            assert!(text_len(&Value::from(p.clone())) <= 30, "{p:?}");
        }
        assert_eq!((f.shortened, f.too_large), (0, 0));
        let big = vec![json!({ "text": "x".repeat(100) })];
        let f = fit(big.clone(), 30);
        assert_eq!((f.shortened, f.too_large), (1, 0));
        assert_eq!(f.parts.len(), 1);
        assert!(text_len(&Value::from(f.parts[0].clone())) <= 30);
        let huge = vec![json!({ "name": "x".repeat(100) })];
        let f = fit(huge.clone(), 30);
        assert_eq!((f.shortened, f.too_large), (1, 1));
        assert_eq!(f.parts, vec![huge]);
    }

    #[test]
    fn the_envelope_bounds_a_real_record_of_a_part() {
        let env = Envelope {
            device: "gw",
            pipeline: "gate",
            stream: "cam-1",
            model: "boxes@1.0.0",
            boot: Some(4),
        };
        let events = vec![json!({"event": "track_start"}), json!({"event": "x"})];
        let rec = ResultRecord {
            id: ResultRecord::make_id("gw", 4, 123_456),
            device: "gw".into(),
            pipeline: "gate".into(),
            stream: "cam-1".into(),
            seq: 123_456,
            ts: crate::record::rfc3339(SystemTime::now()),
            model: "boxes@1.0.0".into(),
            ep: "cpu".into(),
            latency_us: 1234,
            outputs: json!({"events": events, "frame": "4-17", "part": 2, "parts": 3}),
            captured: Some(crate::record::rfc3339(SystemTime::now())),
            clock: Some(ClockMark {
                clock: ClockLabel::Unsynced,
                boot_id: "8d6f6a1e-3f5c-4a51-9a0b-1c2d3e4f5a6b".into(),
                since_boot_us: 98_765_432,
            }),
        };
        let real = serde_json::to_vec(&rec).unwrap().len();
        let bound = envelope_bytes(&env) + text_len(&Value::from(events));
        assert!(real <= bound, "{real} > {bound}");
        assert!(bound - real < 120, "{bound} is far above {real}");
    }

    #[test]
    fn the_smallest_record_grows_with_the_names() {
        let zones: Vec<ZoneConfig> = (0..30)
            .map(|i| ZoneConfig {
                name: format!("zone-{i:02}"),
                polygon: vec![[0.0, 0.0], [10.0, 0.0], [10.0, 10.0], [0.0, 10.0]],
                ..ZoneConfig::default()
            })
            .collect();
        let shape = Shape {
            device: "gw",
            pipeline: "gate",
            model: "boxes@1.0.0",
            stream: &"s".repeat(32),
            label: &"l".repeat(32),
            zones: &zones,
            lines: &[],
        };
        let small = smallest_record_bytes(&shape);
        eprintln!("smallest record, short names: {small}");
        assert!(small <= 1024, "{small}");
        let long = "d".repeat(64);
        let big = smallest_record_bytes(&Shape {
            device: &long,
            pipeline: &long,
            ..shape
        });
        eprintln!("smallest record, 64-byte names: {big}");
        assert!(big > small + 4 * 64, "{big} vs {small}");
    }
}
