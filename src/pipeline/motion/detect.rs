//! The motion detector of one camera: a small grey frame against a slowly
//! updated background, no I/O.
//!
//! Per frame: the frame is scaled down to `frame_height` rows of grey
//! (I420's Y plane as it is; RGB through its luma), blurred 3x3, compared
//! with the background (an exponential average of past frames: `alpha` a
//! frame where the pixel changed since the previous frame, a quarter where
//! it did not, so ghosts fade in a few frames), the pixels that differ by more than `threshold` (and lie outside
//! every mask) are grown by one pixel, joined into blobs (8-connected), the
//! blobs smaller than `min_area` dropped and those within `merge_distance`
//! of each other merged. What is left are the moving boxes, in the source
//! frame's pixels.
//!
//! The first frame (and the first after the frame size changed) has no
//! background yet: it moves everywhere. When most of the picture changes at
//! once (lights switched, the camera's infrared mode, the camera moved) the
//! background is set to the new frame and the whole frame moves once.

use fast_image_resize as fir;

use super::MotionConfig;
use crate::preprocess::DecodeError;
use crate::preprocess::raw::{RawFormat, RawImage};
use crate::track::geometry::{Point, Polygon};

/// Above this share of changed pixels the picture changed as a whole: the
/// background starts over from the frame.
const RECALIBRATE_SHARE: f32 = 0.5;
/// How fast the background learns a pixel that did not change since the
/// previous frame (`alpha` is for those that did): where a mover was, or
/// where one stopped, is background again within a few frames, so its
/// ghost does not keep the detector running for `1/alpha` frames.
const SETTLE_RATE: f32 = 0.25;

/// What one frame's motion is.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Motion {
    /// Moving boxes `[x0, y0, x1, y1]` in source-frame pixels.
    pub boxes: Vec<[u32; 4]>,
    /// The whole frame counts as moving (the first frame, a picture that
    /// changed as a whole).
    pub whole: bool,
}

impl Motion {
    pub fn is_still(&self) -> bool {
        self.boxes.is_empty() && !self.whole
    }
}

/// One camera's motion detector.
pub struct MotionDetector {
    frame_height: u32,
    threshold: f32,
    min_area: u32,
    alpha: f32,
    merge_distance: u32,
    masks: Vec<Polygon>,
    /// Source size the buffers below are for.
    source: (u32, u32),
    /// The small frame's size.
    small: (u32, u32),
    /// Pixels of the small frame under a mask.
    masked: Vec<bool>,
    background: Vec<f32>,
    /// The previous frame's small grey frame.
    prev: Vec<u8>,
    grey: Vec<u8>,
    scratch: Vec<u8>,
    changed: Vec<bool>,
    grown: Vec<bool>,
    resizer: fir::Resizer,
}

impl MotionDetector {
    pub fn new(cfg: &MotionConfig) -> MotionDetector {
        MotionDetector {
            frame_height: cfg.frame_height.max(1),
            threshold: f32::from(cfg.threshold),
            min_area: cfg.min_area,
            alpha: cfg.alpha.clamp(0.0, 1.0),
            merge_distance: cfg.merge_distance,
            masks: cfg
                .mask
                .polygons()
                .iter()
                // `validate` refuses these; a polygon of fewer points has no inside.
                .filter(|p| p.len() >= 3)
                .map(|p| Polygon::new(p.iter().map(|[x, y]| Point::new(*x, *y)).collect()))
                .collect(),
            source: (0, 0),
            small: (0, 0),
            masked: Vec::new(),
            background: Vec::new(),
            prev: Vec::new(),
            grey: Vec::new(),
            scratch: Vec::new(),
            changed: Vec::new(),
            grown: Vec::new(),
            resizer: fir::Resizer::new(),
        }
    }

    /// The small frame's size (after the first frame).
    pub fn small_size(&self) -> (u32, u32) {
        self.small
    }

