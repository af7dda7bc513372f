//! Signed over-the-air updates: bundles, their signatures, slots, the
//! agent that installs models and the binary itself, and probation.

pub mod ota;

// The rooms below, under the names the modules use (`crate::model`).
use outpost_base::{backoff, bytesize, fsio, record};
use outpost_inference::{backend, model};
use outpost_store::{clock, telemetry};
