//! Times outpost's image preprocessing on one file: decode (JPEG/PNG), resize
//! to 224x224 (bilinear), normalize with ImageNet mean/std, NCHW f32: the
//! same work `perf/compare_image` times with Pillow + NumPy.
//!
//! Usage: cargo run --release --example preprocess_bench -- FILE [N] [WARMUP]
//! Prints one JSON line: {"iterations", "p50_us", "mean_us", "min_us", "max_us", "shape"}.
//! Single-threaded: the decoders and fast_image_resize run on this thread.

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use outpost::preprocess::PreprocessConfig;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let file = args
        .next()
        .ok_or("usage: preprocess_bench FILE [N] [WARMUP]")?;
    let n: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(100);
    let warmup: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5);
    let payload = std::fs::read(&file)?;
    let config: PreprocessConfig = toml::from_str(
        r#"
type = "image"
width = 224
height = 224
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
scale = 0.00392156862745098
layout = "nchw"
channel_order = "rgb"
"#,
    )?;
    let problems = config.validate();
    if !problems.is_empty() {
        return Err(problems.join("; ").into());
    }
    let mut pre = config.build();
    let mut shape = Vec::new();
    for _ in 0..warmup {
        let items = pre.process("bench", &payload)?;
        shape = items
            .first()
            .map(|i| i.tensor.shape().to_vec())
            .unwrap_or_default();
    }
    let mut times_us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let items = pre.process("bench", &payload)?;
        times_us.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(items);
    }
    // The decode alone (same decoder, no resize or normalize), to show where
    // the time goes.
    let mut decode_us = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let img = image::load_from_memory(&payload)?.into_rgb8();
        decode_us.push(t.elapsed().as_secs_f64() * 1e6);
        std::hint::black_box(img);
    }
    decode_us.sort_by(f64::total_cmp);
    times_us.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        times_us
            .get(((times_us.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    let mean = times_us.iter().sum::<f64>() / times_us.len().max(1) as f64;
    println!(
        "{}",
        serde_json::json!({
            "iterations": n,
            "p50_us": pct(0.5),
            "mean_us": mean,
            "min_us": pct(0.0),
            "max_us": pct(1.0),
            "shape": shape,
            "decode_p50_us": decode_us.get(decode_us.len() / 2),
        })
    );
    Ok(())
}
