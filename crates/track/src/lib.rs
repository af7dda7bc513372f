//! Object tracking per stream and zone analytics: tracks, zones, lines,
//! occupancy, speeds and the events they raise.

pub mod track;

// The rooms below, under the names the modules use (`crate::record`).
use outpost_base::{bytesize, fsio, record};
use outpost_inference::postprocess;
use outpost_store::telemetry;
