//! Text boxes from a DB (PP-OCR) probability map: binarize, connected
//! components, per component the axis-aligned box and its mean probability,
//! DBNet's unclip (the network is trained on shrunk text regions), and the
//! map back to original image coordinates.
//!
//! The map is assumed to have the model input's resolution (DB heads
//! upsample to it), so `ItemMeta.image` applies to map pixels directly.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{PostError, Postprocessor, find, floats};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_unclip_ratio() -> f32 {
    1.5
}
pub(super) fn default_min_size() -> f32 {
    3.0
}
pub(super) fn default_max_candidates() -> usize {
    1000
}

/// Which neighbours join a component: `connectivity = 4` or `8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum Connectivity {
    /// Edges only.
    Four,
    /// Edges and corners (thin diagonal strokes stay in one component).
    #[default]
    Eight,
}

/// A connectivity other than 4 or 8.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("connectivity {0} must be 4 or 8")]
pub struct BadConnectivity(pub u8);

impl TryFrom<u8> for Connectivity {
    type Error = BadConnectivity;
    fn try_from(v: u8) -> Result<Self, BadConnectivity> {
        match v {
            4 => Ok(Connectivity::Four),
            8 => Ok(Connectivity::Eight),
            _ => Err(BadConnectivity(v)),
        }
    }
}

impl From<Connectivity> for u8 {
    fn from(c: Connectivity) -> u8 {
        match c {
            Connectivity::Four => 4,
            Connectivity::Eight => 8,
        }
    }
}

/// Finds text boxes in a probability map.
pub struct TextBoxesPostprocessor {
    pub output: String,
    pub threshold: f32,
    pub box_threshold: f32,
    pub unclip_ratio: f32,
    pub min_size: f32,
    pub max_candidates: usize,
    pub connectivity: Connectivity,
}

/// One connected component: inclusive pixel bounds and probability sum.
#[derive(Debug, Clone, Copy)]
struct Component {
    x0: usize,
    y0: usize,
    x1: usize,
    y1: usize,
    sum: f64,
    count: usize,
}

/// Connected components of `map > threshold` (iterative flood fill: no
/// recursion, so a map full of text cannot overflow the stack).
fn components(
    map: &[f32],
    w: usize,
    h: usize,
    threshold: f32,
    conn: Connectivity,
) -> Vec<Component> {
    let mut seen = vec![false; map.len()];
    let mut stack = Vec::new();
    let mut out = Vec::new();
    let neighbours: &[(isize, isize)] = match conn {
        Connectivity::Four => &[(-1, 0), (1, 0), (0, -1), (0, 1)],
        Connectivity::Eight => &[
            (-1, 0),
            (1, 0),
            (0, -1),
            (0, 1),
            (-1, -1),
            (1, -1),
            (-1, 1),
            (1, 1),
        ],
    };
    for start in 0..map.len() {
        if seen[start] || map[start] <= threshold {
            continue;
        }
        seen[start] = true;
        stack.push(start);
        let mut c = Component {
            x0: usize::MAX,
            y0: usize::MAX,
            x1: 0,
            y1: 0,
            sum: 0.0,
            count: 0,
        };
        while let Some(i) = stack.pop() {
            let (x, y) = (i % w, i / w);
            c.x0 = c.x0.min(x);
            c.x1 = c.x1.max(x);
            c.y0 = c.y0.min(y);
            c.y1 = c.y1.max(y);
            c.sum += map[i] as f64;
            c.count += 1;
            for (dx, dy) in neighbours {
                let (nx, ny) = (x as isize + dx, y as isize + dy);
                if nx < 0 || ny < 0 || nx >= w as isize || ny >= h as isize {
                    continue;
                }
                let j = ny as usize * w + nx as usize;
                if !seen[j] && map[j] > threshold {
                    seen[j] = true;
                    stack.push(j);
                }
            }
        }
        out.push(c);
    }
    out
}

