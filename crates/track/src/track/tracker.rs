//! One stream's tracks: ByteTrack (trackforge) per label does the Kalman
//! prediction and the two-pass IoU association; this file keeps what
//! outpost adds on top: ids, `min_hits`, `max_age` in time, stationary
//! objects, zones and lines, the best frame, the text vote, and the events.
//!
//! Invariants:
//! - a track has an id (and appears in events) only once it was matched in
//!   `min_hits` frames; a tentative track that misses a frame is dropped
//!   without a word (ByteTrack's and SORT's rule for unconfirmed tracks);
//! - every `track_start` is followed by exactly one `track_end` (lost,
//!   evicted, stream end or restart), and a track inside a zone leaves it
//!   before it ends, so zone occupancy returns to zero;
//! - a stationary object missed for longer than `max_age` but less than
//!   `stationary_max_age` keeps its id when it is detected again where it
//!   stood: a parked truck is announced once;
//! - a lost object (ByteTrack let it go and gave its next detection a new
//!   id) is re-linked to its track when the detection fits where its own
//!   observed motion took it (`motion.rs`), before a new track is made: it
//!   keeps its id, gets no second `track_start`, and its `track_end`
//!   counts the re-links; one hidden under another object's box coasts
//!   for `occluded_max_age` instead of `max_age`;
//! - state is bounded: open tracks by `max_tracks`, labels by
//!   [`MAX_LABELS`], text readings by [`MAX_READINGS`] per track, and
//!   ByteTrack's own lost tracks by its buffer.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use trackforge::trackers::byte_track::{ByteTrack, ByteTrackParams};
use trackforge::trackers::common::CommonParams;

use super::config::{LineConfig, TrackConfig, ZoneConfig, after_depth};
use super::events::{
    Crossing, Direction, EndReason, Event, EventKind, OccupancyEvent, Speed, TrackSummary,
    ZONE_OCCUPANCY,
};
use super::geometry::Point;
use super::motion::Motion;
use super::occupancy::Counter;
use super::speed::SpeedUnit;
use super::stats::TrackStats;
use super::zones::{Line, LineState, Zone, ZoneChange, ZoneState, came_from, line_margin};

/// Labels one stream tracks, at most (a detector's classes); detections of
/// further labels pass untracked and are counted.
pub const MAX_LABELS: usize = 256;
/// Distinct text readings kept per track; later new ones only count in the
/// total (a plate read 12 ways is noise).
pub const MAX_READINGS: usize = 16;
/// ByteTrack counts its lost-track buffer in frames; outpost ends tracks by
/// time. The buffer is `max_age` at this many frames per second, and lost
/// tracks it let go are picked up again by outpost's own re-association.
const FPS_HINT: f64 = 30.0;
/// The crate id of a track the association no longer follows.
const DETACHED: u64 = u64::MAX;
/// How far below `high_score` a detection still takes part in the first
/// (looser) matching pass.
const FIRST_PASS_MARGIN: f32 = 0.1;
/// A box moving less than this fraction of its height stays put.
const STILL_FRACTION: f32 = 0.1;
/// A track whose box last moved (by more than `STILL_FRACTION`) this long
/// before its latest match is not moving now (see `moving_boxes`).
const MOVING_WINDOW: std::time::Duration = std::time::Duration::from_secs(1);

/// Hashes the tracker's own integer keys (its track keys and the crate's
/// ids, never input): a multiply instead of SipHash, looked up for every
/// box of every frame.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u16(&mut self, v: u16) {
        self.write_u64(u64::from(v));
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0.rotate_left(5) ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

/// One detection of a frame, in source-frame pixels.
#[derive(Debug, Clone, PartialEq)]
pub struct Detection {
    /// `[x1, y1, x2, y2]`.
    pub bbox: [f32; 4],
    pub score: f32,
    pub label: String,
    /// A text stage's reading of the box and its score.
    pub text: Option<(String, f32)>,
}

/// What a pipeline's tracking is: built once from the config, shared by
/// its streams.
#[derive(Debug)]
pub struct TrackingSpec {
    pub config: TrackConfig,
    pub zones: Vec<Zone>,
    pub lines: Vec<Line>,
    /// The zones in the order a frame steps them: a zone after the zone
    /// its `after` names, so an entry into both in one frame is in order.
    order: Vec<usize>,
    /// The zones that count their occupancy.
    occupancy: Vec<usize>,
    /// The unit of `max_speed` (the calibrated zones share one).
    speed_unit: Option<SpeedUnit>,
}

