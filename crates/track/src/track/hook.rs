//! Tracking as a pipeline's per-stream step after postprocessing: what it
//! does with each frame's value, without knowing the pipeline. A stream's
//! [`StreamState`] is created on its first frame and ended when the stream
//! leaves the pipeline's stream table (or the daemon stops).
//!
//! Per frame: the boxes of the value are tracked, their track ids written
//! into it (local outputs get every frame's tracked boxes), the frame's
//! events come back as records' outputs (`{"events": [...]}`), and with
//! `emit = "events"` the frame's own record is not sent upstream.
//!
//! A frame's events fit the uplink: when they would make a record larger
//! than `max_record_bytes` (the smaller of the uplink's `max_packet_bytes`
//! and a UDP output's datagram), they are split over several records, each
//! with the frame's reference (`frame`, `{boot}-{n}`: the stream's `n`th
//! frame this boot), its `part` (1, 2, ...) and the number of `parts`; an
//! event too large for a record alone is shortened (see `fit.rs`). A busy
//! frame (hundreds of objects entering dozens of zones) is never dropped
//! whole for its size, nor is an object that went through many zones.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::config::{Emit, LineConfig, TrackConfig, ZoneConfig};
use super::events::{EndReason, Event, EventKind, OccupancyEvent};
use super::fit::{self, Envelope, escape_segment};
use super::snapshots::{SnapshotStore, snapshot_name};
use super::stats::TrackStats;
use super::tracker::{Detection, FrameOutput, StreamTracker, TrackingSpec};
use super::value;
use super::view::{
    Geometry, LIVE_BOXES, LineShape, LiveBox, LiveSlot, LiveTracks, TrackingView, ZoneShape,
};

/// One pipeline's tracking.
pub struct PipelineTracking {
    /// The zones and lines of every stream (those without `camera`).
    spec: Arc<TrackingSpec>,
    /// A camera's own: its zones and lines with those of every stream, for
    /// each camera that zones or lines name (the stream is the camera).
    by_camera: Vec<(String, Arc<TrackingSpec>)>,
    /// Confirmed tracks open now per stream, as of its latest frame.
    open: Mutex<std::collections::BTreeMap<String, usize>>,
    stats: Arc<TrackStats>,
    emit: Emit,
    /// `{device}/{pipeline}/`.
    prefix: String,
    device: String,
    pipeline: String,
    /// The model's `name@version`, in every record.
    model: String,
    /// This boot's number, in every track id.
    boot: u64,
    /// A frame's events go in records of at most this many bytes.
    max_record_bytes: usize,
    /// An event that cannot be shortened to fit is said once in a while.
    log: crate::telemetry::logging::RateLimitedLog,
    numbers: Arc<AtomicU64>,
    default_label: String,
    snapshots: Option<Arc<SnapshotStore>>,
    /// URL path of a track's snapshot, before the escaped id.
    snapshot_base: String,
    geometry: Geometry,
    /// The newest frame's tracked boxes (and each camera's newest frame's).
    live: Mutex<LiveSlot>,
}

/// One stream's tracks.
pub struct StreamState {
    tracker: StreamTracker,
    stream: String,
    /// Bytes of the stream's events records besides the events, at most.
    envelope: usize,
}

impl StreamState {
    pub fn open_tracks(&self) -> usize {
        self.tracker.open_tracks()
    }

    /// The boxes of the stream's tracks that may still move.
    pub fn moving_boxes(&self) -> Vec<[f32; 4]> {
        self.tracker.moving_boxes()
    }
}

/// What one frame gave.
#[derive(Debug, Default)]
pub struct Step {
    /// The outputs of the events records (`{"events": [...]}`, more than
    /// one when they would not fit one record), if any happened.
    pub events: Vec<Value>,
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
    /// The outbox's boot number (the one in record ids): it never repeats
    /// on a device, so neither do track ids that carry it.
    pub boot: u64,
    /// Gives each track its `{n}` within the boot: shared by the
    /// pipeline's streams and kept across reloads.
    pub numbers: Arc<AtomicU64>,
    /// The model's `name@version`, in every record.
    pub model: &'a str,
    /// The largest record the uplink sends (`max_packet_bytes`) and the
    /// local outputs take: a frame's events are split over records that
    /// fit it, and shortened where one alone would not (`fit.rs`).
    pub max_record_bytes: usize,
    /// The label of boxes without `label` or `class` (MTCNN faces, text boxes).
    pub default_label: &'a str,
    pub snapshots: Option<Arc<SnapshotStore>>,
    /// The cameras of a pipeline over several (`cameras = [...]`): each
    /// keeps its own newest frame's boxes for the console; empty otherwise.
    pub cameras: &'a [String],
}

