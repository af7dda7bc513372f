//! Fleet OTA: signed model and daemon updates.

pub mod host;

use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// `[ota]` in the config.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtaConfig {}

impl OtaConfig {
    pub fn validate(&self) -> Vec<String> {
        Vec::new()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OtaError {
    #[error("ota: {0}")]
    Setup(String),
}

/// A running OTA agent.
pub struct OtaAgent {
    pub task: tokio::task::JoinHandle<()>,
}

/// Starts the OTA agent on the current tokio runtime; it runs until `shutdown` turns true.
pub fn start(
    _cfg: &OtaConfig,
    _host: Arc<dyn host::ModelHost>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) -> Result<OtaAgent, OtaError> {
    let task = tokio::spawn(async move {
        let _ = shutdown.wait_for(|s| *s).await;
    });
    Ok(OtaAgent { task })
}
