//! Turning model outputs into result payloads.
//!
//! A pipeline's `[postprocess]` table (or the model manifest's default) is a
//! [`PostprocessConfig`]; `build()` gives a [`Postprocessor`] that turns one
//! item's outputs into the `outputs` object of a result record, or `None`
//! when there is nothing worth sending upstream.

mod angle;
mod ctc;
mod detections;
mod layouts;
mod mtcnn;
mod raw;
mod text_boxes;
mod threshold;
mod topk;

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub use self::angle::AnglePostprocessor;
pub use self::ctc::CtcTextPostprocessor;
pub use self::detections::{BoxFormat, DetectionsConfig, DetectionsPostprocessor, iou, nms};
pub use self::layouts::DetectionLayout;
pub use self::mtcnn::{MtcnnProposalsPostprocessor, MtcnnRefinePostprocessor, NmsMode};
pub use self::raw::RawPostprocessor;
pub use self::text_boxes::{Connectivity, TextBoxesPostprocessor};
pub use self::threshold::ThresholdPostprocessor;
pub use self::topk::SoftmaxTopkPostprocessor;

/// How a model's outputs become a result record's `outputs`.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum PostprocessConfig {
    /// Hysteresis on a scalar probability, per stream: `start` when it rises
    /// past `on`, `end` when it stays below `off`; nothing otherwise.
    Threshold {
        output: String,
        /// Rising edge: probability at or above this starts an event.
        on: f32,
        /// Falling edge: probability below this (for `min_silence_s`) ends it.
        off: f32,
        /// Events shorter than this are dropped unseen (no start, no end).
        #[serde(default = "threshold::default_min_duration_s")]
        min_duration_s: f64,
        /// Hangover: the probability must stay below `off` this long to end an event.
        #[serde(default = "threshold::default_min_silence_s")]
        min_silence_s: f64,
    },
    /// Softmax over the last axis (unless `already_probabilities`) and the top `k`.
    SoftmaxTopk {
        output: String,
        k: usize,
        /// Labels file, one per line (relative to the model's folder).
        #[serde(default)]
        labels: Option<String>,
        /// The model already outputs probabilities: skip the softmax.
        #[serde(default)]
        already_probabilities: bool,
    },
    /// Object detections in one of the layouts detectors are exported in
    /// (`layout`: rows, yolov8, yolov5, yolox, ssd, detr, rtdetr),
    /// thresholded, class-wise NMS, mapped back to the original image.
    Detections(DetectionsConfig),
    /// Axis-aligned text boxes from a DB text-detection probability map `[1, 1, H, W]`.
    TextBoxes {
        output: String,
        /// Pixels above this probability are text.
        threshold: f32,
        /// Boxes whose mean probability is below this are dropped.
        box_threshold: f32,
        /// DBNet unclip: each side grows by `area * ratio / perimeter`.
        #[serde(default = "text_boxes::default_unclip_ratio")]
        unclip_ratio: f32,
        /// Boxes with a side shorter than this (map pixels, before unclip) are dropped.
        #[serde(default = "text_boxes::default_min_size")]
        min_size: f32,
        /// At most this many boxes, highest score first.
        #[serde(default = "text_boxes::default_max_candidates")]
        max_candidates: usize,
        #[serde(default)]
        connectivity: Connectivity,
    },
    /// CTC text recognition (PP-OCR rec): `{"text", "text_score"}`.
    CtcText {
        output: String,
        /// Dictionary file, one character per line (relative to the model's
        /// folder); class 0 is the blank, the class after the last line a space.
        dictionary: String,
        /// Lines whose mean character probability is below this are dropped.
        #[serde(default = "ctc::default_min_score")]
        min_score: f32,
    },
    /// Orientation classifier: `{"angle", "angle_score"}`; later stages rotate
    /// their crops by `angle`.
    Angle {
        output: String,
        /// Degrees of each class (multiples of 90).
        #[serde(default = "angle::default_angles")]
        angles: Vec<u16>,
        /// The best class counts only above this probability (else 0 degrees).
        #[serde(default = "angle::default_min_score")]
        min_score: f32,
    },
    /// MTCNN P-Net over an image pyramid (`preprocess.type = "pyramid"`):
    /// face proposals, merged across scales.
    MtcnnProposals {
        /// Face probability map `[1, W, H, 2]`.
        score_output: String,
        /// Box regression map `[1, W, H, 4]`.
        box_output: String,
        #[serde(default = "mtcnn::default_proposal_threshold")]
        threshold: f32,
    },
    /// MTCNN R-Net / O-Net as a stage: keeps crops that are faces, refines
    /// their boxes (and, with `landmarks_output`, gives five landmarks).
    MtcnnRefine {
        score_output: String,
        box_output: String,
        #[serde(default)]
        landmarks_output: Option<String>,
        #[serde(default = "mtcnn::default_refine_threshold")]
        threshold: f32,
        /// NMS overlap above which the weaker of two faces goes.
        #[serde(default = "mtcnn::default_nms")]
        nms: f32,
        #[serde(default)]
        nms_mode: NmsMode,
    },
    /// Every output as `{dtype, shape, data}`, data capped at `max_values`.
    Raw {
        #[serde(default = "raw::default_max_values")]
        max_values: usize,
    },
}

