//! The tracking families of `/metrics`: tracks started, re-linked, open and ended,
//! objects in each zone and entries per zone and label, crossings per line,
//! direction and label, events by kind, snapshots that could not be
//! written, and the occupancy counts of zones with `occupancy` per
//! stream. One row set per tracking pipeline.

use prometheus_client::encoding::DescriptorEncoder;

use crate::pipeline::Pipeline;
use crate::telemetry::metrics::{Labels, counter, gauge};

fn labels(p: &Pipeline, extra: &[(&'static str, &str)]) -> Labels {
    let mut l: Labels = vec![("pipeline", p.name().to_string())];
    l.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    l
}

pub fn encode(
    enc: &mut DescriptorEncoder,
    pipes: &[std::sync::Arc<Pipeline>],
) -> Result<(), std::fmt::Error> {
    let (mut started, mut open, mut ended, mut events) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut relinked = Vec::new();
    let (mut inside, mut entered, mut crossed) = (Vec::new(), Vec::new(), Vec::new());
    let mut snapshots_failed = Vec::new();
    let mut occupancy = Vec::new();
    for p in pipes {
        let Some(t) = p.tracking() else { continue };
        let c = t.counts();
        started.push((labels(p, &[]), c.tracks_started));
        relinked.push((labels(p, &[]), c.tracks_relinked));
        snapshots_failed.push((labels(p, &[]), c.snapshots_failed));
        open.push((labels(p, &[]), c.tracks_open as f64));
        for (reason, n) in &c.tracks_ended {
            ended.push((labels(p, &[("reason", reason)]), *n));
        }
        for (kind, n) in &c.events {
            events.push((labels(p, &[("event", kind)]), *n));
        }
        for (zone, by_label) in &c.zones {
            for (label, z) in by_label {
                let l = labels(p, &[("zone", zone), ("label", label)]);
                inside.push((l.clone(), z.inside as f64));
                entered.push((l, z.entered));
            }
        }
        for (stream, by_zone) in &c.occupancy {
            for (zone, by_label) in by_zone {
                for (label, n) in by_label {
                    let l = labels(p, &[("stream", stream), ("zone", zone), ("label", label)]);
                    occupancy.push((l, *n as f64));
                }
            }
        }
        for (line, by_dir) in &c.lines {
            for (dir, by_label) in by_dir {
                for (label, n) in by_label {
                    let l = labels(p, &[("line", line), ("direction", dir), ("label", label)]);
                    crossed.push((l, *n));
                }
            }
        }
    }
    if started.is_empty() {
        return Ok(());
    }
    counter(
        enc,
        "outpost_tracks_started",
        "Tracks confirmed (min_hits) and announced",
        &started,
    )?;
    counter(
        enc,
        "outpost_tracks_relinked",
        "Lost objects (hidden, missed) taken up again by their track instead of a new one",
        &relinked,
    )?;
    gauge(
        enc,
        "outpost_tracks_open",
        "Confirmed tracks open now",
        &open,
    )?;
    counter(
        enc,
        "outpost_tracks_ended",
        "Tracks ended, by reason: lost, evicted, stream_end, restart",
        &ended,
    )?;
    counter(
        enc,
        "outpost_track_events",
        "Tracking events, by kind",
        &events,
    )?;
    gauge(
        enc,
        "outpost_zone_objects",
        "Tracked objects in the zone now, by label",
        &inside,
    )?;
    counter(
        enc,
        "outpost_zone_entries",
        "Entries into the zone, by label",
        &entered,
    )?;
    gauge(
        enc,
        "outpost_zone_occupancy",
        "Objects in the zone now per stream and label, as the last zone_occupancy told (zones with occupancy)",
        &occupancy,
    )?;
    counter(
        enc,
        "outpost_line_crossings",
        "Line crossings, by direction and label",
        &crossed,
    )?;
    counter(
        enc,
        "outpost_track_snapshots_failed",
        "Best crops of tracks that could not be written (a full or read-only disk)",
        &snapshots_failed,
    )
}
