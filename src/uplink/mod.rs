//! Uplinks to the fleet: drain the outbox, delete what the fleet acknowledged.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::outbox::Outbox;

/// `[uplink]` in the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum UplinkConfig {
    Mqtt {},
    Http {},
}

impl UplinkConfig {
    pub fn validate(&self) -> Vec<String> {
        Vec::new()
    }
}

#[derive(Debug, Default)]
pub struct UplinkStats {}

impl crate::telemetry::metrics::MetricSource for UplinkStats {
    fn encode(&self, _encoder: &mut prometheus_client::encoding::DescriptorEncoder) -> Result<(), std::fmt::Error> {
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum UplinkError {
    #[error("uplink: {0}")]
    Setup(String),
}

/// A running uplink.
pub struct Uplink {
    pub stats: Arc<UplinkStats>,
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts the uplink on the current tokio runtime; it drains `outbox` until
/// `shutdown` turns true.
pub fn start(
    _cfg: &UplinkConfig,
    _outbox: Outbox,
    _device: &str,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<Uplink, UplinkError> {
    let task = tokio::spawn(async move {
        let _ = shutdown.wait_for(|s| *s).await;
    });
    Ok(Uplink { stats: Arc::new(UplinkStats::default()), task })
}
