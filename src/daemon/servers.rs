//! The servers that live beside the pipelines for the site's controllers
//! (the OPC UA server, feature `opcua`): started once, before the first
//! generation, so every generation's pipelines feed them; a reload keeps
//! them and their clients' sessions.

use std::sync::Arc;

use crate::config::Config;
use crate::output::{RecordTap, ServerStatus};
use crate::telemetry::metrics::MetricSource;

/// Why a floor server could not start (its config, its port, its
/// certificate store): the daemon does not start either.
#[derive(Debug, thiserror::Error)]
pub enum FloorError {
    #[cfg(feature = "opcua")]
    #[error(transparent)]
    Opcua(#[from] crate::output::opcua::OpcuaError),
}

/// The floor servers of this daemon (none without `[opcua]`).
#[derive(Default)]
pub(super) struct Servers {
    #[cfg(feature = "opcua")]
    opcua: Option<Arc<crate::output::opcua::OpcuaServer>>,
}

impl Servers {
    /// Starts what the config asks for; their tasks end with `stop`.
    #[cfg(feature = "opcua")]
    pub(super) async fn start(
        cfg: &Config,
        device: &str,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<Servers, FloorError> {
        use crate::output::opcua::{Opcua, OpcuaServer, ServerCtx};
        let Some(o) = &cfg.opcua else {
            return Ok(Servers::default());
        };
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "localhost".into());
        let ctx = ServerCtx {
            device: device.to_string(),
            data_dir: cfg.data_dir.clone(),
            hostname,
            version: env!("CARGO_PKG_VERSION").to_string(),
            shutdown: stop,
        };
        // The task ends with the daemon's stop token.
        let (server, _task) = Opcua::start(o, ctx).await?;
        Ok(Servers {
            opcua: Some(Arc::new(OpcuaServer(server))),
        })
    }

    /// A build without the `opcua` feature has no floor server (`check`
    /// refuses an `[opcua]` section there).
    #[cfg(not(feature = "opcua"))]
    pub(super) async fn start(
        _cfg: &Config,
        _device: &str,
        _stop: tokio_util::sync::CancellationToken,
    ) -> Result<Servers, FloorError> {
        Ok(Servers::default())
    }

    /// What takes `pipeline`'s records.
    pub(super) fn taps(&self, pipeline: &str) -> Vec<Arc<dyn RecordTap>> {
        #[cfg(feature = "opcua")]
        if let Some(o) = &self.opcua {
            return vec![o.tap(pipeline)];
        }
        let _ = pipeline;
        Vec::new()
    }

    /// Their metrics.
    pub(super) fn metrics(&self) -> Vec<Arc<dyn MetricSource>> {
        #[cfg(feature = "opcua")]
        if let Some(o) = &self.opcua {
            return vec![o.clone()];
        }
        Vec::new()
    }

    /// The OPC UA server's part of `/v1/status`.
    pub(super) fn opcua_status(&self) -> Option<Arc<dyn ServerStatus>> {
        #[cfg(feature = "opcua")]
        if let Some(o) = &self.opcua {
            return Some(o.clone());
        }
        None
    }
}
