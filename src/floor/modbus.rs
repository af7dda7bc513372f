//! The Modbus parts of a build with the `modbus` feature: the crate's
//! config types, the daemon's [`Floor`] (the server, the sources'
//! connections) with its status and metrics, and the register map.

use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;
use serde::Serialize;

pub use outpost_modbus::output::OutputStatus as ModbusOutputReport;
pub use outpost_modbus::{
    Hub, ModbusOutput, OutputConfig as ModbusOutputConfig, ServerConfig as ModbusServerConfig,
    SourceConfig as ModbusSourceConfig,
};

use crate::telemetry::metrics::{Labels, MetricSource, counter, gauge};

/// The server's handle as outputs hold it (records of mapped pipelines
/// update its table).
pub type ServerHandle = outpost_modbus::Server;

pub fn output_problems(c: &ModbusOutputConfig, at: &str) -> Vec<String> {
    c.validate(at)
}

pub fn source_problems(c: &ModbusSourceConfig, at: &str) -> Vec<String> {
    c.validate(at)
}

pub fn server_problems(c: &ModbusServerConfig, pipelines: &[&str]) -> Vec<String> {
    c.validate(pipelines)
}

pub fn output_label(c: &ModbusOutputConfig) -> String {
    format!("modbus:{}", c.target)
}

/// The daemon's Modbus parts that outlive a generation: the server, and
/// the current generation's source connections.
#[derive(Default)]
pub struct Floor {
    server: Option<ServerHandle>,
    hub: Mutex<Arc<Hub>>,
}

impl std::fmt::Debug for Floor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Floor")
            .field("server", &self.server.as_ref().map(|s| s.local_addr()))
            .finish()
    }
}

/// `modbus` in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct FloorStatus {
    /// None: no `[modbus_server]`.
    pub server: Option<outpost_modbus::server::ServerStatus>,
    /// The connections of the modbus sources, one per PLC.
    pub sources: Vec<outpost_modbus::link::LinkStatus>,
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
#[error("modbus_server: cannot listen on {listen}: {source}")]
pub struct ServerError {
    pub listen: std::net::SocketAddr,
    pub source: std::io::Error,
}

impl Floor {
    /// Starts `[modbus_server]` if the config has one. Must run inside the
    /// daemon's runtime; the server stops with `shutdown`.
    pub fn start(
        server: Option<&ModbusServerConfig>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Result<Floor, ServerError> {
        let server = match server {
            Some(cfg) => {
                let (s, _task) =
                    outpost_modbus::Server::start(cfg, shutdown).map_err(|source| ServerError {
                        listen: cfg.listen,
                        source,
                    })?;
                tracing::info!(listen = %s.local_addr(), registers = cfg.registers.len(), "modbus server listening");
                Some(s)
            }
            None => None,
        };
        Ok(Floor {
            server,
            hub: Mutex::default(),
        })
    }

    /// The server, for the outputs of the pipelines it maps.
    pub fn server(&self) -> Option<&ServerHandle> {
        self.server.as_ref()
    }

    /// A reload: the server's new map (its address stays until a restart).
    pub fn reconfigure(&self, server: Option<&ModbusServerConfig>) {
        match (&self.server, server) {
            (Some(s), Some(cfg)) => {
                if cfg.listen != s.local_addr() && cfg.listen.port() != 0 {
                    tracing::warn!(
                        "modbus_server.listen changed: it takes effect at the next restart"
                    );
                }
                s.reconfigure(cfg);
            }
            (None, Some(_)) => {
                tracing::warn!("modbus_server added: it starts at the next restart");
            }
            (Some(s), None) => {
                // No map: every read is refused until the next restart.
                let mut empty = empty_server(s.local_addr());
                empty.allow.clear();
                s.reconfigure(&empty);
            }
            (None, None) => {}
        }
    }

    /// A fresh set of source connections for a new generation.
    pub fn new_hub(&self) -> Arc<Hub> {
        let hub = Arc::new(Hub::default());
        *self.hub.lock() = hub.clone();
        hub
    }

    pub fn status(&self) -> Option<FloorStatus> {
        let sources = self.hub.lock().status();
        if self.server.is_none() && sources.is_empty() {
            return None;
        }
        Some(FloorStatus {
            server: self.server.as_ref().map(|s| s.status()),
            sources,
        })
    }
}

/// A server config with nothing in it, at `listen`.
fn empty_server(listen: std::net::SocketAddr) -> ModbusServerConfig {
    ModbusServerConfig {
        listen,
        allow: Vec::new(),
        max_connections: 1,
        idle_timeout: std::time::Duration::from_secs(1),
        word_order: Default::default(),
        registers: Vec::new(),
    }
}

fn by<K: ToString>(
    base: &Labels,
    key: &'static str,
    m: &std::collections::BTreeMap<K, u64>,
) -> Vec<(Labels, u64)> {
    m.iter()
        .map(|(k, v)| {
            let mut l = base.clone();
            l.push((key, k.to_string()));
            (l, *v)
        })
        .collect()
}

/// An exception code as its label: two hex digits, as PLC manuals write them.
fn code_label(c: &u8) -> String {
    format!("{c:02x}")
}

impl MetricSource for Floor {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(s) = &self.server {
            let st = s.status();
            let l: Labels = vec![("listen", st.listen.clone())];
            gauge(
                enc,
                "outpost_modbus_server_connections",
                "Clients connected to the Modbus server",
                &[(l.clone(), st.connections as f64)],
            )?;
            for (name, help, v) in [
                (
                    "outpost_modbus_server_accepted",
                    "Client connections the Modbus server accepted",
                    st.accepted,
                ),
                (
                    "outpost_modbus_server_requests",
                    "Reads the Modbus server answered with values",
                    st.requests,
                ),
                (
                    "outpost_modbus_server_idle_closed",
                    "Connections closed after idle_timeout without a whole request",
                    st.idle_closed,
                ),
            ] {
                counter(enc, name, help, &[(l.clone(), v)])?;
            }
            counter(
                enc,
                "outpost_modbus_server_refused",
                "Connections closed at once, by reason (not_allowed, too_many_connections)",
                &by(&l, "reason", &st.refused),
            )?;
            counter(
                enc,
                "outpost_modbus_server_malformed",
                "Malformed requests, by reason (protocol_id, bad_length, bad_pdu, bad_quantity, illegal_function)",
                &by(&l, "reason", &st.malformed),
            )?;
            let ex: Vec<(Labels, u64)> = st
                .exceptions
                .iter()
                .map(|(c, v)| {
                    let mut x = l.clone();
                    x.push(("code", code_label(c)));
                    (x, *v)
                })
                .collect();
            counter(
                enc,
                "outpost_modbus_server_exceptions",
                "Exception answers of the Modbus server, by code",
                &ex,
            )?;
            counter(
                enc,
                "outpost_modbus_server_skipped",
                "Record values the Modbus server could not serve, by reason",
                &by(&l, "reason", &st.skipped),
            )?;
        }
        let links = self.hub.lock().status();
        let (mut up, mut connects, mut requests, mut ex, mut failures) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for k in &links {
            let l: Labels = vec![("target", k.target.clone())];
            up.push((l.clone(), if k.connected { 1.0 } else { 0.0 }));
            connects.push((l.clone(), k.connects));
            requests.push((l.clone(), k.requests));
            for (c, v) in &k.exceptions {
                let mut x = l.clone();
                x.push(("code", code_label(c)));
                ex.push((x, *v));
            }
            failures.extend(by(&l, "reason", &k.failures));
        }
        gauge(
            enc,
            "outpost_modbus_source_connected",
            "1 while the modbus sources' connection to a PLC is up",
            &up,
        )?;
        counter(
            enc,
            "outpost_modbus_source_connects",
            "Connections made to a PLC by the modbus sources",
            &connects,
        )?;
        counter(
            enc,
            "outpost_modbus_source_requests",
            "Reads a PLC answered (exceptions included)",
            &requests,
        )?;
        counter(
            enc,
            "outpost_modbus_source_exceptions",
            "Exception answers to the modbus sources' reads, by code",
            &ex,
        )?;
        counter(
            enc,
            "outpost_modbus_source_failures",
            "Reads and connects that failed, by reason (connect, timeout, lost)",
            &failures,
        )
    }
}