impl Postprocessor for TextBoxesPostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError> {
        let t = find(outputs, &self.output)?;
        let shape = t.shape();
        let n = shape.len();
        if n < 2 || shape[..n - 2].iter().any(|d| *d != 1) {
            return Err(PostError::BadShape {
                name: self.output.clone(),
                shape: shape.to_vec(),
                expected: "[1, 1, H, W] (one probability map)".into(),
            });
        }
        let (h, w) = (shape[n - 2], shape[n - 1]);
        let map = floats(t);
        let mut boxes: Vec<([f32; 4], f32)> =
            components(&map, w, h, self.threshold, self.connectivity)
                .into_iter()
                .filter_map(|c| {
                    // Pixel (x, y) covers [x, x+1): the box's far edges are x1+1, y1+1.
                    let (bw, bh) = ((c.x1 + 1 - c.x0) as f32, (c.y1 + 1 - c.y0) as f32);
                    if bw.min(bh) < self.min_size {
                        return None;
                    }
                    let score = (c.sum / c.count as f64) as f32;
                    if score < self.box_threshold {
                        return None;
                    }
                    let d = bw * bh * self.unclip_ratio / (2.0 * (bw + bh));
                    let b = [
                        (c.x0 as f32 - d).max(0.0),
                        (c.y0 as f32 - d).max(0.0),
                        ((c.x1 + 1) as f32 + d).min(w as f32),
                        ((c.y1 + 1) as f32 + d).min(h as f32),
                    ];
                    Some((b, score))
                })
                .collect();
        boxes.sort_by(|a, b| b.1.total_cmp(&a.1));
        boxes.truncate(self.max_candidates);
        let out: Vec<_> = reading_order(boxes)
            .into_iter()
            .map(|(b, score)| {
                let b = match &meta.image {
                    Some(tr) => {
                        let (x1, y1) = tr.to_original(b[0], b[1]);
                        let (x2, y2) = tr.to_original(b[2], b[3]);
                        [x1, y1, x2, y2]
                    }
                    None => b,
                };
                json!({"box": b, "score": score})
            })
            .collect();
        Ok(Some(json!({ "boxes": out })))
    }
}

