//! The daemon's TOML config: load -> parse -> interpolate `${VAR}` in
//! string values -> read (unknown keys refused) -> validate (every problem
//! at once).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod host;

use crate::backend::Provider;
use crate::backend::ort::{CudaOptions, TensorRtOptions};
use crate::outbox::OutboxConfig;
use crate::pipeline::PipelineConfig;
pub use crate::pipeline::SchedulerConfig;
use crate::source::SourceConfig;
use crate::source::camera::CameraDef;
use crate::source::mqtt::{EmbeddedBrokerConfig, SiteBrokerConfig};
use crate::uplink::UplinkConfig;

mod locate;
mod read;
mod records;

pub use records::RecordLimit;

/// Top level of `outpost.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This device: `device = "gw-7"` (its name in result ids and topics;
    /// default: the host name), or a table `[device]` with `name` and the
    /// rollout `groups` it belongs to.
    #[serde(default, deserialize_with = "device_either")]
    pub device: Option<DeviceConfig>,
    /// Where the outbox, engine caches and staged updates live.
    #[serde(default = "default_data_dir")]
    pub data_dir: PathBuf,
    /// Folder of model folders, each with a manifest.toml.
    #[serde(default = "default_model_dir")]
    pub model_dir: PathBuf,
    #[serde(default)]
    pub runtime: RuntimeConfig,
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    #[serde(default)]
    pub outbox: OutboxConfig,
    #[serde(default)]
    pub api: ApiConfig,
    /// The site's MQTT broker, for mqtt sources. Without one, an embedded broker serves.
    #[serde(default)]
    pub site_broker: Option<SiteBrokerConfig>,
    /// The embedded broker's settings (used when mqtt sources exist and no site broker is set).
    #[serde(default)]
    pub embedded_broker: EmbeddedBrokerConfig,
    #[serde(default)]
    pub pipelines: Vec<PipelineConfig>,
    /// Cameras decoded once for every pipeline that names them
    /// (`source = { type = "camera", camera = "NAME" }`).
    #[serde(default)]
    pub cameras: Vec<CameraDef>,
    /// Where results go: the fleet's MQTT broker or HTTP ingestion endpoint.
    /// Without one, results stay in the outbox (export them with `outpost outbox export`).
    #[serde(default)]
    pub uplink: Option<UplinkConfig>,
    /// Signed over-the-air updates of models and of the daemon.
    #[serde(default)]
    pub ota: Option<crate::ota::OtaConfig>,
    /// When the system clock is trusted, and where its last known good time is kept.
    #[serde(default)]
    pub clock: crate::clock::ClockConfig,
    /// outpost's own Modbus TCP server: mapped fields' latest values,
    /// read-only, for PLCs and SCADA that poll (feature `modbus`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub modbus_server: Option<crate::floor::ModbusServerConfig>,
    /// outpost's OPC UA server (feature `opcua`): each pipeline's latest
    /// result as variables for SCADA and PLCs.
    #[serde(default)]
    pub opcua: Option<OpcuaSection>,
}

/// `[opcua]`, read in full by a build with the `opcua` feature.
#[cfg(feature = "opcua")]
pub type OpcuaSection = outpost_opcua::OpcuaConfig;
/// `[opcua]` in a build without the `opcua` feature: taken as written, and
/// refused by `validate` with what the build lacks.
#[cfg(not(feature = "opcua"))]
pub type OpcuaSection = toml::Table;

/// `device = "name"` or `[device] name = "..." groups = [...]`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Name in result ids and topics; default: the host name.
    #[serde(default)]
    pub name: Option<String>,
    /// Rollout groups (e.g. `["site-a", "pilot"]`): a manifest entry that
    /// lists groups is taken only by devices in one of them.
    #[serde(default)]
    pub groups: Vec<String>,
}

