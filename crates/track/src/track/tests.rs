//! The tracker frame by frame: ids, min_hits, max_age, stationary objects,
//! zones and lines through whole tracks, bounded state, the text vote.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::*;

const FPS: u64 = 10;

fn t(frame: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000) + Duration::from_millis(frame * 1000 / FPS)
}

fn det(x: f32, y: f32, w: f32, h: f32, score: f32, label: &str) -> Detection {
    Detection {
        bbox: [x, y, x + w, y + h],
        score,
        label: label.into(),
        text: None,
    }
}

fn tracker(cfg: TrackConfig, zones: &[ZoneConfig], lines: &[LineConfig]) -> StreamTracker {
    let spec = Arc::new(TrackingSpec::new(cfg, zones, lines));
    StreamTracker::new(
        spec,
        Arc::new(TrackStats::default()),
        "gw/gate/cam/".into(),
        Arc::new(1.into()),
    )
}

fn tracker_stats(
    cfg: TrackConfig,
    zones: &[ZoneConfig],
    lines: &[LineConfig],
) -> (StreamTracker, Arc<TrackStats>) {
    let spec = Arc::new(TrackingSpec::new(cfg, zones, lines));
    let stats = Arc::new(TrackStats::default());
    (
        StreamTracker::new(
            spec,
            Arc::clone(&stats),
            "gw/gate/cam/".into(),
            Arc::new(1.into()),
        ),
        stats,
    )
}

fn names(ev: &[Event]) -> Vec<&'static str> {
    ev.iter().map(|e| e.kind.name()).collect()
}

#[test]
fn a_track_is_announced_after_min_hits_and_a_flicker_never() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    // A one-frame false detection far away at frame 1 only.
    let out = tr.update(
        t(1),
        &[
            det(10.0, 10.0, 40.0, 40.0, 0.9, "face"),
            det(400.0, 300.0, 30.0, 30.0, 0.9, "face"),
        ],
    );
    assert!(out.events.is_empty());
    assert!(out.objects.iter().all(|o| o.track.is_none()));
    let out = tr.update(t(2), &[det(12.0, 10.0, 40.0, 40.0, 0.9, "face")]);
    assert!(out.events.is_empty(), "{:?}", out.events);
    let out = tr.update(t(3), &[det(14.0, 10.0, 40.0, 40.0, 0.9, "face")]);
    assert_eq!(names(&out.events), vec!["track_start"]);
    let e = &out.events[0];
    assert_eq!(e.track, "gw/gate/cam/1");
    assert_eq!(e.label, "face");
    assert_eq!(e.kind, EventKind::TrackStart { first_seen: t(1) });
    assert_eq!(out.objects[0].track.as_deref(), Some("gw/gate/cam/1"));
    // Later frames carry the id, and no second start.
    for f in 4..20 {
        let out = tr.update(
            t(f),
            &[det(10.0 + 2.0 * f as f32, 10.0, 40.0, 40.0, 0.9, "face")],
        );
        assert!(out.events.is_empty());
        assert_eq!(out.objects[0].track.as_deref(), Some("gw/gate/cam/1"));
    }
    // The flicker never got a number: the next track is 2.
    assert_eq!(tr.next_n(), 2);
}

#[test]
fn lost_for_less_than_max_age_keeps_its_id_longer_ends_it() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    let at = |f: u64| det(100.0 + 3.0 * f as f32, 100.0, 50.0, 50.0, 0.9, "car");
    for f in 1..=10 {
        tr.update(t(f), &[at(f)]);
    }
    // Missed for 8 frames (0.8 s < max_age 1 s), seen again where it went.
    for f in 11..19 {
        assert!(tr.update(t(f), &[]).events.is_empty());
    }
    let out = tr.update(t(19), &[at(19)]);
    assert!(out.events.is_empty(), "{:?}", out.events);
    assert_eq!(out.objects[0].track.as_deref(), Some("gw/gate/cam/1"));
    // Then gone for good: track_end after max_age, dated when last seen.
    let mut ends = Vec::new();
    for f in 20..40 {
        ends.extend(tr.update(t(f), &[]).events);
    }
    assert_eq!(names(&ends), vec!["track_end"]);
    let EventKind::TrackEnd(s) = &ends[0].kind else {
        unreachable!()
    };
    assert_eq!(s.reason, EndReason::Lost);
    assert_eq!(s.frames, 11);
    assert_eq!((s.first_seen, s.last_seen), (t(1), t(19)));
    assert_eq!(ends[0].ts, t(19));
    assert_eq!(tr.open_tracks(), 0);
    // Back after that: a new track.
    let mut ev = Vec::new();
    for f in 40..44 {
        ev.extend(tr.update(t(f), &[at(19)]).events);
    }
    assert_eq!(ev[0].track, "gw/gate/cam/2");
}