/// Without a configured postprocess, results carry the raw outputs.
impl Default for PostprocessConfig {
    fn default() -> Self {
        PostprocessConfig::Raw {
            max_values: raw::default_max_values(),
        }
    }
}

impl PostprocessConfig {
    /// The output this postprocessor reads; `None` when it reads all.
    pub fn output(&self) -> Option<&str> {
        match self {
            PostprocessConfig::Threshold { output, .. }
            | PostprocessConfig::SoftmaxTopk { output, .. }
            | PostprocessConfig::Detections(DetectionsConfig { output, .. })
            | PostprocessConfig::TextBoxes { output, .. }
            | PostprocessConfig::CtcText { output, .. }
            | PostprocessConfig::Angle { output, .. } => Some(output),
            PostprocessConfig::MtcnnProposals { score_output, .. }
            | PostprocessConfig::MtcnnRefine { score_output, .. } => Some(score_output),
            PostprocessConfig::Raw { .. } => None,
        }
    }

    /// Every problem with the configuration, at once.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(o) = self.output()
            && o.is_empty()
        {
            p.push("postprocess: `output` must name a model output".into());
        }
        let unit = |p: &mut Vec<String>, name: &str, v: f32| {
            if !(0.0..=1.0).contains(&v) {
                p.push(format!("postprocess: `{name}` {v} must be in 0..=1"));
            }
        };
        let nonneg = |p: &mut Vec<String>, name: &str, v: f64| {
            if !v.is_finite() || v < 0.0 {
                p.push(format!(
                    "postprocess: `{name}` {v} must be a non-negative number"
                ));
            }
        };
        match self {
            PostprocessConfig::Threshold {
                on,
                off,
                min_duration_s,
                min_silence_s,
                ..
            } => {
                unit(&mut p, "on", *on);
                unit(&mut p, "off", *off);
                if off > on {
                    p.push(format!(
                        "postprocess: `off` {off} must not exceed `on` {on}"
                    ));
                }
                nonneg(&mut p, "min_duration_s", *min_duration_s);
                nonneg(&mut p, "min_silence_s", *min_silence_s);
            }
            PostprocessConfig::SoftmaxTopk { k, labels, .. } => {
                if *k == 0 {
                    p.push("postprocess: `k` must be at least 1".into());
                }
                if labels.as_deref() == Some("") {
                    p.push("postprocess: `labels` must be a file path".into());
                }
            }
            PostprocessConfig::Detections(d) => d.validate(&mut p),
            PostprocessConfig::TextBoxes {
                threshold,
                box_threshold,
                unclip_ratio,
                min_size,
                max_candidates,
                ..
            } => {
                unit(&mut p, "threshold", *threshold);
                unit(&mut p, "box_threshold", *box_threshold);
                nonneg(&mut p, "unclip_ratio", *unclip_ratio as f64);
                nonneg(&mut p, "min_size", *min_size as f64);
                if *max_candidates == 0 {
                    p.push("postprocess: `max_candidates` must be at least 1".into());
                }
            }
            PostprocessConfig::CtcText {
                dictionary,
                min_score,
                ..
            } => {
                if dictionary.is_empty() {
                    p.push("postprocess: `dictionary` must be a file path".into());
                }
                unit(&mut p, "min_score", *min_score);
            }
            PostprocessConfig::Angle {
                angles, min_score, ..
            } => {
                if angles.is_empty() || angles.iter().any(|a| a % 90 != 0 || *a >= 360) {
                    p.push(format!(
                        "postprocess: `angles` {angles:?} must be multiples of 90 below 360"
                    ));
                }
                unit(&mut p, "min_score", *min_score);
            }
            PostprocessConfig::MtcnnProposals {
                box_output,
                threshold,
                ..
            } => {
                if box_output.is_empty() {
                    p.push("postprocess: `box_output` must name a model output".into());
                }
                unit(&mut p, "threshold", *threshold);
            }
            PostprocessConfig::MtcnnRefine {
                box_output,
                threshold,
                nms,
                ..
            } => {
                if box_output.is_empty() {
                    p.push("postprocess: `box_output` must name a model output".into());
                }
                unit(&mut p, "threshold", *threshold);
                unit(&mut p, "nms", *nms);
            }
            PostprocessConfig::Raw { max_values } => {
                if *max_values == 0 {
                    p.push("postprocess: `max_values` must be at least 1".into());
                }
            }
        }
        p
    }

    /// The postprocessor; `base_dir` resolves a relative labels path (the
    /// model's folder). Fails only when a labels file cannot be read.
    pub fn build(&self, base_dir: &Path) -> Result<Box<dyn Postprocessor>, PostError> {
        Ok(match self {
            PostprocessConfig::Threshold {
                output,
                on,
                off,
                min_duration_s,
                min_silence_s,
            } => Box::new(ThresholdPostprocessor::new(
                output.clone(),
                *on,
                *off,
                *min_duration_s,
                *min_silence_s,
            )),
            PostprocessConfig::SoftmaxTopk {
                output,
                k,
                labels,
                already_probabilities,
            } => Box::new(SoftmaxTopkPostprocessor::new(
                output.clone(),
                *k,
                read_labels(base_dir, labels.as_deref())?,
                *already_probabilities,
            )),
            PostprocessConfig::Detections(d) => Box::new(d.build(base_dir)?),
            PostprocessConfig::TextBoxes {
                output,
                threshold,
                box_threshold,
                unclip_ratio,
                min_size,
                max_candidates,
                connectivity,
            } => Box::new(TextBoxesPostprocessor {
                output: output.clone(),
                threshold: *threshold,
                box_threshold: *box_threshold,
                unclip_ratio: *unclip_ratio,
                min_size: *min_size,
                max_candidates: *max_candidates,
                connectivity: *connectivity,
            }),
            PostprocessConfig::CtcText {
                output,
                dictionary,
                min_score,
            } => Box::new(CtcTextPostprocessor::new(
                output.clone(),
                read_dictionary(base_dir, dictionary)?,
                *min_score,
            )),
            PostprocessConfig::Angle {
                output,
                angles,
                min_score,
            } => Box::new(AnglePostprocessor {
                output: output.clone(),
                angles: angles.clone(),
                min_score: *min_score,
            }),
            PostprocessConfig::MtcnnProposals {
                score_output,
                box_output,
                threshold,
            } => Box::new(MtcnnProposalsPostprocessor {
                score_output: score_output.clone(),
                box_output: box_output.clone(),
                threshold: *threshold,
            }),
            PostprocessConfig::MtcnnRefine {
                score_output,
                box_output,
                landmarks_output,
                threshold,
                nms,
                nms_mode,
            } => Box::new(MtcnnRefinePostprocessor {
                score_output: score_output.clone(),
                box_output: box_output.clone(),
                landmarks_output: landmarks_output.clone(),
                threshold: *threshold,
                nms: *nms,
                nms_mode: *nms_mode,
            }),
            PostprocessConfig::Raw { max_values } => Box::new(RawPostprocessor {
                max_values: *max_values,
            }),
        })
    }
}

