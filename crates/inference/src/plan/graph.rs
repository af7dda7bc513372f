//! What ONNX Runtime's CPU provider will hold for a model, read from the
//! graph without loading ONNX Runtime: node and subgraph counts, which
//! weights feed convolutions, and the peak of the intermediate tensors
//! alive at once during one run.
//!
//! This file counts and holds what the parts share; the shape rules (one
//! file per operator family) are in `shapes`, the walk that finds the peak
//! in `liveness`.

mod liveness;
mod shapes;

use std::collections::{HashMap, HashSet};

use bytes::Bytes;
use prost::Message;

use crate::onnx_proto::{GraphProto, ModelProto, TensorProto};

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

    liveness::walk(&g, opset, inputs, &mut facts);
    Ok(facts)
}

#[cfg(test)]
pub(crate) mod build {
    //! Small ONNX graphs for tests, written with the same prost types.
    use super::*;
    use crate::onnx_proto::{AttributeProto, NodeProto, OperatorSetIdProto, ValueInfoProto};

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
                    input: vec![ValueInfoProto {
                        name: input.into(),
                        ..Default::default()
                    }],
                    output: vec![ValueInfoProto {
                        name: output.into(),
                        ..Default::default()
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
                opset_import: vec![OperatorSetIdProto {
                    domain: String::new(),
                    version: 17,
                }],
                ..Default::default()
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
