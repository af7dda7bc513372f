//! Shape rules of reductions (Reduce*, ArgMax, ArgMin) and TopK.

use std::collections::HashSet;

use super::{Node, attr_i, attr_ints, axis, ints, mk};
use crate::plan::graph::Info;

pub(super) fn reduce(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    c.shape(0).map(|s| {
        let keep = attr_i(n, "keepdims").unwrap_or(1) != 0;
        let axes: Option<Vec<i64>> = if op.starts_with("Arg") {
            Some(vec![attr_i(n, "axis").unwrap_or(0)])
        } else {
            attr_ints(n, "axes").or_else(|| ints(&c.val(1)))
        };
        let axes: HashSet<usize> = match axes {
            Some(a) if !a.is_empty() => a.iter().filter_map(|x| axis(*x, s.len())).collect(),
            _ => (0..s.len()).collect(),
        };
        let mut out = Vec::new();
        for (i, d) in s.iter().enumerate() {
            if axes.contains(&i) {
                if keep {
                    out.push(1);
                }
            } else {
                out.push(*d);
            }
        }
        mk(
            out,
            if op.starts_with("Arg") { 7 } else { c.dtype(0) },
            None,
        )
    })
}

pub(super) fn top_k(c: &Node, r: &mut [Option<Info>]) -> Option<Info> {
    let n = c.n;
    match (c.shape(0), ints(&c.val(1))) {
        (Some(s), Some(k)) if !k.is_empty() => {
            axis(attr_i(n, "axis").unwrap_or(-1), s.len()).map(|a| {
                let mut o = s.clone();
                o[a] = k[0].max(0) as u64;
                if let Some(slot) = r.get_mut(1) {
                    *slot = Some(mk(o.clone(), 7, None));
                }
                mk(o, c.dtype(0), None)
            })
        }
        _ => None,
    }
}
