//! CTC text (PP-OCR recognition): per time step the best class, repeated
//! classes collapsed, the blank (class 0) dropped, classes mapped to
//! characters through the model's dictionary. The dictionary file has one
//! character per line; as PaddleOCR does, class 0 is the blank and the class
//! after the last line is a space.

use serde_json::json;

use super::{PostError, Postprocessor, find, floats};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_min_score() -> f32 {
    0.5
}

/// `{"text": "..", "text_score": mean probability of the kept characters}`;
/// nothing (the box is dropped) below `min_score`.
pub struct CtcTextPostprocessor {
    pub output: String,
    /// Class index -> character: `[blank, dictionary.., " "]`.
    pub classes: Vec<String>,
    pub min_score: f32,
}

impl CtcTextPostprocessor {
    pub fn new(output: String, dictionary: Vec<String>, min_score: f32) -> Self {
        let mut classes = Vec::with_capacity(dictionary.len() + 2);
        classes.push(String::new());
        classes.extend(dictionary);
        classes.push(" ".to_string());
        CtcTextPostprocessor {
            output,
            classes,
            min_score,
        }
    }

    /// Decodes one `[T, C]` row-major probability matrix.
    pub fn decode(&self, probs: &[f32], classes: usize) -> (String, f32) {
        let mut text = String::new();
        let mut sum = 0.0f64;
        let mut kept = 0usize;
        let mut prev = usize::MAX;
        for step in probs.chunks_exact(classes.max(1)) {
            let (best, p) =
                step.iter()
                    .enumerate()
                    .fold((0usize, f32::NEG_INFINITY), |acc, (i, v)| {
                        if *v > acc.1 { (i, *v) } else { acc }
                    });
            if best != 0 && best != prev {
                text.push_str(self.classes.get(best).map(String::as_str).unwrap_or("?"));
                sum += p as f64;
                kept += 1;
            }
            prev = best;
        }
        // A margin around the line may read as a space at either end.
        let trimmed = text.trim();
        if trimmed.len() != text.len() {
            text = trimmed.to_string();
        }
        let score = if kept == 0 {
            0.0
        } else {
            (sum / kept as f64) as f32
        };
        (text, score)
    }
}

impl Postprocessor for CtcTextPostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        _meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError> {
        let t = find(outputs, &self.output)?;
        let shape = t.shape();
        let n = shape.len();
        if n < 2 || shape[..n - 2].iter().any(|d| *d != 1) || shape[n - 1] != self.classes.len() {
            return Err(PostError::BadShape {
                name: self.output.clone(),
                shape: shape.to_vec(),
                expected: format!(
                    "[1, T, {}] (the dictionary's {} characters, blank and space)",
                    self.classes.len(),
                    self.classes.len().saturating_sub(2)
                ),
            });
        }
        let (text, score) = self.decode(&floats(t), shape[n - 1]);
        if text.is_empty() || score < self.min_score {
            return Ok(None);
        }
        Ok(Some(json!({"text": text, "text_score": score})))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    fn post() -> CtcTextPostprocessor {
        CtcTextPostprocessor::new("o".into(), vec!["a".into(), "b".into()], 0.5)
    }

    /// One-hot-ish steps: class index per step with probability p.
    fn steps(classes: &[usize], p: f32) -> Vec<(String, Tensor)> {
        let c = 4; // blank, a, b, space
        let mut a = ArrayD::<f32>::zeros(IxDyn(&[1, classes.len(), c]));
        for (t, k) in classes.iter().enumerate() {
            for j in 0..c {
                a[[0, t, j]] = if j == *k { p } else { (1.0 - p) / 3.0 };
            }
        }
        vec![("o".into(), Tensor::F32(a))]
    }

    #[test]
    fn collapses_repeats_and_blanks() {
        // space a a _ a b b _ space b space -> "aab b"
        let o = steps(&[3, 1, 1, 0, 1, 2, 2, 0, 3, 2, 3], 0.9);
        let r = post()
            .process("s", &ItemMeta::default(), &o)
            .unwrap()
            .unwrap();
        assert_eq!(r["text"], "aab b", "{r}");
        assert!((r["text_score"].as_f64().unwrap() - 0.9).abs() < 1e-6);
    }

    #[test]
    fn low_scores_and_empty_text_give_nothing() {
        assert!(
            post()
                .process("s", &ItemMeta::default(), &steps(&[1, 2], 0.4))
                .unwrap()
                .is_none()
        );
        assert!(
            post()
                .process("s", &ItemMeta::default(), &steps(&[0, 0], 0.9))
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn class_count_must_match_the_dictionary() {
        let o = vec![(
            "o".to_string(),
            Tensor::F32(ArrayD::zeros(IxDyn(&[1, 5, 7]))),
        )];
        let e = post().process("s", &ItemMeta::default(), &o).unwrap_err();
        assert_eq!(e.reason(), "bad_shape");
    }
}