impl DeviceConfig {
    /// Reads the plain string form or the table.
    fn from_either<'de, D: serde::Deserializer<'de>>(d: D) -> Result<DeviceConfig, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = DeviceConfig;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a device name, or a table with `name` and `groups`")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DeviceConfig, E> {
                Ok(DeviceConfig {
                    name: Some(v.to_string()),
                    groups: Vec::new(),
                })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> Result<DeviceConfig, A::Error> {
                #[derive(Deserialize)]
                #[serde(deny_unknown_fields)]
                struct Table {
                    #[serde(default)]
                    name: Option<String>,
                    #[serde(default)]
                    groups: Vec<String>,
                }
                let t = Table::deserialize(serde::de::value::MapAccessDeserializer::new(m))?;
                Ok(DeviceConfig {
                    name: t.name,
                    groups: t.groups,
                })
            }
        }
        d.deserialize_any(V)
    }
}

fn device_either<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<DeviceConfig>, D::Error> {
    DeviceConfig::from_either(d).map(Some)
}

/// The local HTTP API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ApiConfig {
    /// Loopback by default: the API is for the device and its operator's tunnel.
    pub listen: SocketAddr,
    /// A file holding the bearer token for state changes (reload, pause,
    /// resume, OTA). Without one, state changes are refused.
    pub token_file: Option<PathBuf>,
    /// Connections served at once (the API and the http source share
    /// them); one more is answered 503 and closed. Lowered at start to
    /// leave `reserved_fds` of the process's descriptor limit free. A few
    /// (8, at most half) are kept for `/healthz`, `/readyz`, `/metrics` and
    /// `/v1/status`.
    pub max_connections: usize,
    /// A connection must send a request's headers within this, counted from
    /// its start or from the end of its previous response: it is also how
    /// long an idle connection stays open.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// An http-source request must send its whole body within this.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    /// Largest http-source request body; larger ones are answered 413.
    pub max_body_bytes: usize,
    /// Descriptors kept free for storage (outbox, watch folders, journals)
    /// and the uplink: connections never take them.
    pub reserved_fds: u64,
    /// Further names the API is reached by (`host` or `host:port`, e.g.
    /// "gw-1.local"), besides its loopback addresses, `localhost` and the
    /// listen address, which are always served. A request whose `Host` is
    /// none of these is answered 421 (it is what a DNS-rebinding page sends).
    pub allowed_hosts: Vec<String>,
}

/// Default `api.max_connections`.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;
/// Default `api.header_read_timeout`.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default `api.body_read_timeout`.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `api.max_body_bytes`: 16 MiB (a large photo).
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;
/// Default `api.reserved_fds`.
pub const DEFAULT_RESERVED_FDS: u64 = 64;

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8780)),
            token_file: None,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            reserved_fds: DEFAULT_RESERVED_FDS,
            allowed_hosts: Vec::new(),
        }
    }
}

impl ApiConfig {
    /// Every problem, each naming its key.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.max_connections == 0 {
            p.push("api.max_connections: must be at least 1".into());
        }
        if self.header_read_timeout.is_zero() {
            p.push("api.header_read_timeout: must be above 0".into());
        }
        if self.body_read_timeout.is_zero() {
            p.push("api.body_read_timeout: must be above 0".into());
        }
        if self.max_body_bytes == 0 {
            p.push("api.max_body_bytes: must be at least 1".into());
        }
        for h in &self.allowed_hosts {
            if let Err(e) = host::check_entry(h) {
                p.push(format!("api.allowed_hosts: {e}"));
            }
        }
        p
    }
}

fn default_data_dir() -> PathBuf {
    PathBuf::from("/var/lib/outpost")
}
fn default_model_dir() -> PathBuf {
    PathBuf::from("/var/lib/outpost/models")
}

/// How models are run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Path of libonnxruntime.so; searched for when unset (see `backend::ort`).
    pub onnxruntime: Option<PathBuf>,
    /// Execution providers in order of preference; each model gets the first that works here.
    pub providers: Vec<Provider>,
    /// Intra-op threads per session.
    pub intra_threads: usize,
    /// CUDA device ordinal for the CUDA provider.
    pub cuda_device_id: i32,
    pub tensorrt: TensorRtOptions,
    /// I/O binding and CUDA graphs for CUDA and TensorRT sessions.
    pub cuda: CudaOptions,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        RuntimeConfig {
            onnxruntime: None,
            providers: vec![Provider::Tensorrt, Provider::Cuda, Provider::Cpu],
            intra_threads: 1,
            cuda_device_id: 0,
            tensorrt: TensorRtOptions::default(),
            cuda: CudaOptions::default(),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            device: None,
            data_dir: default_data_dir(),
            model_dir: default_model_dir(),
            runtime: RuntimeConfig::default(),
            scheduler: SchedulerConfig::default(),
            outbox: OutboxConfig::default(),
            api: ApiConfig::default(),
            site_broker: None,
            embedded_broker: EmbeddedBrokerConfig::default(),
            pipelines: Vec::new(),
            cameras: Vec::new(),
            uplink: None,
            ota: None,
            clock: crate::clock::ClockConfig::default(),
            modbus_server: None,
            opcua: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {} problem(s):\n{}", .problems.len(), .problems.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid { path: String, problems: Vec<String> },
}

