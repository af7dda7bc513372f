//! Outbox errors, each with the path or operation it concerns.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum OutboxError {
    #[error("outbox config: {}", .0.join("; "))]
    Invalid(Vec<String>),
    #[error("{}: outbox is in use by a running daemon (stop it first): {source}", .path.display())]
    InUse { path: PathBuf, source: sled::Error },
    #[error("{}: no outbox here (no sled database)", .path.display())]
    NotFound { path: PathBuf },
    #[error("{}: cannot open the outbox: {source}", .path.display())]
    Open { path: PathBuf, source: sled::Error },
    #[error("{}: the outbox database is damaged: {reason}", .path.display())]
    Damaged { path: PathBuf, reason: String },
    #[error("{}: cannot move the damaged outbox aside to {}: {source}", .path.display(), .to.display())]
    Quarantine {
        path: PathBuf,
        to: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {op}: {source}", .path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("outbox {op}: {source}")]
    Db {
        op: &'static str,
        source: sled::Error,
    },
    #[error("outbox flush failed: {0}")]
    Flush(String),
    #[error(
        "outbox full: {needed} more bytes do not fit in max_bytes {max_bytes} (when_full = reject_new)"
    )]
    Full { needed: u64, max_bytes: u64 },
    #[error("record of {size} bytes can never fit in max_bytes {max_bytes}")]
    TooLarge { size: u64, max_bytes: u64 },
    #[error("stream name of {len} bytes is longer than {max}")]
    StreamName { len: usize, max: usize },
    #[error("outbox record {key}: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("outbox is opened for inspection: appends are refused")]
    ReadOnly,
    #[error("outbox is closed")]
    Closed,
    /// A write or commit failed (disk full, I/O error): records are refused
    /// until the store recovers by itself.
    #[error("outbox cannot store now: {0}")]
    Unavailable(String),
}

impl OutboxError {
    /// A condition of the server that passes (full, disk full, I/O
    /// trouble), not of the record: the caller may try again later.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            OutboxError::Full { .. }
                | OutboxError::Unavailable(_)
                | OutboxError::Flush(_)
                | OutboxError::Db { .. }
                | OutboxError::Io { .. }
                | OutboxError::Closed
        )
    }

    pub(crate) fn db(op: &'static str) -> impl FnOnce(sled::Error) -> OutboxError {
        move |source| OutboxError::Db { op, source }
    }
}
