//! What ONNX Runtime's CPU provider will hold for a model, read from the
//! graph without loading ONNX Runtime: node and subgraph counts, which
//! weights feed convolutions, and the peak of the intermediate tensors
//! alive at once during one run.
//!
//! Shapes are propagated node by node from the concrete input shapes (batch
//! and free dimensions already resolved) with the ONNX shape rules of the
//! operators vision, audio and tabular models are made of; small integer
//! tensors (shapes, axes, sizes) are evaluated on the way, so the
//! `Shape -> Gather -> Concat -> Reshape` chains exporters emit resolve too.
//! An output whose shape cannot be inferred is counted as large as the
//! largest activation feeding its node (and reported as unknown).
//!
//! The liveness walk follows the graph's node order (topological by the ONNX
//! spec): a tensor is allocated by its producer and freed after its last
//! consumer; Reshape, Flatten, Squeeze, Unsqueeze, Identity and Dropout
//! alias their input. No in-place reuse (an activation writing over its
//! input) is assumed: ONNX Runtime does fuse and reuse, but its planner only
//! reuses buffers of the same size and its NCHWc layout pass adds reorder
//! copies, and measured peaks sit near this walk's figure (PP-OCR det at
//! 736 x 736: walk 52 MB, ONNX Runtime's memory-pattern block 80 MB; the
//! tighter in-place walk gave 35 MB). Nodes whose inputs are all constant are
//! folded, as ONNX Runtime's constant folding does. Graph inputs (the
//! caller's) and outputs are not intermediates; the plan counts them
//! separately.

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use prost::Message;

#[derive(Clone, PartialEq, Message)]
struct ModelProto {
    #[prost(int64, tag = "1")]
    ir_version: i64,
    #[prost(message, optional, tag = "7")]
    graph: Option<GraphProto>,
    #[prost(message, repeated, tag = "8")]
    opset_import: Vec<OpsetId>,
}

#[derive(Clone, PartialEq, Message)]
struct OpsetId {
    #[prost(string, tag = "1")]
    domain: String,
    #[prost(int64, tag = "2")]
    version: i64,
}

#[derive(Clone, PartialEq, Message)]
struct GraphProto {
    #[prost(message, repeated, tag = "1")]
    node: Vec<NodeProto>,
    #[prost(message, repeated, tag = "5")]
    initializer: Vec<TensorProto>,
    #[prost(message, repeated, tag = "11")]
    input: Vec<ValueInfo>,
    #[prost(message, repeated, tag = "12")]
    output: Vec<ValueInfo>,
}

#[derive(Clone, PartialEq, Message)]
struct NodeProto {
    #[prost(string, repeated, tag = "1")]
    input: Vec<String>,
    #[prost(string, repeated, tag = "2")]
    output: Vec<String>,
    #[prost(string, tag = "4")]
    op_type: String,
    #[prost(message, repeated, tag = "5")]
    attribute: Vec<AttributeProto>,
    #[prost(string, tag = "7")]
    domain: String,
}

#[derive(Clone, PartialEq, Message)]
struct AttributeProto {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(float, tag = "2")]
    f: f32,
    #[prost(int64, tag = "3")]
    i: i64,
    #[prost(bytes = "bytes", tag = "4")]
    s: Bytes,
    #[prost(message, optional, tag = "5")]
    t: Option<TensorProto>,
    #[prost(message, optional, tag = "6")]
    g: Option<GraphProto>,
    #[prost(float, repeated, tag = "7")]
    floats: Vec<f32>,
    #[prost(int64, repeated, tag = "8")]
    ints: Vec<i64>,
    #[prost(message, repeated, tag = "11")]
    graphs: Vec<GraphProto>,
}

#[derive(Clone, PartialEq, Message)]
struct TensorProto {
    #[prost(int64, repeated, tag = "1")]
    dims: Vec<i64>,
    #[prost(int32, tag = "2")]
    data_type: i32,
    #[prost(float, repeated, tag = "4")]
    float_data: Vec<f32>,
    #[prost(int32, repeated, tag = "5")]
    int32_data: Vec<i32>,
    #[prost(int64, repeated, tag = "7")]
    int64_data: Vec<i64>,
    #[prost(string, tag = "8")]
    name: String,
    #[prost(bytes = "bytes", tag = "9")]
    raw_data: Bytes,
    #[prost(double, repeated, tag = "10")]
    double_data: Vec<f64>,
}

#[derive(Clone, PartialEq, Message)]
struct ValueInfo {
    #[prost(string, tag = "1")]
    name: String,
}

/// What the graph says about ONNX Runtime's memory for one run.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct GraphFacts {
    /// Nodes in the graph and every subgraph, Constant nodes included.
    pub nodes: u64,
    /// Subgraphs (If branches, Loop and Scan bodies).
    pub subgraphs: u64,
    /// Weight elements (float and 8-bit) that feed a Conv or ConvTranspose
    /// as its weight (ONNX Runtime's CPU provider keeps a reordered copy).
    pub conv_weight_elements: u64,
    /// Largest sum of intermediate tensor bytes alive at one time.
    pub peak_intermediate_bytes: u64,
    /// The largest single intermediate tensor: name and bytes.
    pub largest_intermediate: Option<(String, u64)>,
    /// Node outputs whose shape could not be inferred (sized as the largest
    /// activation feeding their node).
    pub unknown_shapes: u64,
}

