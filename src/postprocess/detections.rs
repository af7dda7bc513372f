//! Object detections: rows of `[box(4), score, class]`, score threshold,
//! class-wise greedy NMS, boxes mapped back to the original image.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{PostError, Postprocessor, find, floats, label};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_score_threshold() -> f32 {
    0.25
}
pub(super) fn default_iou_threshold() -> f32 {
    0.45
}
pub(super) fn default_max_detections() -> usize {
    100
}

/// How the first four columns of a row describe the box.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BoxFormat {
    /// Corners: x1, y1, x2, y2.
    #[default]
    Xyxy,
    /// Centre and size: cx, cy, w, h.
    Cxcywh,
}

/// Detections after thresholding and NMS.
pub struct DetectionsPostprocessor {
    pub output: String,
    pub format: BoxFormat,
    pub score_threshold: f32,
    pub iou_threshold: f32,
    pub max_detections: usize,
    pub labels: Vec<String>,
}

/// One candidate: corners in model coordinates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Det {
    pub bbox: [f32; 4],
    pub score: f32,
    pub class: usize,
}

/// Intersection over union of two `[x1, y1, x2, y2]` boxes (0 when either is empty).
pub fn iou(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let iw = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let ih = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = iw * ih;
    let area = |r: &[f32; 4]| (r[2] - r[0]).max(0.0) * (r[3] - r[1]).max(0.0);
    let union = area(a) + area(b) - inter;
    if union <= 0.0 { 0.0 } else { inter / union }
}

/// Greedy class-wise NMS: highest score first, drops boxes of the same class
/// overlapping a kept one by more than `iou_threshold`; at most `max` kept.
pub fn nms(mut dets: Vec<Det>, iou_threshold: f32, max: usize) -> Vec<Det> {
    dets.sort_by(|a, b| b.score.total_cmp(&a.score));
    let mut kept: Vec<Det> = Vec::new();
    for d in dets {
        if kept.len() >= max {
            break;
        }
        if kept
            .iter()
            .all(|k| k.class != d.class || iou(&k.bbox, &d.bbox) <= iou_threshold)
        {
            kept.push(d);
        }
    }
    kept
}