#[test]
fn two_objects_passing_each_other_keep_their_ids() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    let mut ids_a = std::collections::BTreeSet::new();
    let mut ids_b = std::collections::BTreeSet::new();
    for f in 1..=60u64 {
        // A goes right, B goes left, B a little lower; they overlap mid-way.
        let xa = 20.0 + 8.0 * f as f32;
        let xb = 500.0 - 8.0 * f as f32;
        let out = tr.update(
            t(f),
            &[
                det(xa, 100.0, 60.0, 60.0, 0.9, "face"),
                det(xb, 115.0, 60.0, 60.0, 0.85, "face"),
            ],
        );
        if let Some(a) = &out.objects[0].track {
            ids_a.insert(a.clone());
        }
        if let Some(b) = &out.objects[1].track {
            ids_b.insert(b.clone());
        }
    }
    assert_eq!(ids_a.len(), 1, "{ids_a:?}");
    assert_eq!(ids_b.len(), 1, "{ids_b:?}");
    assert_ne!(ids_a, ids_b);
}

#[test]
fn low_scores_continue_a_track_but_do_not_start_one() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    for f in 1..=5 {
        tr.update(
            t(f),
            &[det(100.0 + f as f32, 100.0, 50.0, 50.0, 0.9, "car")],
        );
    }
    // Scores below high_score (0.5): the second pass keeps the track.
    for f in 6..=30 {
        let out = tr.update(
            t(f),
            &[det(100.0 + f as f32, 100.0, 50.0, 50.0, 0.3, "car")],
        );
        assert_eq!(
            out.objects[0].track.as_deref(),
            Some("gw/gate/cam/1"),
            "frame {f}"
        );
        assert!(out.events.is_empty());
    }
    // A weak detection alone never starts a track.
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    for f in 1..=10 {
        let out = tr.update(t(f), &[det(100.0, 100.0, 50.0, 50.0, 0.3, "car")]);
        assert!(out.events.is_empty() && out.objects[0].track.is_none());
    }
}

#[test]
fn labels_are_tracked_apart() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    let mut ev = Vec::new();
    for f in 1..=5 {
        ev.extend(
            tr.update(
                t(f),
                &[
                    det(100.0, 100.0, 50.0, 50.0, 0.9, "car"),
                    det(100.0, 100.0, 50.0, 50.0, 0.8, "person"),
                ],
            )
            .events,
        );
    }
    assert_eq!(names(&ev), vec!["track_start", "track_start"]);
    let labels: Vec<_> = ev.iter().map(|e| e.label.as_str()).collect();
    assert!(labels.contains(&"car") && labels.contains(&"person"));
}

#[test]
fn a_parked_truck_is_announced_once() {
    let cfg = TrackConfig {
        stationary_after: Duration::from_secs(2),
        ..TrackConfig::default()
    };
    let mut tr = tracker(cfg, &[], &[]);
    let truck = |jitter: f32| det(200.0 + jitter, 150.0, 120.0, 80.0, 0.9, "truck");
    let mut ev = Vec::new();
    let mut f = 1;
    // Drives in.
    for k in 0..10 {
        ev.extend(
            tr.update(
                t(f),
                &[det(
                    60.0 + 14.0 * k as f32,
                    150.0,
                    120.0,
                    80.0,
                    0.9,
                    "truck",
                )],
            )
            .events,
        );
        f += 1;
    }
    // Parks for 5 s (small box jitter).
    for k in 0..50 {
        let out = tr.update(t(f), &[truck((k % 3) as f32)]);
        ev.extend(out.events);
        if k > 25 {
            assert!(out.objects[0].stationary, "frame {f}");
        }
        f += 1;
    }
    // Occluded for 30 s: far beyond max_age (1 s), within stationary_max_age.
    for _ in 0..300 {
        ev.extend(tr.update(t(f), &[]).events);
        f += 1;
    }
    // Seen again where it stood: same id, no new start.
    for _ in 0..10 {
        let out = tr.update(t(f), &[truck(1.0)]);
        assert_eq!(
            out.objects[0].track.as_deref(),
            Some("gw/gate/cam/1"),
            "frame {f}"
        );
        ev.extend(out.events);
        f += 1;
    }
    assert_eq!(names(&ev), vec!["track_start"]);
    // A moving car missed for as long is ended.
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    let mut ev = Vec::new();
    for k in 0..10u64 {
        ev.extend(
            tr.update(
                t(k),
                &[det(60.0 + 14.0 * k as f32, 150.0, 120.0, 80.0, 0.9, "car")],
            )
            .events,
        );
    }
    for k in 10..30 {
        ev.extend(tr.update(t(k), &[]).events);
    }
    assert_eq!(names(&ev), vec!["track_start", "track_end"]);
}