impl Config {
    /// The MQTT uplink's command topic for this device, if there is one.
    pub fn command_topic(&self) -> Option<String> {
        match &self.uplink {
            Some(UplinkConfig::Mqtt(m)) if !m.command_topic.is_empty() => {
                Some(m.command_topic.replace("{device}", &self.device_name()))
            }
            _ => None,
        }
    }

    /// Loads, interpolates, parses and validates; all problems in one error.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: p.clone(),
            source,
        })?;
        Self::from_toml(&text, &p, |k| std::env::var(k).ok())
    }

    pub fn from_toml(
        text: &str,
        path: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigError> {
        Self::read(text, path, env, |_| Vec::new())
    }

    /// Reads as far as the text goes and reports every problem at once,
    /// each with its line and key: the syntax (which stops the reading),
    /// each key that cannot be read, `validate`, and `more`, the caller's
    /// own checks of what could be read (messages that start with their
    /// key path, e.g. `pipelines[0].model: ...`).
    pub fn read(
        text: &str,
        path: &str,
        env: impl Fn(&str) -> Option<String>,
        more: impl FnOnce(&Config) -> Vec<String>,
    ) -> Result<Config, ConfigError> {
        read::read(text, env, more)
            .map(|mut c| {
                c.resolve_cameras();
                c
            })
            .map_err(|problems| ConfigError::Invalid {
                path: path.into(),
                problems: problems.iter().map(|p| p.to_string()).collect(),
            })
    }

    /// Hands each pipeline that names a `[[cameras]]` entry that entry, so
    /// its source knows the camera it joins (names checked by `validate`).
    pub fn resolve_cameras(&mut self) {
        for pl in &mut self.pipelines {
            if let SourceConfig::Camera(c) = &mut pl.source {
                if let Some(name) = &c.camera {
                    c.resolved = self.cameras.iter().find(|d| &d.name == name).cloned();
                }
                if c.is_many() {
                    let names: Vec<String> = c
                        .names(&self.cameras)
                        .into_iter()
                        .map(String::from)
                        .collect();
                    c.resolved_many = names
                        .iter()
                        .filter_map(|n| self.cameras.iter().find(|d| &d.name == n).cloned())
                        .collect();
                }
            }
        }
    }

    /// Every problem, each naming its key.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(d) = self.device.as_ref().and_then(|d| d.name.as_ref())
            && (d.is_empty() || d.contains(['/', '+', '#', ' ']))
        {
            p.push(format!("device: `{d}` must be non-empty without '/', '+', '#' or spaces (it is used in ids and topics)"));
        }
        for g in self.device_groups() {
            if g.is_empty() || g.contains(['/', '+', '#', ' ']) {
                p.push(format!(
                    "device.groups: `{g}` must be non-empty without '/', '+', '#' or spaces"
                ));
            }
        }
        let r = &self.runtime;
        if r.providers.is_empty() {
            p.push("runtime.providers: empty (use e.g. [\"tensorrt\", \"cuda\", \"cpu\"])".into());
        }
        for (i, a) in r.providers.iter().enumerate() {
            if r.providers[..i].contains(a) {
                p.push(format!("runtime.providers: `{a}` listed twice"));
            }
        }
        if r.intra_threads == 0 || r.intra_threads > 256 {
            p.push(format!(
                "runtime.intra_threads: {} is out of range 1..=256",
                r.intra_threads
            ));
        }
        if let Some(lib) = &r.onnxruntime
            && !lib.exists()
        {
            p.push(format!(
                "runtime.onnxruntime: {} does not exist",
                lib.display()
            ));
        }
        if r.cuda.cuda_graph && !r.cuda.io_binding {
            p.push("runtime.cuda.cuda_graph = true needs runtime.cuda.io_binding = true (a replayed graph reads and writes bound buffers)".into());
        }
        let t = &r.tensorrt;
        if let Some(table) = &t.int8_calibration_table {
            if !t.int8 {
                p.push("runtime.tensorrt.int8_calibration_table is set but int8 is false".into());
            }
            if table.is_absolute() && !table.exists() {
                p.push(format!(
                    "runtime.tensorrt.int8_calibration_table: {} does not exist",
                    table.display()
                ));
            }
        }
        p.extend(
            self.outbox
                .validate()
                .into_iter()
                .map(|e| format!("outbox: {e}")),
        );
        if let Some(u) = &self.uplink {
            // Its messages already name their key (`uplink.host: ...`).
            p.extend(u.validate());
        }
        if let Some(o) = &self.ota {
            p.extend(o.validate());
            if o.manifest_url.is_none() && self.command_topic().is_none() {
                p.push(
                    "ota: no manifest_url and no MQTT uplink with a command_topic: no update could arrive"
                        .into(),
                );
            }
        }
        p.extend(self.api.validate());
        p.extend(self.clock.validate());
        if let Some(t) = &self.api.token_file
            && !t.exists()
        {
            p.push(format!("api.token_file: {} does not exist", t.display()));
        }
        p.extend(self.scheduler.validate());
        if let Some(m) = &self.modbus_server {
            let names: Vec<&str> = self.pipelines.iter().map(|p| p.name.as_str()).collect();
            p.extend(crate::floor::server_problems(m, &names));
        }
        if let Some(o) = &self.opcua {
            p.extend(validate_opcua(o, &self.pipelines));
        }
        if !crate::source::mqtt::EMBEDDED_BROKER_BUILT
            && self.site_broker.is_none()
            && self.pipelines.iter().any(|pc| {
                matches!(pc.source, SourceConfig::Mqtt { .. })
                    || pc
                        .outputs
                        .iter()
                        .any(|o| matches!(o, crate::output::OutputConfig::Mqtt { .. }))
            })
        {
            p.push(format!(
                "site_broker: {}",
                crate::source::mqtt::NO_EMBEDDED_BROKER
            ));
        }
        let named: Vec<(usize, &str, &str)> = self
            .pipelines
            .iter()
            .enumerate()
            .flat_map(|(i, pc)| match &pc.source {
                SourceConfig::Camera(c) => {
                    let key = if c.is_many() { "cameras" } else { "camera" };
                    c.names(&self.cameras)
                        .into_iter()
                        .map(|n| (i, key, n))
                        .collect()
                }
                _ => Vec::new(),
            })
            .collect();
        p.extend(crate::source::camera::validate_cameras(
            &self.cameras,
            &named,
        ));
        for (i, pc) in self.pipelines.iter().enumerate() {
            // The reader writes `pipelines[i]` as the pipeline's name and line.
            let at = format!("pipelines[{i}]");
            p.extend(pc.validate(&at));
            let cameras: Vec<&str> = named
                .iter()
                .filter(|(j, ..)| *j == i)
                .map(|(.., n)| *n)
                .collect();
            p.extend(self.check_event_room(&at, pc, &cameras));
            p.extend(crate::track::config::validate_cameras(
                &at,
                &pc.stream_cameras(&self.cameras),
                &pc.zones,
                &pc.lines,
            ));
            if let Some(j) = self.pipelines[..i].iter().position(|o| o.name == pc.name) {
                p.push(format!(
                    "{at}.name: `{}` is already the name of pipelines[{j}]",
                    pc.name
                ));
            }
            for (j, other) in self.pipelines[..i].iter().enumerate() {
                if let (SourceConfig::Udp { listen: a, .. }, SourceConfig::Udp { listen: b, .. }) =
                    (&pc.source, &other.source)
                    && a == b
                {
                    p.push(format!(
                        "{at}.source.listen: {a} is also used by pipelines[{j}]"
                    ));
                }
            }
        }
        p
    }

    /// This device's rollout groups (`[device] groups`).
    pub fn device_groups(&self) -> &[String] {
        self.device.as_ref().map_or(&[], |d| &d.groups)
    }

    /// This device's name: the config's, else the host name.
    pub fn device_name(&self) -> String {
        if let Some(d) = self.device.as_ref().and_then(|d| d.name.as_ref()) {
            return d.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .or_else(|_| std::fs::read_to_string("/etc/hostname"))
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "outpost".to_string())
    }

    /// The engine cache root.
    pub fn tensorrt_cache_dir(&self) -> PathBuf {
        self.data_dir.join("tensorrt")
    }
}

