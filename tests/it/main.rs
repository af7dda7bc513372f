//! Integration tests: the real `outpost` binary, real ONNX Runtime, real
//! models fetched by `models/fetch` and built by `models/build`.

mod batching;
mod camera;
mod common;
mod console;
mod errors;
mod fleet;
mod gpu;
mod hardening;
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
mod state;
mod streams;
mod uplink;
mod vision;
