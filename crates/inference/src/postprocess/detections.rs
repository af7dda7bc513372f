//! Object detections from the output layouts detectors are exported in
//! (see `layouts.rs`): score threshold, class-wise greedy NMS (not for the
//! set-prediction layouts), boxes mapped back to the original image
//! (letterbox undone), labelled from the manifest's class names.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::json;

pub use super::layouts::{BoxFormat, Det};
use super::layouts::{Decode, DetectionLayout, decode};
use super::{PostError, Postprocessor, find, label};
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
fn default_strides() -> Vec<u32> {
    vec![8, 16, 32]
}

/// `type = "detections"`: a detector's boxes.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DetectionsConfig {
    /// The detections tensor; with `ssd`, `detr` and `rtdetr`, the scores
    /// (or logits) tensor.
    pub output: String,
    /// How the outputs are laid out.
    #[serde(default)]
    pub layout: DetectionLayout,
    /// The boxes tensor of `ssd`, `detr` and `rtdetr`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boxes_output: Option<String>,
    /// How a box's four numbers read; default: the layout's own
    /// (`xyxy` for rows and ssd, `cxcywh` for the others).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<BoxFormat>,
    /// Boxes are fractions (0..1) of the model input; default: true for
    /// `detr` and `rtdetr`. Needs `input_size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub normalized: Option<bool>,
    /// The model input's `[width, height]` (normalized boxes, YOLOX grids).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_size: Option<[u32; 2]>,
    /// YOLOX: the strides of its grids, in the order of its anchors.
    #[serde(default = "default_strides")]
    pub strides: Vec<u32>,
    /// `ssd`: the class that means background, never reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub background_class: Option<usize>,
    #[serde(default = "default_score_threshold")]
    pub score_threshold: f32,
    #[serde(default = "default_iou_threshold")]
    pub iou_threshold: f32,
    #[serde(default = "default_max_detections")]
    pub max_detections: usize,
    /// Labels file, one per line (relative to the model's folder).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<String>,
    /// Class names, in class order (instead of a labels file).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub class_names: Vec<String>,
}

impl DetectionsConfig {
    pub fn validate(&self, p: &mut Vec<String>) {
        let unit = |p: &mut Vec<String>, name: &str, v: f32| {
            if !(0.0..=1.0).contains(&v) {
                p.push(format!("postprocess: `{name}` {v} must be in 0..=1"));
            }
        };
        unit(p, "score_threshold", self.score_threshold);
        unit(p, "iou_threshold", self.iou_threshold);
        if self.max_detections == 0 {
            p.push("postprocess: `max_detections` must be at least 1".into());
        }
        match (&self.boxes_output, self.layout.has_boxes_tensor()) {
            (None, true) => p.push(format!(
                "postprocess: layout `{}` needs `boxes_output` (its boxes tensor)",
                self.layout_name()
            )),
            (Some(_), false) => p.push(format!(
                "postprocess: layout `{}` has no separate boxes: drop `boxes_output`",
                self.layout_name()
            )),
            (Some(b), true) if b.is_empty() => {
                p.push("postprocess: `boxes_output` must name a model output".into())
            }
            _ => {}
        }
        let needs_size = self.normalized() || self.layout == DetectionLayout::Yolox;
        match self.input_size {
            None if needs_size => p.push(format!(
                "postprocess: layout `{}`{} needs `input_size = [width, height]`",
                self.layout_name(),
                if self.normalized() {
                    " with normalized boxes"
                } else {
                    ""
                }
            )),
            Some([w, h]) if w == 0 || h == 0 => {
                p.push("postprocess: `input_size` must be positive".into())
            }
            _ => {}
        }
        if self.layout == DetectionLayout::Yolox
            && (self.strides.is_empty() || self.strides.contains(&0))
        {
            p.push("postprocess: `strides` must be positive numbers".into());
        }
        if self.labels.is_some() && !self.class_names.is_empty() {
            p.push("postprocess: give `labels` (a file) or `class_names`, not both".into());
        }
        if self.labels.as_deref() == Some("") {
            p.push("postprocess: `labels` must be a file path".into());
        }
    }

    fn layout_name(&self) -> String {
        serde_json::to_value(self.layout)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }

    fn normalized(&self) -> bool {
        self.normalized
            .unwrap_or_else(|| self.layout.default_normalized())
    }

    pub fn build(&self, base_dir: &Path) -> Result<DetectionsPostprocessor, PostError> {
        let labels = if self.class_names.is_empty() {
            super::read_labels(base_dir, self.labels.as_deref())?
        } else {
            self.class_names.clone()
        };
        Ok(DetectionsPostprocessor {
            output: self.output.clone(),
            boxes_output: self.boxes_output.clone(),
            layout: self.layout,
            format: self.format.unwrap_or_else(|| self.layout.default_format()),
            normalized: self.normalized(),
            input_size: self.input_size,
            strides: self.strides.clone(),
            background_class: self.background_class,
            score_threshold: self.score_threshold,
            iou_threshold: self.iou_threshold,
            max_detections: self.max_detections,
            labels,
        })
    }
}

