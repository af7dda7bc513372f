//! The uplink: results from the outbox to the fleet over MQTT, HTTP or
//! Sparkplug B (I/O-free sessions and their drivers), and fleet rollouts.

pub mod fleet;
pub mod uplink;

// The rooms below, under the names the modules use (`crate::outbox`).
#[cfg(test)]
use outpost_base::record;
use outpost_base::{backoff, bytesize};
use outpost_store::{clock, outbox, telemetry};
