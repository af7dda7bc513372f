//! What outpost keeps and tells: the durable outbox, the clock model (how
//! far a record's time can be trusted) and telemetry (logs and metrics).

pub mod clock;
pub mod outbox;
pub mod telemetry;

// The rooms below, under the names the modules use (`crate::record`).
use outpost_base::{backoff, bytesize, fsio, panics, record};
