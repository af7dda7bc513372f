//! The result record: what a pipeline produces for the fleet. A leaf room:
//! sources (which answer with records), pipelines, the outbox and the API
//! all use it, and it uses nothing of theirs.
//!
//! `id` = `<device>/<boot>/<seq>`: `boot` counts daemon starts (persisted by
//! the outbox), `seq` counts records within a boot. The id is fixed when the
//! record is made and stored with it, so every retry and every restart sends
//! the same id and the fleet can drop duplicates.
//!
//! Beside results the daemon stores status events (a camera going down or
//! coming back, an OTA step) as [`EventRecord`]s: the same id, device,
//! pipeline, stream, seq and ts, and the event's own fields in place of
//! model and outputs. They reach the same store as results, through an
//! [`EventSink`] (the daemon's record sink implements both).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResultRecord {
    pub id: String,
    pub device: String,
    pub pipeline: String,
    pub stream: String,
    pub seq: u64,
    /// RFC 3339, UTC, microseconds.
    pub ts: String,
    /// `name@version`.
    pub model: String,
    /// The execution provider that served it.
    pub ep: String,
    /// Inference time of the item (batch time for micro-batched items).
    pub latency_us: u64,
    pub outputs: serde_json::Value,
    /// When the frame was captured (cameras), RFC 3339 UTC with microseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub captured: Option<String>,
    /// Made while the system clock was not trusted: `clock`, `boot_id`,
    /// `since_boot_us` (absent otherwise).
    #[serde(flatten)]
    pub clock: Option<ClockMark>,
}

/// A record made while the system clock was not trusted: the uplink
/// recomputes `ts` from the boot's offset once it is known.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockMark {
    pub clock: ClockLabel,
    /// `/proc/sys/kernel/random/boot_id` of the boot that made it.
    pub boot_id: String,
    /// Time since that boot (CLOCK_BOOTTIME) when it was made.
    pub since_boot_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClockLabel {
    /// `ts` is the system clock as it was, not trusted.
    Unsynced,
    /// `ts` was recomputed from the boot's offset when it was sent.
    Corrected,
}

impl ResultRecord {
    pub fn make_id(device: &str, boot: u64, seq: u64) -> String {
        format!("{device}/{boot}/{seq}")
    }
}

/// The last instant RFC 3339 can write (9999-12-31T23:59:59.999999Z), as
/// microseconds after the epoch.
pub const RFC3339_LAST_US: u64 = 253_402_300_799_999_999;

/// Formats a system time as RFC 3339 UTC with microseconds (humantime).
/// Total: times before 1970 are written as the epoch, times past year 9999
/// (which humantime refuses, and `to_string` would panic on) as its last
/// microsecond.
pub fn rfc3339(t: std::time::SystemTime) -> String {
    let last = std::time::UNIX_EPOCH + std::time::Duration::from_micros(RFC3339_LAST_US);
    let t = t.clamp(std::time::UNIX_EPOCH, last);
    humantime::format_rfc3339_micros(t).to_string()
}

/// Ids `<device>/<boot>/<seq>`: one sequence per daemon start.
pub struct IdGen {
    pub device: String,
    pub boot: u64,
    seq: AtomicU64,
}

impl IdGen {
    pub fn new(device: String, boot: u64) -> Self {
        IdGen {
            device,
            boot,
            seq: AtomicU64::new(0),
        }
    }

    pub fn next(&self) -> (String, u64) {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        (ResultRecord::make_id(&self.device, self.boot, seq), seq)
    }
}

/// A status event stored beside the results, sent upstream like one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventRecord {
    pub id: String,
    pub device: String,
    pub pipeline: String,
    pub stream: String,
    pub seq: u64,
    /// RFC 3339, UTC, microseconds.
    pub ts: String,
    /// The event's own fields, beside the ones above.
    #[serde(flatten)]
    pub event: Event,
    /// Made while the system clock was not trusted (absent otherwise).
    #[serde(flatten)]
    pub clock: Option<ClockMark>,
}

/// What happened. Each kind keeps the fields its records have always had
/// (the fleet, the Sparkplug mapping and `outpost fleet` read them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Event {
    /// `"event": "camera_up" | "camera_down"`, `"camera"` and, for a
    /// camera that went down, `"error"` (both scrubbed of credentials by
    /// the camera source).
    Camera {
        event: CameraChange,
        camera: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        /// Its `[[cameras]]` name (an inline camera: its pipeline's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        camera_name: Option<String>,
        /// Every pipeline that reads it (the record is stored under the first).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        pipelines: Vec<String>,
    },
    /// `"event": {"step": .., "name": .., "version": .., ..}`: an OTA status
    /// (its shape is the OTA agent's; this room stays a leaf).
    Ota { event: serde_json::Value },
}

