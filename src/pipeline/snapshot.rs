//! Annotated snapshots: the latest frame of an image pipeline with the boxes
//! of its latest record drawn (`GET /v1/pipelines/{name}/snapshot.jpg`), and
//! the optional per-box thumbnails of records. The frame is kept as it
//! came (a reference to its bytes) and decoded and drawn only when asked for.
//!
//! Bounds: a pipeline keeps its newest frame (of any stream); a pipeline
//! over several cameras also keeps the newest frame of each camera
//! (`?stream=NAME`), in slots made with the pipeline from its fixed camera
//! list, never from what arrives. The newest frame is one of those, so such
//! a pipeline holds one frame per camera at most (a reference to bytes the
//! camera already made, no copy); other pipelines hold one frame.
//!
//! Drawing a large frame takes memory and time (a 7936x7936 camera: 190 MB
//! of RGB and a second or more), so requests never multiply it:
//! - each kept frame is drawn once, and every request for it shares that
//!   JPEG (requests that come while it is drawn wait for it);
//! - the daemon draws at most [`MAX_RENDERS`] frames at once ([`Renders`]);
//!   a request that would draw one more is refused at once
//!   ([`SnapshotError::Busy`]: 503 with `Retry-After`), and counted;
//! - what is drawn is at most [`MAX_SIDE`] pixels on its long side: a
//!   raw camera frame is scaled down before it is turned into RGB, so a
//!   render holds the small picture, not a full-size copy (an encoded
//!   image is decoded whole, as the pipeline decoded it, then scaled).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine;
use bytes::Bytes;
use fast_image_resize as fir;
use image::ImageEncoder;
use parking_lot::Mutex;
use serde_json::Value;

use crate::preprocess::PreprocessConfig;
use crate::preprocess::crop::{Rgb, decode_frame};
use crate::preprocess::pixels::resize_pixels;
use crate::preprocess::raw::{RawFormat, RawImage};

/// Box outlines: green, 3 px wide (centred on the box edge), clear of JPEG blur.
pub const BOX_COLOUR: [u8; 3] = [0, 255, 0];
/// Landmarks: red 5x5 squares.
pub const MARK_COLOUR: [u8; 3] = [255, 0, 0];
/// Labels: white 8x8 glyphs (scaled with the frame) on a black strip just
/// above the box (inside its top edge when the frame has no room above).
pub const LABEL_COLOUR: [u8; 3] = [255, 255, 255];
pub const LABEL_BACKGROUND: [u8; 3] = [0, 0, 0];
/// Characters of a label at most (longer text ends in `~`).
const LABEL_CHARS: usize = 48;
/// The long side of a snapshot, at most: a larger frame is scaled down
/// (1080p and smaller are drawn as they are).
pub const MAX_SIDE: u32 = 1920;
/// Frames the daemon draws at once, at most; one more request that needs
/// a drawing is answered 503.
pub const MAX_RENDERS: usize = 2;
/// What a 503 tells the caller to wait before asking again, in seconds.
pub const RETRY_AFTER_S: u64 = 1;

/// A kept frame: its bytes, their layout when raw, the record's outputs,
/// and its drawing once a request made it (shared by every request for
/// this frame; dropped with the frame).
#[derive(Clone)]
struct Slot {
    payload: Bytes,
    raw: Option<RawImage>,
    outputs: Value,
    jpeg: Arc<tokio::sync::OnceCell<Bytes>>,
}

/// A pipeline's snapshot figures, for `/metrics`.
#[derive(Debug, Default)]
pub struct SnapshotStats {
    /// Frames drawn (each at most once).
    pub renders: AtomicU64,
    /// Requests answered 503: the daemon was drawing its most at once.
    pub refused: AtomicU64,
}

/// The daemon's bound on snapshot drawings at once (one per API).
#[derive(Debug, Clone)]
pub struct Renders {
    permits: Arc<tokio::sync::Semaphore>,
    max_side: u32,
}