impl TrackingSpec {
    pub fn new(config: TrackConfig, zones: &[ZoneConfig], lines: &[LineConfig]) -> Self {
        let mut built: Vec<Zone> = zones.iter().map(Zone::new).collect();
        for (z, c) in built.iter_mut().zip(zones) {
            z.after = c
                .after
                .as_ref()
                .and_then(|a| zones.iter().position(|o| o.name == *a));
        }
        // A chain in a circle was refused by `check`; here it sorts last.
        let mut order: Vec<usize> = (0..zones.len()).collect();
        order.sort_by_key(|&i| after_depth(zones, i).unwrap_or(usize::MAX));
        TrackingSpec {
            config,
            occupancy: (0..built.len()).filter(|&i| built[i].occupancy).collect(),
            speed_unit: built.iter().find(|z| z.ground.is_some()).map(|z| z.unit),
            zones: built,
            lines: lines.iter().map(Line::new).collect(),
            order,
        }
    }

    /// The tracker crate's settings for this config (one ByteTrack per label).
    pub fn byte_params(&self) -> ByteTrackParams {
        let c = &self.config;
        let buffer = (c.max_age.as_secs_f64() * FPS_HINT).ceil().max(1.0) as usize;
        ByteTrackParams {
            common: CommonParams::new(buffer, c.min_hits as usize),
            // The first pass takes detections a little below `high_score`
            // too: a person half hidden behind another scores lower, and
            // the second pass (IoU 0.5) loses them while they cross.
            track_thresh: first_pass_score(c.high_score),
            // trackforge takes IoU distances (1 - IoU). The low-score pass
            // asks for at least ByteTrack's reference overlap of 0.5.
            match_thresh: 1.0 - c.iou,
            det_thresh: c.high_score,
            second_match_thresh: 1.0 - c.iou.max(0.5),
        }
    }
}

/// A detection's place in the tracks, aligned with the frame's detections.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tracked {
    /// The track id, once the track is confirmed.
    pub track: Option<Arc<str>>,
    pub stationary: bool,
    /// This frame is the track's best so far (highest score): the frame
    /// whose crop is worth keeping as its snapshot.
    pub best: bool,
    /// The track's local number (`{n}` of its id), once confirmed.
    pub n: Option<u64>,
}

/// What one frame did.
#[derive(Debug, Default)]
pub struct FrameOutput {
    /// One per detection of the frame, in its order.
    pub objects: Vec<Tracked>,
    pub events: Vec<Event>,
    /// Zone counts that changed (zones with `occupancy`).
    pub occupancy: Vec<OccupancyEvent>,
}

#[derive(Debug, Default)]
struct Votes {
    readings: Vec<(String, u32, f32)>,
    total: u32,
}

impl Votes {
    fn add(&mut self, text: &str, score: f32) {
        self.total = self.total.saturating_add(1);
        if let Some(r) = self.readings.iter_mut().find(|r| r.0 == text) {
            r.1 += 1;
            r.2 += score;
        } else if self.readings.len() < MAX_READINGS {
            self.readings.push((text.to_string(), 1, score));
        }
    }

    /// The most frequent reading (ties: the higher summed score) and its share.
    fn winner(&self) -> Option<(String, f32, u32)> {
        let best = self
            .readings
            .iter()
            .max_by(|a, b| a.1.cmp(&b.1).then(a.2.total_cmp(&b.2)))?;
        Some((
            best.0.clone(),
            best.1 as f32 / self.total as f32,
            self.total,
        ))
    }
}

#[derive(Debug)]
struct Track {
    label: u16,
    /// ByteTrack's id in the label's tracker.
    crate_id: u64,
    /// Set on confirmation.
    n: Option<u64>,
    /// `{prefix}{n}`, made once on confirmation.
    id: Option<Arc<str>>,
    hits: u32,
    first_seen: SystemTime,
    last_seen: SystemTime,
    /// Frame number (per stream) of the last match.
    last_frame: u64,
    bbox: [f32; 4],
    score: f32,
    best_score: f32,
    best_box: [f32; 4],
    /// Where it stood still since when (bottom centre).
    anchor: Point,
    anchor_since: SystemTime,
    stationary: bool,
    zones: Vec<ZoneState>,
    lines: Vec<LineState>,
    visited: Vec<usize>,
    crossed: Vec<Crossing>,
    votes: Votes,
    /// The fastest settled speed in a calibrated zone, metres per second.
    max_speed: Option<f64>,
    /// Events of a tentative track, told once it is confirmed.
    held: Vec<Held>,
    /// Times a new detection took up this track after it was lost.
    relinked: u32,
    /// The observed boxes it coasts along while lost.
    motion: Motion,
}