/// A tensor as the walk knows it.
#[derive(Debug, Clone, Default)]
struct Info {
    shape: Option<Vec<u64>>,
    /// ONNX element type (TensorProto.DataType).
    dtype: i32,
    /// Values of small tensors (shapes, axes, scales), when known.
    value: Option<Vec<f64>>,
    /// An initializer, a Constant, or computed from constants only.
    constant: bool,
}

impl Info {
    fn bytes(&self) -> Option<u64> {
        self.shape
            .as_ref()
            .map(|s| s.iter().product::<u64>() * elem_bytes(self.dtype))
    }
}

/// Values kept for tensors up to this many elements.
const MAX_VALUE_ELEMS: u64 = 4096;

fn elem_bytes(data_type: i32) -> u64 {
    match data_type {
        2 | 3 | 9 => 1,        // u8, i8, bool
        4 | 5 | 10 | 16 => 2,  // u16, i16, f16, bf16
        1 | 6 | 12 => 4,       // f32, i32, u32
        7 | 11 | 13 | 14 => 8, // i64, f64, u64, complex64
        15 => 16,              // complex128
        _ => 4,
    }
}

fn is_weight_type(data_type: i32) -> bool {
    matches!(data_type, 1 | 2 | 3 | 10 | 11 | 16)
}

fn tensor_values(t: &TensorProto) -> Option<Vec<f64>> {
    let n: u64 = t.dims.iter().map(|d| (*d).max(0) as u64).product();
    if n > MAX_VALUE_ELEMS {
        return None;
    }
    let raw = &t.raw_data;
    let v: Vec<f64> = if !raw.is_empty() {
        let w = elem_bytes(t.data_type) as usize;
        if raw.len() != n as usize * w {
            return None;
        }
        raw.chunks_exact(w)
            .map(|c| match (t.data_type, w) {
                (1, 4) => f32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as f64,
                (6, 4) => i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as f64,
                (12, 4) => u32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as f64,
                (7, 8) => i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64,
                (13, 8) => u64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64,
                (11, 8) => f64::from_le_bytes(c.try_into().unwrap_or([0; 8])),
                (2 | 9, 1) => c[0] as f64,
                (3, 1) => c[0] as i8 as f64,
                _ => f64::NAN,
            })
            .collect()
    } else if !t.int64_data.is_empty() {
        t.int64_data.iter().map(|x| *x as f64).collect()
    } else if !t.int32_data.is_empty() {
        t.int32_data.iter().map(|x| *x as f64).collect()
    } else if !t.float_data.is_empty() {
        t.float_data.iter().map(|x| *x as f64).collect()
    } else if !t.double_data.is_empty() {
        t.double_data.clone()
    } else {
        return if n == 0 { Some(Vec::new()) } else { None };
    };
    (v.len() as u64 == n && v.iter().all(|x| !x.is_nan())).then_some(v)
}

fn tensor_info(t: &TensorProto) -> Info {
    Info {
        shape: Some(t.dims.iter().map(|d| (*d).max(0) as u64).collect()),
        dtype: t.data_type,
        value: tensor_values(t),
        constant: true,
    }
}

fn attr<'a>(n: &'a NodeProto, name: &str) -> Option<&'a AttributeProto> {
    n.attribute.iter().find(|a| a.name == name)
}
fn attr_i(n: &NodeProto, name: &str) -> Option<i64> {
    attr(n, name).map(|a| a.i)
}
fn attr_ints(n: &NodeProto, name: &str) -> Option<Vec<i64>> {
    attr(n, name).map(|a| a.ints.clone())
}
fn attr_s(n: &NodeProto, name: &str) -> Option<String> {
    attr(n, name).map(|a| String::from_utf8_lossy(&a.s).into_owned())
}

/// Axis in 0..rank from a possibly negative ONNX axis.
fn axis(a: i64, rank: usize) -> Option<usize> {
    let r = rank as i64;
    let a = if a < 0 { a + r } else { a };
    (0..r.max(1)).contains(&a).then_some(a as usize)
}

