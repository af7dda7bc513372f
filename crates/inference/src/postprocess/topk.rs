//! Softmax over the last axis and the `k` best classes.

use serde_json::json;

use super::{PostError, Postprocessor, find, floats, label};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

/// `{"top": [{"index", "label", "score"}, ..]}`; one `top` per row of the
/// last axis when the output has several rows (`{"rows": [{"top": ..}]}`).
pub struct SoftmaxTopkPostprocessor {
    output: String,
    k: usize,
    labels: Vec<String>,
    /// Whether the output is already probabilities (no auto-detection: a
    /// logit vector can look like probabilities by chance).
    already_probabilities: bool,
}

impl SoftmaxTopkPostprocessor {
    pub fn new(output: String, k: usize, labels: Vec<String>, already_probabilities: bool) -> Self {
        SoftmaxTopkPostprocessor {
            output,
            k,
            labels,
            already_probabilities,
        }
    }

    fn top(&self, row: &[f32]) -> serde_json::Value {
        let probs: Vec<f32> = if self.already_probabilities {
            row.to_vec()
        } else {
            softmax(row)
        };
        let mut idx: Vec<usize> = (0..probs.len()).collect();
        // total_cmp: a NaN from a broken model sorts deterministically instead of panicking.
        idx.sort_by(|a, b| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b)));
        let top: Vec<_> = idx
            .into_iter()
            .take(self.k)
            .map(|i| json!({"index": i, "label": label(&self.labels, i), "score": probs[i]}))
            .collect();
        json!({ "top": top })
    }
}

/// Numerically stable softmax (shifted by the max).
pub fn softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = x.iter().map(|v| (v - m).exp()).collect();
    let s: f32 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

impl Postprocessor for SoftmaxTopkPostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        _meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError> {
        let t = find(outputs, &self.output)?;
        let n = t.shape().last().copied().unwrap_or(1);
        if n == 0 || t.is_empty() {
            return Err(PostError::BadShape {
                name: self.output.clone(),
                shape: t.shape().to_vec(),
                expected: "a non-empty class axis".into(),
            });
        }
        let values = floats(t);
        let rows: Vec<_> = values.chunks_exact(n).map(|r| self.top(r)).collect();
        Ok(Some(match <[_; 1]>::try_from(rows) {
            Ok([one]) => one,
            Err(rows) => json!({ "rows": rows }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    fn out(v: Vec<f32>, shape: &[usize]) -> Vec<(String, Tensor)> {
        vec![(
            "o".into(),
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(shape), v).unwrap()),
        )]
    }

    #[test]
    fn softmax_topk_with_labels() {
        let mut p =
            SoftmaxTopkPostprocessor::new("o".into(), 2, vec!["cat".into(), "dog".into()], false);
        let r = p
            .process(
                "s",
                &ItemMeta::default(),
                &out(vec![1.0, 3.0, 2.0], &[1, 3]),
            )
            .unwrap()
            .unwrap();
        let top = r["top"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["index"], 1);
        assert_eq!(top[0]["label"], "dog");
        assert_eq!(top[1]["label"], "2"); // no label: index as string
        let s = top[0]["score"].as_f64().unwrap();
        let expect = 3f64.exp() / (1f64.exp() + 2f64.exp() + 3f64.exp());
        assert!((s - expect).abs() < 1e-6);
    }

    #[test]
    fn probabilities_pass_through_and_rows_split() {
        let mut p = SoftmaxTopkPostprocessor::new("o".into(), 1, vec![], true);
        let r = p
            .process(
                "s",
                &ItemMeta::default(),
                &out(vec![0.2, 0.8, 0.9, 0.1], &[2, 2]),
            )
            .unwrap()
            .unwrap();
        assert_eq!(r["rows"][0]["top"][0]["index"], 1);
        assert!((r["rows"][0]["top"][0]["score"].as_f64().unwrap() - 0.8).abs() < 1e-6);
        assert_eq!(r["rows"][1]["top"][0]["index"], 0);
    }

    #[test]
    fn large_logits_do_not_overflow_and_k_caps() {
        let mut p = SoftmaxTopkPostprocessor::new("o".into(), 10, vec![], false);
        let r = p
            .process(
                "s",
                &ItemMeta::default(),
                &out(vec![1000.0, 999.0], &[1, 2]),
            )
            .unwrap()
            .unwrap();
        assert_eq!(r["top"].as_array().unwrap().len(), 2);
        assert!(r["top"][0]["score"].as_f64().unwrap().is_finite());
        assert_eq!(
            p.process("s", &ItemMeta::default(), &out(vec![], &[1, 0]))
                .unwrap_err()
                .reason(),
            "bad_shape"
        );
    }
}