/// An event waiting for its track's confirmation.
#[derive(Debug)]
struct Held {
    kind: EventKind,
    bbox: [f32; 4],
    score: f32,
    ts: SystemTime,
    /// False: a zone's `direction` keeps it quiet; it still moves the
    /// zone's count of objects inside.
    told: bool,
}

/// The tracks of one stream.
pub struct StreamTracker {
    spec: Arc<TrackingSpec>,
    stats: Arc<TrackStats>,
    /// `{device}/{pipeline}/{stream}/{boot}-`.
    prefix: String,
    /// The next `{n}`, shared by the pipeline's streams.
    numbers: Arc<AtomicU64>,
    next_key: u64,
    frame: u64,
    labels: Vec<(String, ByteTrack)>,
    tracks: KeyMap<u64, Track>,
    by_crate: KeyMap<(u16, u64), u64>,
    /// The stream's name, for its occupancy counts.
    stream: String,
    /// Per zone with `occupancy` (the spec's order), per label index.
    counters: Vec<Vec<Counter>>,
    /// This frame's counts, zone-major: reused, not reallocated.
    raw: Vec<u32>,
}

impl StreamTracker {
    /// `prefix` begins every track id (`{device}/{pipeline}/{stream}/{boot}-`:
    /// the boot keeps ids of different boots apart); `numbers` gives each
    /// confirmed track its `{n}` (a counter the caller shares between
    /// streams and keeps across reloads, so ids never repeat within a boot).
    pub fn new(
        spec: Arc<TrackingSpec>,
        stats: Arc<TrackStats>,
        prefix: String,
        numbers: Arc<AtomicU64>,
    ) -> Self {
        StreamTracker {
            spec,
            stats,
            prefix,
            numbers,
            next_key: 0,
            frame: 0,
            labels: Vec::new(),
            tracks: KeyMap::default(),
            by_crate: KeyMap::default(),
            stream: String::new(),
            counters: Vec::new(),
            raw: Vec::new(),
        }
    }

    /// Names the stream in its occupancy counts (`/metrics`, the status).
    pub fn with_stream(mut self, stream: &str) -> Self {
        self.stream = stream.to_string();
        self
    }

    /// Open tracks (tentative ones included).
    pub fn open_tracks(&self) -> usize {
        self.tracks.len()
    }

    /// The boxes of the tracks matched at the newest frame whose box moved
    /// (by more than a tenth of its height) within the second before:
    /// objects on the move, for which a motion gate keeps the detector
    /// running even when the picture barely changes. A parked car's track
    /// is not one a second after it stopped, long before it is `stationary`.
    pub fn moving_boxes(&self) -> Vec<[f32; 4]> {
        self.tracks
            .values()
            .filter(|t| {
                t.last_frame == self.frame
                    && !t.stationary
                    && t.last_seen
                        .duration_since(t.anchor_since)
                        .is_ok_and(|d| d < MOVING_WINDOW)
            })
            .map(|t| t.bbox)
            .collect()
    }

    /// Frames seen so far (the newest one's number, from 1).
    pub fn frames(&self) -> u64 {
        self.frame
    }

    /// The `{n}` the next confirmed track gets.
    pub fn next_n(&self) -> u64 {
        self.numbers.load(Ordering::Relaxed)
    }

    fn label_index(&mut self, label: &str) -> Option<u16> {
        if let Some(i) = self.labels.iter().position(|(l, _)| l == label) {
            return Some(i as u16);
        }
        if self.labels.len() >= MAX_LABELS {
            return None;
        }
        self.labels.push((
            label.to_string(),
            ByteTrack::from_params(self.spec.byte_params()),
        ));
        Some((self.labels.len() - 1) as u16)
    }

