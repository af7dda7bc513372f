//! Tracking as a pipeline's per-stream step after postprocessing: what it
//! does with each frame's value, without knowing the pipeline. A stream's
//! [`StreamState`] is created on its first frame and ended when the stream
//! leaves the pipeline's stream table (or the daemon stops).
//!
//! Per frame: the boxes of the value are tracked, their track ids written
//! into it (local outputs get every frame's tracked boxes), the frame's
//! events come back as one record's outputs (`{"events": [...]}`), and with
//! `emit = "events"` the frame's own record is not sent upstream.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

use parking_lot::Mutex;
use serde::Serialize;
use serde_json::{Value, json};

use super::config::{Emit, LineConfig, TrackConfig, ZoneConfig};
use super::events::{EndReason, Event, EventKind, OccupancyEvent, rfc3339};
use super::snapshots::{SnapshotStore, snapshot_name};
use super::stats::TrackStats;
use super::tracker::{Detection, FrameOutput, StreamTracker, TrackingSpec};
use super::value;

/// Tracked boxes of the newest frame kept for the console, at most.
pub const LIVE_BOXES: usize = 64;

/// One pipeline's tracking.
pub struct PipelineTracking {
    spec: Arc<TrackingSpec>,
    stats: Arc<TrackStats>,
    emit: Emit,
    /// `{device}/{pipeline}/`.
    prefix: String,
    numbers: Arc<AtomicU64>,
    default_label: String,
    snapshots: Option<Arc<SnapshotStore>>,
    /// URL path of a track's snapshot, before the escaped id.
    snapshot_base: String,
    geometry: Geometry,
    /// The newest frame's tracked boxes: written once a frame (a short
    /// lock), read by the console's feed once a second.
    live: Mutex<LiveSlot>,
}

/// One stream's tracks.
pub struct StreamState {
    tracker: StreamTracker,
    stream: String,
}

/// The zones and lines as configured, in source-frame pixels.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Geometry {
    pub zones: Vec<ZoneShape>,
    pub lines: Vec<LineShape>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZoneShape {
    pub name: String,
    pub polygon: Vec<[f32; 2]>,
}

/// `points[0]` to `points[1]`; crossing from its left to its right (seen
/// with the first point at the top) is `in`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LineShape {
    pub name: String,
    pub points: [[f32; 2]; 2],
}

#[derive(Debug, Default)]
struct LiveSlot {
    /// The source frame's width and height, from the newest frame that had one.
    frame_size: Option<[u32; 2]>,
    tracks: Option<LiveTracks>,
}

/// The tracked boxes of the pipeline's newest frame (of whichever stream).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveTracks {
    pub stream: String,
    #[serde(serialize_with = "rfc3339")]
    pub ts: SystemTime,
    /// At most [`LIVE_BOXES`], those with a track id only.
    pub boxes: Vec<LiveBox>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveBox {
    pub track: String,
    pub label: String,
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
    pub score: f32,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stationary: bool,
}

/// What the console draws of a pipeline's tracking.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrackingView {
    pub geometry: Geometry,
    /// `[width, height]` of the source frames; `null` before the first one.
    pub frame_size: Option<[u32; 2]>,
    /// `null` before the first frame and after its stream ended.
    pub live: Option<LiveTracks>,
}

impl StreamState {
    pub fn open_tracks(&self) -> usize {
        self.tracker.open_tracks()
    }
}

/// What one frame gave.
#[derive(Debug, Default)]
pub struct Step {
    /// The outputs of an events record (`{"events": [...]}`), if any happened.
    pub events: Option<Value>,
    /// Whether the frame's own record still goes upstream (`emit = "frames"`).
    pub send_frame: bool,
    /// Boxes whose crop is their track's best so far: the snapshot name to
    /// keep it under and the box in source-frame pixels.
    pub best_crops: Vec<(String, [f32; 4])>,
}

/// What a pipeline's tracking is made of.
pub struct TrackingSetup<'a> {
    pub track: &'a TrackConfig,
    pub zones: &'a [ZoneConfig],
    pub lines: &'a [LineConfig],
    pub emit: Option<Emit>,
    pub device: &'a str,
    pub pipeline: &'a str,
    /// Gives each track its `{n}`: shared by the pipeline's streams and
    /// kept across reloads, starting past any earlier boot's (the boot
    /// counter times a million), so ids never repeat.
    pub numbers: Arc<AtomicU64>,
    /// The label of boxes without `label` or `class` (MTCNN faces, text boxes).
    pub default_label: &'a str,
    pub snapshots: Option<Arc<SnapshotStore>>,
}

