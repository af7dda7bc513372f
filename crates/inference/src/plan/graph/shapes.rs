//! ONNX shape rules: the output shapes (and, for small integer tensors, the
//! values) of one node from what is known of its inputs. One file per
//! operator family; this one dispatches by operator and holds the helpers
//! they share.
//!
//! Shapes are propagated node by node from the concrete input shapes (batch
//! and free dimensions already resolved) with the ONNX shape rules of the
//! operators vision, audio and tabular models are made of; small integer
//! tensors (shapes, axes, sizes) are evaluated on the way, so the
//! `Shape -> Gather -> Concat -> Reshape` chains exporters emit resolve too.
//! An operator not known here gives an unknown shape (None); the walk then
//! sizes it (see `liveness`).

mod conv;
mod elementwise;
mod generate;
mod layout;
mod linear;
mod recurrent;
mod reduce;
mod select;

use self::elementwise::{BINARY, UNARY};
use super::{Info, MAX_VALUE_ELEMS};
use crate::onnx_proto::{AttributeProto, NodeProto};

/// A node and what is known of its inputs, as the shape rules read them.
pub(super) struct Node<'a> {
    pub n: &'a NodeProto,
    pub op: &'a str,
    pub opset: i64,
    ins: &'a [Option<Info>],
}

impl<'a> Node<'a> {
    fn get(&self, i: usize) -> Option<&'a Info> {
        self.ins.get(i).and_then(|x| x.as_ref())
    }
    fn shape(&self, i: usize) -> Option<Vec<u64>> {
        self.get(i).and_then(|x| x.shape.clone())
    }
    /// Element type of input i (f32 when unknown).
    fn dtype(&self, i: usize) -> i32 {
        self.get(i).map(|x| x.dtype).unwrap_or(1)
    }
    fn val(&self, i: usize) -> Option<Vec<f64>> {
        self.get(i).and_then(|x| x.value.clone())
    }
}

/// A computed (not constant) tensor.
pub(super) fn mk(shape: Vec<u64>, dtype: i32, value: Option<Vec<f64>>) -> Info {
    Info {
        shape: Some(shape),
        dtype,
        value,
        constant: false,
    }
}

pub(super) fn attr<'a>(n: &'a NodeProto, name: &str) -> Option<&'a AttributeProto> {
    n.attribute.iter().find(|a| a.name == name)
}
pub(super) fn attr_i(n: &NodeProto, name: &str) -> Option<i64> {
    attr(n, name).map(|a| a.i)
}
pub(super) fn attr_ints(n: &NodeProto, name: &str) -> Option<Vec<i64>> {
    attr(n, name).map(|a| a.ints.clone())
}
pub(super) fn attr_s(n: &NodeProto, name: &str) -> Option<String> {
    attr(n, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

/// Axis in 0..rank from a possibly negative ONNX axis.
pub(super) fn axis(a: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if a < 0 { a + r } else { a };
    (0..r.max(1)).contains(&a).then_some(a as usize)
}

/// The broadcast of these shapes (numpy rules), None when they clash.
pub(super) fn broadcast(shapes: &[&Vec<u64>]) -> Option<Vec<u64>> {
    let rank = shapes.iter().map(|s| s.len()).max()?;
    let mut out = vec![1u64; rank];
    for s in shapes {
        for (i, d) in s.iter().enumerate() {
            let o = &mut out[rank - s.len() + i];
            if *o == 1 {
                *o = *d;
            } else if *d != 1 && *d != *o {
                return None;
            }
        }
    }
    Some(out)
}

/// Small values as integers (shapes, axes, sizes).
pub(super) fn ints(v: &Option<Vec<f64>>) -> Option<Vec<i64>> {
    v.as_ref().map(|v| v.iter().map(|x| *x as i64).collect())
}

/// Operators whose output is their first input under another shape: the
/// liveness walk lets it share the input's buffer.
pub(super) const ALIAS: &[&str] = &[
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Identity",
    "Dropout",
];

/// Output infos of one node (same length as its outputs; None: unknown).
pub(super) fn infer(n: &NodeProto, ins: &[Option<Info>], opset: i64) -> Vec<Option<Info>> {
    let mut r: Vec<Option<Info>> = vec![None; n.output.len()];
    let op = n.op_type.as_str();
    let c = Node { n, op, opset, ins };
    let first = match op {
        _ if UNARY.contains(&op) => elementwise::unary(&c),
        _ if BINARY.contains(&op) => elementwise::binary(&c),
        "Conv" | "ConvInteger" | "QLinearConv" => conv::conv(&c),
        "ConvTranspose" => conv::conv_transpose(&c),
        "MaxPool" | "AveragePool" | "LpPool" => conv::pool(&c),
        "GlobalAveragePool" | "GlobalMaxPool" | "GlobalLpPool" => conv::global_pool(&c),
        "Gemm" => linear::gemm(&c),
        "MatMul" | "MatMulInteger" | "QLinearMatMul" => linear::matmul(&c),
        "Flatten" => layout::flatten(&c),
        "Reshape" => layout::reshape(&c),
        "Transpose" => layout::transpose(&c),
        "Concat" => select::concat(&c),
        // Several outputs: filled below.
        "Split" => None,
        "Squeeze" | "Unsqueeze" => layout::squeeze(&c),
        "Slice" => select::slice(&c),
        "Shape" => generate::shape(&c),
        "Size" => generate::size(&c),
        "Gather" => select::gather(&c),
        "Expand" => layout::expand(&c),
        "Tile" => layout::tile(&c),
        "ConstantOfShape" => generate::constant_of_shape(&c),
        "Range" => generate::range(&c),
        "Pad" => layout::pad(&c),
        "Resize" | "Upsample" => layout::resize(&c),
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1"
        | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceSumSquare" | "ArgMax"
        | "ArgMin" => reduce::reduce(&c),
        "LSTM" | "GRU" | "RNN" => recurrent::rnn(&c, &mut r),
        "TopK" => reduce::top_k(&c, &mut r),
        "DepthToSpace" | "SpaceToDepth" => layout::depth_space(&c),
        _ if ALIAS.contains(&op) => c.shape(0).map(|s| mk(s, c.dtype(0), c.val(0))),
        _ => None,
    };
    if op == "Split" {
        select::split(&c, &mut r);
        return r;
    }
    if let Some(f) = first
        && let Some(slot) = r.first_mut()
    {
        // Keep values only for small tensors.
        let mut f = f;
        if f.shape
            .as_ref()
            .is_some_and(|s| s.iter().product::<u64>() > MAX_VALUE_ELEMS)
        {
            f.value = None;
        }
        *slot = Some(f);
    }
    // Dropout's mask, BatchNormalization's training outputs: unused at inference.
    r
}
