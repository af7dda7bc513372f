//! Orientation of a crop from a classifier over angles (PP-OCR's text-line
//! classifier: 0 or 180 degrees). Later stages rotate their crops by the
//! box's `angle`.

use serde_json::json;

use super::{PostError, Postprocessor, find, floats};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_angles() -> Vec<u16> {
    vec![0, 180]
}
pub(super) fn default_min_score() -> f32 {
    0.9
}

/// `{"angle": degrees, "angle_score": p}`: the best class's angle when its
/// probability exceeds `min_score`, else 0 (a doubtful crop stays as it is).
pub struct AnglePostprocessor {
    pub output: String,
    pub angles: Vec<u16>,
    pub min_score: f32,
}

impl Postprocessor for AnglePostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        _meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError> {
        let t = find(outputs, &self.output)?;
        let p = floats(t);
        if p.len() != self.angles.len() {
            return Err(PostError::BadShape {
                name: self.output.clone(),
                shape: t.shape().to_vec(),
                expected: format!("{} probabilities (one per angle)", self.angles.len()),
            });
        }
        let (best, score) = p
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |a, (i, v)| {
                if *v > a.1 { (i, *v) } else { a }
            });
        let angle = if score > self.min_score {
            self.angles[best]
        } else {
            0
        };
        Ok(Some(json!({"angle": angle, "angle_score": score})))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    fn run(p: [f32; 2]) -> serde_json::Value {
        let mut post = AnglePostprocessor {
            output: "o".into(),
            angles: default_angles(),
            min_score: 0.9,
        };
        let t = Tensor::F32(ArrayD::from_shape_vec(IxDyn(&[1, 2]), p.to_vec()).unwrap());
        post.process("s", &ItemMeta::default(), &[("o".into(), t)])
            .unwrap()
            .unwrap()
    }

    #[test]
    fn rotates_only_when_sure() {
        assert_eq!(run([0.02, 0.98])["angle"], 180);
        assert_eq!(run([0.15, 0.85])["angle"], 0);
        assert_eq!(run([0.99, 0.01])["angle"], 0);
    }
}