#[test]
fn ten_thousand_tracks_over_time_stay_bounded() {
    let (mut tr, stats) = tracker_stats(TrackConfig::default(), &[], &[]);
    let mut starts = 0;
    let mut ends = 0;
    let mut most_open = 0;
    // Each object lives 4 frames at its own place, a new one every 2
    // frames, over a 20x20 grid of places.
    let mut f = 0u64;
    for obj in 0..10_000u64 {
        let (gx, gy) = ((obj % 20) as f32, ((obj / 20) % 20) as f32);
        for _ in 0..2 {
            f += 1;
            let mut dets = vec![det(gx * 60.0, gy * 60.0, 30.0, 30.0, 0.9, "face")];
            if obj > 0 {
                let p = obj - 1;
                let (px, py) = ((p % 20) as f32, ((p / 20) % 20) as f32);
                dets.push(det(px * 60.0, py * 60.0, 30.0, 30.0, 0.9, "face"));
            }
            for e in tr.update(t(f), &dets).events {
                match e.kind.name() {
                    "track_start" => starts += 1,
                    "track_end" => ends += 1,
                    _ => {}
                }
            }
            most_open = most_open.max(tr.open_tracks());
        }
    }
    assert!(starts >= 9_990, "{starts}");
    // Everything but the last few ended; state never grew.
    assert!(ends >= starts - 30, "{starts} {ends}");
    assert!(most_open <= 40, "{most_open} open tracks");
    let s = stats.snapshot();
    assert_eq!(s.tracks_started, starts);
    assert_eq!(s.tracks_open, starts - ends);
}

#[test]
fn max_tracks_evicts_the_longest_unseen() {
    let cfg = TrackConfig {
        max_tracks: 3,
        min_hits: 1,
        ..TrackConfig::default()
    };
    let mut tr = tracker(cfg, &[], &[]);
    let mut ev = Vec::new();
    for i in 0..5u64 {
        ev.extend(
            tr.update(
                t(i + 1),
                &[det(i as f32 * 100.0, 0.0, 50.0, 50.0, 0.9, "x")],
            )
            .events,
        );
    }
    let evicted: Vec<_> = ev
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::TrackEnd(s) => Some((e.track.as_str(), s.reason)),
            _ => None,
        })
        .collect();
    assert_eq!(
        evicted,
        vec![
            ("gw/gate/cam/1", EndReason::Evicted),
            ("gw/gate/cam/2", EndReason::Evicted)
        ]
    );
    assert_eq!(tr.open_tracks(), 3);
}

fn yard() -> ZoneConfig {
    ZoneConfig {
        name: "yard".into(),
        polygon: vec![[0.0, 240.0], [640.0, 240.0], [640.0, 480.0], [0.0, 480.0]],
        inertia: 3,
        loiter: Some(Duration::from_secs(2)),
        classes: vec![],
        ..ZoneConfig::default()
    }
}

fn gate() -> LineConfig {
    LineConfig {
        name: "gate".into(),
        points: [[320.0, 0.0], [320.0, 480.0]],
        inertia: 2,
        classes: vec![],
        ..LineConfig::default()
    }
}

#[test]
fn a_walk_through_zone_and_line_gives_the_events_in_order() {
    let (mut tr, stats) = tracker_stats(TrackConfig::default(), &[yard()], &[gate()]);
    let mut ev = Vec::new();
    // Walks right along y (bottom) = 200 then down into the yard, stays 3 s,
    // leaves the picture.
    let mut f = 0;
    let mut step = |tr: &mut StreamTracker, x: f32, bottom: f32, ev: &mut Vec<Event>| {
        f += 1;
        ev.extend(
            tr.update(
                t(f),
                &[det(x - 20.0, bottom - 60.0, 40.0, 60.0, 0.9, "person")],
            )
            .events,
        );
        f
    };
    for k in 0..30 {
        step(&mut tr, 200.0 + 8.0 * k as f32, 200.0, &mut ev); // x 200..432, crosses 320 at k = 15
    }
    for k in 0..10 {
        step(&mut tr, 432.0, 210.0 + 8.0 * k as f32, &mut ev); // bottom 210..282: in at 242
    }
    for _ in 0..30 {
        step(&mut tr, 432.0, 290.0, &mut ev);
    }
    let s = stats.snapshot();
    assert_eq!(s.zones["yard"]["person"].inside, 1);
    for _ in 0..20 {
        f += 1;
        ev.extend(tr.update(t(f), &[]).events);
    }
    assert_eq!(
        names(&ev),
        vec![
            "track_start",
            "line_cross",
            "zone_enter",
            "loiter",
            "zone_leave",
            "track_end"
        ]
    );
    let cross = &ev[1];
    assert_eq!(
        cross.kind,
        EventKind::LineCross {
            line: "gate".into(),
            direction: Direction::In
        }
    );
    // x = 200 + 8k first past 320 + margin 6 at k = 16 (x = 328): frame 17.
    assert_eq!(cross.ts, t(17));
    // The bottom first in the yard (> 240): 242 at frame 30 + 5 = 35.
    assert_eq!(ev[2].ts, t(35));
    let EventKind::TrackEnd(sum) = &ev[5].kind else {
        unreachable!()
    };
    assert_eq!(sum.zones, vec!["yard".to_string()]);
    assert_eq!(sum.lines.len(), 1);
    assert!(
        ev.iter()
            .all(|e| e.track == "gw/gate/cam/1" && e.label == "person")
    );
    let s = stats.snapshot();
    assert_eq!(
        s.zones["yard"]["person"],
        ZoneCount {
            inside: 0,
            entered: 1
        }
    );
    assert_eq!(s.lines["gate"]["in"]["person"], 1);
    assert_eq!(s.tracks_open, 0);
}