impl Renders {
    /// At most `max` drawings at once, each at most `max_side` pixels on
    /// its long side.
    pub fn new(max: usize, max_side: u32) -> Renders {
        Renders {
            permits: Arc::new(tokio::sync::Semaphore::new(max)),
            max_side: max_side.max(1),
        }
    }
}

impl Default for Renders {
    fn default() -> Self {
        Renders::new(MAX_RENDERS, MAX_SIDE)
    }
}

/// The latest frame and record outputs of one pipeline.
pub struct Latest {
    /// How frames decode; `None` for pipelines that take no images.
    pre: Option<Arc<PreprocessConfig>>,
    /// The newest frame, of whichever stream.
    slot: Mutex<Option<(Arc<str>, Slot)>>,
    /// Each camera's newest frame (pipelines over several cameras), in the
    /// pipeline's camera order; empty for other pipelines.
    streams: Vec<(Arc<str>, Mutex<Option<Slot>>)>,
    stats: Arc<SnapshotStats>,
}

/// One kept frame, to draw (or to take the drawing of).
pub struct KeptFrame {
    pre: Arc<PreprocessConfig>,
    slot: Slot,
    stats: Arc<SnapshotStats>,
}

impl Latest {
    pub fn new(pre: &PreprocessConfig) -> Latest {
        Latest::with_streams(pre, &[])
    }

    /// A pipeline whose streams are the fixed `streams` (its cameras): each
    /// keeps its own newest frame as well.
    pub fn with_streams(pre: &PreprocessConfig, streams: &[Arc<str>]) -> Latest {
        let pre = matches!(
            pre,
            PreprocessConfig::Image { .. } | PreprocessConfig::Pyramid { .. }
        )
        .then(|| Arc::new(pre.clone()));
        Latest {
            streams: streams
                .iter()
                .map(|s| (s.clone(), Mutex::new(None)))
                .collect(),
            pre,
            slot: Mutex::new(None),
            stats: Arc::default(),
        }
    }

    pub fn takes_images(&self) -> bool {
        self.pre.is_some()
    }

    /// Whether each stream keeps its own frame (`?stream=` of any of
    /// [`Latest::streams`]); otherwise only the newest is kept.
    pub fn keeps_each_stream(&self) -> bool {
        !self.streams.is_empty()
    }

    /// The streams that keep their own frame.
    pub fn streams(&self) -> Vec<&str> {
        self.streams.iter().map(|(s, _)| &**s).collect()
    }

    pub fn stats(&self) -> &SnapshotStats {
        &self.stats
    }

    /// Keeps a frame of `stream` and its outputs (a reference count, no
    /// copy of the bytes).
    pub fn keep(&self, stream: &Arc<str>, payload: &Bytes, raw: Option<RawImage>, outputs: &Value) {
        if self.pre.is_none() {
            return;
        }
        let slot = Slot {
            payload: payload.clone(),
            raw,
            outputs: outputs.clone(),
            jpeg: Arc::default(),
        };
        let name = match self.streams.iter().find(|(s, _)| s == stream) {
            Some((name, own)) => {
                *own.lock() = Some(slot.clone());
                name.clone()
            }
            None => stream.clone(),
        };
        *self.slot.lock() = Some((name, slot));
    }

    /// The latest frame (of `stream`, where given); `Ok(None)` before such
    /// a frame. A stream that is not one of a pipeline's cameras is
    /// [`SnapshotError::UnknownStream`]; a pipeline that keeps only its
    /// newest frame gives it when it is of `stream`.
    pub fn frame(&self, stream: Option<&str>) -> Result<Option<KeptFrame>, SnapshotError> {
        let Some(pre) = self.pre.as_ref() else {
            return Ok(None);
        };
        let kept = match stream {
            None => self.slot.lock().clone().map(|(_, s)| s),
            Some(name) if self.keeps_each_stream() => {
                let Some((_, own)) = self.streams.iter().find(|(s, _)| &**s == name) else {
                    return Err(SnapshotError::UnknownStream(name.to_string()));
                };
                own.lock().clone()
            }
            Some(name) => self
                .slot
                .lock()
                .clone()
                .filter(|(s, _)| &**s == name)
                .map(|(_, s)| s),
        };
        Ok(kept.map(|slot| KeptFrame {
            pre: pre.clone(),
            slot,
            stats: self.stats.clone(),
        }))
    }

