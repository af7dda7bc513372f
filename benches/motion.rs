//! The motion gate's per-frame cost (`[pipelines.motion]`): one 1080p
//! camera frame through the motion detector (scaled to the 100-row grey
//! frame, blurred, against the background, blobs), as the decoder gives
//! it (I420) and as RGB, still and with a mover; and the crop of one
//! 512x512 region out of a 1080p I420 frame (`regions = true`).
//!
//! `cargo bench --bench motion`

// A failed unwrap here is a failed run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{Criterion, criterion_group, criterion_main};
use outpost::pipeline::motion::{MotionConfig, MotionDetector, regions};
use outpost::preprocess::raw::{RawFormat, RawImage};

const W: u32 = 1920;
const H: u32 = 1080;

/// A textured 1080p I420 frame (a smooth gradient with fine detail), a
/// bright square at `x` if given.
fn i420(square: Option<u32>) -> Vec<u8> {
    let mut f: Vec<u8> = (0..W * H)
        .map(|i| {
            let (x, y) = (i % W, i / W);
            ((x / 8 + y / 6) % 200 + ((x ^ y) & 15)) as u8
        })
        .collect();
    if let Some(sx) = square {
        for y in 400..600 {
            for x in sx..sx + 200 {
                f[(y * W + x) as usize] = 250;
            }
        }
    }
    f.extend(std::iter::repeat_n(128u8, 2 * (W / 2 * H / 2) as usize));
    f
}

fn rgb(square: Option<u32>) -> Vec<u8> {
    i420(square)[..(W * H) as usize]
        .iter()
        .flat_map(|&v| [v, v.wrapping_add(20), v.wrapping_sub(20)])
        .collect()
}

fn bench(c: &mut Criterion) {
    let raw_i420 = RawImage {
        width: W,
        height: H,
        format: RawFormat::I420 { bt709: true },
    };
    let raw_rgb = RawImage::rgb(W, H);
    let cfg = MotionConfig::default();
    let mut g = c.benchmark_group("motion_1080p");
    for (name, still, moving, raw) in [
        ("i420", i420(None), i420(Some(900)), raw_i420),
        ("rgb", rgb(None), rgb(Some(900)), raw_rgb),
    ] {
        let mut d = MotionDetector::new(&cfg);
        d.detect(&still, raw).unwrap();
        g.bench_function(format!("{name}_still"), |b| {
            b.iter(|| {
                let m = d.detect(&still, raw).unwrap();
                assert!(m.is_still());
            })
        });
        let mut d = MotionDetector::new(&cfg);
        d.detect(&still, raw).unwrap();
        // The mover comes and goes every other frame, so the background
        // never learns it.
        let mut n = 0u64;
        g.bench_function(format!("{name}_mover"), |b| {
            b.iter(|| {
                n += 1;
                let f = if n.is_multiple_of(2) { &moving } else { &still };
                d.detect(f, raw).unwrap()
            })
        });
    }
    let frame = i420(None);
    g.bench_function("i420_crop_512", |b| {
        b.iter(|| regions::crop(&frame, raw_i420, [800, 300, 1312, 812]))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
