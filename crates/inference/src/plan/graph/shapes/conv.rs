//! Shape rules of convolutions and pooling: a window sliding over the
//! spatial dimensions (strides, dilations, pads, auto_pad, ceil_mode).

use super::{Node, attr_i, attr_ints, attr_s, mk};
use crate::onnx_proto::NodeProto;
use crate::plan::graph::Info;

pub(super) fn conv(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    let (x, w) = if op == "QLinearConv" { (0, 3) } else { (0, 1) };
    match (c.shape(x), c.shape(w)) {
        (Some(xs), Some(ws)) if xs.len() >= 3 && ws.len() == xs.len() => {
            let kernel = attr_ints(n, "kernel_shape")
                .map(|k| k.iter().map(|d| *d as u64).collect())
                .unwrap_or_else(|| ws[2..].to_vec());
            window_out(n, &xs[2..], &kernel, false).map(|sp| {
                let mut s = vec![xs[0], ws[0]];
                s.extend(sp);
                let dt = match op {
                    "Conv" => c.dtype(0),
                    "ConvInteger" => 6,
                    _ => c.dtype(0),
                };
                mk(s, dt, None)
            })
        }
        _ => None,
    }
}

pub(super) fn conv_transpose(c: &Node) -> Option<Info> {
    let n = c.n;
    match (c.shape(0), c.shape(1)) {
        (Some(xs), Some(ws)) if xs.len() >= 3 && ws.len() == xs.len() => {
            let r = xs.len() - 2;
            let group = attr_i(n, "group").unwrap_or(1).max(1) as u64;
            let mut s = vec![xs[0], ws[1] * group];
            if let Some(os) = attr_ints(n, "output_shape") {
                s.extend(os.iter().rev().take(r).rev().map(|d| *d as u64));
            } else {
                let strides = attr_ints(n, "strides").unwrap_or_default();
                let dil = attr_ints(n, "dilations").unwrap_or_default();
                let pads = attr_ints(n, "pads").unwrap_or_default();
                let opad = attr_ints(n, "output_padding").unwrap_or_default();
                let kernel = attr_ints(n, "kernel_shape")
                    .map(|k| k.iter().map(|d| *d as u64).collect())
                    .unwrap_or_else(|| ws[2..].to_vec());
                for i in 0..r {
                    let st = *strides.get(i).unwrap_or(&1);
                    let d = *dil.get(i).unwrap_or(&1);
                    let k = *kernel.get(i).unwrap_or(&1) as i64;
                    let p =
                        pads.get(i).copied().unwrap_or(0) + pads.get(i + r).copied().unwrap_or(0);
                    let o = st * (xs[2 + i] as i64 - 1)
                        + opad.get(i).copied().unwrap_or(0)
                        + (k - 1) * d
                        + 1
                        - p;
                    s.push(o.max(1) as u64);
                }
            }
            Some(mk(s, c.dtype(0), None))
        }
        _ => None,
    }
}

pub(super) fn pool(c: &Node) -> Option<Info> {
    let n = c.n;
    c.shape(0).and_then(|xs| {
        let kernel: Vec<u64> = attr_ints(n, "kernel_shape")?
            .iter()
            .map(|d| *d as u64)
            .collect();
        let ceil = attr_i(n, "ceil_mode").unwrap_or(0) != 0;
        window_out(n, xs.get(2..)?, &kernel, ceil).map(|sp| {
            let mut s = xs[..2].to_vec();
            s.extend(sp);
            mk(s, c.dtype(0), None)
        })
    })
}

pub(super) fn global_pool(c: &Node) -> Option<Info> {
    c.shape(0).map(|xs| {
        let mut s = xs.clone();
        for d in s.iter_mut().skip(2) {
            *d = 1;
        }
        mk(s, c.dtype(0), None)
    })
}

/// Spatial output size of a convolution or pooling window.
fn window_out(
    n: &NodeProto,
    spatial_in: &[u64],
    kernel: &[u64],
    ceil_mode: bool,
) -> Option<Vec<u64>> {
    let r = spatial_in.len();
    let strides = attr_ints(n, "strides").unwrap_or_default();
    let dil = attr_ints(n, "dilations").unwrap_or_default();
    let pads = attr_ints(n, "pads").unwrap_or_default();
    let auto = attr_s(n, "auto_pad").unwrap_or_default();
    let mut out = Vec::with_capacity(r);
    for (i, &input) in spatial_in.iter().enumerate() {
        let s = *strides.get(i).unwrap_or(&1).max(&1) as u64;
        let d = *dil.get(i).unwrap_or(&1).max(&1) as u64;
        let k = *kernel.get(i)?;
        let o = match auto.as_str() {
            "SAME_UPPER" | "SAME_LOWER" => input.div_ceil(s),
            _ => {
                let p = if auto == "VALID" {
                    0
                } else {
                    (pads.get(i).copied().unwrap_or(0) + pads.get(i + r).copied().unwrap_or(0))
                        .max(0) as u64
                };
                let eff = d * (k.max(1) - 1) + 1;
                let span = (input + p).checked_sub(eff)?;
                if ceil_mode {
                    span.div_ceil(s) + 1
                } else {
                    span / s + 1
                }
            }
        };
        out.push(o);
    }
    Some(out)
}
