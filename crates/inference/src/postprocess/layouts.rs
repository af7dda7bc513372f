//! The output layouts of the detectors people export, decoded to candidate
//! boxes in model-input pixels (before thresholding by the caller's NMS):
//!
//! | layout   | tensors                                   | boxes            | score                 |
//! |----------|-------------------------------------------|------------------|-----------------------|
//! | `rows`   | `[1, N, 6+]` box, score, class            | `format`         | column 4              |
//! | `yolov8` | `[1, 4+nc, N]` (YOLOv8 / YOLO11)          | cx, cy, w, h     | best class            |
//! | `yolov5` | `[1, N, 5+nc]`                            | cx, cy, w, h     | objectness x class    |
//! | `yolox`  | `[1, N, 5+nc]`, raw per grid cell         | grid + exp(wh)   | objectness x class    |
//! | `ssd`    | boxes `[1, N, 4]` + scores `[1, N, nc]`   | `format`         | best class (softmaxed)|
//! | `detr`   | boxes `[1, Q, 4]` + logits `[1, Q, nc+1]` | cx, cy, w, h 0-1 | softmax, last = none  |
//! | `rtdetr` | boxes `[1, Q, 4]` + logits `[1, Q, nc]`   | cx, cy, w, h 0-1 | sigmoid               |
//!
//! A leading batch axis of 1 is optional everywhere.

use serde::{Deserialize, Serialize};

use super::{PostError, floats};
use crate::backend::Tensor;

/// How the four numbers of a box describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoxFormat {
    /// Corners: x1, y1, x2, y2.
    #[default]
    Xyxy,
    /// Centre and size: cx, cy, w, h.
    Cxcywh,
    /// Corners, y first: y1, x1, y2, x2 (TensorFlow's SSD exports).
    Yxyx,
}

/// One candidate: corners in model coordinates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Det {
    pub bbox: [f32; 4],
    pub score: f32,
    pub class: usize,
}

/// How a detector's outputs are laid out (see the table above).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DetectionLayout {
    #[default]
    Rows,
    /// Ultralytics YOLOv8 and YOLO11 exports: channels first, no objectness.
    #[serde(alias = "yolo11")]
    Yolov8,
    /// Ultralytics YOLOv5 exports: a row per anchor with objectness.
    Yolov5,
    /// Megvii YOLOX exports without decoding in the graph.
    Yolox,
    /// Separate boxes and per-class scores, one row per prior.
    Ssd,
    /// DETR: no NMS; the last class is "no object".
    Detr,
    /// RT-DETR: no NMS; sigmoid class logits.
    Rtdetr,
}

impl DetectionLayout {
    /// The box format a layout's boxes come in unless `format` says otherwise.
    pub fn default_format(self) -> BoxFormat {
        match self {
            DetectionLayout::Rows | DetectionLayout::Ssd => BoxFormat::Xyxy,
            _ => BoxFormat::Cxcywh,
        }
    }

    /// Whether its boxes are fractions of the input size unless
    /// `normalized` says otherwise.
    pub fn default_normalized(self) -> bool {
        matches!(self, DetectionLayout::Detr | DetectionLayout::Rtdetr)
    }

    /// Layouts whose boxes come from a second tensor (`boxes_output`).
    pub fn has_boxes_tensor(self) -> bool {
        matches!(
            self,
            DetectionLayout::Ssd | DetectionLayout::Detr | DetectionLayout::Rtdetr
        )
    }

    /// Set-prediction models give one box per object: no NMS.
    pub fn needs_nms(self) -> bool {
        !matches!(self, DetectionLayout::Detr | DetectionLayout::Rtdetr)
    }
}

/// What decoding needs besides the tensors.
pub struct Decode<'a> {
    pub layout: DetectionLayout,
    pub format: BoxFormat,
    /// Model input width and height (normalized boxes, YOLOX grids).
    pub input_size: Option<[u32; 2]>,
    pub normalized: bool,
    pub strides: &'a [u32],
    pub background_class: Option<usize>,
    /// Candidates scoring below this are not kept (saves the NMS work).
    pub score_threshold: f32,
}

/// `[.., rows, cols]` with every leading axis 1, as (rows, cols).
fn matrix(name: &str, t: &Tensor, expected: &str) -> Result<(usize, usize), PostError> {
    let s = t.shape();
    let bad = || PostError::BadShape {
        name: name.to_string(),
        shape: s.to_vec(),
        expected: expected.to_string(),
    };
    if s.len() < 2 || s[..s.len() - 2].iter().any(|d| *d != 1) {
        return Err(bad());
    }
    Ok((s[s.len() - 2], s[s.len() - 1]))
}

fn corners(format: BoxFormat, b: [f32; 4]) -> [f32; 4] {
    match format {
        BoxFormat::Xyxy => b,
        BoxFormat::Yxyx => [b[1], b[0], b[3], b[2]],
        BoxFormat::Cxcywh => [
            b[0] - b[2] / 2.0,
            b[1] - b[3] / 2.0,
            b[0] + b[2] / 2.0,
            b[1] + b[3] / 2.0,
        ],
    }
}