    /// One frame's detections at time `at`.
    pub fn update(&mut self, at: SystemTime, dets: &[Detection]) -> FrameOutput {
        self.frame += 1;
        let mut out = FrameOutput {
            objects: vec![Tracked::default(); dets.len()],
            ..FrameOutput::default()
        };
        // Per label: the detections' indices, then one ByteTrack step each
        // (also for labels with none this frame, so their tracks age).
        let mut per_label: Vec<Vec<usize>> = vec![Vec::new(); self.labels.len()];
        for (i, d) in dets.iter().enumerate() {
            if !(d.bbox.iter().all(|v| v.is_finite()) && d.score.is_finite()) {
                self.stats.count_untracked("not_finite");
                continue;
            }
            match self.label_index(&d.label) {
                Some(l) => {
                    if per_label.len() <= l as usize {
                        per_label.resize(l as usize + 1, Vec::new());
                    }
                    per_label[l as usize].push(i);
                }
                None => self.stats.count_untracked("too_many_labels"),
            }
        }
        let mut matched: Vec<(u16, u64, usize)> = Vec::new();
        for (l, idx) in per_label.iter().enumerate() {
            let input: Vec<([f32; 4], f32, i64)> = idx
                .iter()
                .map(|&i| {
                    let b = dets[i].bbox;
                    ([b[0], b[1], b[2] - b[0], b[3] - b[1]], dets[i].score, 0)
                })
                .collect();
            for t in self.labels[l].1.update(input) {
                if let Some(j) = t.det_ind.and_then(|j| idx.get(j)) {
                    matched.push((l as u16, t.track_id, *j));
                }
            }
        }
        // Boxes of known tracks first: a new crate id may re-link only to
        // a track that none of this frame's boxes continued.
        matched.sort_by_key(|(l, c, _)| !self.by_crate.contains_key(&(*l, *c)));
        let min_hits = self.spec.config.min_hits;
        let stationary_after = self.spec.config.stationary_after;
        let frame = self.frame;
        for (label, crate_id, i) in matched {
            let key = match self.by_crate.get(&(label, crate_id)).copied() {
                Some(k) if self.continues(k, &dets[i].bbox) => k,
                Some(k) => {
                    // The association handed a missed object's track to
                    // another one: that one is new (or re-linked), this one
                    // stays lost.
                    self.by_crate.remove(&(label, crate_id));
                    if let Some(t) = self.tracks.get_mut(&k) {
                        t.crate_id = DETACHED;
                    }
                    self.adopt_or_create(label, crate_id, &dets[i], at)
                }
                None => self.adopt_or_create(label, crate_id, &dets[i], at),
            };
            // One lookup per box; the rest works on the track and the
            // tracker's other fields side by side.
            let Some(t) = self.tracks.get_mut(&key) else {
                continue;
            };
            let d = &dets[i];
            t.hits = t.hits.saturating_add(1);
            t.last_seen = at;
            t.last_frame = frame;
            t.bbox = d.bbox;
            t.motion.observe(frame, d.bbox);
            t.score = d.score;
            let best = d.score > t.best_score;
            if best {
                t.best_score = d.score;
                t.best_box = d.bbox;
            }
            if let Some((text, score)) = &d.text {
                t.votes.add(text, *score);
            }
            let p = Point::bottom_centre(&d.bbox);
            let still = (STILL_FRACTION * (d.bbox[3] - d.bbox[1]).abs()).max(1.0);
            if p.distance(t.anchor) > still {
                t.anchor = p;
                t.anchor_since = at;
                t.stationary = false;
            } else if at.duration_since(t.anchor_since).unwrap_or_default() >= stationary_after {
                t.stationary = true;
            }
            let label_name = self.labels[t.label as usize].0.as_str();
            areas(&self.spec, label_name, t, p, at);
            if t.n.is_none() && t.hits >= min_hits {
                match self.stitch_target(key) {
                    Some(lost) => {
                        self.stitch(key, lost, p, at);
                        let Some(t) = self.tracks.get_mut(&lost) else {
                            continue;
                        };
                        out.objects[i] = Tracked {
                            track: t.id.clone(),
                            stationary: t.stationary,
                            best: false,
                            n: t.n,
                        };
                        let label_name = self.labels[t.label as usize].0.as_str();
                        flush_held(t, label_name, &self.stats, &mut out.events);
                        continue;
                    }
                    None => {
                        let Some(t) = self.tracks.get_mut(&key) else {
                            continue;
                        };
                        confirm(t, &self.numbers, &self.stats, &self.prefix);
                    }
                }
            }
            let Some(t) = self.tracks.get_mut(&key) else {
                continue;
            };
            let label_name = self.labels[t.label as usize].0.as_str();
            out.objects[i] = Tracked {
                track: t.id.clone(),
                stationary: t.stationary,
                best: best && t.n.is_some(),
                n: t.n,
            };
            flush_held(t, label_name, &self.stats, &mut out.events);
        }
        self.age(at, &mut out.events);
        if !self.spec.occupancy.is_empty() {
            self.count_zones(at, &mut out.occupancy);
        }
        out
    }