impl PipelineTracking {
    pub fn new(s: TrackingSetup) -> Self {
        // Zones and lines without a camera are every stream's; one with a
        // camera is that stream's alone.
        let of = |cam: Option<&str>| {
            let zones: Vec<ZoneConfig> = s
                .zones
                .iter()
                .filter(|z| z.camera.is_none() || z.camera.as_deref() == cam)
                .cloned()
                .collect();
            let lines: Vec<LineConfig> = s
                .lines
                .iter()
                .filter(|l| l.camera.is_none() || l.camera.as_deref() == cam)
                .cloned()
                .collect();
            Arc::new(TrackingSpec::new(s.track.clone(), &zones, &lines))
        };
        let mut cams: Vec<&str> = Vec::new();
        for c in s
            .zones
            .iter()
            .filter_map(|z| z.camera.as_deref())
            .chain(s.lines.iter().filter_map(|l| l.camera.as_deref()))
        {
            if !cams.contains(&c) {
                cams.push(c);
            }
        }
        PipelineTracking {
            spec: of(None),
            by_camera: cams.iter().map(|c| (c.to_string(), of(Some(c)))).collect(),
            open: Mutex::new(Default::default()),
            stats: Arc::new(TrackStats::default()),
            emit: s.emit.unwrap_or_default(),
            prefix: format!("{}/{}/", s.device, s.pipeline),
            device: s.device.to_string(),
            pipeline: s.pipeline.to_string(),
            model: s.model.to_string(),
            boot: s.boot,
            max_record_bytes: s.max_record_bytes,
            log: crate::telemetry::logging::RateLimitedLog::new(std::time::Duration::from_secs(5)),
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
                        camera: z.camera.clone(),
                        polygon: z.polygon.clone(),
                    })
                    .collect(),
                lines: s
                    .lines
                    .iter()
                    .map(|l| LineShape {
                        name: l.name.clone(),
                        camera: l.camera.clone(),
                        points: l.points,
                    })
                    .collect(),
            },
            live: Mutex::new(LiveSlot::with_cameras(s.cameras)),
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
            cameras: slot.cameras.clone(),
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
        self.live_slot().keep(
            size.map(|(w, h)| [w, h]),
            LiveTracks {
                stream: stream.to_string(),
                ts: at,
                boxes,
            },
        );
    }

    pub fn stats(&self) -> &Arc<TrackStats> {
        &self.stats
    }

    /// The counts the status and the metrics show, failed snapshots included.
    pub fn counts(&self) -> super::TrackCounts {
        let mut c = self.stats.snapshot();
        c.snapshots_failed = self.snapshots.as_ref().map_or(0, |s| s.failed());
        c
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

    /// The zones and lines a stream sees: its camera's, where zones or
    /// lines name it, else those of every stream.
    fn spec_of(&self, stream: &str) -> &Arc<TrackingSpec> {
        self.by_camera
            .iter()
            .find(|(c, _)| c == stream)
            .map_or(&self.spec, |(_, s)| s)
    }

    /// Confirmed tracks open now on `stream` (0 for one not seen).
    pub fn open_tracks(&self, stream: &str) -> usize {
        self.open.lock().get(stream).copied().unwrap_or(0)
    }

    /// A new stream's state (its first frame is on its way).
    pub fn stream(&self, stream: &str) -> StreamState {
        StreamState {
            tracker: StreamTracker::new(
                Arc::clone(self.spec_of(stream)),
                Arc::clone(&self.stats),
                format!("{}{stream}/{}-", self.prefix, self.boot),
                Arc::clone(&self.numbers),
            )
            .with_stream(stream),
            stream: stream.to_string(),
            envelope: fit::envelope_bytes(&Envelope {
                device: &self.device,
                pipeline: &self.pipeline,
                stream,
                model: &self.model,
                boot: Some(self.boot),
            }),
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
        self.open
            .lock()
            .insert(st.stream.clone(), st.tracker.open_tracks());
        self.keep_live(&st.stream, at, size, &dets, &out);
        let best_crops = out
            .objects
            .iter()
            .zip(&dets)
            .filter(|(o, _)| o.best)
            .filter_map(|(o, d)| Some((snapshot_name(o.track.as_deref()?), d.bbox)))
            .collect();
        let frame = st.tracker.frames();
        Step {
            events: self.events(st, out.events, out.occupancy, frame),
            send_frame: self.emit == Emit::Frames,
            best_crops,
        }
    }

    /// The stream is gone (`StreamEnd`) or the daemon stops (`Restart`):
    /// its open tracks end (as the frame after its last one).
    pub fn end(&self, st: &mut StreamState, reason: EndReason, at: SystemTime) -> Vec<Value> {
        let ev = st.tracker.finish(reason, at);
        let frame = st.tracker.frames() + 1;
        self.open.lock().remove(&st.stream);
        let occ = st.tracker.empty_zones(at);
        self.live_slot().end(&st.stream);
        self.events(st, ev, occ, frame)
    }

    /// The events as records' outputs (none with `emit = "frames"`), each
    /// `track_end` naming its snapshot when one was kept, the zones' counts
    /// after the tracks' events; split over several records when one would
    /// be larger than `max_record_bytes`, an event shortened where it would
    /// be on its own.
    fn events(
        &self,
        st: &StreamState,
        mut ev: Vec<Event>,
        occ: Vec<OccupancyEvent>,
        frame: u64,
    ) -> Vec<Value> {
        if (ev.is_empty() && occ.is_empty()) || self.emit == Emit::Frames {
            return Vec::new();
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
        let mut all: Vec<Value> = ev.iter().map(|e| json!(e)).collect();
        all.extend(occ.iter().filter_map(|o| serde_json::to_value(o).ok()));
        let budget = self.max_record_bytes.saturating_sub(st.envelope);
        let fitted = fit::fit(all, budget);
        if fitted.too_large > 0
            && let Some(suppressed) = self.log.allow("too_large")
        {
            tracing::warn!(
                pipeline = %self.pipeline,
                stream = %st.stream,
                events = fitted.too_large,
                max_record_bytes = self.max_record_bytes,
                suppressed,
                "tracking events larger than a record even shortened (their names alone); they will be dead-lettered"
            );
        }
        let parts = fitted.parts;
        let n = parts.len();
        if n <= 1 {
            return parts.into_iter().map(|p| json!({ "events": p })).collect();
        }
        let frame = format!("{}-{frame}", self.boot);
        parts
            .into_iter()
            .enumerate()
            .map(|(i, p)| json!({ "events": p, "frame": frame, "part": i + 1, "parts": n }))
            .collect()
    }
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
            boot: 7,
            numbers: Arc::new(1.into()),
            model: "mtcnn@1",
            max_record_bytes: 1 << 20,
            default_label: "face",
            snapshots,
            cameras: &[],
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
                assert_eq!(v["boxes"][0]["track"], "gw/gate/cam/7-1");
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
        assert_eq!(live.boxes[0].track, "gw/gate/cam/7-1");
        assert_eq!(live.boxes[0].label, "face");
        assert_eq!(live.boxes[0].bbox, [20.0, 10.0, 60.0, 60.0]);
        let end = p.end(&mut st, EndReason::Restart, t(11));
        assert_eq!(end.len(), 1);
        let e = &end[0]["events"][0];
        assert_eq!(e["event"], "track_end");
        assert_eq!(e["reason"], "restart");
        assert_eq!(
            e["snapshot"],
            "/v1/pipelines/gate/tracks/gw%2Fgate%2Fcam%2F7-1/snapshot.jpg"
        );
        assert!(p.end(&mut st, EndReason::Restart, t(12)).is_empty());
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
            assert!(step.send_frame && step.events.is_empty());
        }
        assert_eq!(p.stats().snapshot().tracks_started, 1);
    }

    #[test]
    fn a_busy_frames_events_are_split_to_fit_and_none_is_lost() {
        let track = TrackConfig {
            min_hits: 1,
            max_tracks: 300,
            ..TrackConfig::default()
        };
        let zones: Vec<ZoneConfig> = (0..50)
            .map(|i| ZoneConfig {
                name: format!("z{i}"),
                polygon: vec![[0.0, 0.0], [1000.0, 0.0], [1000.0, 1000.0], [0.0, 1000.0]],
                inertia: 1,
                ..ZoneConfig::default()
            })
            .collect();
        let p = PipelineTracking::new(TrackingSetup {
            track: &track,
            zones: &zones,
            lines: &[],
            emit: None,
            device: "gw",
            pipeline: "gate",
            boot: 4,
            numbers: Arc::new(1.into()),
            model: "boxes@1.0.0",
            max_record_bytes: 64 << 10,
            default_label: "face",
            snapshots: None,
            cameras: &[],
        });
        let mut st = p.stream("cam");
        let boxes: Vec<Value> = (0..256)
            .map(|i| {
                let (x, y) = ((i % 16) as f64 * 40.0, (i / 16) as f64 * 40.0);
                json!({"box": [x, y, x + 20.0, y + 20.0], "score": 0.9})
            })
            .collect();
        let mut v = json!({ "boxes": boxes });
        let step = p.frame(&mut st, t(1), None, &mut v);
        let n = step.events.len();
        assert!(n > 1, "one record of {} events", n);
        let mut enters = 0;
        for (i, r) in step.events.iter().enumerate() {
            assert!(r["events"].to_string().len() + st.envelope <= 64 << 10);
            assert_eq!(r["frame"], "4-1");
            assert_eq!(r["part"], i + 1);
            assert_eq!(r["parts"], n);
            enters += r["events"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["event"] == "zone_enter")
                .count();
        }
        assert_eq!(enters, 256 * 50);
    }

    #[test]
    fn a_track_end_naming_30_zones_is_shortened_to_fit_a_small_packet() {
        // What was dead-lettered at max_packet_bytes = 1024: each object's
        // track_end named its 30 zones (2.5 kB with long zone names).
        let track = TrackConfig {
            min_hits: 1,
            max_age: Duration::from_millis(100),
            ..TrackConfig::default()
        };
        let zones: Vec<ZoneConfig> = (0..30)
            .map(|i| ZoneConfig {
                name: format!("loading-bay-{i:02}-{}", "x".repeat(40)),
                polygon: vec![[0.0, 0.0], [1000.0, 0.0], [1000.0, 1000.0], [0.0, 1000.0]],
                inertia: 1,
                ..ZoneConfig::default()
            })
            .collect();
        let p = PipelineTracking::new(TrackingSetup {
            track: &track,
            zones: &zones,
            lines: &[],
            emit: None,
            device: "gw",
            pipeline: "gate",
            boot: 4,
            numbers: Arc::new(1.into()),
            model: "boxes@1.0.0",
            max_record_bytes: 1024,
            default_label: "object",
            snapshots: None,
            cameras: &[],
        });
        let mut st = p.stream("cam");
        let mut records = Vec::new();
        for f in 1..=3 {
            let mut v = face(10.0 + f as f64, 0.9);
            records.extend(p.frame(&mut st, t(f), None, &mut v).events);
        }
        records.extend(p.end(&mut st, EndReason::Restart, t(4)));
        let events: Vec<&Value> = records
            .iter()
            .flat_map(|r| r["events"].as_array().unwrap())
            .collect();
        for r in &records {
            assert!(r["events"].to_string().len() + st.envelope <= 1024, "{r}");
        }
        let enters = events.iter().filter(|e| e["event"] == "zone_enter").count();
        let leaves = events.iter().filter(|e| e["event"] == "zone_leave").count();
        assert_eq!((enters, leaves), (30, 30));
        let end: Vec<&&Value> = events
            .iter()
            .filter(|e| e["event"] == "track_end")
            .collect();
        assert_eq!(end.len(), 1);
        let end = end[0];
        assert_eq!(end["truncated"], true, "{end}");
        assert_eq!(end["zones_count"], 30, "{end}");
        let named = end["zones"].as_array().unwrap();
        assert!(!named.is_empty() && named.len() < 30, "{end}");
        assert_eq!(named[0], zones[0].name.as_str());
        assert!(end.get("lines_count").is_none(), "{end}");
    }
}
