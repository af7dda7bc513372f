//! A stage's and the thumbnails' config (`[[pipelines.stages]]`,
//! `thumbnails`), with their defaults and checks.

use serde::{Deserialize, Serialize};

use crate::postprocess::PostprocessConfig;
use crate::preprocess::PreprocessConfig;

fn default_max_boxes() -> usize {
    256
}
fn default_stage_batch() -> usize {
    8
}
fn default_rotate() -> bool {
    true
}
fn default_thumbnail_bytes() -> usize {
    20_000
}

/// `[[pipelines.stages]]`: a model run on each box of the stage before.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageConfig {
    /// A model name in the model directory.
    pub model: String,
    /// Overrides the model's preprocessing (an `image` table: the crop's
    /// size, normalization and `resize`).
    #[serde(default)]
    pub preprocess: Option<PreprocessConfig>,
    /// Overrides the model's postprocessing.
    #[serde(default)]
    pub postprocess: Option<PostprocessConfig>,
    /// Each side of a box grows by this fraction of the box's height before
    /// cropping; default: the model manifest's `[stage] padding`, else 0.
    #[serde(default)]
    pub padding: Option<f32>,
    /// Boxes per frame this stage runs on, at most (highest scores first);
    /// the others are left out of the record and counted.
    #[serde(default = "default_max_boxes")]
    pub max_boxes: usize,
    /// Crops per inference run.
    #[serde(default = "default_stage_batch")]
    pub max_batch: usize,
    /// Rotate each crop by its box's `angle` (from an earlier `angle` stage).
    #[serde(default = "default_rotate")]
    pub rotate: bool,
}

impl StageConfig {
    pub fn validate(&self, at: &str) -> Vec<String> {
        let mut p = Vec::new();
        if self.model.is_empty() {
            p.push(format!("{at}.model: empty"));
        }
        if let Some(pad) = self.padding
            && (!pad.is_finite() || !(0.0..=2.0).contains(&pad))
        {
            p.push(format!("{at}.padding: {pad} must be in 0..=2"));
        }
        if self.max_boxes == 0 || self.max_boxes > 100_000 {
            p.push(format!(
                "{at}.max_boxes: {} is out of range 1..=100000",
                self.max_boxes
            ));
        }
        if self.max_batch == 0 || self.max_batch > 1024 {
            p.push(format!(
                "{at}.max_batch: {} is out of range 1..=1024",
                self.max_batch
            ));
        }
        if let Some(pre) = &self.preprocess {
            if !matches!(pre, PreprocessConfig::Image { .. }) {
                p.push(format!(
                    "{at}.preprocess: a stage takes an `image` preprocessing"
                ));
            }
            p.extend(
                pre.validate()
                    .into_iter()
                    .map(|e| format!("{at}.preprocess: {e}")),
            );
        }
        if let Some(post) = &self.postprocess {
            p.extend(
                post.validate()
                    .into_iter()
                    .map(|e| format!("{at}.postprocess: {e}")),
            );
        }
        p
    }
}

/// `thumbnails = { max_bytes = 20000 }`: each box of a record carries a
/// small JPEG of its crop (base64, `thumbnail`), at most `max_bytes` — the
/// one exception to results-only records, off by default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThumbnailConfig {
    /// Largest JPEG per box, bytes (before base64).
    #[serde(default = "default_thumbnail_bytes")]
    pub max_bytes: usize,
}

impl ThumbnailConfig {
    pub fn validate(&self, at: &str) -> Vec<String> {
        if self.max_bytes < 500 {
            vec![format!(
                "{at}.max_bytes: {} is too small for any JPEG (at least 500)",
                self.max_bytes
            )]
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::PipelineConfig;

    #[test]
    fn stages_parse_with_defaults_and_every_problem_is_reported() {
        let c: PipelineConfig = toml::from_str(
            r#"
name = "labels"
model = "ppocr_det"
source = { type = "http" }
thumbnails = { max_bytes = 20000 }
[[stages]]
model = "ppocr_cls"
[[stages]]
model = "ppocr_rec"
padding = 0.1
"#,
        )
        .unwrap();
        assert_eq!(c.stages.len(), 2);
        let s = &c.stages[0];
        assert_eq!(
            (s.max_boxes, s.max_batch, s.rotate, s.padding),
            (256, 8, true, None)
        );
        assert_eq!(c.thumbnails, Some(ThumbnailConfig { max_bytes: 20000 }));
        assert!(c.validate("p").is_empty(), "{:?}", c.validate("p"));
        let bad = PipelineConfig {
            stages: vec![StageConfig {
                model: String::new(),
                padding: Some(-1.0),
                max_boxes: 0,
                max_batch: 0,
                ..c.stages[0].clone()
            }],
            thumbnails: Some(ThumbnailConfig { max_bytes: 10 }),
            ..c
        };
        assert_eq!(bad.validate("p").len(), 5, "{:?}", bad.validate("p"));
        assert!(
            toml::from_str::<StageConfig>("model = \"x\"\nmax_box = 3").is_err(),
            "unknown keys are refused"
        );
    }
}
