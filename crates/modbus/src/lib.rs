//! Modbus TCP for outpost: results written into PLCs, served to SCADA, and
//! registers read as a sensor source.
//!
//! - [`encode`]: kinds (u16, i16, u32, i32, f32, bool), word order, scale
//!   and offset; values to register words and back.
//! - [`config`]: the TOML of the output, the source and `[modbus_server]`,
//!   with `validate` naming every problem's key.
//! - [`session`]: the client output's state (latest value wins per
//!   register, request grouping, outcomes), free of I/O.
//! - [`frame`]: Modbus TCP requests and answers as the server reads and
//!   writes them, free of I/O.
//! - [`link`], [`output`], [`poll`], [`server`]: the wire (tokio).

pub mod config;
pub mod encode;
pub mod frame;
pub mod link;
pub mod output;
pub mod poll;
pub mod server;
pub mod session;

pub use config::{OutputConfig, ServerConfig, SourceConfig};
pub use output::ModbusOutput;
pub use poll::{Hub, Poller};
pub use server::Server;
