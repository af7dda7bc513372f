//! Preprocessing of one camera frame: a 1920x1080 I420 frame (what the
//! camera chain's decoder hands over) into the classifier's 224x224 NCHW
//! f32 tensor, stretched, and letterboxed into a 640x640 detector input.
//! The frame is a smooth picture with noise, so no plane is constant.
//!
//! Run: `cargo bench --bench preprocess`

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use outpost::preprocess::PreprocessConfig;
use outpost::preprocess::raw::{RawFormat, RawImage};

const W: usize = 1920;
const H: usize = 1080;

fn frame() -> Vec<u8> {
    let (cw, ch) = (W / 2, H / 2);
    let mut f = vec![0u8; W * H + 2 * cw * ch];
    let mut seed = 0x2545_f491_4f6c_dd1d_u64;
    let mut noise = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % 17) as i32 - 8
    };
    for y in 0..H {
        for x in 0..W {
            f[y * W + x] = (16 + (x * 200 / W + y * 20 / H) as i32 + noise()).clamp(16, 235) as u8;
        }
    }
    for (i, p) in f[W * H..].iter_mut().enumerate() {
        let (x, y) = (i % cw, (i / cw) % ch);
        *p = (128 + (x as i32 - cw as i32 / 2) / 8 + (y as i32 % 64) - 32 + noise()).clamp(16, 240)
            as u8;
    }
    f
}

fn config(toml_text: &str) -> PreprocessConfig {
    toml::from_str(toml_text).expect("preprocess config")
}

fn bench(c: &mut Criterion) {
    let pixels = frame();
    let raw = RawImage {
        width: W as u32,
        height: H as u32,
        format: RawFormat::I420 { bt709: true },
    };
    let cases = [
        (
            "i420_1080p_to_224_stretch",
            "type = \"image\"\nwidth = 224\nheight = 224\nlayout = \"nchw\"\n",
        ),
        (
            "i420_1080p_to_640_letterbox",
            "type = \"image\"\nwidth = 640\nheight = 640\nresize = \"letterbox\"\nlayout = \"nchw\"\n",
        ),
    ];
    for (name, cfg) in cases {
        let mut p = config(cfg).build();
        c.bench_function(name, |b| {
            b.iter(|| {
                let items = p
                    .process_raw("cam", black_box(&pixels), raw)
                    .expect("preprocess");
                black_box(items)
            })
        });
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
