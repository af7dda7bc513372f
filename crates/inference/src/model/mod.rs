//! Models on disk: manifests, checks against the real model, the registry of
//! loaded models, and the per-stream state of stateful models.

pub mod import;
pub mod manifest;
pub mod onnx;
pub mod registry;
pub mod state;
