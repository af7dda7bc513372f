//! What takes a pipeline's records besides its own outputs: the floor
//! servers (OPC UA), which keep the latest record of each pipeline for
//! the clients that read or subscribe to it.

use crate::record::ResultRecord;

/// Takes each record of one pipeline, from the worker that made it. Must
/// not block and must not wait for anything: it is called where the
/// local outputs are, before the record is stored.
pub trait RecordTap: Send + Sync {
    fn offer(&self, rec: &ResultRecord, json: &[u8]);
}

/// A server that lives beside the pipelines, as `/v1/status` shows it.
pub trait ServerStatus: Send + Sync + std::fmt::Debug {
    fn status(&self) -> serde_json::Value;
}