    /// The latest frame (of `stream`) drawn now, as JPEG, outside the
    /// daemon's bound (tests).
    #[cfg(test)]
    fn render(&self, stream: Option<&str>) -> Result<Option<Bytes>, SnapshotError> {
        match self.frame(stream)? {
            Some(f) => draw_frame(&f.pre, &f.slot, MAX_SIDE).map(Some),
            None => Ok(None),
        }
    }
}

impl KeptFrame {
    /// Its drawing as JPEG: the one already made for this frame, else
    /// drawn now within `renders` (every request for the frame that comes
    /// meanwhile waits for this drawing and shares it). Past the bound:
    /// [`SnapshotError::Busy`], counted.
    pub async fn jpeg(&self, renders: &Renders) -> Result<Bytes, SnapshotError> {
        let jpeg = self
            .slot
            .jpeg
            .get_or_try_init(|| async move {
                let Ok(permit) = renders.permits.clone().try_acquire_owned() else {
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                    return Err(SnapshotError::Busy);
                };
                let (pre, slot, stats) = (self.pre.clone(), self.slot.clone(), self.stats.clone());
                let max_side = renders.max_side;
                // Decoding and JPEG encoding take milliseconds (seconds for
                // a huge frame): off the async workers. The permit goes
                // with the drawing, so a request given up on does not free
                // it before the memory is.
                let drawn = tokio::task::spawn_blocking(move || {
                    let _permit = permit;
                    let r = draw_frame(&pre, &slot, max_side);
                    if r.is_ok() {
                        stats.renders.fetch_add(1, Ordering::Relaxed);
                    }
                    r
                })
                .await;
                drawn.unwrap_or_else(|e| Err(SnapshotError::Interrupted(e.to_string())))
            })
            .await?;
        Ok(jpeg.clone())
    }
}

