//! A build without the `modbus` feature: every Modbus key is still read
//! (so the file parses as it would with the feature), and refused with a
//! problem saying the build left it out. Nothing runs.

use std::sync::Arc;

use prometheus_client::encoding::DescriptorEncoder;
use serde::{Deserialize, Serialize};

use super::needs_modbus_build;
use crate::telemetry::metrics::MetricSource;

/// Whatever a Modbus table holds, kept unread.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Absent(toml::Table);

pub type ModbusOutputConfig = Absent;
pub type ModbusSourceConfig = Absent;
pub type ModbusServerConfig = Absent;

/// Never made without the feature.
#[derive(Debug, Clone, Serialize)]
pub struct ModbusOutputReport;

/// No server in this build.
#[derive(Debug, Clone)]
pub struct ServerHandle;

impl ServerHandle {
    pub fn serves(&self, _pipeline: &str) -> bool {
        false
    }
    pub fn update(&self, _pipeline: &str, _stream: &str, _outputs: &serde_json::Value) {}
}

/// No connections in this build.
#[derive(Debug, Default)]
pub struct Hub;

pub fn output_problems(_: &Absent, at: &str) -> Vec<String> {
    vec![needs_modbus_build(at)]
}

pub fn source_problems(_: &Absent, at: &str) -> Vec<String> {
    vec![needs_modbus_build(at)]
}

pub fn server_problems(_: &Absent, _pipelines: &[&str]) -> Vec<String> {
    vec![needs_modbus_build("modbus_server")]
}

pub fn output_label(_: &Absent) -> String {
    "modbus".into()
}

#[derive(Debug, Default)]
pub struct Floor;

#[derive(Debug, Clone, Serialize)]
pub struct FloorStatus;

/// Never made without the feature.
#[derive(Debug, thiserror::Error)]
#[error("modbus_server: not in this build")]
pub struct ServerError;

impl Floor {
    pub fn start(
        _server: Option<&Absent>,
        _shutdown: tokio_util::sync::CancellationToken,
    ) -> Result<Floor, ServerError> {
        Ok(Floor)
    }
    pub fn server(&self) -> Option<&ServerHandle> {
        None
    }
    pub fn reconfigure(&self, _server: Option<&Absent>) {}
    pub fn new_hub(&self) -> Arc<Hub> {
        Arc::new(Hub)
    }
    pub fn status(&self) -> Option<FloorStatus> {
        None
    }
}

impl MetricSource for Floor {
    fn encode(&self, _: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        Ok(())
    }
}
