//! The building blocks every room of outpost shares: the record a pipeline
//! produces, byte sizes, backoff, crash-safe file writes, panic capture and
//! per-stream tables. Nothing here depends on another outpost crate.

pub mod backoff;
pub mod bytesize;
pub mod fsio;
pub mod panics;
pub mod record;
pub mod stream_table;