/// Why the latest frame could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("decoding the frame: {0}")]
    Decode(#[from] crate::preprocess::DecodeError),
    #[error("encoding the JPEG: {0}")]
    Encode(#[from] image::ImageError),
    #[error("no camera `{0}` in this pipeline")]
    UnknownStream(String),
    /// The daemon is drawing its most snapshots at once: ask again later.
    #[error("busy drawing other snapshots; try again")]
    Busy,
    #[error("the drawing stopped: {0}")]
    Interrupted(String),
}

/// `w` x `h` within `max_side` on the long side (aspect kept, at least 1
/// pixel a side), and the scale from the frame to it.
pub fn fit(w: u32, h: u32, max_side: u32) -> (u32, u32, f64) {
    let long = w.max(h);
    if long <= max_side || long == 0 {
        return (w, h, 1.0);
    }
    let s = max_side as f64 / long as f64;
    let side = |v: u32| ((v as f64 * s).round() as u32).clamp(1, max_side);
    (side(w), side(h), s)
}

/// A raw frame as RGB within `max_side`: scaled down in its own layout
/// first (I420 planes, packed RGB), so only the small picture is
/// converted; the scale from the frame to it.
fn raw_within(raw: &RawImage, payload: &[u8], max_side: u32) -> Result<(Rgb, f64), SnapshotError> {
    let (w, h, s) = fit(raw.width, raw.height, max_side);
    if (w, h) == (raw.width, raw.height) {
        return Ok((raw.to_rgb(payload)?, s));
    }
    raw.check(payload)?;
    let mut resizer = fir::Resizer::new();
    let pixels = match raw.format {
        RawFormat::Rgb => resize_pixels(
            &mut resizer,
            payload,
            (raw.width, raw.height),
            (w, h),
            fir::PixelType::U8x3,
        )?,
        RawFormat::I420 { .. } => raw.i420_resized_rgb(payload, w, h, &mut resizer)?,
    };
    Ok((
        Rgb {
            width: w,
            height: h,
            pixels,
        },
        s,
    ))
}

/// A kept frame with its boxes drawn, at most `max_side` on its long side,
/// as JPEG.
fn draw_frame(pre: &PreprocessConfig, slot: &Slot, max_side: u32) -> Result<Bytes, SnapshotError> {
    let (mut img, scale) = match &slot.raw {
        Some(raw) => raw_within(raw, &slot.payload, max_side)?,
        None => {
            let full = decode_frame(&slot.payload, pre)?;
            let (w, h, s) = fit(full.width, full.height, max_side);
            if (w, h) == (full.width, full.height) {
                (full, s)
            } else {
                let small = full.resize(w, h)?;
                drop(full);
                (small, s)
            }
        }
    };
    draw_scaled(&mut img, &slot.outputs, scale);
    Ok(Bytes::from(jpeg(&img, 90)?))
}

fn four(v: &Value) -> Option<[f64; 4]> {
    let a = v.as_array()?;
    let x: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
    (x.len() == 4).then(|| [x[0], x[1], x[2], x[3]])
}

/// Draws each box of `outputs.detections` (a detector's) or
/// `outputs.boxes` (MTCNN's, OCR's), and its landmarks.
pub fn draw(img: &mut Rgb, outputs: &Value) {
    draw_scaled(img, outputs, 1.0)
}

/// [`draw`] on a picture `scale` times the frame's size (the boxes are in
/// the frame's pixels).
fn draw_scaled(img: &mut Rgb, outputs: &Value, scale: f64) {
    let Some(boxes) = crate::track::value::BOX_KEYS
        .iter()
        .find_map(|k| outputs.get(*k).and_then(Value::as_array))
    else {
        return;
    };
    for b in boxes {
        if let Some(r) = b.get("box").and_then(four).map(|r| r.map(|v| v * scale)) {
            rect(img, r);
            if let Some(text) = label(b) {
                draw_label(img, r, &text);
            }
        }
        for p in b
            .get("landmarks")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some([x, y]) = p
                .as_array()
                .filter(|a| a.len() == 2)
                .and_then(|a| Some([a[0].as_f64()?, a[1].as_f64()?]))
            {
                let (x, y) = ((x * scale).round() as i64, (y * scale).round() as i64);
                fill(img, x - 2, y - 2, x + 3, y + 3, MARK_COLOUR);
            }
        }
    }
}

/// What a box says: its text (OCR), else its class label, else its score;
/// a tracked box's label ends in its track's number (`{boot}-{n}`).
fn label(b: &Value) -> Option<String> {
    let score = b.get("score").and_then(Value::as_f64);
    if let Some(t) = b.get("text").and_then(Value::as_str) {
        return Some(t.to_string());
    }
    let class = b.get("label").and_then(|v| match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    });
    let track = b
        .get("track")
        .and_then(Value::as_str)
        .and_then(|t| t.rsplit('/').next());
    let class = match (class, track) {
        (Some(c), Some(t)) => Some(format!("{c} {t}")),
        (c, _) => c,
    };
    match (class, score) {
        (Some(c), Some(s)) => Some(format!("{c} {s:.2}")),
        (Some(c), None) => Some(c),
        (None, Some(s)) => Some(format!("{s:.2}")),
        (None, None) => None,
    }
}

/// Glyph pixel size: 1 up to 480 px frames, 2 up to 960, and so on.
fn label_scale(img: &Rgb) -> i64 {
    (img.width.max(img.height) as i64 / 480).clamp(1, 4)
}

