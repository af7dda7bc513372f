//! Shape rules of matrix products: Gemm and the batched MatMul family.

use super::{Node, attr_i, broadcast, mk};
use crate::plan::graph::Info;

pub(super) fn gemm(c: &Node) -> Option<Info> {
    let n = c.n;
    match (c.shape(0), c.shape(1)) {
        (Some(a), Some(b)) if a.len() == 2 && b.len() == 2 => {
            let m = if attr_i(n, "transA").unwrap_or(0) != 0 {
                a[1]
            } else {
                a[0]
            };
            let nn = if attr_i(n, "transB").unwrap_or(0) != 0 {
                b[0]
            } else {
                b[1]
            };
            Some(mk(vec![m, nn], c.dtype(0), None))
        }
        _ => None,
    }
}

pub(super) fn matmul(c: &Node) -> Option<Info> {
    let op = c.op;
    let (ai, bi) = if op == "QLinearMatMul" {
        (0, 3)
    } else {
        (0, 1)
    };
    match (c.shape(ai), c.shape(bi)) {
        (Some(mut a), Some(mut b)) if !a.is_empty() && !b.is_empty() => {
            let (a1, b1) = (a.len() == 1, b.len() == 1);
            if a1 {
                a.insert(0, 1);
            }
            if b1 {
                b.push(1);
            }
            let (m, nn) = (a[a.len() - 2], b[b.len() - 1]);
            let ab = a[..a.len() - 2].to_vec();
            let bb = b[..b.len() - 2].to_vec();
            broadcast(&[&ab, &bb]).map(|mut s| {
                if !a1 {
                    s.push(m);
                }
                if !b1 {
                    s.push(nn);
                }
                let b = match op {
                    "MatMulInteger" => 6,
                    _ => c.dtype(ai),
                };
                mk(s, b, None)
            })
        }
        _ => None,
    }
}
