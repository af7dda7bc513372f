//! What happened to a tracked object: the events that become records.
//! Every event names its track, label, box and score, and the time it
//! happened (the frame it was first seen doing it, which can be up to
//! `inertia` frames before the frame that made it certain).

use std::time::SystemTime;

use serde::{Serialize, Serializer};

use super::speed::SpeedUnit;

/// A crossing's direction (see `LineConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    In,
    Out,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::In => "in",
            Direction::Out => "out",
        }
    }
}

/// Why a track ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EndReason {
    /// Not seen for `max_age` (`stationary_max_age` when parked).
    Lost,
    /// More open tracks than `max_tracks`: the longest unseen went.
    Evicted,
    /// Its stream left the pipeline's stream table (idle or least recently
    /// seen among too many streams).
    StreamEnd,
    /// The daemon stopped or reloaded while the object was in view.
    Restart,
}

impl EndReason {
    pub fn as_str(self) -> &'static str {
        match self {
            EndReason::Lost => "lost",
            EndReason::Evicted => "evicted",
            EndReason::StreamEnd => "stream_end",
            EndReason::Restart => "restart",
        }
    }
}

/// A track's speed in a calibrated zone, in the zone's unit.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Speed {
    pub speed: f64,
    pub speed_unit: SpeedUnit,
}

impl Speed {
    /// `mps` metres per second in `unit`, to a hundredth.
    pub fn new(mps: f64, unit: SpeedUnit) -> Self {
        Speed {
            speed: (unit.from_mps(mps) * 100.0).round() / 100.0,
            speed_unit: unit,
        }
    }
}

/// A line a track crossed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Crossing {
    pub line: String,
    pub direction: Direction,
}

/// What `track_end` tells of the whole track.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrackSummary {
    pub reason: EndReason,
    #[serde(serialize_with = "rfc3339")]
    pub first_seen: SystemTime,
    #[serde(serialize_with = "rfc3339")]
    pub last_seen: SystemTime,
    /// Frames the object was detected in.
    pub frames: u64,
    pub best_score: f32,
    /// Box of the best-scoring frame (the snapshot's).
    pub best_box: [f32; 4],
    /// Zones entered, in the order of their first entry.
    pub zones: Vec<String>,
    pub lines: Vec<Crossing>,
    /// Stationary when it ended (a parked vehicle).
    pub stationary: bool,
    /// The fastest it went in a calibrated zone (over at least half a
    /// second), in `speed_unit`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_speed: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speed_unit: Option<SpeedUnit>,
    /// The best crop's snapshot name, when one was kept.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// The text read most often across the track's frames (a text stage's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Share of the frames with a reading that read `text`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_agreement: Option<f32>,
    /// Frames with a reading.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub text_reads: Option<u32>,
    /// Times the object was lost (occluded, missed) and its track taken up
    /// again by a new detection where it was expected: one object, one
    /// `track_start`, however often it went out of sight.
    #[serde(skip_serializing_if = "is_zero")]
    pub relinked: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The kinds of events, with what each adds.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// The object was matched in `min_hits` frames: it is real.
    TrackStart {
        #[serde(serialize_with = "rfc3339")]
        first_seen: SystemTime,
    },
    ZoneEnter {
        zone: String,
        /// In a calibrated zone: the speed over the frames so far.
        #[serde(flatten)]
        speed: Option<Speed>,
    },
    ZoneLeave {
        zone: String,
        /// Seconds between entering and leaving.
        dwell_s: f64,
        /// In a calibrated zone: the speed over its last second inside.
        #[serde(flatten)]
        speed: Option<Speed>,
    },
    /// In the zone for its `loiter` time (once per visit).
    Loiter {
        zone: String,
        dwell_s: f64,
    },
    /// Faster than the zone's `speed_limit` (once per track and zone).
    Speeding {
        zone: String,
        #[serde(flatten)]
        speed: Speed,
        speed_limit: f32,
    },
    LineCross {
        line: String,
        direction: Direction,
    },
    TrackEnd(Box<TrackSummary>),
}