    /// Counts each occupancy zone's confirmed tracks per label where they
    /// were last seen; tells the counts that changed.
    fn count_zones(&mut self, at: SystemTime, out: &mut Vec<OccupancyEvent>) {
        let nl = self.labels.len();
        let occ = &self.spec.occupancy;
        self.raw.clear();
        self.raw.resize(occ.len() * nl, 0);
        for t in self.tracks.values() {
            if t.n.is_none() {
                continue;
            }
            for (k, &zi) in occ.iter().enumerate() {
                if t.zones[zi].raw() {
                    self.raw[k * nl + t.label as usize] += 1;
                }
            }
        }
        self.counters.resize_with(occ.len(), Vec::new);
        for (k, &zi) in occ.iter().enumerate() {
            let zone = &self.spec.zones[zi];
            let counters = &mut self.counters[k];
            counters.resize(nl, Counter::default());
            for (l, c) in counters.iter_mut().enumerate() {
                let Some(ch) = c.step(self.raw[k * nl + l], zone.inertia(), at) else {
                    continue;
                };
                let label = &self.labels[l].0;
                self.stats
                    .occupancy(&self.stream, &zone.name, label, ch.count);
                out.push(OccupancyEvent {
                    event: ZONE_OCCUPANCY,
                    zone: zone.name.clone(),
                    label: label.clone(),
                    count: ch.count,
                    previous: ch.previous,
                    ts: ch.at,
                });
            }
        }
    }

    /// The stream ended: every zone is empty now. Call after [`Self::finish`].
    pub fn empty_zones(&mut self, at: SystemTime) -> Vec<OccupancyEvent> {
        let mut out = Vec::new();
        for (k, counters) in self.counters.iter_mut().enumerate() {
            let Some(zone) = self.spec.occupancy.get(k).map(|&zi| &self.spec.zones[zi]) else {
                continue;
            };
            for (l, c) in counters.iter_mut().enumerate() {
                if let Some(ch) = c.empty(at) {
                    self.stats.count_event(ZONE_OCCUPANCY);
                    out.push(OccupancyEvent {
                        event: ZONE_OCCUPANCY,
                        zone: zone.name.clone(),
                        label: self.labels[l].0.clone(),
                        count: 0,
                        previous: ch.previous,
                        ts: at,
                    });
                }
            }
        }
        self.stats.forget_stream(&self.stream);
        out
    }