impl Postprocessor for DetectionsPostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError> {
        let t = find(outputs, &self.output)?;
        let cols = t.shape().last().copied().unwrap_or(0);
        if cols < 6
            || t.shape().len() < 2
            || t.shape()[..t.shape().len() - 2].iter().any(|d| *d != 1)
        {
            return Err(PostError::BadShape {
                name: self.output.clone(),
                shape: t.shape().to_vec(),
                expected: "[N, 6] or [1, N, 6] rows of box(4), score, class".into(),
            });
        }
        let values = floats(t);
        let candidates: Vec<Det> = values
            .chunks_exact(cols)
            .filter(|r| r[4] >= self.score_threshold && r[..5].iter().all(|v| v.is_finite()))
            .map(|r| {
                let bbox = match self.format {
                    BoxFormat::Xyxy => [r[0], r[1], r[2], r[3]],
                    BoxFormat::Cxcywh => [
                        r[0] - r[2] / 2.0,
                        r[1] - r[3] / 2.0,
                        r[0] + r[2] / 2.0,
                        r[1] + r[3] / 2.0,
                    ],
                };
                // Class ids are small non-negative integers stored as floats.
                let class = if r[5].is_finite() && r[5] >= 0.0 {
                    r[5].round() as usize
                } else {
                    0
                };
                Det {
                    bbox,
                    score: r[4],
                    class,
                }
            })
            .collect();
        let kept = nms(candidates, self.iou_threshold, self.max_detections);
        let detections: Vec<_> = kept
            .iter()
            .map(|d| {
                let b = match &meta.image {
                    Some(tr) => {
                        let (x1, y1) = tr.to_original(d.bbox[0], d.bbox[1]);
                        let (x2, y2) = tr.to_original(d.bbox[2], d.bbox[3]);
                        [x1, y1, x2, y2]
                    }
                    None => d.bbox,
                };
                json!({"box": b, "score": d.score, "class": d.class, "label": label(&self.labels, d.class)})
            })
            .collect();
        Ok(Some(json!({ "detections": detections })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::ImageTransform;
    use ndarray::{ArrayD, IxDyn};

    fn rows(r: &[[f32; 6]]) -> Vec<(String, Tensor)> {
        let v: Vec<f32> = r.iter().flatten().copied().collect();
        vec![(
            "d".into(),
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[1, r.len(), 6]), v).unwrap()),
        )]
    }

    fn post(format: BoxFormat) -> DetectionsPostprocessor {
        DetectionsPostprocessor {
            output: "d".into(),
            format,
            score_threshold: 0.3,
            iou_threshold: 0.5,
            max_detections: 10,
            labels: vec!["person".into()],
        }
    }

    #[test]
    fn iou_basics() {
        assert_eq!(iou(&[0.0, 0.0, 2.0, 2.0], &[0.0, 0.0, 2.0, 2.0]), 1.0);
        assert_eq!(iou(&[0.0, 0.0, 1.0, 1.0], &[2.0, 2.0, 3.0, 3.0]), 0.0);
        assert!((iou(&[0.0, 0.0, 2.0, 2.0], &[1.0, 0.0, 3.0, 2.0]) - 1.0 / 3.0).abs() < 1e-6);
        assert_eq!(iou(&[1.0, 1.0, 1.0, 1.0], &[1.0, 1.0, 1.0, 1.0]), 0.0);
    }

    #[test]
    fn threshold_nms_per_class_and_labels() {
        let r = rows(&[
            [0.0, 0.0, 10.0, 10.0, 0.9, 0.0],
            [1.0, 1.0, 11.0, 11.0, 0.8, 0.0], // overlaps the first, same class: dropped
            [1.0, 1.0, 11.0, 11.0, 0.7, 1.0], // same place, other class: kept
            [50.0, 50.0, 60.0, 60.0, 0.2, 0.0], // below threshold
        ]);
        let out = post(BoxFormat::Xyxy)
            .process("s", &ItemMeta::default(), &r)
            .unwrap()
            .unwrap();
        let d = out["detections"].as_array().unwrap();
        assert_eq!(d.len(), 2, "{out}");
        assert_eq!(d[0]["label"], "person");
        assert_eq!(d[1]["class"], 1);
        assert_eq!(d[1]["label"], "1");
    }

    #[test]
    fn cxcywh_and_mapping_back() {
        let r = rows(&[[60.0, 60.0, 20.0, 20.0, 0.9, 0.0]]);
        // Letterbox of 200x100 into 100x100: scale 0.5, pad_y 25.
        let meta = ItemMeta {
            image: Some(ImageTransform {
                orig_width: 200,
                orig_height: 100,
                scale_x: 0.5,
                scale_y: 0.5,
                pad_x: 0.0,
                pad_y: 25.0,
            }),
            ..ItemMeta::default()
        };
        let out = post(BoxFormat::Cxcywh)
            .process("s", &meta, &r)
            .unwrap()
            .unwrap();
        let b: Vec<f64> = out["detections"][0]["box"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(b, vec![100.0, 50.0, 140.0, 90.0]);
    }

    #[test]
    fn max_detections_and_bad_shapes() {
        let many: Vec<[f32; 6]> = (0..30)
            .map(|i| [i as f32 * 20.0, 0.0, i as f32 * 20.0 + 10.0, 10.0, 0.9, 0.0])
            .collect();
        let out = post(BoxFormat::Xyxy)
            .process("s", &ItemMeta::default(), &rows(&many))
            .unwrap()
            .unwrap();
        assert_eq!(out["detections"].as_array().unwrap().len(), 10);
        let bad = vec![(
            "d".to_string(),
            Tensor::F32(ArrayD::zeros(IxDyn(&[2, 3, 6]))),
        )];
        assert_eq!(
            post(BoxFormat::Xyxy)
                .process("s", &ItemMeta::default(), &bad)
                .unwrap_err()
                .reason(),
            "bad_shape"
        );
        let bad = vec![("d".to_string(), Tensor::F32(ArrayD::zeros(IxDyn(&[3, 4]))))];
        assert!(
            post(BoxFormat::Xyxy)
                .process("s", &ItemMeta::default(), &bad)
                .is_err()
        );
    }
}