/// Detections after thresholding and NMS.
pub struct DetectionsPostprocessor {
    pub output: String,
    pub boxes_output: Option<String>,
    pub layout: DetectionLayout,
    pub format: BoxFormat,
    pub normalized: bool,
    pub input_size: Option<[u32; 2]>,
    pub strides: Vec<u32>,
    pub background_class: Option<usize>,
    pub score_threshold: f32,
    pub iou_threshold: f32,
    pub max_detections: usize,
    pub labels: Vec<String>,
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
        let boxes = match &self.boxes_output {
            Some(b) => Some((b.as_str(), find(outputs, b)?)),
            None => None,
        };
        let d = Decode {
            layout: self.layout,
            format: self.format,
            input_size: self.input_size,
            normalized: self.normalized,
            strides: &self.strides,
            background_class: self.background_class,
            score_threshold: self.score_threshold,
        };
        let candidates = decode(&d, (&self.output, t), boxes)?;
        let kept = if self.layout.needs_nms() {
            nms(candidates, self.iou_threshold, self.max_detections)
        } else {
            let mut c = candidates;
            c.sort_by(|a, b| b.score.total_cmp(&a.score));
            c.truncate(self.max_detections);
            c
        };
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

    fn config(layout: &str, extra: &str) -> DetectionsConfig {
        toml::from_str(&format!(
            "output = \"d\"\nlayout = \"{layout}\"\nscore_threshold = 0.3\niou_threshold = 0.5\nmax_detections = 10\nclass_names = [\"person\", \"car\", \"truck\"]\n{extra}"
        ))
        .unwrap()
    }

    fn post(format: BoxFormat) -> DetectionsPostprocessor {
        let f = match format {
            BoxFormat::Xyxy => "xyxy",
            BoxFormat::Cxcywh => "cxcywh",
            BoxFormat::Yxyx => "yxyx",
        };
        let c = config("rows", &format!("format = \"{f}\""));
        let mut p = Vec::new();
        c.validate(&mut p);
        assert!(p.is_empty(), "{p:?}");
        c.build(Path::new(".")).unwrap()
    }

