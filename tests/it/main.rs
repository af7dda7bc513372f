//! Integration tests: the real `outpost` binary, real ONNX Runtime, real
//! models fetched by `models/fetch` and built by `models/build`.

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod batching;
mod boundaries;
mod camera;
mod camera_hostile;
mod camera_shared;
mod cameras_many;
mod check_report;
mod clock;
mod coco;
mod common;
mod console;
mod console_cameras;
mod detection_layouts;
mod docs;
mod errors;
mod event_parts;
mod fleet;
mod floor;
mod gpu;
mod hardening;
mod house;
mod install;
mod local_api;
mod models_import;
mod motion;
mod mqtt_acks;
#[cfg(feature = "opcua")]
mod opcua;
mod ota;
mod outbox;
mod outbox_model;
mod outputs;
mod plan;
mod preprocess;
mod providers;
mod read_only_disk;
mod reference;
mod registry;
mod round_three;
mod runtime;
mod service;
mod shared_decoder;
mod sparkplug;
mod state;
mod stream_bounds;
mod streams;
mod street;
mod tracking;
mod udp_kernel_drops;
mod uplink;
mod uplink_outbox_fault;
mod vision;
mod zone_analytics;