fn broadcast(shapes: &[&Vec<u64>]) -> Option<Vec<u64>> {
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

fn ints(v: &Option<Vec<f64>>) -> Option<Vec<i64>> {
    v.as_ref().map(|v| v.iter().map(|x| *x as i64).collect())
}

const UNARY: &[&str] = &[
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
const BINARY: &[&str] = &[
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
const ALIAS: &[&str] = &[
    "Reshape",
    "Flatten",
    "Squeeze",
    "Unsqueeze",
    "Identity",
    "Dropout",
];

/// Output infos of one node (same length as its outputs; None: unknown).
fn infer(n: &NodeProto, ins: &[Option<Info>], opset: i64) -> Vec<Option<Info>> {
    let outs = n.output.len();
    let mut r: Vec<Option<Info>> = vec![None; outs];
    let get = |i: usize| ins.get(i).and_then(|x| x.as_ref());
    let shape = |i: usize| get(i).and_then(|x| x.shape.clone());
    let eb = |i: usize| get(i).map(|x| x.dtype).unwrap_or(1);
    let val = |i: usize| get(i).and_then(|x| x.value.clone());
    let op = n.op_type.as_str();
    let mk = |shape: Vec<u64>, dtype: i32, value: Option<Vec<f64>>| Info {
        shape: Some(shape),
        dtype,
        value,
        constant: false,
    };
    let first = match op {
        _ if UNARY.contains(&op) => shape(0).map(|s| {
            let b = match op {
                "Cast" => attr_i(n, "to").unwrap_or(1) as i32,
                "Not" | "IsNaN" | "IsInf" => 9,
                "DequantizeLinear" => 1,
                "QuantizeLinear" => get(2).map(|x| x.dtype).unwrap_or(2),
                "CastLike" => eb(1),
                _ => eb(0),
            };
            let v = if matches!(op, "Cast" | "CastLike") {
                val(0)
            } else if op == "Neg" {
                val(0).map(|v| v.iter().map(|x| -x).collect())
            } else {
                None
            };
            mk(s, b, v)
        }),
        _ if BINARY.contains(&op) => {
            let shapes: Vec<Vec<u64>> = (0..n.input.len()).filter_map(shape).collect();
            if shapes.len() != n.input.len() {
                None
            } else {
                let refs: Vec<&Vec<u64>> = shapes.iter().collect();
                broadcast(&refs).map(|s| {
                    let b = match op {
                        "Equal" | "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" | "And"
                        | "Or" | "Xor" => 9,
                        "Where" => eb(1),
                        _ => eb(0),
                    };
                    let v = match (op, val(0), val(1)) {
                        ("Add" | "Sub" | "Mul" | "Div", Some(a), Some(c))
                            if !a.is_empty() && !c.is_empty() =>
                        {
                            let len = a.len().max(c.len());
                            let int = !matches!(eb(0), 1 | 10 | 11 | 16);
                            ((a.len() == len || a.len() == 1) && (c.len() == len || c.len() == 1))
                                .then(|| {
                                    (0..len)
                                        .map(|i| {
                                            let x = a[if a.len() == 1 { 0 } else { i }];
                                            let y = c[if c.len() == 1 { 0 } else { i }];
                                            match op {
                                                "Add" => x + y,
                                                "Sub" => x - y,
                                                "Mul" => x * y,
                                                _ if y == 0.0 => 0.0,
                                                _ if int => (x / y).floor(),
                                                _ => x / y,
                                            }
                                        })
                                        .collect()
                                })
                        }
                        _ => None,
                    };
                    mk(s, b, v)
                })
            }
        }
        "Conv" | "ConvInteger" | "QLinearConv" => {
            let (x, w) = if op == "QLinearConv" { (0, 3) } else { (0, 1) };
            match (shape(x), shape(w)) {
                (Some(xs), Some(ws)) if xs.len() >= 3 && ws.len() == xs.len() => {
                    let kernel = attr_ints(n, "kernel_shape")
                        .map(|k| k.iter().map(|d| *d as u64).collect())
                        .unwrap_or_else(|| ws[2..].to_vec());
                    window_out(n, &xs[2..], &kernel, false).map(|sp| {
                        let mut s = vec![xs[0], ws[0]];
                        s.extend(sp);
                        let dt = match op {
                            "Conv" => eb(0),
                            "ConvInteger" => 6,
                            _ => eb(0),
                        };
                        mk(s, dt, None)
                    })
                }
                _ => None,
            }
        }
        "ConvTranspose" => match (shape(0), shape(1)) {
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
                        let p = pads.get(i).copied().unwrap_or(0)
                            + pads.get(i + r).copied().unwrap_or(0);
                        let o = st * (xs[2 + i] as i64 - 1)
                            + opad.get(i).copied().unwrap_or(0)
                            + (k - 1) * d
                            + 1
                            - p;
                        s.push(o.max(1) as u64);
                    }
                }
                Some(mk(s, eb(0), None))
            }
            _ => None,
        },
        "MaxPool" | "AveragePool" | "LpPool" => shape(0).and_then(|xs| {
            let kernel: Vec<u64> = attr_ints(n, "kernel_shape")?
                .iter()
                .map(|d| *d as u64)
                .collect();
            let ceil = attr_i(n, "ceil_mode").unwrap_or(0) != 0;
            window_out(n, xs.get(2..)?, &kernel, ceil).map(|sp| {
                let mut s = xs[..2].to_vec();
                s.extend(sp);
                mk(s, eb(0), None)
            })
        }),
        "GlobalAveragePool" | "GlobalMaxPool" | "GlobalLpPool" => shape(0).map(|xs| {
            let mut s = xs.clone();
            for d in s.iter_mut().skip(2) {
                *d = 1;
            }
            mk(s, eb(0), None)
        }),
        "Gemm" => match (shape(0), shape(1)) {
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
                Some(mk(vec![m, nn], eb(0), None))
            }
            _ => None,
        },
        "MatMul" | "MatMulInteger" | "QLinearMatMul" => {
            let (ai, bi) = if op == "QLinearMatMul" {
                (0, 3)
            } else {
                (0, 1)
            };
            match (shape(ai), shape(bi)) {
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
                            _ => eb(ai),
                        };
                        mk(s, b, None)
                    })
                }
                _ => None,
            }
        }
        "Flatten" => shape(0).and_then(|s| {
            let a = axis(attr_i(n, "axis").unwrap_or(1), s.len() + 1)?;
            let a = a.min(s.len());
            Some(mk(
                vec![s[..a].iter().product(), s[a..].iter().product()],
                eb(0),
                val(0),
            ))
        }),
        "Reshape" => match (shape(0), ints(&val(1))) {
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
                (out.iter().product::<u64>() == total).then(|| mk(out, eb(0), val(0)))
            }
            _ => None,
        },
        "Transpose" => shape(0).map(|s| {
            let perm = attr_ints(n, "perm").unwrap_or_else(|| (0..s.len() as i64).rev().collect());
            let out = perm
                .iter()
                .map(|p| s.get(*p as usize).copied().unwrap_or(1))
                .collect();
            mk(out, eb(0), None)
        }),
        "Concat" => {
            let shapes: Vec<Vec<u64>> = (0..n.input.len()).filter_map(shape).collect();
            if shapes.len() != n.input.len() || shapes.is_empty() {
                None
            } else {
                axis(attr_i(n, "axis").unwrap_or(0), shapes[0].len()).map(|a| {
                    let mut s = shapes[0].clone();
                    s[a] = shapes.iter().map(|x| x.get(a).copied().unwrap_or(0)).sum();
                    let v: Option<Vec<f64>> = (0..n.input.len())
                        .map(val)
                        .collect::<Option<Vec<_>>>()
                        .map(|vs| vs.concat());
                    mk(s, eb(0), v)
                })
            }
        }
        "Split" => {
            // Handled below: several outputs.
            None
        }
        "Squeeze" | "Unsqueeze" => shape(0).and_then(|s| {
            let axes = if opset >= 13 {
                ints(&val(1)).or_else(|| attr_ints(n, "axes"))
            } else {
                attr_ints(n, "axes")
            };
            let out = if op == "Squeeze" {
                match axes {
                    Some(ax) => {
                        let ax: HashSet<usize> =
                            ax.iter().filter_map(|a| axis(*a, s.len())).collect();
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
            Some(mk(out, eb(0), val(0)))
        }),
        "Slice" => shape(0).and_then(|s| {
            let (starts, ends, axes, steps) = if opset >= 10 {
                (
                    ints(&val(1))?,
                    ints(&val(2))?,
                    if n.input.len() > 3 && !n.input[3].is_empty() {
                        ints(&val(3))?
                    } else {
                        (0..s.len() as i64).collect()
                    },
                    if n.input.len() > 4 && !n.input[4].is_empty() {
                        ints(&val(4))?
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
            let v = val(0).filter(|_| s.len() == 1).map(|v| {
                let (b, _, st) = ranges[0];
                (0..out[0] as i64)
                    .filter_map(|k| v.get((b + k * st) as usize).copied())
                    .collect()
            });
            Some(mk(out, eb(0), v))
        }),
        "Shape" => shape(0).map(|s| {
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
        }),
        "Size" => shape(0).map(|s| mk(vec![], 7, Some(vec![s.iter().product::<u64>() as f64]))),
        "Gather" => match (shape(0), shape(1)) {
            (Some(d), Some(idx)) => axis(attr_i(n, "axis").unwrap_or(0), d.len()).map(|a| {
                let mut s = d[..a].to_vec();
                s.extend(idx.iter().copied());
                s.extend(d[a + 1..].iter().copied());
                let v = match (val(0), ints(&val(1))) {
                    (Some(dv), Some(iv)) if d.len() == 1 => iv
                        .iter()
                        .map(|i| {
                            let i = if *i < 0 { *i + dv.len() as i64 } else { *i };
                            dv.get(i as usize).copied()
                        })
                        .collect::<Option<Vec<f64>>>(),
                    _ => None,
                };
                mk(s, eb(0), v)
            }),
            _ => None,
        },
        "Expand" => match (shape(0), ints(&val(1))) {
            (Some(s), Some(t)) => {
                let t: Vec<u64> = t.iter().map(|d| (*d).max(0) as u64).collect();
                broadcast(&[&s, &t]).map(|o| mk(o, eb(0), None))
            }
            _ => None,
        },
        "Tile" => match (shape(0), ints(&val(1))) {
            (Some(s), Some(rep)) if rep.len() == s.len() => Some(mk(
                s.iter()
                    .zip(&rep)
                    .map(|(d, r)| d * (*r).max(0) as u64)
                    .collect(),
                eb(0),
                None,
            )),
            _ => None,
        },
        "ConstantOfShape" => ints(&val(0)).map(|t| {
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
        }),
        "Range" => match (val(0), val(1), val(2)) {
            (Some(a), Some(b), Some(d)) if a.len() == 1 && b.len() == 1 && d.len() == 1 => {
                let (a, b, d) = (a[0], b[0], d[0]);
                if d == 0.0 {
                    None
                } else {
                    let count = ((b - a) / d).ceil().max(0.0) as u64;
                    let v = (count <= MAX_VALUE_ELEMS)
                        .then(|| (0..count).map(|k| a + k as f64 * d).collect());
                    Some(mk(vec![count], eb(0), v))
                }
            }
            _ => None,
        },
        "Pad" => shape(0).and_then(|s| {
            let pads = if opset >= 11 {
                ints(&val(1))?
            } else {
                attr_ints(n, "pads")?
            };
            let r = s.len();
            let axes: Vec<usize> = if opset >= 18 && n.input.len() > 3 && !n.input[3].is_empty() {
                ints(&val(3))?.iter().filter_map(|a| axis(*a, r)).collect()
            } else {
                (0..r).collect()
            };
            let k = axes.len();
            let mut out = s.clone();
            for (i, a) in axes.iter().enumerate() {
                let add = pads.get(i).copied().unwrap_or(0) + pads.get(i + k).copied().unwrap_or(0);
                out[*a] = (out[*a] as i64 + add).max(0) as u64;
            }
            Some(mk(out, eb(0), None))
        }),
        "Resize" | "Upsample" => shape(0).and_then(|s| {
            let sizes = n
                .input
                .get(3)
                .filter(|x| !x.is_empty())
                .and_then(|_| ints(&val(3)))
                .filter(|v| !v.is_empty());
            let scale_idx = if op == "Upsample" || opset < 11 { 1 } else { 2 };
            let scales = val(scale_idx).filter(|v| !v.is_empty()).or_else(|| {
                attr(n, "scales").map(|a| a.floats.iter().map(|f| *f as f64).collect())
            });
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
            Some(mk(out, eb(0), None))
        }),
        "ReduceMean" | "ReduceSum" | "ReduceMax" | "ReduceMin" | "ReduceProd" | "ReduceL1"
        | "ReduceL2" | "ReduceLogSum" | "ReduceLogSumExp" | "ReduceSumSquare" | "ArgMax"
        | "ArgMin" => shape(0).map(|s| {
            let keep = attr_i(n, "keepdims").unwrap_or(1) != 0;
            let axes: Option<Vec<i64>> = if op.starts_with("Arg") {
                Some(vec![attr_i(n, "axis").unwrap_or(0)])
            } else {
                attr_ints(n, "axes").or_else(|| ints(&val(1)))
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
            mk(out, if op.starts_with("Arg") { 7 } else { eb(0) }, None)
        }),
        "LSTM" | "GRU" | "RNN" => match shape(0) {
            Some(x) if x.len() == 3 => {
                let h = attr_i(n, "hidden_size").unwrap_or(0).max(0) as u64;
                let dirs = if attr_s(n, "direction").as_deref() == Some("bidirectional") {
                    2
                } else {
                    1
                };
                let batch_first = attr_i(n, "layout").unwrap_or(0) != 0;
                let (seq, batch) = if batch_first {
                    (x[1], x[0])
                } else {
                    (x[0], x[1])
                };
                let y = if batch_first {
                    vec![batch, seq, dirs, h]
                } else {
                    vec![seq, dirs, batch, h]
                };
                let state = if batch_first {
                    vec![batch, dirs, h]
                } else {
                    vec![dirs, batch, h]
                };
                for slot in r.iter_mut().skip(1) {
                    *slot = Some(mk(state.clone(), eb(0), None));
                }
                Some(mk(y, eb(0), None))
            }
            _ => None,
        },
        "TopK" => match (shape(0), ints(&val(1))) {
            (Some(s), Some(k)) if !k.is_empty() => axis(attr_i(n, "axis").unwrap_or(-1), s.len())
                .map(|a| {
                    let mut o = s.clone();
                    o[a] = k[0].max(0) as u64;
                    if let Some(slot) = r.get_mut(1) {
                        *slot = Some(mk(o.clone(), 7, None));
                    }
                    mk(o, eb(0), None)
                }),
            _ => None,
        },
        "DepthToSpace" | "SpaceToDepth" => shape(0).and_then(|s| {
            let b = attr_i(n, "blocksize")?.max(1) as u64;
            (s.len() == 4).then(|| {
                let o = if op == "DepthToSpace" {
                    vec![s[0], s[1] / (b * b), s[2] * b, s[3] * b]
                } else {
                    vec![s[0], s[1] * b * b, s[2] / b, s[3] / b]
                };
                mk(o, eb(0), None)
            })
        }),
        _ if ALIAS.contains(&op) => shape(0).map(|s| mk(s, eb(0), val(0))),
        _ => None,
    };
    if op == "Split" {
        if let Some(s) = shape(0)
            && let Some(a) = axis(attr_i(n, "axis").unwrap_or(0), s.len())
        {
            let sizes: Vec<u64> = match ints(&val(1)).or_else(|| attr_ints(n, "split")) {
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
                *slot = Some(mk(o, eb(0), None));
            }
        }
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

fn count(g: &GraphProto, facts: &mut GraphFacts) {
    for n in &g.node {
        facts.nodes += 1;
        for a in &n.attribute {
            if let Some(sub) = &a.g {
                facts.subgraphs += 1;
                count(sub, facts);
            }
            for sub in &a.graphs {
                facts.subgraphs += 1;
                count(sub, facts);
            }
        }
    }
}

/// Names a subgraph reads from the scopes around it.
fn outer_names(g: &GraphProto, into: &mut HashSet<String>) {
    let mut own: HashSet<&str> = g.initializer.iter().map(|t| t.name.as_str()).collect();
    own.extend(g.input.iter().map(|v| v.name.as_str()));
    for n in &g.node {
        for i in &n.input {
            if !i.is_empty() && !own.contains(i.as_str()) {
                into.insert(i.clone());
            }
        }
        for a in &n.attribute {
            if let Some(sub) = &a.g {
                outer_names(sub, into);
            }
            for sub in &a.graphs {
                outer_names(sub, into);
            }
        }
        own.extend(n.output.iter().map(|o| o.as_str()));
    }
}

fn conv_weights(g: &GraphProto, weights: &HashMap<String, (u64, i32)>, total: &mut u64) {
    // Weight tensors of this graph and the ones visible from it.
    let mut local = weights.clone();
    for t in &g.initializer {
        let n = t.dims.iter().map(|d| (*d).max(0) as u64).product();
        local.insert(t.name.clone(), (n, t.data_type));
    }
    for n in &g.node {
        if n.op_type == "Constant"
            && let Some(t) = n.attribute.iter().find_map(|a| a.t.as_ref())
        {
            let e = t.dims.iter().map(|d| (*d).max(0) as u64).product();
            if let Some(o) = n.output.first() {
                local.insert(o.clone(), (e, t.data_type));
            }
        }
    }
    let mut seen = HashSet::new();
    for n in &g.node {
        if matches!(n.op_type.as_str(), "Conv" | "ConvTranspose")
            && let Some(w) = n.input.get(1)
            && let Some((e, dt)) = local.get(w)
            && is_weight_type(*dt)
            && seen.insert(w.clone())
        {
            *total += e;
        }
        for a in &n.attribute {
            if let Some(sub) = &a.g {
                conv_weights(sub, &local, total);
            }
            for sub in &a.graphs {
                conv_weights(sub, &local, total);
            }
        }
    }
}

/// Analyses a model's bytes with its inputs at these concrete shapes:
/// name -> (dims, ONNX element type). An input not given makes what depends
/// on it unknown.
pub fn analyse(
    bytes: Bytes,
    inputs: &HashMap<String, (Vec<u64>, i32)>,
) -> Result<GraphFacts, prost::DecodeError> {
    let m = ModelProto::decode(bytes)?;
    let g = m.graph.unwrap_or_default();
    let opset = m
        .opset_import
        .iter()
        .find(|o| o.domain.is_empty() || o.domain == "ai.onnx")
        .map(|o| o.version)
        .unwrap_or(13);
    let mut facts = GraphFacts::default();
    count(&g, &mut facts);
    conv_weights(&g, &HashMap::new(), &mut facts.conv_weight_elements);

    let mut info: HashMap<String, Info> = HashMap::new();
    for t in &g.initializer {
        info.insert(t.name.clone(), tensor_info(t));
    }
    let graph_inputs: HashSet<&str> = g
        .input
        .iter()
        .map(|v| v.name.as_str())
        .filter(|n| !info.contains_key(*n))
        .collect();
    for name in &graph_inputs {
        if let Some((s, dtype)) = inputs.get(*name) {
            info.insert(
                name.to_string(),
                Info {
                    shape: Some(s.clone()),
                    dtype: *dtype,
                    value: None,
                    constant: false,
                },
            );
        }
    }
    let outputs: HashSet<&str> = g.output.iter().map(|v| v.name.as_str()).collect();

    // Last node reading each name (subgraph reads count at their node).
    let mut last_use: HashMap<String, usize> = HashMap::new();
    let mut sub_reads: Vec<HashSet<String>> = Vec::with_capacity(g.node.len());
    for (i, n) in g.node.iter().enumerate() {
        let mut reads = HashSet::new();
        for a in &n.attribute {
            if let Some(sub) = &a.g {
                outer_names(sub, &mut reads);
            }
            for sub in &a.graphs {
                outer_names(sub, &mut reads);
            }
        }
        for x in n.input.iter().chain(reads.iter()).filter(|x| !x.is_empty()) {
            last_use.insert(x.clone(), i);
        }
        sub_reads.push(reads);
    }

    // Buffers: bytes and how many live names point at each.
    let mut buf_bytes: Vec<u64> = Vec::new();
    let mut buf_refs: Vec<u32> = Vec::new();
    let mut buf_of: HashMap<String, usize> = HashMap::new();
    let mut live: u64 = 0;
    for (i, n) in g.node.iter().enumerate() {
        let ins: Vec<Option<Info>> = n
            .input
            .iter()
            .map(|x| {
                if x.is_empty() {
                    None
                } else {
                    info.get(x).cloned()
                }
            })
            .collect();
        let folded = n.op_type == "Constant"
            || (!n.input.is_empty()
                && n.input
                    .iter()
                    .filter(|x| !x.is_empty())
                    .all(|x| info.get(x).is_some_and(|t| t.constant))
                && sub_reads[i].is_empty());
        let mut out_infos = if n.op_type == "Constant" {
            let t = n.attribute.iter().find_map(|a| a.t.as_ref());
            let scalar = |v: f64, b: i32| Info {
                shape: Some(vec![]),
                dtype: b,
                value: Some(vec![v]),
                constant: true,
            };
            let list = |v: Vec<f64>, b: i32| Info {
                shape: Some(vec![v.len() as u64]),
                dtype: b,
                value: Some(v),
                constant: true,
            };
            vec![match (t, n.attribute.first()) {
                (Some(t), _) => Some(tensor_info(t)),
                (None, Some(a)) if a.name == "value_int" => Some(scalar(a.i as f64, 7)),
                (None, Some(a)) if a.name == "value_float" => Some(scalar(a.f as f64, 1)),
                (None, Some(a)) if a.name == "value_ints" => {
                    Some(list(a.ints.iter().map(|x| *x as f64).collect(), 7))
                }
                (None, Some(a)) if a.name == "value_floats" => {
                    Some(list(a.floats.iter().map(|x| *x as f64).collect(), 1))
                }
                _ => None,
            }]
        } else {
            infer(n, &ins, opset)
        };
        out_infos.resize(n.output.len(), None);

        // Size of the largest activation feeding the node: the stand-in for
        // outputs of unknown shape.
        let biggest_in = n
            .input
            .iter()
            .filter_map(|x| buf_of.get(x).map(|b| buf_bytes[*b]))
            .max()
            .unwrap_or(0);
        for (o, oi) in n.output.iter().zip(out_infos.iter_mut()) {
            if o.is_empty() {
                continue;
            }
            let mut t = oi.take().unwrap_or_default();
            t.constant = folded;
            if !folded && t.shape.is_none() {
                // Stand in with the largest activation input, so that what
                // follows still has a shape.
                facts.unknown_shapes += 1;
                if let Some(big) = ins
                    .iter()
                    .flatten()
                    .filter(|x| !x.constant)
                    .max_by_key(|x| x.bytes().unwrap_or(0))
                {
                    t.shape = big.shape.clone();
                    t.dtype = big.dtype;
                }
            }
            info.insert(o.clone(), t);
        }
        if folded {
            continue;
        }

        // Allocate the outputs.
        let op = n.op_type.as_str();
        for (k, o) in n.output.iter().enumerate() {
            if o.is_empty() || outputs.contains(o.as_str()) || !last_use.contains_key(o) {
                continue;
            }
            let bytes = info.get(o).and_then(|t| t.bytes()).unwrap_or(biggest_in);
            let reuse = match n.input.first().and_then(|x| buf_of.get(x).copied()) {
                Some(b) if k == 0 && ALIAS.contains(&op) => Some(b),
                _ => None,
            };
            match reuse {
                Some(b) => {
                    buf_refs[b] += 1;
                    buf_of.insert(o.clone(), b);
                }
                None => {
                    buf_bytes.push(bytes);
                    buf_refs.push(1);
                    buf_of.insert(o.clone(), buf_bytes.len() - 1);
                    live += bytes;
                    if facts
                        .largest_intermediate
                        .as_ref()
                        .is_none_or(|(_, b)| bytes > *b)
                    {
                        facts.largest_intermediate = Some((o.clone(), bytes));
                    }
                }
            }
        }
        facts.peak_intermediate_bytes = facts.peak_intermediate_bytes.max(live);

        // Free what dies here.
        let mut dying: Vec<&String> = n
            .input
            .iter()
            .chain(sub_reads[i].iter())
            .filter(|x| last_use.get(*x) == Some(&i))
            .collect();
        dying.sort_unstable();
        dying.dedup();
        for x in dying {
            if let Some(b) = buf_of.remove(x) {
                buf_refs[b] -= 1;
                if buf_refs[b] == 0 {
                    live -= buf_bytes[b];
                }
            }
        }
    }
    Ok(facts)
}

#[cfg(test)]
pub(crate) mod build {
    //! Small ONNX graphs for tests, written with the same prost types.
    use super::*;

    pub struct G {
        graph: GraphProto,
    }

    fn f32_tensor(name: &str, dims: &[i64]) -> TensorProto {
        let n: i64 = dims.iter().product();
        TensorProto {
            dims: dims.to_vec(),
            data_type: 1,
            name: name.into(),
            raw_data: Bytes::from(vec![0u8; n as usize * 4]),
            ..Default::default()
        }
    }

    fn i64_tensor(name: &str, v: &[i64]) -> TensorProto {
        TensorProto {
            dims: vec![v.len() as i64],
            data_type: 7,
            name: name.into(),
            int64_data: v.to_vec(),
            ..Default::default()
        }
    }

    fn ints(name: &str, v: &[i64]) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            ints: v.to_vec(),
            ..Default::default()
        }
    }

    fn int(name: &str, v: i64) -> AttributeProto {
        AttributeProto {
            name: name.into(),
            i: v,
            ..Default::default()
        }
    }

    impl G {
        pub fn new(input: &str, output: &str) -> G {
            G {
                graph: GraphProto {
                    input: vec![ValueInfo { name: input.into() }],
                    output: vec![ValueInfo {
                        name: output.into(),
                    }],
                    ..Default::default()
                },
            }
        }

        fn init(mut self, t: TensorProto) -> G {
            self.graph.initializer.push(t);
            self
        }

        fn node(
            mut self,
            op: &str,
            ins: &[&str],
            outs: &[&str],
            attribute: Vec<AttributeProto>,
        ) -> G {
            self.graph.node.push(NodeProto {
                input: ins.iter().map(|s| s.to_string()).collect(),
                output: outs.iter().map(|s| s.to_string()).collect(),
                op_type: op.into(),
                attribute,
                domain: String::new(),
            });
            self
        }

        /// A 3x3 (pad 1) or 1x1 convolution with stride `s`, weights `cout x cin x k x k`.
        pub fn conv(self, x: &str, y: &str, cin: i64, cout: i64, k: i64, s: i64) -> G {
            let w = format!("{y}.w");
            let p = k / 2;
            self.init(f32_tensor(&w, &[cout, cin, k, k])).node(
                "Conv",
                &[x, &w],
                &[y],
                vec![ints("pads", &[p, p, p, p]), ints("strides", &[s, s])],
            )
        }

        /// An int64 initializer (shapes, indices).
        pub fn const_i64(self, name: &str, v: &[i64]) -> G {
            self.init(i64_tensor(name, v))
        }

        pub fn op(self, op: &str, ins: &[&str], y: &str) -> G {
            self.node(op, ins, &[y], vec![])
        }

        pub fn gemm(self, x: &str, y: &str, k: i64, n: i64) -> G {
            let w = format!("{y}.w");
            self.init(f32_tensor(&w, &[n, k]))
                .node("Gemm", &[x, &w], &[y], vec![int("transB", 1)])
        }

        pub fn reshape(self, x: &str, y: &str, to: &[i64]) -> G {
            let s = format!("{y}.shape");
            self.init(i64_tensor(&s, to)).op("Reshape", &[x, &s], y)
        }

        pub fn bytes(self) -> Bytes {
            let m = ModelProto {
                ir_version: 8,
                graph: Some(self.graph),
                opset_import: vec![OpsetId {
                    domain: String::new(),
                    version: 17,
                }],
            };
            Bytes::from(m.encode_to_vec())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::build::G;
    use super::*;

    fn shapes(name: &str, s: &[u64]) -> HashMap<String, (Vec<u64>, i32)> {
        HashMap::from([(name.to_string(), (s.to_vec(), 1))])
    }

    #[test]
    fn conv_chain_peak_is_the_widest_layer_pair() {
        // x [1,3,64,64] -> conv 16 (s1) -> relu -> conv 32 (s2) -> relu -> pool -> flatten -> gemm
        let g = G::new("x", "y")
            .conv("x", "c1", 3, 16, 3, 1)
            .op("Relu", &["c1"], "r1")
            .conv("r1", "c2", 16, 32, 3, 2)
            .op("Relu", &["c2"], "r2")
            .op("GlobalAveragePool", &["r2"], "p")
            .op("Flatten", &["p"], "f")
            .gemm("f", "y", 32, 10);
        let f = analyse(g.bytes(), &shapes("x", &[1, 3, 64, 64])).unwrap();
        let c1 = 16 * 64 * 64 * 4;
        // The first Relu: its input and output alive together.
        assert_eq!(f.peak_intermediate_bytes, 2 * c1);
        assert_eq!(f.largest_intermediate, Some(("c1".into(), c1)));
        assert_eq!(f.unknown_shapes, 0);
        assert_eq!(f.nodes, 7);
        assert_eq!(f.conv_weight_elements, 16 * 3 * 9 + 32 * 16 * 9);
        // Twice the batch, twice the activations.
        let f4 = analyse(g_again(), &shapes("x", &[2, 3, 64, 64])).unwrap();
        assert_eq!(f4.peak_intermediate_bytes, 2 * 2 * c1);
    }

    fn g_again() -> Bytes {
        G::new("x", "y")
            .conv("x", "c1", 3, 16, 3, 1)
            .op("Relu", &["c1"], "r1")
            .conv("r1", "c2", 16, 32, 3, 2)
            .op("Relu", &["c2"], "r2")
            .op("GlobalAveragePool", &["r2"], "p")
            .op("Flatten", &["p"], "f")
            .gemm("f", "y", 32, 10)
            .bytes()
    }

    #[test]
    fn residual_keeps_the_skip_alive_and_reshape_aliases() {
        // x -> c1 -> c2 -> add(c1, c2) -> reshape -> y
        let g = G::new("x", "y")
            .conv("x", "c1", 8, 8, 3, 1)
            .conv("c1", "c2", 8, 8, 3, 1)
            .conv("c2", "c3", 8, 8, 1, 1)
            .op("Add", &["c3", "c1"], "a")
            .reshape("a", "r", &[1, -1])
            .op("Relu", &["r"], "y");
        let f = analyse(g.bytes(), &shapes("x", &[1, 8, 10, 10])).unwrap();
        let t = 8 * 10 * 10 * 4;
        // At c3: c1 (skip), c2, c3 alive; at Add: c1, c3, a; Reshape aliases a,
        // and the Relu (a graph output) adds nothing.
        assert_eq!(f.peak_intermediate_bytes, 3 * t);
        assert_eq!(f.unknown_shapes, 0);
    }

    #[test]
    fn shape_arithmetic_resolves_a_dynamic_reshape() {
        // Shape(x) -> Gather(0) -> Unsqueeze -> Concat(-1) -> Reshape(x) : [N, C*H*W]
        let g = G::new("x", "y")
            .const_i64("zero", &[0])
            .const_i64("minus1", &[-1])
            .op("Shape", &["x"], "s")
            .op("Gather", &["s", "zero"], "n")
            .op("Concat", &["n", "minus1"], "shape")
            .conv("x", "c", 4, 4, 1, 1)
            .op("Reshape", &["c", "shape"], "r")
            .gemm("r", "y", 4 * 6 * 6, 3);
        let f = analyse(g.bytes(), &shapes("x", &[2, 4, 6, 6])).unwrap();
        // Reshape resolved to [2, 144] (else Gemm's output would be unknown too).
        assert_eq!(f.unknown_shapes, 0, "{f:?}");
        // The conv output, and the 2 x i64 target shape still alive beside it.
        assert_eq!(f.peak_intermediate_bytes, 2 * 4 * 6 * 6 * 4 + 16);
    }

    #[test]
    fn an_unknown_op_counts_as_large_as_its_input() {
        let g = G::new("x", "y")
            .conv("x", "c", 2, 2, 1, 1)
            .op("SomeCustomOp", &["c"], "u")
            .op("Relu", &["u"], "y");
        let f = analyse(g.bytes(), &shapes("x", &[1, 2, 5, 5])).unwrap();
        assert_eq!(f.unknown_shapes, 1);
        assert_eq!(f.peak_intermediate_bytes, 2 * (2 * 5 * 5 * 4));
    }
}
