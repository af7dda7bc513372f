//! outpost: an edge inference daemon. Sources feed pipelines that run ONNX
//! models locally; results wait in a durable outbox until the fleet has them.

pub mod api;
pub mod backend;
pub mod backoff;
pub mod bytesize;
pub mod cli;
pub mod clock;
pub mod config;
pub mod daemon;
pub mod fleet;
pub mod floor;
pub mod fsio;
pub mod model;
pub mod onnx_proto;
pub mod ota;
pub mod outbox;
pub mod output;
pub mod panics;
pub mod pipeline;
pub mod plan;
pub mod postprocess;
pub mod preprocess;
pub mod record;
pub mod source;
pub mod stream_table;
pub mod telemetry;
pub mod track;
pub mod uplink;
