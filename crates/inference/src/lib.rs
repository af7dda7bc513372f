//! Inference: ONNX Runtime backends and execution providers,
//! preprocessing, postprocessing into results, model folders and their
//! manifests, and deployment plans.

pub mod backend;
pub mod model;
pub mod onnx_proto;
pub mod plan;
pub mod postprocess;
pub mod preprocess;

// The rooms below, under the names the modules use (`crate::fsio`).
#[allow(unused_imports)]
use outpost_base::{backoff, bytesize, fsio, panics, record, stream_table};