#[cfg(feature = "opcua")]
fn validate_opcua(o: &OpcuaSection, pipelines: &[PipelineConfig]) -> Vec<String> {
    let names: Vec<&str> = pipelines.iter().map(|p| p.name.as_str()).collect();
    o.validate(&names)
}

#[cfg(not(feature = "opcua"))]
fn validate_opcua(_: &OpcuaSection, _: &[PipelineConfig]) -> Vec<String> {
    vec![
        "opcua: this outpost was built without the OPC UA server (cargo feature `opcua`); use a build or package that has it, or remove [opcua]"
            .into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolation_replaces_and_reports_each_unset_variable() {
        let env = |k: &str| (k == "SITE").then(|| "farm-7".to_string());
        let c =
            Config::from_toml("device = \"${SITE}-$$5\" # ${NOT_A_REFERENCE}\n", "t", env).unwrap();
        assert_eq!(c.device_name(), "farm-7-$5");
        let err = Config::from_toml("device = \"${NOPE}\"\ndata_dir = \"${ALSO}\"\n", "t", env)
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1: environment variable `NOPE`"), "{err}");
        assert!(err.contains("line 2: environment variable `ALSO`"), "{err}");
    }

    #[test]
    fn a_variable_holding_quotes_or_backslashes_arrives_byte_for_byte() {
        // Edited into the text before parsing, such a value broke the file
        // or changed its structure (a camera password, say).
        let secret = "p\"a\\ss\nword # \" ]\n[api]\nlisten = \"0.0.0.0:1\"";
        let env = |k: &str| (k == "SECRET").then(|| secret.to_string());
        let c = Config::from_toml("data_dir = \"/srv/${SECRET}\"\n", "t", env).unwrap();
        assert_eq!(c.data_dir, PathBuf::from(format!("/srv/{secret}")));
        assert_eq!(c.api, ApiConfig::default());
    }

    #[test]
    fn device_is_a_name_or_a_table_with_groups() {
        let c = Config::from_toml("device = \"gw-7\"\n", "t", |_| None).unwrap();
        assert_eq!(c.device_name(), "gw-7");
        assert!(c.device_groups().is_empty());
        let c = Config::from_toml(
            "[device]\nname = \"gw-8\"\ngroups = [\"site-a\", \"pilot\"]\n",
            "t",
            |_| None,
        )
        .unwrap();
        assert_eq!(c.device_name(), "gw-8");
        assert_eq!(c.device_groups(), ["site-a", "pilot"]);
        let c = Config::from_toml("device = { groups = [\"x\"] }\n", "t", |_| None).unwrap();
        assert_eq!(c.device_groups(), ["x"]);
        assert!(c.device.as_ref().unwrap().name.is_none());
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml("[device]\nname = \"a\"\ngroup = [\"x\"]\n", "t", |_| None)
        else {
            panic!("an unknown key in [device] must be refused");
        };
        assert!(problems[0].contains("group"), "{problems:?}");
        let Err(ConfigError::Invalid { problems, .. }) = Config::from_toml(
            "[device]\nname = \"a b\"\ngroups = [\"\", \"site/a\"]\n",
            "t",
            |_| None,
        ) else {
            panic!("expected invalid");
        };
        assert_eq!(problems.len(), 3, "{problems:?}");
        assert!(Config::from_toml("device = 3\n", "t", |_| None).is_err());
    }

    #[test]
    fn every_problem_reported_at_once() {
        let text = r#"
device = "a b"
[runtime]
providers = ["cuda", "cuda"]
intra_threads = 0
[runtime.tensorrt]
int8_calibration_table = "/nonexistent/table"
"#;
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml(text, "t.toml", |_| None)
        else {
            panic!("expected invalid");
        };
        assert_eq!(problems.len(), 5, "{problems:?}");
    }

    const MANY: &str = r#"
[[cameras]]
name = "gate"
url = "rtsp://10.0.0.7/a"
[[cameras]]
name = "yard"
url = "rtsp://10.0.0.8/a"
fps = 5
[[pipelines]]
name = "site"
model = "m"
source = { type = "camera", cameras = "*", fps = 1 }
[pipelines.track]
[[pipelines.zones]]
name = "door"
polygon = [[0, 0], [10, 0], [10, 10]]
[[pipelines.lines]]
name = "fence"
camera = "dock"
points = [[0, 0], [10, 10]]
"#;

    #[test]
    fn every_bad_motion_key_is_reported_with_its_line() {
        let text = r#"
[[pipelines]]
name = "street"
model = "m"
source = { type = "http" }
[pipelines.motion]
enabled = true
threshold = 0
alpha = 2.0
max_regions = 0
mask = [[0, 0], [10, 10]]
"#;
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml(text, "t.toml", |_| None)
        else {
            panic!("bad motion keys were accepted");
        };
        for (line, key) in [
            (7, "motion.enabled: motion gating needs a camera source"),
            (8, "motion.threshold: must be at least 1"),
            (9, "motion.alpha: 2 is out of range"),
            (10, "motion.max_regions: 0 is out of range"),
            (11, "motion.mask#1: 2 points"),
        ] {
            assert!(
                problems.iter().any(|p| p
                    .starts_with(&format!("line {line}: pipeline \"street\""))
                    && p.contains(key)),
                "{key}: {problems:?}"
            );
        }
        let unknown = text.replace("threshold = 0", "treshold = 30");
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml(&unknown, "t.toml", |_| None)
        else {
            panic!("an unknown motion key was accepted");
        };
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("line 8:") && p.contains("treshold")),
            "{problems:?}"
        );
    }

    #[test]
    fn a_pipeline_over_several_cameras_resolves_them_and_places_its_zones() {
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml(MANY, "t.toml", |_| None)
        else {
            panic!("a zone without its camera was accepted");
        };
        let p: Vec<&String> = problems
            .iter()
            .filter(|e| !e.contains("`camera` feature"))
            .collect();
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(
            p.iter().any(|e| e.starts_with("line 14: pipeline \"site\"")
                && e.contains("zones#1.camera: the pipeline reads 2 cameras (gate, yard): say which one zone `door` is on")),
            "{p:?}"
        );
        assert!(
            p.iter().any(|e| e.starts_with("line 19:")
                && e.contains(
                    "lines#1.camera: `dock` is not one of the pipeline's cameras (gate, yard)"
                )),
            "{p:?}"
        );
        // Placed, every camera resolves in order, each with its rate.
        let fixed = MANY
            .replace("name = \"door\"\n", "name = \"door\"\ncamera = \"gate\"\n")
            .replace("camera = \"dock\"", "camera = \"yard\"");
        let cfg = read::read(&fixed, |_| None, |_| Vec::new());
        let mut cfg = match cfg {
            Ok(c) => c,
            // A build without the camera feature refuses any camera source.
            Err(p) if p.iter().all(|e| e.to_string().contains("`camera` feature")) => return,
            Err(p) => panic!("{p:?}"),
        };
        cfg.resolve_cameras();
        let SourceConfig::Camera(c) = &cfg.pipelines[0].source else {
            panic!("not a camera source");
        };
        let names: Vec<&str> = c.resolved_many.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["gate", "yard"]);
        let fps: Vec<Option<f64>> = c.resolved_many.iter().map(|d| c.fps_of(d)).collect();
        assert_eq!(fps, [Some(1.0), Some(5.0)]);
        // `camera` and `cameras` together are refused.
        let both = MANY.replace("cameras = \"*\"", "camera = \"gate\", cameras = \"*\"");
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml(&both, "t.toml", |_| None)
        else {
            panic!("camera and cameras together were accepted");
        };
        assert!(
            problems.iter().any(|e| e.contains("not both")),
            "{problems:?}"
        );
    }

    #[test]
    fn outputs_and_realtime_settings_are_validated() {
        let text = r#"
[scheduler]
cpus = [1, 1]
realtime_priority = 120
lock_memory = true
[[pipelines]]
name = "vad"
model = "silero_vad"
source = { type = "udp", listen = "127.0.0.1:9000" }
outputs = [
  { type = "mqtt", topic = "site/#" },
  { type = "unix", path = "" },
  { type = "udp", to = "127.0.0.1:9500", payload = "cbor" },
]
"#;
        let Err(ConfigError::Invalid { problems, .. }) =
            Config::from_toml(text, "t.toml", |_| None)
        else {
            panic!("expected invalid");
        };
        assert_eq!(problems.len(), 4, "{problems:?}");
        // Elements as the file counts them, each with its line.
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("line 11: pipeline \"vad\" (line 6), outputs#1.topic")),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("line 12: pipeline \"vad\" (line 6), outputs#2.path")),
            "{problems:?}"
        );
        assert!(problems.iter().any(|p| p.contains("realtime_priority")));
        assert!(problems.iter().any(|p| p.contains("cpus")));
        let ok = text
            .replace("[1, 1]", "[1]")
            .replace("120", "50")
            .replace("site/#", "site/{stream}")
            .replace("path = \"\"", "path = \"/run/outpost/vad.sock\"");
        let c = Config::from_toml(&ok, "t.toml", |_| None).unwrap();
        assert_eq!(c.scheduler.realtime_priority, Some(50));
        assert_eq!(c.pipelines[0].outputs.len(), 3);
    }

    #[test]
    fn unknown_keys_and_providers_refused() {
        assert!(Config::from_toml("[runtime]\nthreads = 2\n", "t", |_| None).is_err());
        assert!(Config::from_toml("[runtime]\nproviders = [\"tpu\"]\n", "t", |_| None).is_err());
        let c = Config::from_toml("[runtime]\nproviders = [\"cpu\"]\n", "t", |_| None).unwrap();
        assert_eq!(c.runtime.providers, vec![Provider::Cpu]);
    }

    /// The issue's `[opcua]` with a user, a mapped field, and two mistakes.
    const OPCUA: &str = r#"[[pipelines]]
