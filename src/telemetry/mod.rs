//! Logging setup, metrics, and process and device sensors.

pub mod device;
pub mod logging;
pub mod metrics;