#[test]
fn zone_classes_filter_labels() {
    let zone = ZoneConfig {
        classes: vec!["car".into()],
        ..yard()
    };
    let mut tr = tracker(TrackConfig::default(), &[zone], &[]);
    let mut ev = Vec::new();
    for f in 1..20 {
        ev.extend(
            tr.update(t(f), &[det(100.0, 300.0, 50.0, 50.0, 0.9, "person")])
                .events,
        );
    }
    assert_eq!(names(&ev), vec!["track_start"]);
}

#[test]
fn events_of_the_first_frames_wait_for_confirmation() {
    // Starts inside the zone with inertia 1 and min_hits 3: the entry is
    // told after track_start, dated at the first frame.
    let zone = ZoneConfig {
        inertia: 1,
        loiter: None,
        ..yard()
    };
    let mut tr = tracker(TrackConfig::default(), &[zone], &[]);
    let mut ev = Vec::new();
    for f in 1..=3 {
        ev.extend(
            tr.update(t(f), &[det(100.0, 300.0, 50.0, 50.0, 0.9, "car")])
                .events,
        );
    }
    assert_eq!(names(&ev), vec!["track_start", "zone_enter"]);
    assert_eq!(ev[1].ts, t(1));
}

#[test]
fn finish_ends_open_tracks_with_the_reason_and_leaves_zones() {
    let (mut tr, stats) = tracker_stats(TrackConfig::default(), &[yard()], &[]);
    for f in 1..=10 {
        tr.update(
            t(f),
            &[
                det(100.0, 300.0, 50.0, 50.0, 0.9, "car"),
                det(400.0, 50.0, 50.0, 50.0, 0.9, "car"),
            ],
        );
    }
    assert_eq!(stats.snapshot().zones["yard"]["car"].inside, 1);
    let ev = tr.finish(EndReason::Restart, t(11));
    assert_eq!(names(&ev), vec!["zone_leave", "track_end", "track_end"]);
    for e in &ev[1..] {
        let EventKind::TrackEnd(s) = &e.kind else {
            unreachable!()
        };
        assert_eq!(s.reason, EndReason::Restart);
        assert_eq!(e.ts, t(11));
    }
    assert_eq!(tr.open_tracks(), 0);
    assert!(
        tr.finish(EndReason::Restart, t(12)).is_empty(),
        "nothing twice"
    );
    let s = stats.snapshot();
    assert_eq!(s.zones["yard"]["car"].inside, 0);
    assert_eq!(s.tracks_ended["restart"], 2);
}

#[test]
fn a_dropped_tracker_leaves_no_open_counts() {
    let (mut tr, stats) = tracker_stats(TrackConfig::default(), &[yard()], &[]);
    for f in 1..=10 {
        tr.update(t(f), &[det(100.0, 300.0, 50.0, 50.0, 0.9, "car")]);
    }
    assert_eq!(stats.snapshot().tracks_open, 1);
    drop(tr);
    let s = stats.snapshot();
    assert_eq!(s.tracks_open, 0);
    assert_eq!(s.zones["yard"]["car"].inside, 0);
}

#[test]
fn the_text_of_a_track_is_voted() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    for f in 1..=12u64 {
        let mut d = det(
            100.0 + f as f32,
            100.0,
            80.0,
            20.0,
            0.6 + f as f32 * 0.01,
            "plate",
        );
        let text = if f % 4 == 0 { "A8123" } else { "AB123" };
        d.text = Some((text.into(), 0.9));
        tr.update(t(f), &[d]);
    }
    let ev = tr.finish(EndReason::StreamEnd, t(13));
    let EventKind::TrackEnd(s) = &ev[0].kind else {
        unreachable!()
    };
    assert_eq!(s.text.as_deref(), Some("AB123"));
    assert_eq!(s.text_agreement, Some(0.75));
    assert_eq!(s.text_reads, Some(12));
    assert_eq!(s.frames, 12);
    assert!((s.best_score - 0.72).abs() < 1e-6);
    assert_eq!(s.best_box, [112.0, 100.0, 192.0, 120.0]);
}

