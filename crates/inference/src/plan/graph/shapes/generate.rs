//! Shape rules of operators that make a tensor from shapes or scalars:
//! Shape, Size, ConstantOfShape, Range. Their values are computed, since
//! what follows them (Reshape, Expand, Tile) needs them.

use super::{Node, attr, attr_i, ints, mk};
use crate::plan::graph::{Info, MAX_VALUE_ELEMS, tensor_values};

pub(super) fn shape(c: &Node) -> Option<Info> {
    let n = c.n;
    c.shape(0).map(|s| {
        let r = s.len() as i64;
        let norm = |x: i64| if x < 0 { (x + r).max(0) } else { x.min(r) };
        let start = norm(attr_i(n, "start").unwrap_or(0)) as usize;
        let end = attr(n, "end")
            .map(|a| norm(a.i) as usize)
            .unwrap_or(s.len());
        let v: Vec<f64> = s
            .get(start..end.max(start))
            .unwrap_or(&[])
            .iter()
            .map(|d| *d as f64)
            .collect();
        mk(vec![v.len() as u64], 7, Some(v))
    })
}

pub(super) fn size(c: &Node) -> Option<Info> {
    c.shape(0)
        .map(|s| mk(vec![], 7, Some(vec![s.iter().product::<u64>() as f64])))
}

pub(super) fn constant_of_shape(c: &Node) -> Option<Info> {
    let n = c.n;
    ints(&c.val(0)).map(|t| {
        let s: Vec<u64> = t.iter().map(|d| (*d).max(0) as u64).collect();
        let (b, fill) = attr(n, "value")
            .and_then(|a| a.t.as_ref())
            .map(|t| {
                (
                    t.data_type,
                    tensor_values(t).and_then(|v| v.first().copied()),
                )
            })
            .unwrap_or((1, Some(0.0)));
        let count: u64 = s.iter().product();
        let v = (count <= MAX_VALUE_ELEMS)
            .then(|| fill.map(|f| vec![f; count as usize]))
            .flatten();
        mk(s, b, v)
    })
}

pub(super) fn range(c: &Node) -> Option<Info> {
    match (c.val(0), c.val(1), c.val(2)) {
        (Some(a), Some(b), Some(d)) if a.len() == 1 && b.len() == 1 && d.len() == 1 => {
            let (a, b, d) = (a[0], b[0], d[0]);
            if d == 0.0 {
                None
            } else {
                let count = ((b - a) / d).ceil().max(0.0) as u64;
                let v = (count <= MAX_VALUE_ELEMS)
                    .then(|| (0..count).map(|k| a + k as f64 * d).collect());
                Some(mk(vec![count], c.dtype(0), v))
            }
        }
        _ => None,
    }
}