/// Each modbus output's families (its labels: pipeline and output).
pub fn output_metrics(
    enc: &mut DescriptorEncoder,
    rows: &[(Labels, ModbusOutputReport)],
) -> Result<(), std::fmt::Error> {
    type Get = fn(&ModbusOutputReport) -> u64;
    let plain: [(&str, &str, Get); 6] = [
        (
            "outpost_modbus_output_requests",
            "Write requests the PLC acknowledged",
            |r| r.requests,
        ),
        (
            "outpost_modbus_output_written",
            "Registers and coils written into the PLC",
            |r| r.written,
        ),
        (
            "outpost_modbus_output_replaced",
            "Values replaced by a newer one before they were written (the PLC was slower than the records)",
            |r| r.replaced,
        ),
        (
            "outpost_modbus_output_lost",
            "Write requests lost with their connection (their values wait for the next one)",
            |r| r.lost,
        ),
        (
            "outpost_modbus_output_connects",
            "Connections made to the PLC",
            |r| r.link.connects,
        ),
        (
            "outpost_modbus_output_records",
            "Records offered to the output",
            |r| r.records,
        ),
    ];
    for (name, help, get) in plain {
        let v: Vec<(Labels, u64)> = rows.iter().map(|(l, r)| (l.clone(), get(r))).collect();
        counter(enc, name, help, &v)?;
    }
    let mut ex = Vec::new();
    let mut skipped = Vec::new();
    let mut failures = Vec::new();
    for (l, r) in rows {
        for (c, v) in &r.exceptions {
            let mut x = l.clone();
            x.push(("code", code_label(c)));
            ex.push((x, *v));
        }
        skipped.extend(by(l, "reason", &r.skipped));
        failures.extend(by(l, "reason", &r.link.failures));
    }
    counter(
        enc,
        "outpost_modbus_output_exceptions",
        "Exception answers of the PLC to writes, by code (02 illegal address, 06 device busy, ...)",
        &ex,
    )?;
    counter(
        enc,
        "outpost_modbus_output_skipped",
        "Record values not written, by reason (field_missing, not_a_number, out_of_range, not_finite)",
        &skipped,
    )?;
    counter(
        enc,
        "outpost_modbus_output_failures",
        "Connects and requests that failed, by reason (connect, timeout, lost)",
        &failures,
    )
}

/// The server's map entries, registers then coils, by address.
pub fn map_order(cfg: &ModbusServerConfig) -> Vec<&outpost_modbus::config::ServerRegister> {
    outpost_modbus::Server::map_rows(cfg)
}