impl PipelineTracking {
    pub fn new(s: TrackingSetup) -> Self {
        PipelineTracking {
            spec: Arc::new(TrackingSpec::new(s.track.clone(), s.zones, s.lines)),
            stats: Arc::new(TrackStats::default()),
            emit: s.emit.unwrap_or_default(),
            prefix: format!("{}/{}/", s.device, s.pipeline),
            numbers: s.numbers,
            default_label: s.default_label.to_string(),
            snapshots: s.snapshots,
            snapshot_base: format!("/v1/pipelines/{}/tracks/", s.pipeline),
            geometry: Geometry {
                zones: s
                    .zones
                    .iter()
                    .map(|z| ZoneShape {
                        name: z.name.clone(),
                        polygon: z.polygon.clone(),
                    })
                    .collect(),
                lines: s
                    .lines
                    .iter()
                    .map(|l| LineShape {
                        name: l.name.clone(),
                        points: l.points,
                    })
                    .collect(),
            },
            live: Mutex::new(LiveSlot::default()),
        }
    }

    fn live_slot(&self) -> parking_lot::MutexGuard<'_, LiveSlot> {
        self.live.lock()
    }

    /// The zones, lines and the newest frame's tracked boxes.
    pub fn view(&self) -> TrackingView {
        let slot = self.live_slot();
        TrackingView {
            geometry: self.geometry.clone(),
            frame_size: slot.frame_size,
            live: slot.tracks.clone(),
        }
    }

    fn keep_live(
        &self,
        stream: &str,
        at: SystemTime,
        size: Option<(u32, u32)>,
        dets: &[Detection],
        out: &FrameOutput,
    ) {
        let boxes: Vec<LiveBox> = out
            .objects
            .iter()
            .zip(dets)
            .filter_map(|(o, d)| {
                Some(LiveBox {
                    track: o.track.as_deref()?.to_string(),
                    label: d.label.clone(),
                    bbox: d.bbox,
                    score: d.score,
                    stationary: o.stationary,
                })
            })
            .take(LIVE_BOXES)
            .collect();
        let mut slot = self.live_slot();
        if let Some((w, h)) = size {
            slot.frame_size = Some([w, h]);
        }
        slot.tracks = Some(LiveTracks {
            stream: stream.to_string(),
            ts: at,
            boxes,
        });
    }

    pub fn stats(&self) -> &Arc<TrackStats> {
        &self.stats
    }

    pub fn emit(&self) -> Emit {
        self.emit
    }

    pub fn snapshots(&self) -> Option<&Arc<SnapshotStore>> {
        self.snapshots.as_ref()
    }

    /// One crop's JPEG at most.
    pub fn snapshot_max_bytes(&self) -> usize {
        self.spec.config.snapshot_max_bytes
    }

    /// The kept snapshot of a track, by its id.
    pub fn snapshot(&self, track_id: &str) -> Option<Vec<u8>> {
        self.snapshots.as_ref()?.get(&snapshot_name(track_id))
    }

    /// A new stream's state (its first frame is on its way).
    pub fn stream(&self, stream: &str) -> StreamState {
        StreamState {
            tracker: StreamTracker::new(
                Arc::clone(&self.spec),
                Arc::clone(&self.stats),
                format!("{}{stream}/", self.prefix),
                Arc::clone(&self.numbers),
            )
            .with_stream(stream),
            stream: stream.to_string(),
        }
    }

    /// One frame of the stream (`size`: the source frame's width and
    /// height, when known), its value as postprocessing (and the stages)
    /// left it; track ids are written into it.
    pub fn frame(
        &self,
        st: &mut StreamState,
        at: SystemTime,
        size: Option<(u32, u32)>,
        v: &mut Value,
    ) -> Step {
        let (dets, at_idx) = value::detections(v, &self.default_label);
        let out = st.tracker.update(at, &dets);
        value::annotate(v, &at_idx, &out);
        self.keep_live(&st.stream, at, size, &dets, &out);
        let best_crops = out
            .objects
            .iter()
            .zip(&dets)
            .filter(|(o, _)| o.best)
            .filter_map(|(o, d)| Some((snapshot_name(o.track.as_deref()?), d.bbox)))
            .collect();
        Step {
            events: self.events(out.events, out.occupancy),
            send_frame: self.emit == Emit::Frames,
            best_crops,
        }
    }

    /// The stream is gone (`StreamEnd`) or the daemon stops (`Restart`):
    /// its open tracks end.
    pub fn end(&self, st: &mut StreamState, reason: EndReason, at: SystemTime) -> Option<Value> {
        let ev = st.tracker.finish(reason, at);
        let occ = st.tracker.empty_zones(at);
        let mut slot = self.live_slot();
        if slot.tracks.as_ref().is_some_and(|t| t.stream == st.stream) {
            slot.tracks = None;
        }
        drop(slot);
        self.events(ev, occ)
    }

    /// The events as a record's outputs (none with `emit = "frames"`), each
    /// `track_end` naming its snapshot when one was kept; the zones' counts
    /// after the tracks' events.
    fn events(&self, mut ev: Vec<Event>, occ: Vec<OccupancyEvent>) -> Option<Value> {
        if (ev.is_empty() && occ.is_empty()) || self.emit == Emit::Frames {
            return None;
        }
        if let Some(store) = &self.snapshots {
            for e in &mut ev {
                if let EventKind::TrackEnd(s) = &mut e.kind {
                    let name = snapshot_name(&e.track);
                    if store.contains(&name) {
                        s.snapshot = Some(format!(
                            "{}{}/snapshot.jpg",
                            self.snapshot_base,
                            escape_segment(&e.track)
                        ));
                    }
                }
            }
        }
        if occ.is_empty() {
            return Some(json!({ "events": ev }));
        }
        let mut list = serde_json::to_value(ev).ok()?;
        if let Value::Array(a) = &mut list {
            a.extend(occ.iter().filter_map(|o| serde_json::to_value(o).ok()));
        }
        Some(json!({ "events": list }))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, UNIX_EPOCH};

    fn setup<'a>(
        track: &'a TrackConfig,
        zones: &'a [ZoneConfig],
        emit: Option<Emit>,
        snapshots: Option<Arc<SnapshotStore>>,
    ) -> PipelineTracking {
        PipelineTracking::new(TrackingSetup {
            track,
            zones,
            lines: &[],
            emit,
            device: "gw",
            pipeline: "gate",
            numbers: Arc::new(7_000_001.into()),
            default_label: "face",
            snapshots,
        })
    }

    fn t(f: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(f * 100)
    }

    fn face(x: f64, score: f64) -> Value {
        json!({"boxes": [{"box": [x, 10.0, x + 40.0, 60.0], "score": score}]})
    }

    #[test]
    fn events_replace_frames_and_ids_reach_the_local_value() {
        let track = TrackConfig::default();
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(SnapshotStore::open(dir.path(), 1 << 20).unwrap());
        let p = setup(&track, &[], None, Some(Arc::clone(&store)));
        let mut st = p.stream("cam");
        let mut records = Vec::new();
        for f in 1..=10 {
            let mut v = face(10.0 + f as f64, 0.5 + f as f64 * 0.01);
            let step = p.frame(&mut st, t(f), Some((320, 240)), &mut v);
            assert!(!step.send_frame);
            if f >= 3 {
                assert_eq!(v["boxes"][0]["track"], "gw/gate/cam/7000001");
                // Scores rise every frame: each is the best so far.
                assert_eq!(step.best_crops.len(), 1);
                store.put(&step.best_crops[0].0, b"jpeg").unwrap();
            }
            records.extend(step.events);
        }
        assert_eq!(records.len(), 1);
        assert_eq!(records[0]["events"][0]["event"], "track_start");
        // The newest frame's tracked boxes, for the console.
        let view = p.view();
        assert_eq!(view.frame_size, Some([320, 240]));
        let live = view.live.as_ref().unwrap();
        assert_eq!(live.stream, "cam");
        assert_eq!(live.ts, t(10));
        assert_eq!(live.boxes.len(), 1);
        assert_eq!(live.boxes[0].track, "gw/gate/cam/7000001");
        assert_eq!(live.boxes[0].label, "face");
        assert_eq!(live.boxes[0].bbox, [20.0, 10.0, 60.0, 60.0]);
        let end = p.end(&mut st, EndReason::Restart, t(11)).unwrap();
        let e = &end["events"][0];
        assert_eq!(e["event"], "track_end");
        assert_eq!(e["reason"], "restart");
        assert_eq!(
            e["snapshot"],
            "/v1/pipelines/gate/tracks/gw%2Fgate%2Fcam%2F7000001/snapshot.jpg"
        );
        assert!(p.end(&mut st, EndReason::Restart, t(12)).is_none());
        // The stream is gone: its boxes are no longer shown.
        assert!(p.view().live.is_none());
        assert_eq!(p.view().frame_size, Some([320, 240]));
    }

    #[test]
    fn emit_frames_keeps_the_frame_record_and_sends_no_events() {
        let track = TrackConfig::default();
        let p = setup(&track, &[], Some(Emit::Frames), None);
        let mut st = p.stream("cam");
        for f in 1..=5 {
            let mut v = face(10.0, 0.9);
            let step = p.frame(&mut st, t(f), None, &mut v);
            assert!(step.send_frame && step.events.is_none());
        }
        assert_eq!(p.stats().snapshot().tracks_started, 1);
    }
}
