//! outpost's OPC UA server: each pipeline's latest result as variables
//! under the namespace `urn:outpost:<device>` (NodeId strings
//! `<pipeline>/<field>` and `<pipeline>/record`), with subscriptions, the
//! device's own certificate, and user, certificate or (when configured)
//! anonymous logins.
//!
//! The daemon hands each record to a pipeline's [`Feed`] (a bounded
//! latest-value slot that never blocks the pipeline); the server's task
//! takes it into the variables, which notifies every subscription that
//! watches them.

mod auth;
pub mod config;
mod feed;
mod server;
mod values;

pub use auth::AuthStats;
pub use config::{Kind, OpcuaConfig, Security, UserConfig, VariableConfig};
pub use feed::Feed;
pub use server::{Opcua, OpcuaError, OpcuaStatus, ServerCtx};