/// Reading order: lines top to bottom, left to right within a line. A box
/// joins the line of the box above it when its vertical centre lies within
/// that line's first box (words of a slightly tilted line stay together).
fn reading_order(mut boxes: Vec<([f32; 4], f32)>) -> Vec<([f32; 4], f32)> {
    boxes.sort_by(|a, b| a.0[1].total_cmp(&b.0[1]).then(a.0[0].total_cmp(&b.0[0])));
    let mut out = Vec::with_capacity(boxes.len());
    let mut line: Vec<([f32; 4], f32)> = Vec::new();
    for b in boxes {
        if let Some(first) = line.first()
            && (b.0[1] + b.0[3]) / 2.0 > first.0[3]
        {
            line.sort_by(|a, b| a.0[0].total_cmp(&b.0[0]));
            out.append(&mut line);
        }
        line.push(b);
    }
    line.sort_by(|a, b| a.0[0].total_cmp(&b.0[0]));
    out.append(&mut line);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn words_of_a_tilted_line_read_left_to_right() {
        // Right word a little higher than the left one, then a line below.
        let b = super::reading_order(vec![
            ([100.0, 8.0, 150.0, 28.0], 0.9),
            ([10.0, 12.0, 90.0, 32.0], 0.9),
            ([10.0, 50.0, 90.0, 70.0], 0.9),
        ]);
        let xs: Vec<(f32, f32)> = b.iter().map(|(r, _)| (r[0], r[1])).collect();
        assert_eq!(xs, vec![(10.0, 12.0), (100.0, 8.0), (10.0, 50.0)]);
    }

    use super::*;
    use crate::preprocess::ImageTransform;
    use ndarray::{ArrayD, IxDyn};

    fn map(
        w: usize,
        h: usize,
        rects: &[(usize, usize, usize, usize, f32)],
    ) -> Vec<(String, Tensor)> {
        let mut a = ArrayD::<f32>::zeros(IxDyn(&[1, 1, h, w]));
        for &(x0, y0, x1, y1, p) in rects {
            for y in y0..y1 {
                for x in x0..x1 {
                    a[[0, 0, y, x]] = p;
                }
            }
        }
        vec![("m".into(), Tensor::F32(a))]
    }

    fn post(conn: Connectivity) -> TextBoxesPostprocessor {
        TextBoxesPostprocessor {
            output: "m".into(),
            threshold: 0.3,
            box_threshold: 0.5,
            unclip_ratio: 1.5,
            min_size: 3.0,
            max_candidates: 100,
            connectivity: conn,
        }
    }

    #[test]
    fn finds_boxes_scores_and_unclips() {
        let m = map(
            100,
            50,
            &[
                (10, 10, 50, 20, 0.9),
                (10, 30, 30, 40, 0.4),
                (80, 40, 82, 42, 0.9),
            ],
        );
        let out = post(Connectivity::Eight)
            .process("s", &ItemMeta::default(), &m)
            .unwrap()
            .unwrap();
        let b = out["boxes"].as_array().unwrap();
        // Second rect's mean 0.4 < box_threshold; third is 2x2 < min_size.
        assert_eq!(b.len(), 1, "{out}");
        assert!((b[0]["score"].as_f64().unwrap() - 0.9).abs() < 1e-6);
        // 40x10 box: d = 400 * 1.5 / 100 = 6.
        let bx: Vec<f64> = b[0]["box"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(bx, vec![4.0, 4.0, 56.0, 26.0]);
    }

    #[test]
    fn connectivity_decides_diagonal_joins() {
        // Two 4x4 squares touching only at a corner.
        let m = map(20, 20, &[(0, 0, 4, 4, 0.9), (4, 4, 8, 8, 0.9)]);
        let p8 = post(Connectivity::Eight)
            .process("s", &ItemMeta::default(), &m)
            .unwrap()
            .unwrap();
        let p4 = post(Connectivity::Four)
            .process("s", &ItemMeta::default(), &m)
            .unwrap()
            .unwrap();
        assert_eq!(p8["boxes"].as_array().unwrap().len(), 1);
        assert_eq!(p4["boxes"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn maps_back_and_orders_top_to_bottom() {
        let m = map(100, 100, &[(10, 60, 90, 70, 0.9), (10, 10, 90, 20, 0.8)]);
        let meta = ItemMeta {
            image: Some(ImageTransform {
                orig_width: 200,
                orig_height: 200,
                scale_x: 0.5,
                scale_y: 0.5,
                pad_x: 0.0,
                pad_y: 0.0,
            }),
            ..ItemMeta::default()
        };
        let out = post(Connectivity::Eight)
            .process("s", &meta, &m)
            .unwrap()
            .unwrap();
        let b = out["boxes"].as_array().unwrap();
        assert_eq!(b.len(), 2);
        assert!(b[0]["box"][1].as_f64().unwrap() < b[1]["box"][1].as_f64().unwrap());
        assert!(b[1]["box"][3].as_f64().unwrap() > 100.0); // original scale
    }

    #[test]
    fn bad_shapes_are_errors() {
        let m = vec![(
            "m".to_string(),
            Tensor::F32(ArrayD::zeros(IxDyn(&[2, 1, 4, 4]))),
        )];
        assert_eq!(
            post(Connectivity::Eight)
                .process("s", &ItemMeta::default(), &m)
                .unwrap_err()
                .reason(),
            "bad_shape"
        );
        let m = vec![("m".to_string(), Tensor::F32(ArrayD::zeros(IxDyn(&[4]))))];
        assert!(
            post(Connectivity::Eight)
                .process("s", &ItemMeta::default(), &m)
                .is_err()
        );
    }
}
