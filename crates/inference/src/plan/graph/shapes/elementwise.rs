//! Shape rules of element-wise operators: activations, normalisations and
//! casts keep their input's shape; arithmetic and comparisons broadcast.
//! Add, Sub, Mul, Div and Neg also compute small values (shape arithmetic).

use super::{Node, attr_i, broadcast, mk};
use crate::plan::graph::Info;

/// Operators whose output has their (first) input's shape.
pub(super) const UNARY: &[&str] = &[
    "Relu",
    "Clip",
    "Sigmoid",
    "HardSigmoid",
    "HardSwish",
    "Tanh",
    "LeakyRelu",
    "Elu",
    "Selu",
    "Celu",
    "Gelu",
    "FastGelu",
    "Erf",
    "Exp",
    "Log",
    "Sqrt",
    "Neg",
    "Abs",
    "Reciprocal",
    "Floor",
    "Ceil",
    "Round",
    "Sin",
    "Cos",
    "Softplus",
    "Softsign",
    "Mish",
    "Sign",
    "ThresholdedRelu",
    "Softmax",
    "LogSoftmax",
    "Hardmax",
    "BatchNormalization",
    "InstanceNormalization",
    "LayerNormalization",
    "LpNormalization",
    "MeanVarianceNormalization",
    "LRN",
    "CumSum",
    "Not",
    "IsNaN",
    "IsInf",
    "Cast",
    "CastLike",
    "QuantizeLinear",
    "DequantizeLinear",
    "Shrink",
];
/// Operators whose inputs broadcast to their output.
pub(super) const BINARY: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Max",
    "Min",
    "Sum",
    "Mean",
    "PRelu",
    "Mod",
    "BitShift",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "And",
    "Or",
    "Xor",
    "Where",
];

pub(super) fn unary(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    c.shape(0).map(|s| {
        let b = match op {
            "Cast" => attr_i(n, "to").unwrap_or(1) as i32,
            "Not" | "IsNaN" | "IsInf" => 9,
            "DequantizeLinear" => 1,
            "QuantizeLinear" => c.get(2).map(|x| x.dtype).unwrap_or(2),
            "CastLike" => c.dtype(1),
            _ => c.dtype(0),
        };
        let v = if matches!(op, "Cast" | "CastLike") {
            c.val(0)
        } else if op == "Neg" {
            c.val(0).map(|v| v.iter().map(|x| -x).collect())
        } else {
            None
        };
        mk(s, b, v)
    })
}

pub(super) fn binary(c: &Node) -> Option<Info> {
    let n = c.n;
    let op = c.op;
    let shapes: Vec<Vec<u64>> = (0..n.input.len()).filter_map(|i| c.shape(i)).collect();
    if shapes.len() != n.input.len() {
        None
    } else {
        let refs: Vec<&Vec<u64>> = shapes.iter().collect();
        broadcast(&refs).map(|s| {
            let b = match op {
                "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And" | "Or"
                | "Xor" => 9,
                "Where" => c.dtype(1),
                _ => c.dtype(0),
            };
            let v = match (op, c.val(0), c.val(1)) {
                ("Add" | "Sub" | "Mul" | "Div", Some(a), Some(y))
                    if !a.is_empty() && !y.is_empty() =>
                {
                    let len = a.len().max(y.len());
                    let int = !matches!(c.dtype(0), 1 | 10 | 11 | 16);
                    ((a.len() == len || a.len() == 1) && (y.len() == len || y.len() == 1)).then(
                        || {
                            (0..len)
                                .map(|i| {
                                    let x = a[if a.len() == 1 { 0 } else { i }];
                                    let w = y[if y.len() == 1 { 0 } else { i }];
                                    match op {
                                        "Add" => x + w,
                                        "Sub" => x - w,
                                        "Mul" => x * w,
                                        _ if w == 0.0 => 0.0,
                                        _ if int => (x / w).floor(),
                                        _ => x / w,
                                    }
                                })
                                .collect()
                        },
                    )
                }
                _ => None,
            };
            mk(s, b, v)
        })
    }
}