/// A camera's transition: one record per change, not per retry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CameraChange {
    CameraUp,
    CameraDown,
}

impl Event {
    pub fn camera_up(camera: &str) -> Event {
        Event::Camera {
            event: CameraChange::CameraUp,
            camera: camera.to_string(),
            error: None,
            camera_name: None,
            pipelines: Vec::new(),
        }
    }

    pub fn camera_down(camera: &str, error: &str) -> Event {
        Event::Camera {
            event: CameraChange::CameraDown,
            camera: camera.to_string(),
            error: Some(error.to_string()),
            camera_name: None,
            pipelines: Vec::new(),
        }
    }

    /// The camera's `[[cameras]]` name and the pipelines that read it.
    pub fn of_camera(mut self, name: &str, readers: &[String]) -> Event {
        if let Event::Camera {
            camera_name,
            pipelines,
            ..
        } = &mut self
        {
            *camera_name = Some(name.to_string());
            *pipelines = readers.to_vec();
        }
        self
    }

    pub fn ota(status: serde_json::Value) -> Event {
        Event::Ota { event: status }
    }

    /// A short name for logs: `camera_up`, `camera_down`, `ota`.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Camera {
                event: CameraChange::CameraUp,
                ..
            } => "camera_up",
            Event::Camera {
                event: CameraChange::CameraDown,
                ..
            } => "camera_down",
            Event::Ota { .. } => "ota",
        }
    }
}

/// The time an event is stamped with and, while the clock is not trusted,
/// its mark (the daemon passes the clock's; this room stays a leaf).
pub type StampFn = fn() -> (String, Option<ClockMark>);

/// The system clock as it is, unmarked.
pub fn plain_stamp() -> (String, Option<ClockMark>) {
    (rfc3339(std::time::SystemTime::now()), None)
}

impl EventRecord {
    /// An event of `pipeline` on `stream`, with the next id and the time now.
    pub fn new(ids: &IdGen, pipeline: &str, stream: &str, event: Event) -> EventRecord {
        EventRecord::stamped(ids, pipeline, stream, event, plain_stamp())
    }

    /// The same, with the time and mark a clock gave.
    pub fn stamped(
        ids: &IdGen,
        pipeline: &str,
        stream: &str,
        event: Event,
        stamp: (String, Option<ClockMark>),
    ) -> EventRecord {
        let (id, seq) = ids.next();
        EventRecord {
            id,
            device: ids.device.clone(),
            pipeline: pipeline.to_string(),
            stream: stream.to_string(),
            seq,
            ts: stamp.0,
            event,
            clock: stamp.1,
        }
    }

    /// The stored bytes: one JSON object with its keys sorted, as these
    /// records have always been written (the flattened event's fields
    /// would otherwise follow the struct's order).
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(&serde_json::to_value(self)?)
    }
}

/// Why an event record was not stored.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error(transparent)]
    Encode(#[from] serde_json::Error),
    /// The store refused it (its own error, e.g. the outbox's).
    #[error(transparent)]
    Store(Box<dyn std::error::Error + Send + Sync>),
}

/// Where event records go: the store results go to.
pub trait EventSink: Send + Sync {
    fn store_event(&self, event: &EventRecord) -> Result<(), EventError>;
}

/// What a part that reports events holds: the daemon's ids and its sink.
#[derive(Clone)]
pub struct Events {
    pub ids: Arc<IdGen>,
    pub sink: Arc<dyn EventSink>,
    pub stamp: StampFn,
}

