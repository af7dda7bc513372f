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

use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use image::ImageEncoder;
use parking_lot::Mutex;
use serde_json::Value;

use crate::preprocess::PreprocessConfig;
use crate::preprocess::crop::{Rgb, decode_frame};
use crate::preprocess::raw::RawImage;

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

/// A kept frame: its bytes, their layout when raw, the record's outputs.
type Slot = (Bytes, Option<RawImage>, Value);

/// The latest frame and record outputs of one pipeline.
pub struct Latest {
    /// How frames decode; `None` for pipelines that take no images.
    pre: Option<PreprocessConfig>,
    /// The newest frame, of whichever stream.
    slot: Mutex<Option<(Arc<str>, Slot)>>,
    /// Each camera's newest frame (pipelines over several cameras), in the
    /// pipeline's camera order; empty for other pipelines.
    streams: Vec<(Arc<str>, Mutex<Option<Slot>>)>,
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
        .then(|| pre.clone());
        Latest {
            streams: streams
                .iter()
                .map(|s| (s.clone(), Mutex::new(None)))
                .collect(),
            pre,
            slot: Mutex::new(None),
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

    /// Keeps a frame of `stream` and its outputs (a reference count, no
    /// copy of the bytes).
    pub fn keep(&self, stream: &Arc<str>, payload: &Bytes, raw: Option<RawImage>, outputs: &Value) {
        if self.pre.is_none() {
            return;
        }
        let slot = (payload.clone(), raw, outputs.clone());
        let name = match self.streams.iter().find(|(s, _)| s == stream) {
            Some((name, own)) => {
                *own.lock() = Some(slot.clone());
                name.clone()
            }
            None => stream.clone(),
        };
        *self.slot.lock() = Some((name, slot));
    }

    /// The latest frame (of `stream`, where given) with its boxes drawn, as
    /// JPEG; `Ok(None)` before such a frame. A stream that is not one of
    /// a pipeline's cameras is [`SnapshotError::UnknownStream`]; a pipeline
    /// that keeps only its newest frame draws it when it is of `stream`.
    pub fn render(&self, stream: Option<&str>) -> Result<Option<Vec<u8>>, SnapshotError> {
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
        let Some((payload, raw, outputs)) = kept else {
            return Ok(None);
        };
        let mut img = match raw {
            Some(raw) => raw.to_rgb(&payload),
            None => decode_frame(&payload, pre),
        }?;
        draw(&mut img, &outputs);
        Ok(Some(jpeg(&img, 90)?))
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
}

fn four(v: &Value) -> Option<[f64; 4]> {
    let a = v.as_array()?;
    let x: Vec<f64> = a.iter().filter_map(Value::as_f64).collect();
    (x.len() == 4).then(|| [x[0], x[1], x[2], x[3]])
}

/// Draws each box of `outputs.detections` (a detector's) or
/// `outputs.boxes` (MTCNN's, OCR's), and its landmarks.
pub fn draw(img: &mut Rgb, outputs: &Value) {
    let Some(boxes) = crate::track::value::BOX_KEYS
        .iter()
        .find_map(|k| outputs.get(*k).and_then(Value::as_array))
    else {
        return;
    };
    for b in boxes {
        if let Some(r) = b.get("box").and_then(four) {
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
                let (x, y) = (x.round() as i64, y.round() as i64);
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
        let size = |j: Vec<u8>| {
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
