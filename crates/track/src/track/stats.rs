//! Counts of one pipeline's tracking, across its streams: tracks open and
//! ended, objects in each zone now and entries so far per zone and label,
//! crossings per line, direction and label. Updated on events only (rare
//! next to frames), read by `/metrics` and `/v1/status`.
//!
//! Bounded: zones and lines come from the config, labels from the model's
//! classes (at most `MAX_LABELS` per stream).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use super::events::{Direction, EndReason, EventKind};

#[derive(Default)]
pub struct TrackStats {
    started: AtomicU64,
    relinked: AtomicU64,
    open: AtomicI64,
    counts: Mutex<Counts>,
}

#[derive(Default)]
struct Counts {
    ended: BTreeMap<EndReason, u64>,
    events: BTreeMap<&'static str, u64>,
    zones: BTreeMap<(String, String), ZoneCount>,
    lines: BTreeMap<(String, String, Direction), u64>,
    untracked: BTreeMap<&'static str, u64>,
    /// (stream, zone, label) -> the count told last (zones with `occupancy`).
    occupancy: BTreeMap<(String, String, String), u64>,
}

/// One zone and label.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ZoneCount {
    /// Objects in the zone now.
    pub inside: u64,
    /// Entries so far.
    pub entered: u64,
}

/// A copy of the counts, for the status and the metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TrackCounts {
    pub tracks_started: u64,
    /// Lost objects taken up again by their track (not announced again).
    pub tracks_relinked: u64,
    /// Confirmed tracks open now.
    pub tracks_open: u64,
    pub tracks_ended: BTreeMap<&'static str, u64>,
    pub events: BTreeMap<&'static str, u64>,
    /// zone -> label -> counts.
    pub zones: BTreeMap<String, BTreeMap<String, ZoneCount>>,
    /// line -> direction -> label -> crossings.
    pub lines: BTreeMap<String, BTreeMap<&'static str, BTreeMap<String, u64>>>,
    /// Detections left untracked, by reason.
    pub untracked: BTreeMap<&'static str, u64>,
    /// Best crops that could not be written (a full or read-only disk).
    pub snapshots_failed: u64,
    /// stream -> zone -> label -> objects in the zone now, as the last
    /// `zone_occupancy` told (zones with `occupancy`; a stream that ended
    /// is gone).
    pub occupancy: BTreeMap<String, BTreeMap<String, BTreeMap<String, u64>>>,
}

impl TrackStats {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Counts> {
        self.counts.lock()
    }

    pub fn track_started(&self) {
        self.started.fetch_add(1, Ordering::Relaxed);
        self.open.fetch_add(1, Ordering::Relaxed);
    }

    /// A lost object was re-linked to its track.
    pub fn count_relinked(&self) {
        self.relinked.fetch_add(1, Ordering::Relaxed);
    }

    pub fn track_ended(&self, reason: EndReason) {
        self.open.fetch_sub(1, Ordering::Relaxed);
        *self.lock().ended.entry(reason).or_default() += 1;
    }

    /// A tracker went away without ending its tracks (its pipeline was
    /// replaced): they are no longer open.
    pub fn track_forgotten(&self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn zone_forgotten(&self, zone: &str, label: &str) {
        let mut c = self.lock();
        if let Some(z) = c.zones.get_mut(&(zone.to_string(), label.to_string())) {
            z.inside = z.inside.saturating_sub(1);
        }
    }

    pub fn count_untracked(&self, reason: &'static str) {
        *self.lock().untracked.entry(reason).or_default() += 1;
    }

    /// An event told (zone occupancy and crossings follow from them).
    pub fn event(&self, kind: &EventKind, label: &str) {
        let mut c = self.lock();
        *c.events.entry(kind.name()).or_default() += 1;
        match kind {
            EventKind::ZoneEnter { zone, .. } => {
                let z = c
                    .zones
                    .entry((zone.clone(), label.to_string()))
                    .or_default();
                z.inside += 1;
                z.entered += 1;
            }
            EventKind::ZoneLeave { zone, .. } => {
                let z = c
                    .zones
                    .entry((zone.clone(), label.to_string()))
                    .or_default();
                z.inside = z.inside.saturating_sub(1);
            }
            EventKind::LineCross { line, direction } => {
                *c.lines
                    .entry((line.clone(), label.to_string(), *direction))
                    .or_default() += 1;
            }
            _ => {}
        }
    }

    /// An entry or leaving a zone's `direction` keeps quiet: not an
    /// event, but the object is in the zone (or no longer) all the same.
    pub fn presence(&self, kind: &EventKind, label: &str) {
        let mut c = self.lock();
        match kind {
            EventKind::ZoneEnter { zone, .. } => {
                c.zones
                    .entry((zone.clone(), label.to_string()))
                    .or_default()
                    .inside += 1;
            }
            EventKind::ZoneLeave { zone, .. } => {
                let z = c
                    .zones
                    .entry((zone.clone(), label.to_string()))
                    .or_default();
                z.inside = z.inside.saturating_sub(1);
            }
            _ => {}
        }
    }

    /// An event that is no track's, by its kind's name.
    pub fn count_event(&self, kind: &'static str) {
        *self.lock().events.entry(kind).or_default() += 1;
    }

    /// A `zone_occupancy` told: the stream's count of `label` in `zone`.
    pub fn occupancy(&self, stream: &str, zone: &str, label: &str, count: u32) {
        let mut c = self.lock();
        *c.events.entry(super::events::ZONE_OCCUPANCY).or_default() += 1;
        c.occupancy.insert(
            (stream.to_string(), zone.to_string(), label.to_string()),
            u64::from(count),
        );
    }

    /// The stream ended: its counts go.
    pub fn forget_stream(&self, stream: &str) {
        self.lock().occupancy.retain(|(s, _, _), _| s != stream);
    }

    pub fn snapshot(&self) -> TrackCounts {
        let c = self.lock();
        let mut zones: BTreeMap<String, BTreeMap<String, ZoneCount>> = BTreeMap::new();
        for ((z, l), n) in &c.zones {
            zones.entry(z.clone()).or_default().insert(l.clone(), *n);
        }
        let mut lines: BTreeMap<String, BTreeMap<&'static str, BTreeMap<String, u64>>> =
            BTreeMap::new();
        for ((line, l, d), n) in &c.lines {
            lines
                .entry(line.clone())
                .or_default()
                .entry(d.as_str())
                .or_default()
                .insert(l.clone(), *n);
        }
        let mut occupancy: BTreeMap<String, BTreeMap<String, BTreeMap<String, u64>>> =
            BTreeMap::new();
        for ((s, z, l), n) in &c.occupancy {
            occupancy
                .entry(s.clone())
                .or_default()
                .entry(z.clone())
                .or_default()
                .insert(l.clone(), *n);
        }
        TrackCounts {
            tracks_started: self.started.load(Ordering::Relaxed),
            tracks_relinked: self.relinked.load(Ordering::Relaxed),
            tracks_open: self.open.load(Ordering::Relaxed).max(0) as u64,
            tracks_ended: c.ended.iter().map(|(r, n)| (r.as_str(), *n)).collect(),
            events: c.events.clone(),
            zones,
            lines,
            untracked: c.untracked.clone(),
            snapshots_failed: 0,
            occupancy,
        }
    }
}
