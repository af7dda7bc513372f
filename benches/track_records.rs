//! Records upstream per camera-hour: `emit = "events"` against
//! `emit = "frames"` (one record per processed frame), for an hour of
//! frames at 10 fps through the tracker, zones and lines (plain harness,
//! prints a table). The detections are the scenes' known boxes, so the
//! figure is the tracker's and the events', not a detector's.
//!
//! - `rendered scene, looped`: the tracking test's scene (two faces crossing
//!   a 320x240 picture in 50 frames, a zone and a line), played 720 times;
//! - `gate`: a parked truck all hour (its box jittering by 2 px) and a car
//!   every 3 minutes driving through the zone and across the line in 4 s;
//! - `parked`: the truck alone.
//!
//! `cargo bench --bench track_records`

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outpost::track::{
    Detection, LineConfig, StreamTracker, TrackConfig, TrackStats, TrackingSpec, ZoneConfig,
};

const FPS: u64 = 10;
const HOUR_FRAMES: u64 = 3600 * FPS;

fn det(x: f32, y: f32, w: f32, h: f32, label: &str, score: f32) -> Detection {
    Detection {
        bbox: [x, y, x + w, y + h],
        score,
        label: label.to_string(),
        text: None,
    }
}

/// The tracking test's scene (tests/vision/render_scene.py): face A from
/// (10, 10) 5 px right a frame, face B from (250, 65) 5 px left and 2 down.
fn rendered(f: u64) -> Vec<Detection> {
    let i = (f % 50) as f32;
    vec![
        det(10.0 + 5.0 * i, 10.0, 60.0, 75.0, "face", 0.95),
        det(250.0 - 5.0 * i, 65.0 + 2.0 * i, 60.0, 75.0, "face", 0.95),
    ]
}

fn rendered_spec() -> TrackingSpec {
    TrackingSpec::new(
        TrackConfig {
            min_hits: 3,
            max_age: Duration::from_secs(10),
            ..TrackConfig::default()
        },
        &[ZoneConfig {
            name: "yard".into(),
            polygon: vec![[0.0, 150.0], [320.0, 150.0], [320.0, 240.0], [0.0, 240.0]],
            inertia: 3,
            loiter: None,
            classes: vec![],
            ..ZoneConfig::default()
        }],
        &[LineConfig {
            name: "gate".into(),
            points: [[160.0, 0.0], [160.0, 240.0]],
            inertia: 2,
            classes: vec![],
            ..LineConfig::default()
        }],
    )
}

/// A 1920x1080 gate: the truck parked at the left, a car every 180 s from
/// the right edge to the left through the yard and across the gate line.
fn gate(f: u64, with_cars: bool) -> Vec<Detection> {
    let jitter = ((f * 7919) % 5) as f32 - 2.0;
    let mut v = vec![det(
        100.0 + jitter,
        500.0 - jitter,
        400.0,
        300.0,
        "truck",
        0.8 + jitter * 0.02,
    )];
    let t = f % (180 * FPS);
    if with_cars && t < 4 * FPS {
        let x = 1800.0 - 35.0 * t as f32;
        v.push(det(x, 600.0, 160.0, 110.0, "car", 0.9));
    }
    v
}

fn gate_spec() -> TrackingSpec {
    TrackingSpec::new(
        TrackConfig::default(),
        &[ZoneConfig {
            name: "yard".into(),
            polygon: vec![
                [600.0, 400.0],
                [1700.0, 400.0],
                [1700.0, 1000.0],
                [600.0, 1000.0],
            ],
            inertia: 3,
            loiter: Some(Duration::from_secs(30)),
            classes: vec![],
            ..ZoneConfig::default()
        }],
        &[LineConfig {
            name: "gate".into(),
            points: [[960.0, 0.0], [960.0, 1080.0]],
            inertia: 2,
            classes: vec![],
            ..LineConfig::default()
        }],
    )
}

/// (frames, events) for an hour of `scene`.
fn hour(spec: TrackingSpec, scene: impl Fn(u64) -> Vec<Detection>) -> (u64, u64) {
    let mut tr = StreamTracker::new(
        Arc::new(spec),
        Arc::new(TrackStats::default()),
        "gw/gate/cam/".into(),
        Arc::new(1.into()),
    );
    let t0: SystemTime = UNIX_EPOCH + Duration::from_secs(1_796_000_000);
    let mut events = 0u64;
    for f in 0..HOUR_FRAMES {
        let out = tr.update(t0 + Duration::from_millis(f * 1000 / FPS), &scene(f));
        events += out.events.len() as u64;
    }
    (HOUR_FRAMES, events)
}

fn main() {
    println!(
        "| scene (1 h at {FPS} fps) | records, emit = \"frames\" | records, emit = \"events\" | fewer |"
    );
    println!("|---|---:|---:|---:|");
    let rows: [(&str, (u64, u64)); 3] = [
        (
            "rendered scene, looped 720 times",
            hour(rendered_spec(), rendered),
        ),
        (
            "gate: parked truck, a car every 3 min",
            hour(gate_spec(), |f| gate(f, true)),
        ),
        ("parked truck alone", hour(gate_spec(), |f| gate(f, false))),
    ];
    for (name, (frames, events)) in rows {
        assert!(events > 0, "{name}: no event in an hour");
        println!(
            "| {name} | {frames} | {events} | {:.0}x |",
            frames as f64 / events as f64
        );
    }
}