/// Turns model outputs into result payloads, per stream.
pub trait Postprocessor: Send {
    /// Turns one item's outputs into the `outputs` object of a result record,
    /// or None when there is nothing to send (e.g. VAD with no state change:
    /// a quiet microphone sends nothing upstream).
    fn process(
        &mut self,
        stream: &str,
        meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError>;
    /// Forgets per-stream state (stream ended).
    fn reset(&mut self, _stream: &str) {}
    /// Combines the results of one frame's items into one (an image pyramid
    /// gives an item per scale). Default: the first result.
    fn merge_items(&mut self, results: Vec<serde_json::Value>) -> Option<serde_json::Value> {
        results.into_iter().next()
    }
    /// As a cascade stage: once every box of a frame has this stage's result
    /// merged in, the boxes to keep (e.g. after NMS). Default: all of them.
    fn finish_boxes(&mut self, boxes: Vec<serde_json::Value>) -> Vec<serde_json::Value> {
        boxes
    }
}

/// Why outputs could not be turned into a result.
#[derive(thiserror::Error, Debug)]
pub enum PostError {
    #[error("output `{name}` is missing (the model gave: {available})")]
    MissingOutput { name: String, available: String },
    #[error("output `{name}` has shape {shape:?}, expected {expected}")]
    BadShape {
        name: String,
        shape: Vec<usize>,
        expected: String,
    },
    #[error("labels file {path}: {source}")]
    Labels {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl PostError {
    /// Short stable label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            PostError::MissingOutput { .. } => "missing_output",
            PostError::BadShape { .. } => "bad_shape",
            PostError::Labels { .. } => "labels",
        }
    }
}

/// Reads a labels file: one label per line, trailing whitespace trimmed.
fn read_labels(base_dir: &Path, path: Option<&str>) -> Result<Vec<String>, PostError> {
    let Some(path) = path else {
        return Ok(Vec::new());
    };
    let full = base_dir.join(path);
    let text = std::fs::read_to_string(&full).map_err(|source| PostError::Labels {
        path: full.clone(),
        source,
    })?;
    Ok(text.lines().map(|l| l.trim_end().to_string()).collect())
}

/// Reads a dictionary: one entry per line, only the line break removed
/// (a line may be a single space).
fn read_dictionary(base_dir: &Path, path: &str) -> Result<Vec<String>, PostError> {
    let full = base_dir.join(path);
    let text = std::fs::read_to_string(&full).map_err(|source| PostError::Labels {
        path: full.clone(),
        source,
    })?;
    let mut lines: Vec<String> = text
        .split('\n')
        .map(|l| l.strip_suffix('\r').unwrap_or(l).to_string())
        .collect();
    // The file's final line break leaves an empty last entry.
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    Ok(lines)
}

/// The named output.
fn find<'a>(outputs: &'a [(String, Tensor)], name: &str) -> Result<&'a Tensor, PostError> {
    outputs
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, t)| t)
        .ok_or_else(|| PostError::MissingOutput {
            name: name.to_string(),
            available: outputs
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// The tensor's elements as f32, row-major; borrowed when already a
/// contiguous f32 array (the common case: no copy of a large map).
fn floats(t: &Tensor) -> Cow<'_, [f32]> {
    if let Tensor::F32(a) = t
        && let Some(s) = a.as_slice()
    {
        return Cow::Borrowed(s);
    }
    Cow::Owned(t.to_f64_vec().into_iter().map(|x| x as f32).collect())
}

/// The label of class `i`, or its index as a string when there is none.
fn label(labels: &[String], i: usize) -> String {
    labels.get(i).cloned().unwrap_or_else(|| i.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Wrap {
        postprocess: PostprocessConfig,
    }

    fn parse(s: &str) -> Result<PostprocessConfig, toml::de::Error> {
        toml::from_str::<Wrap>(s).map(|w| w.postprocess)
    }

    #[test]
    fn manifest_forms_parse_with_defaults() {
        let t =
            parse("[postprocess]\ntype = \"threshold\"\noutput = \"output\"\non = 0.5\noff = 0.35")
                .unwrap();
        assert!(t.validate().is_empty());
        assert_eq!(t.output(), Some("output"));
        let PostprocessConfig::Threshold {
            min_duration_s,
            min_silence_s,
            ..
        } = t
        else {
            panic!("{t:?}")
        };
        assert_eq!((min_duration_s, min_silence_s), (0.25, 0.1));
        let raw = parse("[postprocess]\ntype = \"raw\"").unwrap();
        assert_eq!(raw, PostprocessConfig::Raw { max_values: 4096 });
        assert_eq!(raw.output(), None);
        let tb = parse("[postprocess]\ntype = \"text_boxes\"\noutput = \"m\"\nthreshold = 0.3\nbox_threshold = 0.5").unwrap();
        assert!(tb.validate().is_empty());
        let d = parse("[postprocess]\ntype = \"detections\"\noutput = \"d\"\nformat = \"cxcywh\"")
            .unwrap();
        assert!(d.validate().is_empty());
    }

    #[test]
    fn unknown_keys_are_refused_and_every_problem_reported() {
        assert!(parse("[postprocess]\ntype = \"raw\"\nmax_value = 3").is_err());
        let t = parse("[postprocess]\ntype = \"threshold\"\noutput = \"\"\non = 0.2\noff = 1.5\nmin_silence_s = -1.0").unwrap();
        // empty output, off out of range, off > on, negative hangover
        assert_eq!(t.validate().len(), 4, "{:?}", t.validate());
    }

    #[test]
    fn labels_resolve_relative_to_base_dir() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("l.txt"), "cat\ndog\n").unwrap();
        let c = parse(
            "[postprocess]\ntype = \"softmax_topk\"\noutput = \"o\"\nk = 1\nlabels = \"l.txt\"",
        )
        .unwrap();
        assert!(c.build(dir.path()).is_ok());
        let e = c.build(&dir.path().join("nope")).err().unwrap();
        assert_eq!(e.reason(), "labels");
    }

    #[test]
    fn missing_output_names_the_available_ones() {
        let o = vec![(
            "a".to_string(),
            Tensor::filled(crate::backend::DType::F32, &[1], 0.0),
        )];
        let e = find(&o, "b").unwrap_err();
        assert!(e.to_string().contains("(the model gave: a)"), "{e}");
    }
}