/// Writes `text` on a strip above the box `r` (characters outside ASCII and
/// Latin-1 print as `?`).
fn draw_label(img: &mut Rgb, r: [f64; 4], text: &str) {
    let s = label_scale(img);
    let mut chars: Vec<char> = text.chars().take(LABEL_CHARS + 1).collect();
    if chars.len() > LABEL_CHARS {
        chars.truncate(LABEL_CHARS - 1);
        chars.push('~');
    }
    let [x0, y0, _, _] = r.map(|v| v.round() as i64);
    let (pad, glyph) = (s, 8 * s);
    let h = glyph + 2 * pad;
    let w = chars.len() as i64 * glyph + 2 * pad;
    let top = if y0 - 2 - h >= 0 { y0 - 2 - h } else { y0 + 2 };
    let left = (x0 - 1).clamp(0, (img.width as i64 - w).max(0));
    fill(img, left, top, left + w, top + h, LABEL_BACKGROUND);
    for (i, c) in chars.iter().enumerate() {
        let rows = glyph_rows(*c);
        let gx = left + pad + i as i64 * glyph;
        for (row, bits) in rows.iter().enumerate() {
            for col in 0..8 {
                // Bit 0 is the leftmost pixel of a row.
                if bits >> col & 1 == 1 {
                    let (px, py) = (gx + col * s, top + pad + row as i64 * s);
                    fill(img, px, py, px + s, py + s, LABEL_COLOUR);
                }
            }
        }
    }
}

fn glyph_rows(c: char) -> [u8; 8] {
    use font8x8::legacy::{BASIC_LEGACY, LATIN_LEGACY};
    let code = c as usize;
    match code {
        0x20..0x7f => BASIC_LEGACY[code],
        0xa0..=0xff => LATIN_LEGACY[code - 0xa0],
        _ => BASIC_LEGACY[b'?' as usize],
    }
}

fn fill(img: &mut Rgb, x0: i64, y0: i64, x1: i64, y1: i64, c: [u8; 3]) {
    let (w, h) = (img.width as i64, img.height as i64);
    for y in y0.max(0)..y1.min(h) {
        for x in x0.max(0)..x1.min(w) {
            let at = ((y * w + x) * 3) as usize;
            img.pixels[at..at + 3].copy_from_slice(&c);
        }
    }
}

/// A 3 px outline centred on the box's edges.
fn rect(img: &mut Rgb, r: [f64; 4]) {
    let [x0, y0, x1, y1] = r.map(|v| v.round() as i64);
    fill(img, x0 - 1, y0 - 1, x1 + 2, y0 + 2, BOX_COLOUR);
    fill(img, x0 - 1, y1 - 1, x1 + 2, y1 + 2, BOX_COLOUR);
    fill(img, x0 - 1, y0 - 1, x0 + 2, y1 + 2, BOX_COLOUR);
    fill(img, x1 - 1, y0 - 1, x1 + 2, y1 + 2, BOX_COLOUR);
}

/// JPEG of packed RGB at `quality`.
pub fn jpeg(img: &Rgb, quality: u8) -> Result<Vec<u8>, image::ImageError> {
    let mut out = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, quality).write_image(
        &img.pixels,
        img.width,
        img.height,
        image::ExtendedColorType::Rgb8,
    )?;
    Ok(out)
}

/// A JPEG of the crop within `max_bytes`: lower quality first, then half
/// the size, until it fits (`None` when even 8 px does not).
pub fn thumbnail(crop: &Rgb, max_bytes: usize) -> Option<Vec<u8>> {
    let mut img = crop.clone();
    // Thumbnails are small: at most 256 px on the longer side.
    let long = img.width.max(img.height);
    if long > 256 {
        let s = 256.0 / long as f64;
        img = img
            .resize(
                ((img.width as f64 * s).round() as u32).max(1),
                ((img.height as f64 * s).round() as u32).max(1),
            )
            .ok()?;
    }
    loop {
        for q in [80u8, 60, 40, 25] {
            let j = jpeg(&img, q).ok()?;
            if j.len() <= max_bytes {
                return Some(j);
            }
        }
        if img.width.max(img.height) <= 8 {
            return None;
        }
        img = img
            .resize((img.width / 2).max(1), (img.height / 2).max(1))
            .ok()?;
    }
}

