//! Why the daemon could not start, or could not stop cleanly: one typed
//! error for `outpost run`, which the binary maps to its exit codes.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::backend::ort::RuntimeError;
use crate::ota::OtaError;
use crate::outbox::OutboxError;
use crate::uplink::UplinkError;

pub use super::generation::{GenerationError, Refused};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// ONNX Runtime could not be loaded (exit code 3).
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    #[error("tokio runtime")]
    AsyncRuntime(#[source] std::io::Error),
    #[error("{what} handler")]
    Signal {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("data_dir {}", .path.display())]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("outbox {}", .path.display())]
    Outbox {
        path: PathBuf,
        #[source]
        source: OutboxError,
    },
    #[error("closing the outbox")]
    CloseOutbox(#[source] OutboxError),
    #[error(transparent)]
    Generation(#[from] GenerationError),
    #[error(transparent)]
    Uplink(#[from] UplinkError),
    #[error(transparent)]
    Ota(#[from] OtaError),
    #[error(transparent)]
    Api(#[from] crate::api::ControlError),
    /// `[modbus_server]` cannot listen (address in use, no permission for port 502).
    #[error(transparent)]
    Modbus(#[from] crate::floor::ServerError),
    #[error("API listen {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// A floor server (OPC UA) could not start.
    #[error(transparent)]
    Floor(#[from] super::servers::FloorError),
    /// A blocking task of the start or the stop panicked or was cancelled.
    #[error("a daemon task ended early")]
    Task(#[from] tokio::task::JoinError),
}
