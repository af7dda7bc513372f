//! outpost: an edge inference daemon. Sources feed pipelines that run ONNX
//! models locally; results wait in a durable outbox until the fleet has them.
//!
//! This crate is the daemon (sources, pipelines, outputs, config, the local
//! API, the floor protocols' glue) and the CLI. The rooms below it are crates
//! of their own (docs/ARCHITECTURE.md), re-exported here under their module
//! names so `outpost::record` and `crate::record` name what they always did.

pub mod api;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod floor;
pub mod output;
pub mod pipeline;
pub mod source;

pub use outpost_base::{backoff, bytesize, fsio, panics, record, stream_table};
pub use outpost_inference::{backend, model, onnx_proto, plan, postprocess, preprocess};
pub use outpost_ota::ota;
pub use outpost_store::{clock, outbox, telemetry};
pub use outpost_track::track;
pub use outpost_uplink::{fleet, uplink};
