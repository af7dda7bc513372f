//! Shape rules of operators that pick or join parts of tensors: Concat,
//! Split, Slice, Gather. On small 1-D tensors they also compute values, which
//! is how `Shape -> Gather -> Concat -> Reshape` chains resolve.

use super::{Node, attr_i, attr_ints, axis, ints, mk};
use crate::plan::graph::Info;

pub(super) fn concat(c: &Node) -> Option<Info> {
    let n = c.n;
    let shapes: Vec<Vec<u64>> = (0..n.input.len()).filter_map(|i| c.shape(i)).collect();
    if shapes.len() != n.input.len() || shapes.is_empty() {
        None
    } else {
        axis(attr_i(n, "axis").unwrap_or(0), shapes[0].len()).map(|a| {
            let mut s = shapes[0].clone();
            s[a] = shapes.iter().map(|x| x.get(a).copied().unwrap_or(0)).sum();
            let v: Option<Vec<f64>> = (0..n.input.len())
                .map(|i| c.val(i))
                .collect::<Option<Vec<_>>>()
                .map(|vs| vs.concat());
            mk(s, c.dtype(0), v)
        })
    }
}

pub(super) fn slice(c: &Node) -> Option<Info> {
    let n = c.n;
    let opset = c.opset;
    c.shape(0).and_then(|s| {
        let (starts, ends, axes, steps) = if opset >= 10 {
            (
                ints(&c.val(1))?,
                ints(&c.val(2))?,
                if n.input.len() > 3 && !n.input[3].is_empty() {
                    ints(&c.val(3))?
                } else {
                    (0..s.len() as i64).collect()
                },
                if n.input.len() > 4 && !n.input[4].is_empty() {
                    ints(&c.val(4))?
                } else {
                    vec![1; s.len()]
                },
            )
        } else {
            let st = attr_ints(n, "starts")?;
            let en = attr_ints(n, "ends")?;
            let ax = attr_ints(n, "axes").unwrap_or_else(|| (0..st.len() as i64).collect());
            let k = st.len();
            (st, en, ax, vec![1; k])
        };
        let mut out = s.clone();
        let mut ranges: Vec<(i64, i64, i64)> = s.iter().map(|d| (0, *d as i64, 1)).collect();
        for (i, a) in axes.iter().enumerate() {
            let a = axis(*a, s.len())?;
            let dim = s[a] as i64;
            let step = *steps.get(i).unwrap_or(&1);
            if step == 0 {
                return None;
            }
            let clamp = |x: i64, lo: i64, hi: i64| x.max(lo).min(hi);
            let norm = |x: i64| if x < 0 { x + dim } else { x };
            let (b, e) = if step > 0 {
                (
                    clamp(norm(*starts.get(i)?), 0, dim),
                    clamp(norm(*ends.get(i)?), 0, dim),
                )
            } else {
                (
                    clamp(norm(*starts.get(i)?), -1, dim - 1),
                    clamp(norm(*ends.get(i)?), -1, dim - 1),
                )
            };
            let len = if step > 0 {
                ((e - b).max(0) + step - 1) / step
            } else {
                ((b - e).max(0) + (-step) - 1) / (-step)
            };
            out[a] = len as u64;
            ranges[a] = (b, e, step);
        }
        // Values of a 1-D slice (shape arithmetic).
        let v = c.val(0).filter(|_| s.len() == 1).map(|v| {
            let (b, _, st) = ranges[0];
            (0..out[0] as i64)
                .filter_map(|k| v.get((b + k * st) as usize).copied())
                .collect()
        });
        Some(mk(out, c.dtype(0), v))
    })
}

pub(super) fn gather(c: &Node) -> Option<Info> {
    let n = c.n;
    match (c.shape(0), c.shape(1)) {
        (Some(d), Some(idx)) => axis(attr_i(n, "axis").unwrap_or(0), d.len()).map(|a| {
            let mut s = d[..a].to_vec();
            s.extend(idx.iter().copied());
            s.extend(d[a + 1..].iter().copied());
            let v = match (c.val(0), ints(&c.val(1))) {
                (Some(dv), Some(iv)) if d.len() == 1 => iv
                    .iter()
                    .map(|i| {
                        let i = if *i < 0 { *i + dv.len() as i64 } else { *i };
                        dv.get(i as usize).copied()
                    })
                    .collect::<Option<Vec<f64>>>(),
                _ => None,
            };
            mk(s, c.dtype(0), v)
        }),
        _ => None,
    }
}

/// Split's outputs: the sizes given (input or attribute), or equal parts.
pub(super) fn split(c: &Node, r: &mut [Option<Info>]) {
    let n = c.n;
    let outs = r.len();
    if let Some(s) = c.shape(0)
        && let Some(a) = axis(attr_i(n, "axis").unwrap_or(0), s.len())
    {
        let sizes: Vec<u64> = match ints(&c.val(1)).or_else(|| attr_ints(n, "split")) {
            Some(v) if v.len() == outs => v.iter().map(|x| (*x).max(0) as u64).collect(),
            _ => {
                let k = outs.max(1) as u64;
                let each = s[a].div_ceil(k);
                (0..k)
                    .map(|i| each.min(s[a].saturating_sub(i * each)))
                    .collect()
            }
        };
        for (slot, sz) in r.iter_mut().zip(sizes) {
            let mut o = s.clone();
            o[a] = sz;
            *slot = Some(mk(o, c.dtype(0), None));
        }
    }
}
