//! GPU image preprocessing against the CPU preprocessing (the reference),
//! for perf/gpu-check: real photographs and a camera-sized frame, as RGB,
//! BGR and NV12, through the preprocess configs of the models and a
//! letterbox / crop / NHWC / f16 / u8 set. Prints one JSON object per case
//! (max difference in pixel levels, share of elements that differ, p50 time
//! of each path), then a summary line; exits 1 when a case is out of
//! tolerance, 0 when all are in, and 0 with `"available": false` and the
//! reason when the GPU path cannot run here.
//!
//! cargo run --release --features cuda --example gpu_preprocess_check -- [IMAGE...]

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use outpost::backend::Tensor;
use outpost::preprocess::PreprocessConfig;
use outpost::preprocess::gpu::{Frame, GpuImagePreprocessor};
use outpost::preprocess::gpu_launch::SourceFormat;

/// Largest difference accepted, in 0..=255 pixel levels: the GPU filters in
/// one 2-D pass where fast_image_resize rounds between its two passes.
const TOLERANCE_LEVELS: f64 = 2.0;

fn config(toml_body: &str, w: u32, h: u32, format: &str) -> PreprocessConfig {
    #[derive(serde::Deserialize)]
    struct W {
        p: PreprocessConfig,
    }
    let text = format!(
        "[p]\ntype = \"image\"\nformat = \"{format}\"\ninput_width = {w}\ninput_height = {h}\n{toml_body}"
    );
    let w: W = toml::from_str(&text).expect("config");
    w.p
}

fn rgb_to_nv12(rgb: &[u8], w: usize, h: usize) -> Vec<u8> {
    let mut out = vec![0u8; w * h * 3 / 2];
    let px = |x: usize, y: usize| {
        let p = &rgb[(y * w + x) * 3..];
        (p[0] as f64, p[1] as f64, p[2] as f64)
    };
    for y in 0..h {
        for x in 0..w {
            let (r, g, b) = px(x, y);
            out[y * w + x] = (16.0 + 0.257 * r + 0.504 * g + 0.098 * b)
                .round()
                .clamp(0.0, 255.0) as u8;
        }
    }
    for y in (0..h).step_by(2) {
        for x in (0..w).step_by(2) {
            let (r, g, b) = px(x, y);
            let i = w * h + (y / 2) * w + x;
            out[i] = (128.0 - 0.148 * r - 0.291 * g + 0.439 * b)
                .round()
                .clamp(0.0, 255.0) as u8;
            out[i + 1] = (128.0 + 0.439 * r - 0.368 * g - 0.071 * b)
                .round()
                .clamp(0.0, 255.0) as u8;
        }
    }
    out
}

fn p50(mut v: Vec<Duration>) -> f64 {
    v.sort_unstable();
    v[v.len() / 2].as_nanos() as f64 / 1e3
}