#[test]
fn the_best_frame_is_flagged_for_the_snapshot() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    let scores = [0.6, 0.7, 0.8, 0.75, 0.9, 0.85];
    let mut best = Vec::new();
    for (f, s) in scores.iter().enumerate() {
        let out = tr.update(t(f as u64 + 1), &[det(100.0, 100.0, 50.0, 50.0, *s, "x")]);
        best.push(out.objects[0].best);
    }
    // Confirmed at the third frame; from then on only new bests.
    assert_eq!(best, vec![false, false, true, false, true, false]);
}

fn occupancy_events(out: &FrameOutput) -> Vec<(String, u32)> {
    out.occupancy
        .iter()
        .map(|o| (o.label.clone(), o.count))
        .collect()
}

#[test]
fn occupancy_counts_per_label_after_inertia_and_empties_at_the_end() {
    let zone = ZoneConfig {
        occupancy: true,
        loiter: None,
        ..yard()
    };
    let spec = Arc::new(TrackingSpec::new(TrackConfig::default(), &[zone], &[]));
    let stats = Arc::new(TrackStats::default());
    let mut tr = StreamTracker::new(
        spec,
        Arc::clone(&stats),
        "gw/gate/cam/".into(),
        Arc::new(1.into()),
    )
    .with_stream("cam");
    // Two cars and a person come down into the yard (bottom 240) one
    // after the other and stop at 350; the counts follow each entry
    // `inertia` (3) frames after its first frame inside.
    let bottom = |f: u64, start: u64| (155.0 + 10.0 * f.saturating_sub(start) as f32).min(350.0);
    let mut told = Vec::new();
    for f in 1..=40u64 {
        let dets = [
            det(50.0, bottom(f, 0) - 50.0, 50.0, 50.0, 0.9, "car"),
            det(250.0, bottom(f, 10) - 50.0, 50.0, 50.0, 0.9, "car"),
            det(450.0, bottom(f, 5) - 50.0, 50.0, 50.0, 0.9, "person"),
        ];
        let out = tr.update(t(f), &dets);
        for o in &out.occupancy {
            told.push((f, o.label.clone(), o.count, o.previous, o.ts));
        }
    }
    // First frame inside (bottom 245): car 1 at f = 9, the person at
    // 14, car 2 at 19; told at the third frame inside, dated at the first.
    assert_eq!(
        told,
        vec![
            (11, "car".into(), 1, 0, t(9)),
            (16, "person".into(), 1, 0, t(14)),
            (21, "car".into(), 2, 1, t(19)),
        ]
    );
    let s = stats.snapshot();
    assert_eq!(s.occupancy["cam"]["yard"]["car"], 2);
    assert_eq!(s.occupancy["cam"]["yard"]["person"], 1);
    assert_eq!(s.events["zone_occupancy"], 3);
    // One car leaves the picture: lost after max_age (1 s), then counted out.
    let mut later = Vec::new();
    for f in 41..=60u64 {
        let out = tr.update(
            t(f),
            &[
                det(50.0, 300.0, 50.0, 50.0, 0.9, "car"),
                det(450.0, 300.0, 50.0, 50.0, 0.9, "person"),
            ],
        );
        later.extend(occupancy_events(&out));
    }
    assert_eq!(later, vec![("car".to_string(), 1)]);
    tr.finish(EndReason::StreamEnd, t(61));
    let end = tr.empty_zones(t(61));
    let mut end: Vec<(String, u32, u32)> = end
        .iter()
        .map(|o| (o.label.clone(), o.count, o.previous))
        .collect();
    end.sort();
    assert_eq!(end, vec![("car".into(), 0, 1), ("person".into(), 0, 1)]);
    assert!(stats.snapshot().occupancy.is_empty(), "the stream is gone");
}

#[test]
fn zones_without_occupancy_count_nothing() {
    let mut tr = tracker(TrackConfig::default(), &[yard()], &[]);
    for f in 1..=10 {
        let out = tr.update(t(f), &[det(100.0, 300.0, 50.0, 50.0, 0.9, "car")]);
        assert!(out.occupancy.is_empty());
    }
}

/// A street (left) and a driveway (right), both along the bottom half.
fn street_and_drive(after: Option<&str>) -> Vec<ZoneConfig> {
    vec![
        ZoneConfig {
            name: "drive".into(),
            polygon: vec![
                [320.0, 240.0],
                [640.0, 240.0],
                [640.0, 480.0],
                [320.0, 480.0],
            ],
            after: after.map(String::from),
            ..ZoneConfig::default()
        },
        ZoneConfig {
            name: "street".into(),
            polygon: vec![[0.0, 240.0], [320.0, 240.0], [320.0, 480.0], [0.0, 480.0]],
            ..ZoneConfig::default()
        },
    ]
}