name = "line3"
model = "m"
source = { type = "http" }

[opcua]
listen = "opc.tcp://0.0.0.0:4840"
security = ["basic256sha256_sign_encrypt"]
anonymous = false
[[opcua.users]]
user = "scada"
password_fil = "/etc/outpost/scada.pass"
[[opcua.variables]]
pipeline = "line4"
field = "/top/0/index"
"#;

    #[cfg(feature = "opcua")]
    #[test]
    fn opcua_keys_are_checked_each_with_its_line() {
        let Err(ConfigError::Invalid { problems, .. }) = Config::from_toml(OPCUA, "t", |_| None)
        else {
            panic!("the mistakes were not found");
        };
        assert!(
            problems.iter().any(|p| p.starts_with(
                "line 12: opcua.users#1.password_fil: unknown key `password_fil` (did you mean `password_file`?)"
            )),
            "{problems:#?}"
        );
        assert!(
            problems.iter().any(|p| p
                .starts_with("line 14: opcua.variables#1.pipeline: no pipeline is named `line4`")),
            "{problems:#?}"
        );
        let ok = OPCUA
            .replace(
                "password_fil = \"/etc/outpost/scada.pass\"",
                "password_env = \"HOME\"",
            )
            .replace("line4", "line3");
        let c = Config::from_toml(&ok, "t", |_| None).unwrap();
        assert_eq!(c.opcua.unwrap().variables[0].field, "/top/0/index");
    }

    #[cfg(not(feature = "opcua"))]
    #[test]
    fn a_build_without_opcua_refuses_the_section_by_name() {
        let ok = OPCUA.replace("password_fil", "password_file");
        let Err(ConfigError::Invalid { problems, .. }) = Config::from_toml(&ok, "t", |_| None)
        else {
            panic!("[opcua] accepted by a build without it");
        };
        assert_eq!(problems.len(), 1, "{problems:#?}");
        assert!(
            problems[0]
                .starts_with("line 6: opcua: this outpost was built without the OPC UA server"),
            "{problems:#?}"
        );
    }
}
