//! The motion detector on synthetic frames and on real photographs
//! (models/images, fetched by models/fetch): a still scene with sensor
//! noise gives no motion, a mover gives a box where it is, a masked area
//! never does, a picture that changes as a whole starts the background over.

use super::*;
use crate::pipeline::motion::{Mask, MotionConfig};

fn photo(name: &str) -> (Vec<u8>, u32, u32) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("models/images")
        .join(name);
    let img = image::open(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run models/fetch)", path.display()))
        .to_rgb8();
    let (w, h) = img.dimensions();
    (img.into_raw(), w, h)
}

/// A small deterministic noise source (sensor noise of a few levels).
struct Noise(u64);

impl Noise {
    fn next(&mut self) -> i16 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % 7) as i16 - 3
    }
}

fn noisy(frame: &[u8], noise: &mut Noise) -> Vec<u8> {
    frame
        .iter()
        .map(|&v| (i16::from(v) + noise.next()).clamp(0, 255) as u8)
        .collect()
}

/// `patch` (pw x ph RGB) pasted into `frame` (w wide) at (x, y).
fn paste(frame: &mut [u8], w: u32, patch: &[u8], pw: u32, ph: u32, x: u32, y: u32) {
    for r in 0..ph {
        let dst = (((y + r) * w + x) * 3) as usize;
        let src = (r * pw * 3) as usize;
        frame[dst..dst + (pw * 3) as usize].copy_from_slice(&patch[src..src + (pw * 3) as usize]);
    }
}

/// The cat's face from chelsea.png: a real mover's texture.
fn cat(size: u32) -> Vec<u8> {
    let (c, cw, _) = photo("chelsea.png");
    let mut out = Vec::new();
    for r in 0..size {
        let at = (((60 + r) * cw + 140) * 3) as usize;
        out.extend_from_slice(&c[at..at + (size * 3) as usize]);
    }
    out
}

fn covers(b: &[u32; 4], x: u32, y: u32, size: u32, slack: u32) -> bool {
    b[0] <= x + slack && b[1] <= y + slack && b[2] + slack >= x + size && b[3] + slack >= y + size
}

#[test]
fn a_still_real_scene_with_sensor_noise_gives_no_motion() {
    let (bg, w, h) = photo("coffee.png");
    let mut d = MotionDetector::new(&MotionConfig::default());
    let mut noise = Noise(1);
    let first = d
        .detect(&noisy(&bg, &mut noise), RawImage::rgb(w, h))
        .unwrap();
    assert!(
        first.whole,
        "the first frame has no background: it moves whole"
    );
    for i in 0..30 {
        let m = d
            .detect(&noisy(&bg, &mut noise), RawImage::rgb(w, h))
            .unwrap();
        assert!(m.is_still(), "frame {i}: {m:?}");
    }
    assert_eq!(d.small_size().1, 100);
}

#[test]
fn a_real_mover_gives_one_box_where_it_is() {
    let (bg, w, h) = photo("coffee.png");
    let cat = cat(80);
    let mut d = MotionDetector::new(&MotionConfig::default());
    let mut noise = Noise(2);
    d.detect(&noisy(&bg, &mut noise), RawImage::rgb(w, h))
        .unwrap();
    for i in 0..10 {
        let (x, y) = (40 + 40 * i, 150 + 5 * i);
        let mut f = bg.clone();
        paste(&mut f, w, &cat, 80, 80, x, y);
        let m = d
            .detect(&noisy(&f, &mut noise), RawImage::rgb(w, h))
            .unwrap();
        assert!(!m.whole, "frame {i}");
        // The box holds the cat now (and where it was a frame ago, which
        // also changed against the background).
        assert!(
            m.boxes.iter().any(|b| covers(b, x, y, 80, 8)),
            "frame {i}: cat at ({x}, {y}), boxes {:?}",
            m.boxes
        );
        for b in &m.boxes {
            // Nothing far from the cat's path moves.
            assert!(b[1] + 8 >= 150 && b[3] <= 150 + 5 * i + 80 + 12, "{b:?}");
        }
    }
}

