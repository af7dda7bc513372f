//! Tracking, zones and lines per frame: 50 objects moving across a
//! 1920x1080 frame, 3 zones and 2 lines, one stream; and with zone
//! analytics, 5 zones counting occupancy and measuring speed (calibrated,
//! with a speed limit) and 4 lines, two of them one way. The figure is the
//! cost of `StreamTracker::update` for one frame (targets: 50 µs, and 60 µs
//! with the analytics).
//!
//! Run: `cargo bench --bench track`

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use criterion::{Criterion, criterion_group, criterion_main};
use outpost::track::{
    Detection, Directions, LineConfig, StreamTracker, TrackConfig, TrackStats, TrackingSpec,
    ZoneConfig,
};
use trackforge::trackers::byte_track::ByteTrack;

const OBJECTS: usize = 50;

/// Frame `f`'s detections: objects on a 10x5 grid, each drifting on its own
/// heading and wrapping around, so tracks also end and start.
fn frame(f: u64) -> Vec<Detection> {
    (0..OBJECTS)
        .map(|i| {
            let (gx, gy) = ((i % 10) as f32, (i / 10) as f32);
            let vx = 2.0 + (i % 7) as f32;
            let vy = ((i % 5) as f32 - 2.0) * 0.5;
            let x = (gx * 180.0 + vx * f as f32) % 1800.0;
            let y = (gy * 200.0 + 60.0 + vy * f as f32).rem_euclid(950.0);
            Detection {
                bbox: [x, y, x + 60.0, y + 120.0],
                score: if i % 4 == 0 { 0.4 } else { 0.9 },
                label: if i % 3 == 0 { "car" } else { "person" }.to_string(),
                text: None,
            }
        })
        .collect()
}

fn spec() -> TrackingSpec {
    let zone = |name: &str, x: f32| ZoneConfig {
        name: name.into(),
        polygon: vec![
            [x, 300.0],
            [x + 500.0, 300.0],
            [x + 560.0, 800.0],
            [x + 250.0, 900.0],
            [x - 60.0, 800.0],
        ],
        inertia: 3,
        loiter: Some(Duration::from_secs(5)),
        classes: vec![],
        ..ZoneConfig::default()
    };
    let line = |name: &str, x: f32| LineConfig {
        name: name.into(),
        points: [[x, 0.0], [x + 100.0, 1080.0]],
        inertia: 2,
        classes: vec![],
        ..LineConfig::default()
    };
    TrackingSpec::new(
        TrackConfig::default(),
        &[zone("a", 100.0), zone("b", 700.0), zone("c", 1300.0)],
        &[line("l1", 600.0), line("l2", 1200.0)],
    )
}

/// 5 calibrated zones (perspective quadrilaterals side by side, 3.5 m x
/// 20 m each) with occupancy and a speed limit, and 4 lines.
fn analytics_spec() -> TrackingSpec {
    let zone = |i: usize| {
        let x = 40.0 + 370.0 * i as f32;
        ZoneConfig {
            name: format!("lane{i}"),
            polygon: vec![
                [x + 60.0, 250.0],
                [x + 300.0, 250.0],
                [x + 360.0, 950.0],
                [x, 950.0],
            ],
            inertia: 3,
            occupancy: true,
            distances: Some([3.5, 20.0, 3.5, 20.0]),
            speed_limit: Some(30.0),
            after: (i == 4).then(|| "lane3".to_string()),
            ..ZoneConfig::default()
        }
    };
    let line = |i: usize| LineConfig {
        name: format!("l{i}"),
        points: [
            [200.0 + 450.0 * i as f32, 0.0],
            [300.0 + 450.0 * i as f32, 1080.0],
        ],
        direction: match i % 3 {
            0 => Directions::Both,
            1 => Directions::In,
            _ => Directions::Out,
        },
        ..LineConfig::default()
    };
    TrackingSpec::new(
        TrackConfig::default(),
        &(0..5).map(zone).collect::<Vec<_>>(),
        &(0..4).map(line).collect::<Vec<_>>(),
    )
}

fn bench(c: &mut Criterion) {
    let frames: Vec<Vec<Detection>> = (0..1000).map(frame).collect();
    let mut tr = StreamTracker::new(
        Arc::new(spec()),
        Arc::new(TrackStats::default()),
        "gw/p/cam/".into(),
        Arc::new(1.into()),
    );
    // Warm: tracks exist and are confirmed before timing.
    for (f, d) in frames.iter().enumerate().take(30) {
        tr.update(UNIX_EPOCH + Duration::from_millis(f as u64 * 100), d);
    }
    let mut f = 30u64;
    // The tracker crate alone on the same frames (one ByteTrack per label,
    // as the stream tracker runs it): what outpost's own part adds is the
    // difference.
    let params = spec().byte_params();
    let mut crates: Vec<(String, ByteTrack)> = Vec::new();
    let mut g = 0u64;
    c.bench_function("bytetrack_alone_50_objects", |b| {
        b.iter(|| {
            let d = &frames[(g % 1000) as usize];
            g += 1;
            let mut n = 0;
            for label in ["car", "person"] {
                let input: Vec<([f32; 4], f32, i64)> = d
                    .iter()
                    .filter(|x| x.label == label)
                    .map(|x| {
                        let b = x.bbox;
                        ([b[0], b[1], b[2] - b[0], b[3] - b[1]], x.score, 0)
                    })
                    .collect();
                let t = match crates.iter_mut().find(|(l, _)| l == label) {
                    Some((_, t)) => t,
                    None => {
                        crates.push((label.to_string(), ByteTrack::from_params(params)));
                        &mut crates.last_mut().expect("just pushed").1
                    }
                };
                n += t.update(input).len();
            }
            black_box(n)
        })
    });
    c.bench_function("track_50_objects_3_zones_2_lines", |b| {
        b.iter(|| {
            let d = &frames[(f % 1000) as usize];
            let out = tr.update(UNIX_EPOCH + Duration::from_millis(f * 100), black_box(d));
            f += 1;
            black_box(out)
        })
    });
    let mut tr = StreamTracker::new(
        Arc::new(analytics_spec()),
        Arc::new(TrackStats::default()),
        "gw/p/cam/".into(),
        Arc::new(1.into()),
    )
    .with_stream("cam");
    for (f, d) in frames.iter().enumerate().take(30) {
        tr.update(UNIX_EPOCH + Duration::from_millis(f as u64 * 100), d);
    }
    let mut f = 30u64;
    c.bench_function("track_50_objects_5_zones_occupancy_speed_4_lines", |b| {
        b.iter(|| {
            let d = &frames[(f % 1000) as usize];
            let out = tr.update(UNIX_EPOCH + Duration::from_millis(f * 100), black_box(d));
            f += 1;
            black_box(out)
        })
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(Duration::from_secs(5));
    targets = bench
}
criterion_main!(benches);