/// The best class of a row of scores (skipping `skip`), and its score.
fn best(scores: impl Iterator<Item = f32>, skip: Option<usize>) -> Option<(usize, f32)> {
    let mut top: Option<(usize, f32)> = None;
    for (c, s) in scores.enumerate() {
        if Some(c) == skip || !s.is_finite() {
            continue;
        }
        if top.is_none_or(|(_, b)| s > b) {
            top = Some((c, s));
        }
    }
    top
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Decodes one frame's outputs: `main` is `output` (rows, YOLO tensors;
/// scores or logits of the two-tensor layouts), `boxes` the `boxes_output`.
pub fn decode(
    d: &Decode,
    main: (&str, &Tensor),
    boxes: Option<(&str, &Tensor)>,
) -> Result<Vec<Det>, PostError> {
    let (name, t) = main;
    let v = floats(t);
    let mut out = Vec::new();
    let scale = |b: [f32; 4]| -> [f32; 4] {
        match (d.normalized, d.input_size) {
            (true, Some([w, h])) => {
                let (w, h) = (w as f32, h as f32);
                [b[0] * w, b[1] * h, b[2] * w, b[3] * h]
            }
            _ => b,
        }
    };
    let mut push = |bbox: [f32; 4], score: f32, class: usize| {
        if score >= d.score_threshold && score.is_finite() && bbox.iter().all(|x| x.is_finite()) {
            out.push(Det {
                bbox: scale(corners(d.format, bbox)),
                score,
                class,
            });
        }
    };
    match d.layout {
        DetectionLayout::Rows => {
            let (n, cols) = matrix(name, t, "[N, 6] or [1, N, 6] rows of box(4), score, class")?;
            if cols < 6 {
                return Err(PostError::BadShape {
                    name: name.into(),
                    shape: t.shape().to_vec(),
                    expected: "[N, 6] or [1, N, 6] rows of box(4), score, class".into(),
                });
            }
            for r in v.chunks_exact(cols).take(n) {
                // Class ids are small non-negative integers stored as floats.
                let class = if r[5].is_finite() && r[5] >= 0.0 {
                    r[5].round() as usize
                } else {
                    0
                };
                push([r[0], r[1], r[2], r[3]], r[4], class);
            }
        }
        DetectionLayout::Yolov8 => {
            let expected = "[1, 4 + classes, N] (channels first)";
            let (ch, n) = matrix(name, t, expected)?;
            if ch < 5 {
                return Err(PostError::BadShape {
                    name: name.into(),
                    shape: t.shape().to_vec(),
                    expected: expected.into(),
                });
            }
            for j in 0..n {
                let at = |c: usize| v[c * n + j];
                if let Some((class, s)) = best((4..ch).map(at), None) {
                    push([at(0), at(1), at(2), at(3)], s, class);
                }
            }
        }
        DetectionLayout::Yolov5 | DetectionLayout::Yolox => {
            let expected = "[1, N, 5 + classes]";
            let (n, cols) = matrix(name, t, expected)?;
            if cols < 6 {
                return Err(PostError::BadShape {
                    name: name.into(),
                    shape: t.shape().to_vec(),
                    expected: expected.into(),
                });
            }
            let grid = if d.layout == DetectionLayout::Yolox {
                Some(yolox_grid(name, t, d, n)?)
            } else {
                None
            };
            for (j, r) in v.chunks_exact(cols).take(n).enumerate() {
                let obj = r[4];
                let Some((class, cls)) = best(r[5..].iter().copied(), None) else {
                    continue;
                };
                let b = match &grid {
                    Some(g) => {
                        let (gx, gy, s) = g[j];
                        [
                            (r[0] + gx) * s,
                            (r[1] + gy) * s,
                            r[2].exp() * s,
                            r[3].exp() * s,
                        ]
                    }
                    None => [r[0], r[1], r[2], r[3]],
                };
                push(b, obj * cls, class);
            }
        }
        DetectionLayout::Ssd | DetectionLayout::Detr | DetectionLayout::Rtdetr => {
            let (bname, bt) = boxes.ok_or_else(|| PostError::MissingOutput {
                name: "boxes_output".into(),
                available: "a layout with separate boxes needs `boxes_output`".into(),
            })?;
            let (n, nc) = matrix(name, t, "[1, N, classes]")?;
            let (bn, four) = matrix(bname, bt, "[1, N, 4]")?;
            if four != 4 || bn != n || nc == 0 {
                return Err(PostError::BadShape {
                    name: bname.into(),
                    shape: bt.shape().to_vec(),
                    expected: format!("[1, {n}, 4] beside scores of shape {:?}", t.shape()),
                });
            }
            let bv = floats(bt);
            for j in 0..n {
                let row = &v[j * nc..(j + 1) * nc];
                let top = match d.layout {
                    DetectionLayout::Ssd => best(row.iter().copied(), d.background_class),
                    DetectionLayout::Detr => {
                        // Softmax over all classes, "no object" (the last) included.
                        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                        let sum: f32 = row.iter().map(|x| (x - m).exp()).sum();
                        best(row.iter().map(|x| (x - m).exp() / sum), Some(nc - 1))
                    }
                    _ => best(row.iter().map(|x| sigmoid(*x)), None),
                };
                let Some((class, s)) = top else { continue };
                let b = &bv[j * 4..j * 4 + 4];
                push([b[0], b[1], b[2], b[3]], s, class);
            }
        }
    }
    Ok(out)
}

/// Each YOLOX anchor's grid cell and stride: the strides' grids, each row
/// by row, in order.
fn yolox_grid(
    name: &str,
    t: &Tensor,
    d: &Decode,
    n: usize,
) -> Result<Vec<(f32, f32, f32)>, PostError> {
    let [w, h] = d.input_size.unwrap_or([0, 0]);
    let mut g = Vec::with_capacity(n);
    for &s in d.strides {
        let s = s.max(1);
        for y in 0..h / s {
            for x in 0..w / s {
                g.push((x as f32, y as f32, s as f32));
            }
        }
    }
    if g.len() != n {
        return Err(PostError::BadShape {
            name: name.to_string(),
            shape: t.shape().to_vec(),
            expected: format!(
                "{} anchors for an input of {w}x{h} at strides {:?}",
                g.len(),
                d.strides
            ),
        });
    }
    Ok(g)
}
