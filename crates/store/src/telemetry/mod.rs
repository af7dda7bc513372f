//! Logging setup, metrics, and process, device and machine sensors.

pub mod device;
pub mod logging;
pub mod metrics;
pub mod system;