#[test]
fn a_masked_area_never_moves() {
    let (bg, w, h) = photo("coffee.png");
    let cat = cat(60);
    let cfg = MotionConfig {
        // The band the cat walks along.
        mask: Mask::One(vec![
            [0.0, 130.0],
            [w as f32, 130.0],
            [w as f32, 230.0],
            [0.0, 230.0],
        ]),
        ..MotionConfig::default()
    };
    let mut d = MotionDetector::new(&cfg);
    let mut noise = Noise(3);
    d.detect(&noisy(&bg, &mut noise), RawImage::rgb(w, h))
        .unwrap();
    for i in 0..10 {
        let mut f = bg.clone();
        paste(&mut f, w, &cat, 60, 60, 20 + 45 * i, 150);
        let m = d
            .detect(&noisy(&f, &mut noise), RawImage::rgb(w, h))
            .unwrap();
        assert!(m.is_still(), "frame {i}: {m:?}");
    }
    // Outside the mask it still sees the cat.
    let mut f = bg.clone();
    paste(&mut f, w, &cat, 60, 60, 200, 300);
    let m = d.detect(&f, RawImage::rgb(w, h)).unwrap();
    assert!(m.boxes.iter().any(|b| covers(b, 200, 300, 60, 8)), "{m:?}");
}

#[test]
fn a_picture_that_changes_whole_starts_the_background_over() {
    let (bg, w, h) = photo("coffee.png");
    let mut d = MotionDetector::new(&MotionConfig::default());
    d.detect(&bg, RawImage::rgb(w, h)).unwrap();
    // The lights go on: everything is brighter.
    let lit: Vec<u8> = bg.iter().map(|v| v.saturating_add(90)).collect();
    let m = d.detect(&lit, RawImage::rgb(w, h)).unwrap();
    assert!(m.whole, "{m:?}");
    let m = d.detect(&lit, RawImage::rgb(w, h)).unwrap();
    assert!(m.is_still(), "the new picture is the background: {m:?}");
}

#[test]
fn i420_frames_move_like_rgb_ones_on_their_luma() {
    // Synthetic: flat grey, a bright square walks across.
    let (w, h) = (320u32, 240u32);
    let i420 = |sq: Option<u32>| {
        let mut y = vec![60u8; (w * h) as usize];
        if let Some(x) = sq {
            for r in 100..140 {
                for c in x..x + 40 {
                    y[(r * w + c) as usize] = 220;
                }
            }
        }
        y.extend(vec![128u8; 2 * (w / 2 * h / 2) as usize]);
        y
    };
    let raw = RawImage {
        width: w,
        height: h,
        format: RawFormat::I420 { bt709: false },
    };
    let mut d = MotionDetector::new(&MotionConfig::default());
    assert!(d.detect(&i420(None), raw).unwrap().whole);
    assert!(d.detect(&i420(None), raw).unwrap().is_still());
    let m = d.detect(&i420(Some(200)), raw).unwrap();
    assert_eq!(m.boxes.len(), 1, "{m:?}");
    assert!(covers(&m.boxes[0], 200, 100, 40, 8), "{m:?}");
    // A frame of the wrong size is refused, not read past its end.
    assert!(d.detect(&[0u8; 10], raw).is_err());
}

#[test]
fn near_boxes_merge_and_far_ones_stay_apart() {
    let m = merge(vec![[0, 0, 10, 10], [13, 0, 20, 10], [50, 50, 60, 60]], 5);
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m.contains(&[0, 0, 20, 10]));
    assert!(m.contains(&[50, 50, 60, 60]));
}

#[test]
fn where_a_mover_was_is_still_again_within_a_few_frames() {
    let (bg, w, h) = photo("coffee.png");
    let cat = cat(80);
    let mut d = MotionDetector::new(&MotionConfig::default());
    let mut noise = Noise(4);
    d.detect(&noisy(&bg, &mut noise), RawImage::rgb(w, h))
        .unwrap();
    // The cat walks through, then parks at (400, 200).
    for i in 0..6 {
        let mut f = bg.clone();
        paste(&mut f, w, &cat, 80, 80, 40 + 60 * i, 200);
        assert!(
            !d.detect(&noisy(&f, &mut noise), RawImage::rgb(w, h))
                .unwrap()
                .is_still()
        );
    }
    let mut parked = bg.clone();
    paste(&mut parked, w, &cat, 80, 80, 400, 200);
    let mut still_at = None;
    for n in 0..30 {
        if d.detect(&noisy(&parked, &mut noise), RawImage::rgb(w, h))
            .unwrap()
            .is_still()
        {
            still_at = Some(n);
            break;
        }
    }
    // Neither its old places nor where it parked keep moving for long
    // (at `alpha` alone that would take about 80 frames).
    let n = still_at.expect("the parked cat kept moving");
    assert!(n <= 10, "still after {n} frames");
}
