//! Reads what ONNX Runtime does not report about a model file: its opset
//! imports, IR version, producer and parameter count. The messages are
//! `crate::onnx_proto`'s; decoded from a `Bytes` buffer, the weights' raw
//! bytes are sliced, not copied, so a 10 MB model is walked in milliseconds.

use bytes::Bytes;
use prost::Message;

use crate::backend::{DType, Dim, IoSpec};
use crate::onnx_proto::{GraphProto, ModelProto, TensorProto, ValueInfoProto};

/// Facts about an ONNX file that the runtime's session API does not give.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct OnnxInfo {
    pub ir_version: i64,
    pub producer: String,
    /// (domain, version); the default domain is written "ai.onnx".
    pub opsets: Vec<(String, i64)>,
    /// Elements of floating-point and 8-bit tensors held as initializers or
    /// Constant nodes, in every (sub)graph: the learned weights. Integer
    /// tensors (shapes, indices) are not counted.
    pub parameters: u64,
    pub nodes: usize,
    /// The graph's inputs (initializers left out) and outputs as the file
    /// declares them: held to the limit on declared tensors before ONNX
    /// Runtime or a warm-up allocates anything.
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
}

impl OnnxInfo {
    /// The default-domain opset, the one people mean by "opset 17".
    pub fn opset(&self) -> Option<i64> {
        self.opsets
            .iter()
            .find(|(d, _)| d == "ai.onnx")
            .map(|(_, v)| *v)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OnnxParseError {
    #[error("empty file")]
    Empty,
    #[error("not an ONNX model (protobuf decode failed: {0})")]
    Decode(#[from] prost::DecodeError),
    #[error("not an ONNX model (no graph or no opset import)")]
    NotAModel,
}

/// Parses the model header and weights' shapes from the bytes of an .onnx file.
pub fn inspect_bytes(bytes: Bytes) -> Result<OnnxInfo, OnnxParseError> {
    if bytes.is_empty() {
        return Err(OnnxParseError::Empty);
    }
    let m = ModelProto::decode(bytes)?;
    let Some(graph) = m.graph.as_ref() else {
        return Err(OnnxParseError::NotAModel);
    };
    if m.opset_import.is_empty() || m.ir_version <= 0 {
        return Err(OnnxParseError::NotAModel);
    }
    let mut parameters = 0u64;
    let mut nodes = 0usize;
    count_graph(graph, &mut parameters, &mut nodes);
    let (inputs, outputs) = graph_io(graph);
    let producer = format!("{} {}", m.producer_name, m.producer_version)
        .trim()
        .to_string();
    Ok(OnnxInfo {
        ir_version: m.ir_version,
        producer,
        opsets: m
            .opset_import
            .iter()
            .map(|o| {
                let d = if o.domain.is_empty() {
                    "ai.onnx".to_string()
                } else {
                    o.domain.clone()
                };
                (d, o.version)
            })
            .collect(),
        parameters,
        nodes,
        inputs,
        outputs,
    })
}

/// A graph's inputs (those an initializer feeds left out: older exporters
/// list every weight as an input too) and outputs, in outpost's terms.
pub fn graph_io(g: &GraphProto) -> (Vec<IoSpec>, Vec<IoSpec>) {
    let weights: std::collections::HashSet<&str> =
        g.initializer.iter().map(|t| t.name.as_str()).collect();
    let inputs = g
        .input
        .iter()
        .filter(|i| !weights.contains(i.name.as_str()))
        .filter_map(io_spec)
        .collect();
    (inputs, g.output.iter().filter_map(io_spec).collect())
}

/// A graph input or output as outpost declares it (free dimensions keep
/// their names; unnamed ones are `?`); None for element types outpost does
/// not handle.
pub fn io_spec(v: &ValueInfoProto) -> Option<IoSpec> {
    let t = v.r#type.as_ref()?.tensor_type.as_ref()?;
    let dtype = DType::from_onnx(t.elem_type)?;
    let shape = t
        .shape
        .as_ref()
        .map(|s| {
            s.dim
                .iter()
                .map(|d| match (d.dim_value, &d.dim_param) {
                    (Some(n), _) if n > 0 => Dim::Fixed(n as u64),
                    (_, Some(p)) if !p.is_empty() => Dim::Symbolic(p.clone()),
                    _ => Dim::Symbolic("?".into()),
                })
                .collect()
        })
        .unwrap_or_default();
    Some(IoSpec {
        name: v.name.clone(),
        dtype,
        shape,
    })
}

fn is_weight(t: &TensorProto) -> bool {
    matches!(
        DType::from_onnx(t.data_type),
        Some(DType::F32 | DType::F16 | DType::F64 | DType::I8 | DType::U8)
    ) || t.data_type == 16 // bfloat16
}

fn elements(t: &TensorProto) -> u64 {
    // Saturating: a file may declare dims whose product overflows.
    t.dims
        .iter()
        .fold(1u64, |n, d| n.saturating_mul((*d).max(0) as u64))
}

fn count_graph(g: &GraphProto, params: &mut u64, nodes: &mut usize) {
    for t in &g.initializer {
        if is_weight(t) {
            *params = params.saturating_add(elements(t));
        }
    }
    for n in &g.node {
        *nodes += 1;
        for a in &n.attribute {
            if n.op_type == "Constant"
                && let Some(t) = &a.t
                && is_weight(t)
            {
                *params = params.saturating_add(elements(t));
            }
            if let Some(sub) = &a.g {
                count_graph(sub, params, nodes);
            }
            for sub in &a.graphs {
                count_graph(sub, params, nodes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::onnx_proto::{AttributeProto, NodeProto, OperatorSetIdProto};

    fn tiny_model() -> Bytes {
        ModelProto {
            ir_version: 8,
            producer_name: "test".into(),
            producer_version: "1".into(),
            graph: Some(GraphProto {
                node: vec![NodeProto {
                    op_type: "Constant".into(),
                    attribute: vec![AttributeProto {
                        t: Some(TensorProto {
                            dims: vec![4],
                            data_type: 1,
                            ..Default::default()
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                initializer: vec![
                    TensorProto {
                        dims: vec![16, 64],
                        data_type: 1,
                        ..Default::default()
                    },
                    TensorProto {
                        dims: vec![2],
                        data_type: 7,
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }),
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: 17,
            }],
            metadata_props: Vec::new(),
        }
        .encode_to_vec()
        .into()
    }

    #[test]
    fn counts_float_weights_not_shapes() {
        let info = inspect_bytes(tiny_model()).unwrap();
        assert_eq!(info.parameters, 16 * 64 + 4);
        assert_eq!(info.opset(), Some(17));
        assert_eq!(info.ir_version, 8);
        assert_eq!(info.nodes, 1);
    }

    #[test]
    fn refuses_empty_and_garbage() {
        assert!(matches!(
            inspect_bytes(Bytes::new()),
            Err(OnnxParseError::Empty)
        ));
        assert!(inspect_bytes(Bytes::from_static(b"\x89PNG\r\n\x1a\n this is an image")).is_err());
        assert!(
            inspect_bytes(Bytes::from_static(b"hello world, definitely not protobuf")).is_err()
        );
        let m = tiny_model();
        assert!(inspect_bytes(m.slice(..m.len() / 2)).is_err());
    }
}
