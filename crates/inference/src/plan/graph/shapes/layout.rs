//! Shape rules of operators that rearrange or resize a tensor without
//! choosing elements: reshapes, transposes, broadcasts, padding, resizing.
//! Reshape, Flatten, Squeeze and Unsqueeze carry small values through.

use std::collections::HashSet;

use super::{Node, attr, attr_i, attr_ints, axis, broadcast, ints, mk};
use crate::plan::graph::Info;

pub(super) fn flatten(c: &Node) -> Option<Info> {
    let n = c.n;
    c.shape(0).and_then(|s| {
        let a = axis(attr_i(n, "axis").unwrap_or(1), s.len() + 1)?;
        let a = a.min(s.len());
        Some(mk(
            vec![s[..a].iter().product(), s[a..].iter().product()],
            c.dtype(0),
            c.val(0),
        ))
    })
}

pub(super) fn reshape(c: &Node) -> Option<Info> {
    let n = c.n;
    match (c.shape(0), ints(&c.val(1))) {
        (Some(s), Some(target)) => {
            let allowzero = attr_i(n, "allowzero").unwrap_or(0) != 0;
            let total: u64 = s.iter().product();
            let mut out: Vec<i64> = target
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    if *d == 0 && !allowzero {
                        s.get(i).map(|x| *x as i64).unwrap_or(0)
                    } else {
                        *d
                    }
                })
                .collect();
            let known: i64 = out.iter().filter(|d| **d >= 0).product();
            if let Some(p) = out.iter().position(|d| *d == -1) {
                out[p] = if known > 0 { total as i64 / known } else { 0 };
            }
            let out: Vec<u64> = out.iter().map(|d| (*d).max(0) as u64).collect();
            (out.iter().product::<u64>() == total).then(|| mk(out, c.dtype(0), c.val(0)))
        }
        _ => None,
    }
}

pub(super) fn transpose(c: &Node) -> Option<Info> {
    let n = c.n;
    c.shape(0).map(|s| {
        let perm = attr_ints(n, "perm").unwrap_or_else(|| (0..s.len() as i64).rev().collect());
        let out = perm
            .iter()
            .map(|p| s.get(*p as usize).copied().unwrap_or(1))
            .collect();
        mk(out, c.dtype(0), None)
    })
}

pub(super) fn squeeze(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    let opset = c.opset;
    c.shape(0).and_then(|s| {
        let axes = if opset >= 13 {
            ints(&c.val(1)).or_else(|| attr_ints(n, "axes"))
        } else {
            attr_ints(n, "axes")
        };
        let out = if op == "Squeeze" {
            match axes {
                Some(ax) => {
                    let ax: HashSet<usize> = ax.iter().filter_map(|a| axis(*a, s.len())).collect();
                    s.iter()
                        .enumerate()
                        .filter(|(i, _)| !ax.contains(i))
                        .map(|(_, d)| *d)
                        .collect()
                }
                None => s.iter().copied().filter(|d| *d != 1).collect(),
            }
        } else {
            let ax = axes?;
            let rank = s.len() + ax.len();
            let mut ax: Vec<usize> = ax.iter().filter_map(|a| axis(*a, rank)).collect();
            ax.sort_unstable();
            let mut out = s.clone();
            for a in ax {
                out.insert(a.min(out.len()), 1);
            }
            out
        };
        Some(mk(out, c.dtype(0), c.val(0)))
    })
}

pub(super) fn expand(c: &Node) -> Option<Info> {
    match (c.shape(0), ints(&c.val(1))) {
        (Some(s), Some(t)) => {
            let t: Vec<u64> = t.iter().map(|d| (*d).max(0) as u64).collect();
            broadcast(&[&s, &t]).map(|o| mk(o, c.dtype(0), None))
        }
        _ => None,
    }
}

pub(super) fn tile(c: &Node) -> Option<Info> {
    match (c.shape(0), ints(&c.val(1))) {
        (Some(s), Some(rep)) if rep.len() == s.len() => Some(mk(
            s.iter()
                .zip(&rep)
                .map(|(d, r)| d * (*r).max(0) as u64)
                .collect(),
            c.dtype(0),
            None,
        )),
        _ => None,
    }
}

pub(super) fn pad(c: &Node) -> Option<Info> {
    let n = c.n;
    let opset = c.opset;
    c.shape(0).and_then(|s| {
        let pads = if opset >= 11 {
            ints(&c.val(1))?
        } else {
            attr_ints(n, "pads")?
        };
        let r = s.len();
        let axes: Vec<usize> = if opset >= 18 && n.input.len() > 3 && !n.input[3].is_empty() {
            ints(&c.val(3))?
                .iter()
                .filter_map(|a| axis(*a, r))
                .collect()
        } else {
            (0..r).collect()
        };
        let k = axes.len();
        let mut out = s.clone();
        for (i, a) in axes.iter().enumerate() {
            let add = pads.get(i).copied().unwrap_or(0) + pads.get(i + k).copied().unwrap_or(0);
            out[*a] = (out[*a] as i64 + add).max(0) as u64;
        }
        Some(mk(out, c.dtype(0), None))
    })
}

pub(super) fn resize(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    let opset = c.opset;
    c.shape(0).and_then(|s| {
        let sizes = n
            .input
            .get(3)
            .filter(|x| !x.is_empty())
            .and_then(|_| ints(&c.val(3)))
            .filter(|v| !v.is_empty());
        let scale_idx = if op == "Upsample" || opset < 11 { 1 } else { 2 };
        let scales = c
            .val(scale_idx)
            .filter(|v| !v.is_empty())
            .or_else(|| attr(n, "scales").map(|a| a.floats.iter().map(|f| *f as f64).collect()));
        let out: Vec<u64> = if let Some(sz) = sizes {
            if sz.len() == s.len() {
                sz.iter().map(|d| (*d).max(0) as u64).collect()
            } else {
                return None;
            }
        } else {
            let sc = scales?;
            if sc.len() != s.len() {
                return None;
            }
            s.iter()
                .zip(&sc)
                .map(|(d, f)| (*d as f64 * f).floor() as u64)
                .collect()
        };
        Some(mk(out, c.dtype(0), None))
    })
}

pub(super) fn depth_space(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    c.shape(0).and_then(|s| {
        let b = attr_i(n, "blocksize")?.max(1) as u64;
        (s.len() == 4).then(|| {
            let o = if op == "DepthToSpace" {
                vec![s[0], s[1] / (b * b), s[2] * b, s[3] * b]
            } else {
                vec![s[0], s[1] * b * b, s[2] / b, s[3] / b]
            };
            mk(o, c.dtype(0), None)
        })
    })
}
