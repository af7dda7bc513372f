//! The liveness walk: the peak of the intermediate tensors alive at once
//! during one run, from the shapes `shapes` infers.
//!
//! The walk follows the graph's node order (topological by the ONNX
//! spec): a tensor is allocated by its producer and freed after its last
//! consumer (a subgraph's reads count at its node); Reshape, Flatten,
//! Squeeze, Unsqueeze, Identity and Dropout alias their input. No in-place
//! reuse (an activation writing over its input) is assumed: ONNX Runtime
//! does fuse and reuse, but its planner only reuses buffers of the same size
//! and its NCHWc layout pass adds reorder copies, and measured peaks sit
//! near this walk's figure (PP-OCR det at 736 x 736: walk 52 MB, ONNX
//! Runtime's memory-pattern block 80 MB; the tighter in-place walk gave 35
//! MB). Nodes whose inputs are all constant are folded, as ONNX Runtime's
//! constant folding does. Graph inputs (the caller's) and outputs are not
//! intermediates; the plan counts them separately. An output whose shape
//! cannot be inferred is counted as large as the largest activation feeding
//! its node (and reported as unknown).

use std::collections::{HashMap, HashSet};

use super::shapes::{ALIAS, infer};
use super::{GraphFacts, Info, tensor_info};
use crate::onnx_proto::GraphProto;

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

/// Walks the graph with its inputs at these concrete shapes (name -> (dims,
/// ONNX element type)) and records the peak in `facts`.
pub(super) fn walk(
    g: &GraphProto,
    opset: i64,
    inputs: &HashMap<String, (Vec<u64>, i32)>,
    facts: &mut GraphFacts,
) {
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
}