impl EventKind {
    pub fn name(&self) -> &'static str {
        match self {
            EventKind::TrackStart { .. } => "track_start",
            EventKind::ZoneEnter { .. } => "zone_enter",
            EventKind::ZoneLeave { .. } => "zone_leave",
            EventKind::Loiter { .. } => "loiter",
            EventKind::Speeding { .. } => "speeding",
            EventKind::LineCross { .. } => "line_cross",
            EventKind::TrackEnd(_) => "track_end",
        }
    }
}

/// One event of one track.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    #[serde(flatten)]
    pub kind: EventKind,
    /// `{device}/{pipeline}/{stream}/{n}`.
    pub track: String,
    pub label: String,
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
    pub score: f32,
    /// When it happened.
    #[serde(serialize_with = "rfc3339")]
    pub ts: SystemTime,
}

/// A zone's count of one label changed (and held for its `inertia`
/// frames): the stream's objects, not one track's.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OccupancyEvent {
    /// Always `zone_occupancy`.
    pub event: &'static str,
    pub zone: String,
    pub label: String,
    pub count: u32,
    pub previous: u32,
    /// The first frame of the new count.
    #[serde(serialize_with = "rfc3339")]
    pub ts: SystemTime,
}

pub const ZONE_OCCUPANCY: &str = "zone_occupancy";

pub(super) fn rfc3339<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(&humantime::format_rfc3339_millis(*t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn events_serialize_flat_with_their_kind() {
        let e = Event {
            kind: EventKind::LineCross {
                line: "gate".into(),
                direction: Direction::In,
            },
            track: "gw/p/cam/1".into(),
            label: "face".into(),
            bbox: [1.0, 2.0, 3.0, 4.0],
            score: 0.5,
            ts: UNIX_EPOCH + Duration::from_millis(1500),
        };
        let v = serde_json::to_value(&e).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"event": "line_cross", "line": "gate", "direction": "in",
                "track": "gw/p/cam/1", "label": "face", "box": [1.0, 2.0, 3.0, 4.0],
                "score": 0.5, "ts": "1970-01-01T00:00:01.500Z"})
        );
        let end = Event {
            kind: EventKind::TrackEnd(Box::new(TrackSummary {
                reason: EndReason::Restart,
                first_seen: UNIX_EPOCH,
                last_seen: UNIX_EPOCH,
                frames: 3,
                best_score: 0.9,
                best_box: [0.0; 4],
                zones: vec![],
                lines: vec![],
                stationary: false,
                max_speed: Some(9.0),
                speed_unit: Some(SpeedUnit::KmH),
                snapshot: None,
                text: Some("AB12".into()),
                text_agreement: Some(0.75),
                text_reads: Some(4),
                relinked: 2,
            })),
            ..e
        };
        let v = serde_json::to_value(&end).unwrap();
        assert_eq!(v["event"], "track_end");
        assert_eq!(v["reason"], "restart");
        assert_eq!(v["text"], "AB12");
        assert!(v.get("snapshot").is_none());
        assert_eq!(v["max_speed"], 9.0);
        assert_eq!(v["relinked"], 2);
        assert_eq!(v["speed_unit"], "km/h");
        let enter = |speed| {
            serde_json::to_value(EventKind::ZoneEnter {
                zone: "road".into(),
                speed,
            })
            .unwrap()
        };
        assert_eq!(
            enter(None),
            serde_json::json!({"event": "zone_enter", "zone": "road"})
        );
        assert_eq!(
            enter(Some(Speed::new(1.0, SpeedUnit::Mph))),
            serde_json::json!({"event": "zone_enter", "zone": "road", "speed": 2.24, "speed_unit": "mph"})
        );
        let fast = EventKind::Speeding {
            zone: "road".into(),
            speed: Speed::new(10.0, SpeedUnit::KmH),
            speed_limit: 30.0,
        };
        assert_eq!(
            serde_json::to_value(&fast).unwrap(),
            serde_json::json!({"event": "speeding", "zone": "road", "speed": 36.0, "speed_unit": "km/h", "speed_limit": 30.0})
        );
        assert_eq!(end.kind.name(), "track_end");
    }
}
