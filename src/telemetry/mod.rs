//! Logging setup (and, later, metrics and device sensors).

pub mod logging;