    /// A new ByteTrack id: the continuation of a lost track of outpost's
    /// that ByteTrack let go (an object hidden for a while, a parked object
    /// missed), re-linked where its motion took it, or a new tentative
    /// track.
    fn adopt_or_create(&mut self, label: u16, crate_id: u64, d: &Detection, at: SystemTime) -> u64 {
        let frame = self.frame;
        let min_iou = self.spec.config.iou;
        let lost = self
            .tracks
            .iter()
            .filter(|(_, t)| t.label == label && t.n.is_some() && t.last_frame < frame)
            .filter_map(|(k, t)| {
                let cost = t
                    .motion
                    .relink_cost(&d.bbox, frame, t.stationary, min_iou)?;
                Some((*k, cost))
            })
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)));
        if let Some((key, _)) = lost {
            if let Some(t) = self.tracks.get_mut(&key) {
                self.by_crate.remove(&(t.label, t.crate_id));
                t.crate_id = crate_id;
                t.relinked = t.relinked.saturating_add(1);
                self.stats.count_relinked();
            }
            self.by_crate.insert((label, crate_id), key);
            return key;
        }
        let key = self.next_key;
        self.next_key += 1;
        let p = Point::bottom_centre(&d.bbox);
        self.tracks.insert(
            key,
            Track {
                label,
                crate_id,
                n: None,
                id: None,
                hits: 0,
                first_seen: at,
                last_seen: at,
                last_frame: frame,
                bbox: d.bbox,
                score: d.score,
                best_score: f32::NEG_INFINITY,
                best_box: d.bbox,
                anchor: p,
                anchor_since: at,
                stationary: false,
                zones: vec![ZoneState::default(); self.spec.zones.len()],
                lines: vec![LineState::default(); self.spec.lines.len()],
                visited: Vec::new(),
                crossed: Vec::new(),
                votes: Votes::default(),
                max_speed: None,
                held: Vec::new(),
                relinked: 0,
                motion: Motion::new(frame, d.bbox),
            },
        );
        self.by_crate.insert((label, crate_id), key);
        key
    }

    /// Whether `bbox` can continue track `key` (always, when it was seen in
    /// the frame before).
    fn continues(&self, key: u64, bbox: &[f32; 4]) -> bool {
        self.tracks
            .get(&key)
            .is_none_or(|t| t.last_frame + 1 >= self.frame || t.motion.continues(bbox, self.frame))
    }

    /// The lost track a tentative one about to be confirmed continues
    /// (tracklet stitching), if one fits: of its label, confirmed, not seen
    /// since before the tentative track began.
    fn stitch_target(&self, key: u64) -> Option<u64> {
        let new = self.tracks.get(&key)?;
        let min_iou = self.spec.config.iou;
        self.tracks
            .iter()
            .filter(|(k, t)| {
                **k != key
                    && t.label == new.label
                    && t.n.is_some()
                    && t.last_frame < self.frame
                    && t.last_seen < new.first_seen
            })
            .filter_map(|(k, t)| Some((*k, t.motion.stitch_cost(&new.motion, min_iou)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
            .map(|(k, _)| k)
    }

    /// The tentative track `key` is the lost track `lost` come back: the
    /// lost one takes its place (its id, its zones and lines, seen now at
    /// `p`), the tentative one goes without a word, its held events with it
    /// (they were its own view of zones it may have been in all along).
    fn stitch(&mut self, key: u64, lost: u64, p: Point, at: SystemTime) {
        let Some(new) = self.tracks.remove(&key) else {
            return;
        };
        self.by_crate.remove(&(new.label, new.crate_id));
        let Some(t) = self.tracks.get_mut(&lost) else {
            return;
        };
        self.by_crate.remove(&(t.label, t.crate_id));
        self.by_crate.insert((new.label, new.crate_id), lost);
        t.crate_id = new.crate_id;
        t.hits = t.hits.saturating_add(new.hits);
        t.last_seen = new.last_seen;
        t.last_frame = new.last_frame;
        t.bbox = new.bbox;
        t.score = new.score;
        if new.best_score > t.best_score {
            t.best_score = new.best_score;
            t.best_box = new.best_box;
        }
        for (text, n, score) in &new.votes.readings {
            for _ in 0..*n {
                t.votes.add(text, score / *n as f32);
            }
        }
        t.motion.absorb(&new.motion);
        t.anchor = new.anchor;
        t.anchor_since = new.anchor_since;
        t.stationary = new.stationary;
        t.relinked = t.relinked.saturating_add(1);
        self.stats.count_relinked();
        let label = self.labels[t.label as usize].0.as_str();
        areas(&self.spec, label, t, p, at);
    }

    /// Ends what is too old and what is over `max_tracks`; drops tentative
    /// tracks that missed this frame.
    fn age(&mut self, at: SystemTime, events: &mut Vec<Event>) {
        let frame = self.frame;
        let c = &self.spec.config;
        let (max_age, parked_age) = (c.max_age, c.stationary_max_age);
        let hidden_age = c.occluded_max_age.max(max_age);
        let mut gone: Vec<(u64, Option<EndReason>)> = Vec::new();
        // This frame's boxes, that may hide a lost object (only looked at
        // when one is lost longer than max_age).
        let mut seen: Option<Vec<[f32; 4]>> = None;
        for (k, t) in &self.tracks {
            if t.last_frame == frame {
                continue;
            }
            if t.n.is_none() {
                gone.push((*k, None));
                continue;
            }
            let unseen = at.duration_since(t.last_seen).unwrap_or_default();
            let limit = if t.stationary { parked_age } else { max_age };
            if unseen <= limit {
                continue;
            }
            if unseen <= hidden_age {
                let seen = seen.get_or_insert_with(|| {
                    self.tracks
                        .values()
                        .filter(|o| o.last_frame == frame)
                        .map(|o| o.bbox)
                        .collect()
                });
                if t.motion.hidden(frame, seen) {
                    continue;
                }
            }
            gone.push((*k, Some(EndReason::Lost)));
        }
        let over = self.tracks.len().saturating_sub(gone.len());
        if over > c.max_tracks {
            let mut rest: Vec<(u64, SystemTime, u64)> = self
                .tracks
                .iter()
                .filter(|(k, _)| !gone.iter().any(|g| g.0 == **k))
                .map(|(k, t)| (*k, t.last_seen, t.last_frame))
                .collect();
            rest.sort_by(|a, b| a.1.cmp(&b.1).then(a.2.cmp(&b.2)));
            for (k, _, _) in rest.into_iter().take(over - c.max_tracks) {
                gone.push((k, Some(EndReason::Evicted)));
            }
        }
        // Ends in a stable order (oldest number first) for readable records.
        gone.sort_by_key(|(k, _)| self.tracks.get(k).and_then(|t| t.n).unwrap_or(0));
        for (k, reason) in gone {
            match reason {
                None => {
                    if let Some(t) = self.tracks.remove(&k) {
                        self.by_crate.remove(&(t.label, t.crate_id));
                    }
                }
                Some(r) => self.end(k, r, at, events),
            }
        }
    }

    fn end(&mut self, key: u64, reason: EndReason, at: SystemTime, events: &mut Vec<Event>) {
        let Some(mut t) = self.tracks.remove(&key) else {
            return;
        };
        self.by_crate.remove(&(t.label, t.crate_id));
        let Some(n) = t.n else {
            return;
        };
        let label = self.labels[t.label as usize].0.clone();
        let track = format!("{}{n}", self.prefix);
        // Leave the zones it is in, so occupancy returns to zero.
        for (zi, z) in self.spec.zones.iter().enumerate() {
            let st = &t.zones[zi];
            if st.inside() && !st.ignored {
                let dwell = st
                    .entered_at()
                    .and_then(|e| t.last_seen.duration_since(e).ok())
                    .unwrap_or(Duration::ZERO);
                let kind = EventKind::ZoneLeave {
                    zone: z.name.clone(),
                    dwell_s: dwell.as_secs_f64(),
                    speed: st.speed.estimate().map(|e| Speed::new(e.mps, z.unit)),
                };
                if !z.direction.allows(Direction::Out) {
                    self.stats.presence(&kind, &label);
                    continue;
                }
                self.stats.event(&kind, &label);
                events.push(Event {
                    kind,
                    track: track.clone(),
                    label: label.clone(),
                    bbox: t.bbox,
                    score: t.score,
                    ts: t.last_seen,
                });
            }
        }
        let vote = t.votes.winner();
        let summary = TrackSummary {
            reason,
            first_seen: t.first_seen,
            last_seen: t.last_seen,
            frames: t.hits as u64,
            best_score: t.best_score,
            best_box: t.best_box,
            zones: t
                .visited
                .iter()
                .map(|&z| self.spec.zones[z].name.clone())
                .collect(),
            lines: std::mem::take(&mut t.crossed),
            stationary: t.stationary,
            max_speed: t
                .max_speed
                .zip(self.spec.speed_unit)
                .map(|(m, u)| Speed::new(m, u).speed),
            speed_unit: self.spec.speed_unit.filter(|_| t.max_speed.is_some()),
            snapshot: None,
            text: vote.as_ref().map(|v| v.0.clone()),
            text_agreement: vote.as_ref().map(|v| v.1),
            text_reads: vote.as_ref().map(|v| v.2),
            relinked: t.relinked,
        };
        let kind = EventKind::TrackEnd(Box::new(summary));
        self.stats.event(&kind, &label);
        self.stats.track_ended(reason);
        events.push(Event {
            kind,
            track,
            label,
            bbox: t.bbox,
            score: t.score,
            // A lost track ended when it was last seen; the others now.
            ts: if reason == EndReason::Lost {
                t.last_seen
            } else {
                at
            },
        });
    }

    /// Ends every open track (the stream left, or the daemon stops):
    /// confirmed ones with `track_end` and `reason`, tentative ones silently.
    pub fn finish(&mut self, reason: EndReason, at: SystemTime) -> Vec<Event> {
        let mut keys: Vec<(u64, u64)> = self
            .tracks
            .iter()
            .map(|(k, t)| (t.n.unwrap_or(0), *k))
            .collect();
        keys.sort_unstable();
        let mut events = Vec::new();
        for (_, k) in keys {
            self.end(k, reason, at, &mut events);
        }
        self.by_crate.clear();
        events
    }
}

/// Zones and lines for a track seen at `p`.
fn areas(spec: &TrackingSpec, label: &str, t: &mut Track, p: Point, at: SystemTime) {
    let (bbox, score) = (t.bbox, t.score);
    let hold = |held: &mut Vec<Held>, kind: EventKind, ts: SystemTime, told: bool| {
        held.push(Held {
            kind,
            bbox,
            score,
            ts,
            told,
        })
    };
    for &zi in &spec.order {
        let z = &spec.zones[zi];
        if !z.counts(label) {
            continue;
        }
        let st = &mut t.zones[zi];
        let change = st.step(z, p, at);
        // Speed: ground positions while the point is in the polygon, of a
        // visit not (yet) found to be one `after` keeps out.
        if let Some(g) = &z.ground
            && st.raw()
            && !st.ignored
            && let Some(w) = g.ground(p)
        {
            st.speed.push(at, w);
        }
        let speed = || st.speed.estimate().map(|e| Speed::new(e.mps, z.unit));
        match change {
            None => {}
            Some(ZoneChange::Enter { at: when }) => {
                if !came_from(z, &t.visited) {
                    st.ignored = true;
                    st.speed.clear();
                    continue;
                }
                let kind = EventKind::ZoneEnter {
                    zone: z.name.clone(),
                    speed: speed(),
                };
                if !t.visited.contains(&zi) {
                    t.visited.push(zi);
                }
                hold(&mut t.held, kind, when, z.direction.allows(Direction::In));
            }
            Some(ZoneChange::Leave { at: when, dwell }) => {
                if std::mem::take(&mut st.ignored) {
                    st.speed.clear();
                    continue;
                }
                let kind = EventKind::ZoneLeave {
                    zone: z.name.clone(),
                    dwell_s: dwell.as_secs_f64(),
                    speed: speed(),
                };
                st.speed.clear();
                hold(&mut t.held, kind, when, z.direction.allows(Direction::Out));
            }
            Some(ZoneChange::Loiter { dwell }) => {
                if st.ignored {
                    continue;
                }
                let kind = EventKind::Loiter {
                    zone: z.name.clone(),
                    dwell_s: dwell.as_secs_f64(),
                };
                hold(&mut t.held, kind, at, true);
            }
        }
        // Settled estimates of an entered visit that counts raise
        // max_speed and may be speeding.
        if z.ground.is_some()
            && st.inside()
            && !st.ignored
            && let Some(e) = st.speed.estimate().filter(|e| e.settled())
        {
            t.max_speed = Some(t.max_speed.map_or(e.mps, |m| m.max(e.mps)));
            if let Some(limit) = z.speed_limit
                && !st.sped
                && e.mps > limit
            {
                st.sped = true;
                let kind = EventKind::Speeding {
                    zone: z.name.clone(),
                    speed: Speed::new(e.mps, z.unit),
                    speed_limit: z.unit.from_mps(limit) as f32,
                };
                hold(&mut t.held, kind, at, true);
            }
        }
    }
    if spec.lines.is_empty() {
        return;
    }
    let margin = line_margin(&bbox);
    for (li, l) in spec.lines.iter().enumerate() {
        if !l.counts(label) {
            continue;
        }
        if let Some((direction, when)) = t.lines[li].step(l, p, margin, at)
            && l.direction.allows(direction)
        {
            t.crossed.push(Crossing {
                line: l.name.clone(),
                direction,
            });
            let kind = EventKind::LineCross {
                line: l.name.clone(),
                direction,
            };
            hold(&mut t.held, kind, when, true);
        }
    }
}

/// The score from which a detection is matched in ByteTrack's first pass:
/// [`FIRST_PASS_MARGIN`] below `high_score` (which a new track needs).
pub fn first_pass_score(high_score: f32) -> f32 {
    (high_score - FIRST_PASS_MARGIN).max(0.0)
}

/// A tentative track reached `min_hits`: it gets its number and id, and its
/// `track_start` goes before the events it held.
fn confirm(t: &mut Track, numbers: &AtomicU64, stats: &TrackStats, prefix: &str) {
    let n = numbers.fetch_add(1, Ordering::Relaxed);
    t.n = Some(n);
    t.id = Some(Arc::from(format!("{prefix}{n}")));
    let kind = EventKind::TrackStart {
        first_seen: t.first_seen,
    };
    t.held.insert(
        0,
        Held {
            kind,
            bbox: t.bbox,
            score: t.score,
            ts: t.last_seen,
            told: true,
        },
    );
    stats.track_started();
}

/// Tells a confirmed track's held events.
fn flush_held(t: &mut Track, label: &str, stats: &TrackStats, events: &mut Vec<Event>) {
    let Some(id) = &t.id else {
        return;
    };
    for h in t.held.drain(..) {
        if !h.told {
            stats.presence(&h.kind, label);
            continue;
        }
        stats.event(&h.kind, label);
        events.push(Event {
            kind: h.kind,
            track: id.to_string(),
            label: label.to_string(),
            bbox: h.bbox,
            score: h.score,
            ts: h.ts,
        });
    }
}

impl Drop for StreamTracker {
    /// Keeps the gauges right when a tracker goes without `finish`.
    fn drop(&mut self) {
        for t in self.tracks.values().filter(|t| t.n.is_some()) {
            let label = &self.labels[t.label as usize].0;
            for (zi, z) in self.spec.zones.iter().enumerate() {
                if t.zones[zi].inside() && !t.zones[zi].ignored {
                    self.stats.zone_forgotten(&z.name, label);
                }
            }
            self.stats.track_forgotten();
        }
        if !self.counters.is_empty() {
            self.stats.forget_stream(&self.stream);
        }
    }
}