impl Events {
    /// Makes the record (next id, time now) and stores it.
    pub fn emit(&self, pipeline: &str, stream: &str, event: Event) -> Result<(), EventError> {
        self.sink.store_event(&EventRecord::stamped(
            &self.ids,
            pipeline,
            stream,
            event,
            (self.stamp)(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    #[test]
    fn rfc3339_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000Z");
        // 2026-11-30T02:30:41.5Z
        let t = UNIX_EPOCH + Duration::from_micros(1_796_005_841_500_000);
        assert_eq!(rfc3339(t), "2026-11-30T02:30:41.500000Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(rfc3339(t), "2000-02-29T00:00:00.000000Z");
    }

    /// Issue 50, item 9: a fleet's `Date` of 9999-12-31 put a time past
    /// year 9999 in the clock's status, and formatting it panicked.
    #[test]
    fn rfc3339_of_a_time_past_year_9999_is_its_last_microsecond() {
        let last = "9999-12-31T23:59:59.999999Z";
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_micros(RFC3339_LAST_US)),
            last
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(253_402_300_800)),
            last
        );
        assert_eq!(
            rfc3339(UNIX_EPOCH + Duration::from_secs(u64::MAX / 4)),
            last
        );
    }

    #[test]
    fn record_serializes_with_the_documented_keys() {
        let r = ResultRecord {
            id: ResultRecord::make_id("gw", 3, 17),
            device: "gw".into(),
            pipeline: "vad".into(),
            stream: "mic1".into(),
            seq: 17,
            ts: rfc3339(UNIX_EPOCH),
            model: "silero_vad@6.2.3".into(),
            ep: "cpu".into(),
            latency_us: 120,
            outputs: serde_json::json!({"event": "start"}),
            captured: None,
            clock: None,
        };
        let v: serde_json::Value = serde_json::to_value(&r).unwrap();
        assert_eq!(v["id"], "gw/3/17");
        for k in [
            "id",
            "device",
            "pipeline",
            "stream",
            "seq",
            "ts",
            "model",
            "ep",
            "latency_us",
            "outputs",
        ] {
            assert!(v.get(k).is_some(), "{k}");
        }
    }

    /// The event as it was written before it had a type: `json!` (keys sorted).
    fn old_camera(id: &str, seq: u64, ts: &str, event: &str, error: Option<&str>) -> Vec<u8> {
        let mut rec = serde_json::json!({
            "id": id,
            "device": "gw",
            "pipeline": "gate",
            "stream": "gate",
            "seq": seq,
            "ts": ts,
            "event": event,
            "camera": "rtsp://***@10.0.0.5/cam",
        });
        if let (Some(e), Some(o)) = (error, rec.as_object_mut()) {
            o.insert("error".into(), e.into());
        }
        serde_json::to_vec(&rec).unwrap()
    }

    #[test]
    fn camera_events_encode_byte_for_byte_as_before() {
        let ids = IdGen::new("gw".into(), 4);
        let cam = "rtsp://***@10.0.0.5/cam";
        for (event, old) in [
            (Event::camera_up(cam), ("camera_up", None)),
            (
                Event::camera_down(cam, "connection refused"),
                ("camera_down", Some("connection refused")),
            ),
        ] {
            let name = event.name();
            let r = EventRecord::new(&ids, "gate", "gate", event);
            assert_eq!(name, old.0);
            let bytes = r.to_json().unwrap();
            assert_eq!(
                String::from_utf8(bytes.clone()).unwrap(),
                String::from_utf8(old_camera(&r.id, r.seq, &r.ts, old.0, old.1)).unwrap()
            );
            // And it reads back as the same record.
            let back: EventRecord = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(back, r);
        }
        // camera_up has no error key at all (not null).
        let up = EventRecord::new(&ids, "gate", "gate", Event::camera_up(cam));
        let v: serde_json::Value = serde_json::from_slice(&up.to_json().unwrap()).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        assert_eq!(up.seq, 3, "ids come from the shared sequence");
    }

    #[test]
    fn ota_events_encode_byte_for_byte_as_before() {
        let ids = IdGen::new("gw".into(), 2);
        let status = serde_json::json!({"step": "installed", "name": "sensor_mlp", "version": "1.1.0", "from": "1.0.0"});
        let r = EventRecord::new(&ids, "ota", "ota", Event::ota(status.clone()));
        let old = serde_json::json!({
            "id": r.id,
            "device": "gw",
            "pipeline": "ota",
            "stream": "ota",
            "seq": r.seq,
            "ts": r.ts,
            "event": status,
        });
        assert_eq!(r.to_json().unwrap(), serde_json::to_vec(&old).unwrap());
        assert_eq!(r.event.name(), "ota");
        assert_eq!(r.id, "gw/2/1");
        let back: EventRecord = serde_json::from_slice(&r.to_json().unwrap()).unwrap();
        assert_eq!(back, r);
    }

    #[test]
    fn events_go_to_the_sink_with_the_next_id() {
        struct Keep(std::sync::Mutex<Vec<EventRecord>>);
        impl EventSink for Keep {
            fn store_event(&self, e: &EventRecord) -> Result<(), EventError> {
                self.0.lock().unwrap().push(e.clone());
                Ok(())
            }
        }
        let keep = Arc::new(Keep(Default::default()));
        let ids = Arc::new(IdGen::new("gw".into(), 1));
        ids.next();
        let events = Events {
            ids,
            sink: keep.clone(),
            stamp: plain_stamp,
        };
        events.emit("gate", "gate", Event::camera_up("c")).unwrap();
        let got = keep.0.lock().unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].id.as_str(), got[0].seq), ("gw/1/2", 2));
        assert_eq!(got[0].pipeline, "gate");
    }
}