/// The zone events of a car at bottom `y`, from x = `x0` by `dx` a frame.
fn zone_events(zones: &[ZoneConfig], x0: f32, dx: f32, y: f32) -> Vec<(String, String)> {
    let mut tr = tracker(TrackConfig::default(), zones, &[]);
    let mut ev = Vec::new();
    for f in 0..60u64 {
        let x = x0 + dx * f as f32;
        ev.extend(
            tr.update(t(f + 1), &[det(x, y - 40.0, 60.0, 40.0, 0.9, "car")])
                .events,
        );
    }
    ev.extend(tr.finish(EndReason::Lost, t(61)));
    ev.iter()
        .filter_map(|e| match &e.kind {
            EventKind::ZoneEnter { zone, .. } => Some(("enter".into(), zone.clone())),
            EventKind::ZoneLeave { zone, .. } => Some(("leave".into(), zone.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn after_counts_only_tracks_that_came_from_the_other_zone() {
    let zones = street_and_drive(Some("street"));
    // From the street into the drive (the drive comes first in the config:
    // the order of steps follows `after`, not the list).
    let from_street = zone_events(&zones, 100.0, 8.0, 400.0);
    assert_eq!(
        from_street,
        vec![
            ("enter".into(), "street".into()),
            ("leave".into(), "street".into()),
            ("enter".into(), "drive".into()),
            ("leave".into(), "drive".into()),
        ]
    );
    // Down into the drive from above (never in the street): nothing.
    let mut tr = tracker(TrackConfig::default(), &zones, &[]);
    let mut ev = Vec::new();
    for f in 0..40u64 {
        let y = 150.0 + 8.0 * f as f32;
        ev.extend(
            tr.update(t(f + 1), &[det(450.0, y - 40.0, 60.0, 40.0, 0.9, "car")])
                .events,
        );
    }
    ev.extend(tr.finish(EndReason::Lost, t(41)));
    assert_eq!(names(&ev), vec!["track_start", "track_end"]);
    let EventKind::TrackEnd(s) = &ev[1].kind else {
        unreachable!()
    };
    assert!(s.zones.is_empty(), "{:?}", s.zones);
    // Without `after` the same path enters the drive.
    let plain = street_and_drive(None);
    let mut tr = tracker(TrackConfig::default(), &plain, &[]);
    let mut ev = Vec::new();
    for f in 0..40u64 {
        let y = 150.0 + 8.0 * f as f32;
        ev.extend(
            tr.update(t(f + 1), &[det(450.0, y - 40.0, 60.0, 40.0, 0.9, "car")])
                .events,
        );
    }
    assert_eq!(names(&ev), vec!["track_start", "zone_enter"]);
}

#[test]
fn a_zone_direction_tells_only_entries_or_only_leavings() {
    let mut zones = street_and_drive(None);
    zones[1].direction = Directions::Out;
    zones[0].direction = Directions::In;
    let (mut tr, stats) = tracker_stats(TrackConfig::default(), &zones, &[]);
    let mut ev = Vec::new();
    for f in 0..30u64 {
        let x = 100.0 + 12.0 * f as f32;
        ev.extend(
            tr.update(t(f + 1), &[det(x, 360.0, 60.0, 40.0, 0.9, "car")])
                .events,
        );
        if f == 5 {
            // In the street, unannounced, but counted inside.
            assert_eq!(stats.snapshot().zones["street"]["car"].inside, 1);
        }
    }
    ev.extend(tr.finish(EndReason::Lost, t(31)));
    let mut got: Vec<(&str, String)> = ev
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ZoneEnter { zone, .. } => Some(("enter", zone.clone())),
            EventKind::ZoneLeave { zone, .. } => Some(("leave", zone.clone())),
            _ => None,
        })
        .collect();
    // Out of the street and into the drive on the same frame.
    got.sort();
    assert_eq!(
        got,
        vec![
            ("enter", "drive".to_string()),
            ("leave", "street".to_string())
        ]
    );
    let s = stats.snapshot();
    assert_eq!(s.zones["street"]["car"].inside, 0);
    assert_eq!(
        s.zones["street"]["car"].entered, 0,
        "entries are not counted"
    );
    assert_eq!(
        s.zones["drive"]["car"].inside, 0,
        "left at the end, quietly"
    );
    assert_eq!(s.zones["drive"]["car"].entered, 1);
}

#[test]
fn a_line_direction_counts_one_way_only() {
    let only_in = LineConfig {
        direction: Directions::In,
        ..gate()
    };
    let only_out = LineConfig {
        name: "exit".into(),
        direction: Directions::Out,
        ..gate()
    };
    let (mut tr, stats) = tracker_stats(TrackConfig::default(), &[], &[only_in, only_out]);
    let mut ev = Vec::new();
    // Right across the gate (in), then back left (out).
    for f in 0..60u64 {
        let x = if f < 30 {
            200.0 + 8.0 * f as f32
        } else {
            432.0 - 8.0 * (f - 30) as f32
        };
        ev.extend(
            tr.update(t(f + 1), &[det(x - 20.0, 140.0, 40.0, 60.0, 0.9, "person")])
                .events,
        );
    }
    let crossings: Vec<(String, Direction)> = ev
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::LineCross { line, direction } => Some((line.clone(), *direction)),
            _ => None,
        })
        .collect();
    assert_eq!(
        crossings,
        vec![
            ("gate".into(), Direction::In),
            ("exit".into(), Direction::Out)
        ]
    );
    let s = stats.snapshot();
    assert_eq!(s.lines["gate"].keys().collect::<Vec<_>>(), vec![&"in"]);
    assert_eq!(s.lines["exit"].keys().collect::<Vec<_>>(), vec![&"out"]);
}

/// A road 10 m x 40 m: 400 px across (0.025 m/px), 200 px down (0.2 m/px).
fn road(limit: Option<f32>) -> ZoneConfig {
    ZoneConfig {
        name: "road".into(),
        polygon: vec![
            [100.0, 200.0],
            [500.0, 200.0],
            [500.0, 400.0],
            [100.0, 400.0],
        ],
        distances: Some([10.0, 40.0, 10.0, 40.0]),
        speed_limit: limit,
        ..ZoneConfig::default()
    }
}

#[test]
fn speed_in_a_calibrated_zone_reaches_the_events_and_track_end() {
    // Down the road at 5 px a frame, 10 fps: 50 px/s x 0.2 m/px = 10 m/s
    // = 36 km/h; then across at 20 px a frame: 200 px/s x 0.025 = 5 m/s.
    let mut tr = tracker(TrackConfig::default(), &[road(Some(30.0))], &[]);
    let mut ev = Vec::new();
    let mut f = 0u64;
    for k in 0..40 {
        f += 1;
        let bottom = 180.0 + 5.0 * k as f32;
        ev.extend(
            tr.update(t(f), &[det(280.0, bottom - 40.0, 40.0, 40.0, 0.9, "car")])
                .events,
        );
    }
    ev.extend(tr.finish(EndReason::Lost, t(f + 1)));
    let kinds = names(&ev);
    assert_eq!(
        kinds,
        vec![
            "track_start",
            "zone_enter",
            "speeding",
            "zone_leave",
            "track_end"
        ]
    );
    let speed_of = |e: &Event| match &e.kind {
        EventKind::ZoneEnter { speed, .. } | EventKind::ZoneLeave { speed, .. } => {
            speed.map(|s| s.speed)
        }
        EventKind::Speeding { speed, .. } => Some(speed.speed),
        EventKind::TrackEnd(s) => s.max_speed,
        _ => None,
    };
    for e in &ev[1..] {
        let v = speed_of(e).unwrap_or_else(|| panic!("no speed: {e:?}"));
        assert!((v - 36.0).abs() < 0.5, "{}: {v}", e.kind.name());
    }
    let EventKind::TrackEnd(s) = &ev[4].kind else {
        unreachable!()
    };
    assert_eq!(s.speed_unit, Some(crate::track::SpeedUnit::KmH));
    let EventKind::Speeding { speed_limit, .. } = &ev[2].kind else {
        unreachable!()
    };
    assert!((speed_limit - 30.0).abs() < 1e-3);

    // Slower than the limit: no speeding; across the road, 5 m/s = 18 km/h.
    let mut tr = tracker(TrackConfig::default(), &[road(Some(30.0))], &[]);
    let mut ev = Vec::new();
    for k in 0..30u64 {
        let x = 60.0 + 20.0 * k as f32;
        ev.extend(
            tr.update(t(k + 1), &[det(x - 20.0, 260.0, 40.0, 40.0, 0.9, "car")])
                .events,
        );
    }
    assert!(!names(&ev).contains(&"speeding"), "{:?}", names(&ev));
    let leave = ev
        .iter()
        .find(|e| e.kind.name() == "zone_leave")
        .expect("left the road");
    let v = speed_of(leave).unwrap();
    assert!((v - 18.0).abs() < 0.5, "{v}");
    // A zone without distances gives no speed.
    let mut tr = tracker(TrackConfig::default(), &[yard()], &[]);
    let mut ev = Vec::new();
    for k in 0..20u64 {
        ev.extend(
            tr.update(
                t(k + 1),
                &[det(100.0, 300.0 + k as f32, 40.0, 40.0, 0.9, "car")],
            )
            .events,
        );
    }
    ev.extend(tr.finish(EndReason::Lost, t(21)));
    assert!(ev.iter().all(|e| speed_of(e).is_none()), "{ev:?}");
}

#[test]
fn a_moving_track_is_moving_until_a_second_after_it_stopped() {
    let mut tr = tracker(TrackConfig::default(), &[], &[]);
    // A car drives along (10 px a frame, a box 40 high: more than a tenth).
    for f in 1..=10 {
        tr.update(t(f), &[det(10.0 * f as f32, 50.0, 60.0, 40.0, 0.9, "car")]);
        assert_eq!(tr.moving_boxes().len(), 1, "frame {f}");
    }
    // It parks: moving for the next second still, then not.
    for f in 11..=30 {
        tr.update(t(f), &[det(100.0, 50.0, 60.0, 40.0, 0.9, "car")]);
        let moving = !tr.moving_boxes().is_empty();
        assert_eq!(moving, f < 20, "frame {f}");
    }
    // A frame without it: a track not matched now is not moving.
    tr.update(t(31), &[det(100.0, 50.0, 60.0, 40.0, 0.9, "car")]);
    tr.update(t(32), &[]);
    assert!(tr.moving_boxes().is_empty());
}

/// A person (40x100) walking right at `speed` px a frame from x = 180,
/// hidden in frames `hidden`, and a van parked at x 300..420 in front of
/// its path, every frame at `fps`; a zone over the right side of the
/// picture and a line at x = 360 the person crosses while hidden. Returns
/// the events and, per frame the person was seen, its id.
fn behind_the_van(
    fps: u64,
    speed: f32,
    hidden: std::ops::Range<u64>,
    frames: u64,
) -> (Vec<Event>, Vec<Option<Arc<str>>>) {
    let lot = ZoneConfig {
        name: "lot".into(),
        polygon: vec![[250.0, 0.0], [640.0, 0.0], [640.0, 480.0], [250.0, 480.0]],
        inertia: 3,
        classes: vec!["person".into()],
        ..ZoneConfig::default()
    };
    let line = LineConfig {
        name: "door".into(),
        points: [[360.0, 0.0], [360.0, 480.0]],
        inertia: 2,
        classes: vec!["person".into()],
        ..LineConfig::default()
    };
    let mut tr = tracker(TrackConfig::default(), &[lot], &[line]);
    let at = |f: u64| {
        UNIX_EPOCH + Duration::from_secs(1_800_000_000) + Duration::from_millis(f * 1000 / fps)
    };
    let van = det(300.0, 80.0, 120.0, 140.0, 0.9, "car");
    let (mut ev, mut ids) = (Vec::new(), Vec::new());
    for f in 1..=frames {
        let x = 180.0 + speed * f as f32;
        let mut d = vec![van.clone()];
        if !hidden.contains(&f) {
            d.push(det(x, 100.0, 40.0, 100.0, 0.9, "person"));
        }
        let out = tr.update(at(f), &d);
        if d.len() == 2 {
            ids.push(out.objects[1].track.clone());
        }
        ev.extend(out.events);
    }
    ev.extend(tr.finish(EndReason::Restart, at(frames + 1)));
    (ev, ids)
}

fn person(ev: &[Event], name: &str) -> usize {
    ev.iter()
        .filter(|e| e.label == "person" && e.kind.name() == name)
        .count()
}

#[test]
fn a_person_hidden_behind_a_parked_van_longer_than_max_age_is_counted_once() {
    // 10 fps, 3 px a frame; hidden frames 40..56 (1.6 s > max_age 1 s):
    // the van's box covers where the person went, so its track coasts.
    let (ev, ids) = behind_the_van(10, 3.0, 40..56, 90);
    assert_eq!(person(&ev, "track_start"), 1, "{:?}", names(&ev));
    assert_eq!(person(&ev, "track_end"), 1);
    // Entered the lot once, crossed the door once (while hidden: seen on
    // the near side before, the far side after).
    assert_eq!(person(&ev, "zone_enter"), 1, "{:?}", names(&ev));
    let crossings: Vec<&Event> = ev
        .iter()
        .filter(|e| e.label == "person" && e.kind.name() == "line_cross")
        .collect();
    assert_eq!(crossings.len(), 1, "{:?}", names(&ev));
    assert_eq!(
        crossings[0].kind,
        EventKind::LineCross {
            line: "door".into(),
            direction: Direction::In
        }
    );
    // One id on every confirmed frame, before and after.
    let seen: std::collections::BTreeSet<&str> = ids.iter().flatten().map(|s| &**s).collect();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(ids.last().is_some_and(Option::is_some));
}

#[test]
fn a_person_the_association_let_go_is_relinked_not_announced_again() {
    // 30 fps, 1 px a frame, hidden 45 frames (1.5 s): longer than
    // ByteTrack keeps a lost track (max_age at 30 frames a second), so the
    // person comes back under a new association id and is re-linked.
    let (ev, ids) = behind_the_van(30, 1.0, 120..165, 260);
    assert_eq!(person(&ev, "track_start"), 1, "{:?}", names(&ev));
    assert_eq!(person(&ev, "zone_enter"), 1, "{:?}", names(&ev));
    let end = ev
        .iter()
        .find(|e| e.label == "person" && e.kind.name() == "track_end")
        .expect("the person's track ends");
    let EventKind::TrackEnd(s) = &end.kind else {
        unreachable!()
    };
    assert_eq!(s.relinked, 1);
    let seen: std::collections::BTreeSet<&str> = ids.iter().flatten().map(|s| &**s).collect();
    assert_eq!(seen.len(), 1, "{seen:?}");
}