fn main() {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let mut images: Vec<std::path::PathBuf> = std::env::args().skip(1).map(Into::into).collect();
    if images.is_empty() {
        images.push(root.join("models/images/astronaut.png"));
    }
    let mut frames: Vec<(String, Vec<u8>, u32, u32)> = Vec::new();
    for p in &images {
        let img = image::open(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .into_rgb8();
        let (w, h) = img.dimensions();
        frames.push((
            p.file_name().unwrap().to_string_lossy().into_owned(),
            img.into_raw(),
            w,
            h,
        ));
    }
    // A 1080p camera frame: gradients and a fine checker, so resampling shows.
    let (w, h) = (1920u32, 1080u32);
    let cam: Vec<u8> = (0..h)
        .flat_map(|y| {
            (0..w).flat_map(move |x| {
                let c = if (x / 3 + y / 3).is_multiple_of(2) {
                    40
                } else {
                    0
                };
                [
                    (x * 255 / w) as u8 ^ c,
                    (y * 255 / h) as u8,
                    ((x + y) % 256) as u8,
                ]
            })
        })
        .collect();
    frames.push(("camera-1080p".into(), cam, w, h));

    let models: [(&str, &str); 5] = [
        (
            "classifier",
            "width = 224\nheight = 224\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]",
        ),
        (
            "ppocr_det",
            "width = 736\nheight = 736\nmean = [0.485, 0.456, 0.406]\nstd = [0.229, 0.224, 0.225]\nchannel_order = \"bgr\"",
        ),
        (
            "letterbox-nhwc-f16",
            "width = 640\nheight = 384\nresize = \"letterbox\"\nlayout = \"nhwc\"\ndtype = \"f16\"",
        ),
        (
            "crop-u8",
            "width = 256\nheight = 256\ncrop = [224, 224]\ndtype = \"u8\"",
        ),
        (
            "letterbox-crop-bgr",
            "width = 320\nheight = 320\nresize = \"letterbox\"\ncrop = [300, 200]\nchannel_order = \"bgr\"\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]",
        ),
    ];

    let probe = config(models[0].1, 2, 2, "raw_rgb");
    if let Err(e) = GpuImagePreprocessor::new(&probe, 0) {
        println!(
            "{}",
            serde_json::json!({"summary": true, "available": false, "reason": e.to_string()})
        );
        return;
    }
    let mut worst_case = 0.0f64;
    let mut failed = 0;
    let mut cases = 0;
    for (fname, rgb, w, h) in &frames {
        let bgr: Vec<u8> = rgb
            .chunks_exact(3)
            .flat_map(|p| [p[2], p[1], p[0]])
            .collect();
        let nv12 = (w.is_multiple_of(2) && h.is_multiple_of(2))
            .then(|| rgb_to_nv12(rgb, *w as usize, *h as usize));
        let mut sources: Vec<(&str, SourceFormat, &[u8])> = vec![
            ("rgb", SourceFormat::Rgb, rgb),
            ("bgr", SourceFormat::Bgr, &bgr),
        ];
        if let Some(n) = &nv12 {
            sources.push(("nv12", SourceFormat::Nv12, n));
        }
        for (mname, body) in &models {
            for (sname, sfmt, data) in &sources {
                let fmt = match sfmt {
                    SourceFormat::Rgb => "raw_rgb",
                    SourceFormat::Bgr => "raw_bgr",
                    SourceFormat::Nv12 => "raw_nv12",
                };
                let cfg = config(body, *w, *h, fmt);
                let mut cpu = cfg.build();
                let mut g = GpuImagePreprocessor::new(&cfg, 0).expect("GPU preprocessor");
                let frame = Frame {
                    data,
                    width: *w,
                    height: *h,
                    format: *sfmt,
                };
                let t0 = Instant::now();
                let item = cpu.process("check", data).expect("cpu").remove(0);
                let mut tc = vec![t0.elapsed()];
                let (gt, gtr) = g.run_to_host(&frame).expect("gpu");
                let (want, got) = (item.tensor.to_f64_vec(), gt.to_f64_vec());
                assert_eq!(item.tensor.shape(), gt.shape());
                assert_eq!(item.meta.image, Some(gtr));
                // Pixel levels: undo scale and std (u8 outputs are levels already).
                let PreprocessConfig::Image {
                    std, scale, dtype, ..
                } = &cfg
                else {
                    unreachable!()
                };
                let per_level = if matches!(gt, Tensor::U8(_)) {
                    1.0
                } else {
                    (*scale as f64) / std.iter().cloned().fold(f32::MAX, f32::min) as f64
                };
                let diffs: Vec<f64> = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).collect();
                let max = diffs.iter().cloned().fold(0.0, f64::max) / per_level;
                let differing =
                    diffs.iter().filter(|d| **d > 1e-6).count() as f64 / diffs.len() as f64;
                let mut tg = Vec::new();
                for _ in 0..30 {
                    let t0 = Instant::now();
                    g.run_scratch(&frame).expect("gpu");
                    tg.push(t0.elapsed());
                }
                // One more CPU run (the first paid for allocations).
                let t0 = Instant::now();
                let _ = cpu.process("check", data).expect("cpu");
                tc.push(t0.elapsed());
                let ok = max <= TOLERANCE_LEVELS;
                cases += 1;
                if !ok {
                    failed += 1;
                }
                worst_case = worst_case.max(max);
                println!(
                    "{}",
                    serde_json::json!({
                        "frame": fname, "size": format!("{w}x{h}"), "source": sname, "config": mname,
                        "dtype": format!("{dtype:?}").to_lowercase(),
                        "max_diff_levels": max, "differing_share": differing,
                        "gpu_p50_us": p50(tg), "cpu_p50_us": p50(tc), "ok": ok,
                    })
                );
            }
        }
    }
    println!(
        "{}",
        serde_json::json!({"summary": true, "available": true, "cases": cases, "failed": failed,
                           "max_diff_levels": worst_case, "tolerance_levels": TOLERANCE_LEVELS})
    );
    if failed > 0 {
        std::process::exit(1);
    }
}