    /// One decoded frame's motion; the background learns the frame.
    pub fn detect(&mut self, payload: &[u8], raw: RawImage) -> Result<Motion, DecodeError> {
        raw.check(payload)?;
        let fresh = self.source != (raw.width, raw.height);
        if fresh {
            self.resize_for(raw.width, raw.height);
        }
        self.grey_small(payload, raw)?;
        blur(&self.grey, &mut self.scratch, self.small);
        std::mem::swap(&mut self.grey, &mut self.scratch);
        if fresh {
            self.prev = self.grey.clone();
            self.start_over();
            return Ok(Motion {
                boxes: Vec::new(),
                whole: true,
            });
        }
        let mut count = 0usize;
        let mut open = 0usize;
        let settle = SETTLE_RATE.max(self.alpha);
        let steady = self.threshold / 2.0;
        for (i, ((&g, &p), b)) in self
            .grey
            .iter()
            .zip(&self.prev)
            .zip(&mut self.background)
            .enumerate()
        {
            let g = f32::from(g);
            let on = !self.masked[i] && (g - *b).abs() > self.threshold;
            self.changed[i] = on;
            count += usize::from(on);
            open += usize::from(!self.masked[i]);
            let rate = if (g - f32::from(p)).abs() <= steady {
                settle
            } else {
                self.alpha
            };
            *b += rate * (g - *b);
        }
        std::mem::swap(&mut self.prev, &mut self.grey);
        if open > 0 && count as f32 > RECALIBRATE_SHARE * open as f32 {
            self.start_over();
            return Ok(Motion {
                boxes: Vec::new(),
                whole: true,
            });
        }
        if count == 0 {
            return Ok(Motion::default());
        }
        dilate(&self.changed, &mut self.grown, self.small);
        let blobs = blobs(&mut self.grown, self.small, self.min_area);
        let merged = merge(blobs, self.merge_distance);
        let (sw, sh) = (self.small.0 as f32, self.small.1 as f32);
        let (fw, fh) = (raw.width as f32 / sw, raw.height as f32 / sh);
        let boxes = merged
            .into_iter()
            .map(|[x0, y0, x1, y1]| {
                [
                    ((x0 as f32 * fw).floor() as u32).min(raw.width),
                    ((y0 as f32 * fh).floor() as u32).min(raw.height),
                    ((x1 as f32 * fw).ceil() as u32).min(raw.width),
                    ((y1 as f32 * fh).ceil() as u32).min(raw.height),
                ]
            })
            .collect();
        Ok(Motion {
            boxes,
            whole: false,
        })
    }

    /// The background is the newest frame (kept in `prev`).
    fn start_over(&mut self) {
        self.background = self.prev.iter().map(|&v| f32::from(v)).collect();
    }

    /// Sizes the small frame and the mask for a `w` x `h` source.
    fn resize_for(&mut self, w: u32, h: u32) {
        let sh = self.frame_height.min(h).max(1);
        let sw = ((u64::from(w) * u64::from(sh)) as f64 / f64::from(h))
            .round()
            .max(1.0) as u32;
        let n = (sw * sh) as usize;
        self.source = (w, h);
        self.small = (sw, sh);
        let (fx, fy) = (w as f32 / sw as f32, h as f32 / sh as f32);
        self.masked = (0..n)
            .map(|i| {
                let (x, y) = ((i % sw as usize) as f32, (i / sw as usize) as f32);
                let p = Point::new((x + 0.5) * fx, (y + 0.5) * fy);
                self.masks.iter().any(|m| m.contains(p))
            })
            .collect();
        self.changed = vec![false; n];
        self.grown = vec![false; n];
    }

    /// The frame as the small grey frame, in `self.grey`.
    fn grey_small(&mut self, payload: &[u8], raw: RawImage) -> Result<(), DecodeError> {
        let (w, h) = (raw.width, raw.height);
        let to = self.small;
        let err = |e: &dyn std::fmt::Display| DecodeError::Resize {
            message: e.to_string(),
        };
        let opts =
            fir::ResizeOptions::new().resize_alg(fir::ResizeAlg::Convolution(fir::FilterType::Box));
        match raw.format {
            RawFormat::I420 { .. } => {
                let y = payload.get(..(w * h) as usize).unwrap_or_default();
                let view =
                    fir::images::ImageRef::new(w, h, y, fir::PixelType::U8).map_err(|e| err(&e))?;
                let mut dst = fir::images::Image::new(to.0, to.1, fir::PixelType::U8);
                self.resizer
                    .resize(&view, &mut dst, &opts)
                    .map_err(|e| err(&e))?;
                self.grey = dst.into_vec();
            }
            RawFormat::Rgb => {
                let view = fir::images::ImageRef::new(w, h, payload, fir::PixelType::U8x3)
                    .map_err(|e| err(&e))?;
                let mut dst = fir::images::Image::new(to.0, to.1, fir::PixelType::U8x3);
                self.resizer
                    .resize(&view, &mut dst, &opts)
                    .map_err(|e| err(&e))?;
                self.grey.clear();
                self.grey.extend(dst.buffer().chunks_exact(3).map(|p| {
                    // BT.601 luma in fixed point.
                    ((77 * u32::from(p[0]) + 150 * u32::from(p[1]) + 29 * u32::from(p[2])) >> 8)
                        as u8
                }));
            }
        }
        Ok(())
    }
}