    fn tensor(name: &str, shape: &[usize], v: Vec<f32>) -> (String, Tensor) {
        (
            name.into(),
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(shape), v).unwrap()),
        )
    }

    fn boxes(out: &serde_json::Value) -> Vec<(Vec<f32>, String)> {
        out["detections"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                let b = d["box"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| (v.as_f64().unwrap() as f32 * 100.0).round() / 100.0)
                    .collect();
                (b, d["label"].as_str().unwrap().to_string())
            })
            .collect()
    }

    #[test]
    fn yolov8_channels_first() {
        // 3 anchors, 2 classes: [1, 6, 3]; anchor 1 overlaps anchor 0 (NMS).
        let cx = [50.0, 51.0, 10.0];
        let cy = [50.0, 50.0, 10.0];
        let w = [20.0, 20.0, 4.0];
        let h = [10.0, 10.0, 4.0];
        let c0 = [0.9, 0.8, 0.1];
        let c1 = [0.1, 0.2, 0.7];
        let v: Vec<f32> = [cx, cy, w, h, c0, c1].concat();
        let mut p = config("yolov8", "").build(Path::new(".")).unwrap();
        let out = p
            .process("s", &ItemMeta::default(), &[tensor("d", &[1, 6, 3], v)])
            .unwrap()
            .unwrap();
        assert_eq!(
            boxes(&out),
            vec![
                (vec![40.0, 45.0, 60.0, 55.0], "person".into()),
                (vec![8.0, 8.0, 12.0, 12.0], "car".into())
            ]
        );
    }

    #[test]
    fn yolov5_objectness_times_class() {
        let v = vec![
            50.0, 50.0, 20.0, 10.0, 0.5, 0.9, 0.1, // 0.45
            10.0, 10.0, 4.0, 4.0, 0.9, 0.2, 0.3, // 0.27 < 0.3
        ];
        let mut p = config("yolov5", "").build(Path::new(".")).unwrap();
        let out = p
            .process("s", &ItemMeta::default(), &[tensor("d", &[1, 2, 7], v)])
            .unwrap()
            .unwrap();
        let d = &out["detections"][0];
        assert!((d["score"].as_f64().unwrap() - 0.45).abs() < 1e-6);
        assert_eq!(out["detections"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn yolox_grids_are_decoded() {
        // 16x8 input, strides 8 and 16: 2x1 + 1x0... use 16x16: 4 + 1 anchors.
        let mut v = vec![0.0f32; 5 * 6];
        // Anchor 3 (stride 8, cell x=1, y=1): offsets 0.5, 0.5, size e^0 * 8.
        v[3 * 6..4 * 6].copy_from_slice(&[0.5, 0.5, 0.0, 0.0, 0.9, 0.9]);
        // Anchor 4 (stride 16, cell 0,0): centre 8,8, size 16 * e^ln2 = 32.
        v[4 * 6..5 * 6].copy_from_slice(&[0.5, 0.5, 2f32.ln(), 2f32.ln(), 0.8, 0.9]);
        let c = config("yolox", "input_size = [16, 16]\nstrides = [8, 16]");
        let mut p = c.build(Path::new(".")).unwrap();
        let out = p
            .process(
                "s",
                &ItemMeta::default(),
                &[tensor("d", &[1, 5, 6], v.clone())],
            )
            .unwrap()
            .unwrap();
        assert_eq!(
            boxes(&out),
            vec![
                (vec![8.0, 8.0, 16.0, 16.0], "person".into()),
                (vec![-8.0, -8.0, 24.0, 24.0], "person".into())
            ]
        );
        // The anchors must match the grids.
        let e = p
            .process(
                "s",
                &ItemMeta::default(),
                &[tensor("d", &[1, 4, 6], v[..24].to_vec())],
            )
            .unwrap_err();
        assert_eq!(e.reason(), "bad_shape");
    }

    #[test]
    fn ssd_skips_the_background_and_reads_yxyx() {
        let c = config(
            "ssd",
            "boxes_output = \"b\"\nformat = \"yxyx\"\nnormalized = true\ninput_size = [200, 100]\nbackground_class = 0",
        );
        let mut p = c.build(Path::new(".")).unwrap();
        let scores = tensor("d", &[1, 2, 3], vec![0.95, 0.04, 0.01, 0.1, 0.1, 0.8]);
        let b = tensor(
            "b",
            &[1, 2, 4],
            vec![0.0, 0.0, 1.0, 1.0, 0.1, 0.2, 0.5, 0.6],
        );
        let out = p
            .process("s", &ItemMeta::default(), &[scores, b])
            .unwrap()
            .unwrap();
        // Row 0 is background; row 1 is class 2 ("truck").
        assert_eq!(
            boxes(&out),
            vec![(vec![40.0, 10.0, 120.0, 50.0], "truck".into())]
        );
    }

    #[test]
    fn detr_softmax_without_no_object_and_no_nms() {
        let c = config("detr", "boxes_output = \"b\"\ninput_size = [100, 100]");
        let mut p = c.build(Path::new(".")).unwrap();
        // 3 queries, 2 classes + no-object; queries 0 and 1 overlap fully
        // (no NMS: both stay), query 2 is "no object".
        let logits = tensor(
            "d",
            &[1, 3, 3],
            vec![5.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0, 9.0],
        );
        let b = tensor(
            "b",
            &[1, 3, 4],
            vec![0.5, 0.5, 0.2, 0.2, 0.5, 0.5, 0.2, 0.2, 0.1, 0.1, 0.1, 0.1],
        );
        let out = p
            .process("s", &ItemMeta::default(), &[logits.clone(), b.clone()])
            .unwrap()
            .unwrap();
        assert_eq!(out["detections"].as_array().unwrap().len(), 2, "{out}");
        let s0 = out["detections"][0]["score"].as_f64().unwrap();
        assert!((s0 - (5f64.exp() / (5f64.exp() + 2.0))).abs() < 1e-5);
        assert_eq!(boxes(&out)[0].0, vec![40.0, 40.0, 60.0, 60.0]);
        // RT-DETR: sigmoid per class, nothing is "no object".
        let c = config("rtdetr", "boxes_output = \"b\"\ninput_size = [100, 100]");
        let mut p = c.build(Path::new(".")).unwrap();
        let out = p
            .process("s", &ItemMeta::default(), &[logits, b])
            .unwrap()
            .unwrap();
        assert_eq!(out["detections"].as_array().unwrap().len(), 3, "{out}");
        assert_eq!(out["detections"][0]["label"], "truck");
    }

    #[test]
    fn layout_needs_are_validated() {
        let mut p = Vec::new();
        config("ssd", "").validate(&mut p);
        config("yolox", "").validate(&mut p);
        config("detr", "boxes_output = \"b\"").validate(&mut p);
        config("rows", "boxes_output = \"b\"\nlabels = \"l.txt\"").validate(&mut p);
        assert_eq!(p.len(), 5, "{p:#?}");
        assert!(p[0].contains("boxes_output"));
        assert!(p[1].contains("input_size"));
        assert!(p[2].contains("normalized"));
        assert!(p[4].contains("not both"));
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
        assert_eq!(d[1]["label"], "car");
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
