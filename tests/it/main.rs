//! Integration tests: the real `outpost` binary, real ONNX Runtime, real
//! models fetched by `models/fetch` and built by `models/build`.

mod batching;
mod boundaries;
mod camera;
mod check_report;
mod common;
mod console;
mod detection_layouts;
mod docs;
mod errors;
mod fleet;
mod gpu;
mod hardening;
mod local_api;
mod mqtt_acks;
mod ota;
mod outbox;
mod outbox_model;
mod outputs;
mod plan;
mod preprocess;
mod providers;
mod reference;
mod registry;
mod runtime;
mod service;
mod sparkplug;
mod state;
mod stream_bounds;
mod streams;
mod tracking;
mod udp_kernel_drops;
mod uplink;
mod uplink_outbox_fault;
mod vision;