/// 3x3 box blur (edges clamped): sensor noise of single pixels stays below
/// the threshold.
fn blur(src: &[u8], dst: &mut Vec<u8>, (w, h): (u32, u32)) {
    let (w, h) = (w as usize, h as usize);
    dst.clear();
    dst.resize(src.len(), 0);
    for y in 0..h {
        let rows = [y.saturating_sub(1), y, (y + 1).min(h - 1)];
        for x in 0..w {
            let cols = [x.saturating_sub(1), x, (x + 1).min(w - 1)];
            let mut s = 0u32;
            for r in rows {
                for c in cols {
                    s += u32::from(src[r * w + c]);
                }
            }
            dst[y * w + x] = (s / 9) as u8;
        }
    }
}

/// Grows the changed pixels by one in every direction (joins the parts of
/// one mover that the threshold split).
fn dilate(src: &[bool], dst: &mut [bool], (w, h): (u32, u32)) {
    let (w, h) = (w as usize, h as usize);
    dst.fill(false);
    for y in 0..h {
        for x in 0..w {
            if !src[y * w + x] {
                continue;
            }
            for r in y.saturating_sub(1)..=(y + 1).min(h - 1) {
                for c in x.saturating_sub(1)..=(x + 1).min(w - 1) {
                    dst[r * w + c] = true;
                }
            }
        }
    }
}

/// The 8-connected blobs of `on` (cleared on the way) with at least
/// `min_area` pixels, as boxes `[x0, y0, x1, y1)` of the small frame.
fn blobs(on: &mut [bool], (w, h): (u32, u32), min_area: u32) -> Vec<[u32; 4]> {
    let (w, h) = (w as usize, h as usize);
    let mut out = Vec::new();
    let mut stack = Vec::new();
    for start in 0..on.len() {
        if !on[start] {
            continue;
        }
        on[start] = false;
        stack.push(start);
        let (mut x0, mut y0, mut x1, mut y1) = (w, h, 0, 0);
        let mut area = 0u32;
        while let Some(i) = stack.pop() {
            let (x, y) = (i % w, i / w);
            area += 1;
            x0 = x0.min(x);
            y0 = y0.min(y);
            x1 = x1.max(x + 1);
            y1 = y1.max(y + 1);
            for r in y.saturating_sub(1)..=(y + 1).min(h - 1) {
                for c in x.saturating_sub(1)..=(x + 1).min(w - 1) {
                    let j = r * w + c;
                    if on[j] {
                        on[j] = false;
                        stack.push(j);
                    }
                }
            }
        }
        if area >= min_area {
            out.push([x0 as u32, y0 as u32, x1 as u32, y1 as u32]);
        }
    }
    out
}

/// Boxes closer than `gap` pixels (or overlapping) merged into one, until
/// no two are.
pub fn merge(mut boxes: Vec<[u32; 4]>, gap: u32) -> Vec<[u32; 4]> {
    let near = |a: &[u32; 4], b: &[u32; 4]| {
        a[0] <= b[2] + gap && b[0] <= a[2] + gap && a[1] <= b[3] + gap && b[1] <= a[3] + gap
    };
    loop {
        let mut joined = false;
        let mut i = 0;
        while i < boxes.len() {
            let mut j = i + 1;
            while j < boxes.len() {
                if near(&boxes[i], &boxes[j]) {
                    let b = boxes.swap_remove(j);
                    let a = &mut boxes[i];
                    *a = [
                        a[0].min(b[0]),
                        a[1].min(b[1]),
                        a[2].max(b[2]),
                        a[3].max(b[3]),
                    ];
                    joined = true;
                } else {
                    j += 1;
                }
            }
            i += 1;
        }
        if !joined {
            return boxes;
        }
    }
}

#[cfg(test)]
#[path = "detect_tests.rs"]
mod tests;