/// Adds `thumbnail` (base64 JPEG of the box's pixels) to each box.
pub fn attach_thumbnails(frame: &Rgb, outputs: &mut Value, max_bytes: usize) {
    let Some(boxes) = outputs.get_mut("boxes").and_then(Value::as_array_mut) else {
        return;
    };
    for b in boxes.iter_mut() {
        let Some(r) = b.get("box").and_then(four) else {
            continue;
        };
        let (x0, y0) = (r[0].floor() as i64, r[1].floor() as i64);
        let (x1, y1) = (
            (r[2].ceil() as i64).max(x0 + 1),
            (r[3].ceil() as i64).max(y0 + 1),
        );
        let crop = frame.crop(
            x0.max(0),
            y0.max(0),
            x1.min(frame.width as i64).max(x0.max(0) + 1),
            y1.min(frame.height as i64).max(y0.max(0) + 1),
        );
        if let Some(j) = thumbnail(&crop, max_bytes) {
            b["thumbnail"] = Value::String(base64::engine::general_purpose::STANDARD.encode(j));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grey(w: u32, h: u32) -> Rgb {
        Rgb {
            width: w,
            height: h,
            pixels: vec![128; (w * h * 3) as usize],
        }
    }

    #[test]
    fn draws_outlines_and_landmarks_inside_the_frame() {
        let mut img = grey(50, 40);
        let out = serde_json::json!({"boxes": [
            {"box": [10.0, 10.0, 30.0, 20.0], "landmarks": [[20.0, 15.0]]},
            {"box": [-100.0, -5.0, 400.0, 1e9]}
        ]});
        draw(&mut img, &out);
        let at = |x: usize, y: usize| &img.pixels[(y * 50 + x) * 3..(y * 50 + x) * 3 + 3];
        assert_eq!(at(20, 10), BOX_COLOUR);
        assert_eq!(at(30, 15), BOX_COLOUR);
        assert_eq!(at(20, 15), MARK_COLOUR);
        assert_eq!(at(15, 15), &[128, 128, 128]);
    }

    #[test]
    fn a_detectors_detections_are_drawn_like_boxes() {
        // Room above the box for its label strip (rows 8..18).
        let mut img = grey(60, 50);
        let out = serde_json::json!({"detections": [
            {"box": [10.0, 20.0, 30.0, 35.0], "score": 0.5, "class": 2, "label": "car"}
        ]});
        draw(&mut img, &out);
        let at = |x: usize, y: usize| &img.pixels[(y * 60 + x) * 3..(y * 60 + x) * 3 + 3];
        assert_eq!(at(30, 27), BOX_COLOUR);
        assert_eq!(at(20, 35), BOX_COLOUR);
        assert_eq!(at(20, 27), &[128, 128, 128]);
        assert_eq!(at(10, 8), LABEL_BACKGROUND);
    }

    #[test]
    fn labels_say_text_or_score_above_the_box() {
        assert_eq!(
            label(&serde_json::json!({"text": "pump 3", "score": 0.9})).as_deref(),
            Some("pump 3")
        );
        assert_eq!(
            label(&serde_json::json!({"score": 0.98765})).as_deref(),
            Some("0.99")
        );
        assert_eq!(
            label(&serde_json::json!({"label": "cat", "score": 0.5})).as_deref(),
            Some("cat 0.50")
        );
        assert_eq!(label(&serde_json::json!({"box": [0, 0, 1, 1]})), None);
        assert_eq!(
            label(
                &serde_json::json!({"label": "car", "score": 0.5, "track": "gw/street/cam/3-17"})
            )
            .as_deref(),
            Some("car 3-17 0.50")
        );

        let mut img = grey(100, 60);
        draw(
            &mut img,
            &serde_json::json!({"boxes": [{"box": [10.0, 30.0, 60.0, 50.0], "text": "I"}]}),
        );
        let at = |x: i64, y: i64| {
            let i = ((y * 100 + x) * 3) as usize;
            [img.pixels[i], img.pixels[i + 1], img.pixels[i + 2]]
        };
        // Strip: rows 18..28 (10 px = 8 + 2 x 1 padding), from x = 9.
        assert_eq!(at(9, 18), LABEL_BACKGROUND);
        assert_eq!(at(9 + 9, 27), LABEL_BACKGROUND);
        assert_eq!(at(9, 17), [128, 128, 128]);
        // The glyph `I`: its stem is lit in the middle rows.
        let lit = (19..27)
            .flat_map(|y| (10..18).map(move |x| (x, y)))
            .filter(|(x, y)| at(*x, *y) == LABEL_COLOUR)
            .count();
        assert!(lit >= 8, "{lit} lit pixels");
        // No room above: the label goes inside the box's top edge.
        let mut img = grey(100, 60);
        draw(
            &mut img,
            &serde_json::json!({"boxes": [{"box": [10.0, 4.0, 60.0, 50.0], "score": 0.5}]}),
        );
        let i = ((7 * 100 + 10) * 3) as usize;
        assert_eq!(&img.pixels[i..i + 3], LABEL_BACKGROUND);
    }

    #[test]
    fn each_camera_keeps_its_own_frame_and_others_are_unknown() {
        let pre: PreprocessConfig =
            toml::from_str("type = \"image\"\nwidth = 8\nheight = 8").unwrap();
        let (gate, yard): (Arc<str>, Arc<str>) = ("gate".into(), "yard".into());
        let l = Latest::with_streams(&pre, &[gate.clone(), yard.clone()]);
        assert!(l.keeps_each_stream());
        assert!(l.render(None).unwrap().is_none());
        assert!(l.render(Some("gate")).unwrap().is_none());
        let frame = |w: u32, h: u32| Bytes::from(vec![200u8; (w * h * 3) as usize]);
        let out = serde_json::json!({});
        l.keep(&gate, &frame(16, 8), Some(RawImage::rgb(16, 8)), &out);
        l.keep(&yard, &frame(8, 24), Some(RawImage::rgb(8, 24)), &out);
        let size = |j: Bytes| {
            let img = image::load_from_memory(&j).unwrap();
            (img.width(), img.height())
        };
        assert_eq!(size(l.render(Some("gate")).unwrap().unwrap()), (16, 8));
        assert_eq!(size(l.render(Some("yard")).unwrap().unwrap()), (8, 24));
        // Without a stream: the newest of any.
        assert_eq!(size(l.render(None).unwrap().unwrap()), (8, 24));
        assert!(matches!(
            l.render(Some("dock")),
            Err(SnapshotError::UnknownStream(s)) if s == "dock"
        ));

        // One stream's frame only: a stream is drawn while its frame is the newest.
        let one = Latest::new(&pre);
        assert!(!one.keeps_each_stream());
        one.keep(&gate, &frame(16, 8), Some(RawImage::rgb(16, 8)), &out);
        assert!(one.render(Some("gate")).unwrap().is_some());
        assert!(one.render(Some("yard")).unwrap().is_none());
    }

    /// Issue 50, item 3: a 7936x7936 camera's snapshot was drawn at full
    /// size for every request. A large frame is drawn within MAX_SIDE,
    /// its boxes where they belong on the smaller picture, from raw RGB
    /// and raw I420 alike.
    #[test]
    fn a_large_frame_is_drawn_within_max_side_with_its_boxes_scaled() {
        let pre: PreprocessConfig =
            toml::from_str("type = \"image\"\nwidth = 8\nheight = 8").unwrap();
        let (w, h) = (4000u32, 2000u32);
        let out = serde_json::json!({"boxes": [{"box": [1000.0, 500.0, 3000.0, 1500.0]}]});
        let cam: Arc<str> = "cam".into();
        let rgb = vec![128u8; (w * h * 3) as usize];
        let i420 =
            crate::preprocess::raw::reference::rgb_to_i420(&rgb, w as usize, h as usize, false);
        for (payload, raw) in [
            (rgb.clone(), RawImage::rgb(w, h)),
            (
                i420,
                RawImage {
                    width: w,
                    height: h,
                    format: RawFormat::I420 { bt709: false },
                },
            ),
        ] {
            let l = Latest::new(&pre);
            l.keep(&cam, &Bytes::from(payload), Some(raw), &out);
            let j = l.render(None).unwrap().unwrap();
            let img = image::load_from_memory(&j).unwrap().into_rgb8();
            assert_eq!((img.width(), img.height()), (1920, 960), "{raw:?}");
            // The box [1000, 500, 3000, 1500] at 0.48: [480, 240, 1440, 720].
            let green = |x: u32, y: u32| {
                let p = img.get_pixel(x, y).0;
                p[1] > 180 && p[0] < 110 && p[2] < 110
            };
            assert!(green(960, 240) && green(960, 720) && green(480, 480) && green(1440, 480));
            assert!(!green(960, 480) && !green(960, 260));
        }
        assert_eq!(fit(7936, 7936, MAX_SIDE), (1920, 1920, 1920.0 / 7936.0));
        assert_eq!(fit(1920, 1080, MAX_SIDE), (1920, 1080, 1.0));
        assert_eq!(fit(100_000, 1, MAX_SIDE), (1920, 1, 1920.0 / 100_000.0));
    }

    /// Issue 50, item 3: 8 clients x 3 requests drew the frame 24 times at
    /// once. A frame is drawn once and shared; a request that needs a
    /// drawing while the daemon draws its most is refused and counted.
    #[test]
    fn a_frame_is_drawn_once_and_a_drawing_past_the_bound_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let pre: PreprocessConfig =
            toml::from_str("type = \"image\"\nwidth = 8\nheight = 8").unwrap();
        let cam: Arc<str> = "cam".into();
        let l = Latest::new(&pre);
        let frame = || Bytes::from(vec![90u8; 64 * 48 * 3]);
        l.keep(
            &cam,
            &frame(),
            Some(RawImage::rgb(64, 48)),
            &serde_json::json!({}),
        );
        let renders = Renders::new(1, MAX_SIDE);
        rt.block_on(async {
            // Another drawing holds the only permit: refused, counted.
            let held = renders.permits.clone().try_acquire_owned().unwrap();
            let f = l.frame(None).unwrap().unwrap();
            assert!(matches!(f.jpeg(&renders).await, Err(SnapshotError::Busy)));
            assert_eq!(l.stats().refused.load(Ordering::Relaxed), 1);
            drop(held);
            // Free: drawn once, and every request for the frame shares it.
            let mut all = tokio::task::JoinSet::new();
            for _ in 0..8 {
                let (f, r) = (l.frame(None).unwrap().unwrap(), renders.clone());
                all.spawn(async move { f.jpeg(&r).await.unwrap() });
            }
            let got = all.join_all().await;
            assert_eq!(got.len(), 8);
            assert!(got.windows(2).all(|w| w[0] == w[1]));
            assert_eq!(l.stats().renders.load(Ordering::Relaxed), 1);
            // A new frame is drawn anew.
            l.keep(
                &cam,
                &frame(),
                Some(RawImage::rgb(64, 48)),
                &serde_json::json!({}),
            );
            let f = l.frame(None).unwrap().unwrap();
            f.jpeg(&renders).await.unwrap();
            assert_eq!(l.stats().renders.load(Ordering::Relaxed), 2);
            assert_eq!(renders.permits.available_permits(), 1);
        });
    }

    #[test]
    fn thumbnails_fit_their_bound() {
        let mut img = grey(300, 200);
        for (i, p) in img.pixels.iter_mut().enumerate() {
            *p = (i * 7919 % 251) as u8; // noise compresses badly
        }
        let t = thumbnail(&img, 2_000).unwrap();
        assert!(t.len() <= 2_000, "{}", t.len());
        assert!(t.starts_with(&[0xFF, 0xD8]));
    }
}
