//! `outpost config example`: a commented config covering every source and
//! uplink kind; it passes `outpost check`.

/// The example, with the MQTT uplink active and the HTTP one commented out
/// (a daemon has one uplink); `--uplink http` swaps them.
pub const EXAMPLE: &str = r#"# outpost.toml: every key is optional unless marked required.
# ${VAR} is replaced from the environment (EnvironmentFile=/etc/default/outpost); $$ is a dollar.

device = "site-0001-gw1"            # name in result ids and topics (default: host name)
data_dir = "/var/lib/outpost"       # outbox, engine caches, OTA staging
model_dir = "/var/lib/outpost/models"

[runtime]
# onnxruntime = "/usr/lib/outpost/libonnxruntime.so"   # default: searched (see README)
providers = ["tensorrt", "cuda", "cpu"]  # first that works on this machine serves each model
intra_threads = 1

[runtime.tensorrt]
fp16 = true
int8 = false
# int8_calibration_table = "/etc/outpost/calibration.table"
engine_cache = true                 # engines built once on the device, reused after restarts
ep_context = "dump"                 # precompiled EPContext models beside the engines

[scheduler]
workers = 0                         # inference threads; 0 = one per core

[outbox]
flush_interval = "10ms"             # a record is durable within this (group commit + fsync)
flush_records = 1000
max_bytes = "1 GiB"                 # records + dead letters; then when_full applies
when_full = "drop_oldest"           # or "reject_new"

[api]
listen = "127.0.0.1:8780"           # /healthz /readyz /metrics /v1/status
# token_file = "/etc/outpost/api.token"   # bearer token for reload, pause/resume, OTA

# MQTT sources connect to the site's broker when set, else to the embedded one.
# [site_broker]
# host = "192.0.2.10"
# port = 1883
[embedded_broker]
listen = "127.0.0.1:1883"

# Speech from microphones publishing PCM16 at 16 kHz over MQTT.
[[pipelines]]
name = "vad"
model = "silero_vad"
priority = "realtime"
when_full = "block"
source = { type = "mqtt", topics = ["site/+/audio"], qos = 1, stream = { topic_segment = 1 } }

# Sensor vectors as datagrams: `[len][stream name][16 little-endian f32]`.
[[pipelines]]
name = "vibration"
model = "sensor_mlp"
source = { type = "udp", listen = "127.0.0.1:9400", framing = "named" }
[pipelines.preprocess]
type = "sensor"
format = "f32le"
length = 16

# Camera frames from a capture process on the same device (u32 length + raw RGB).
[[pipelines]]
name = "camera"
model = "classifier"
queue = 16
when_full = "drop_oldest"
max_batch = 8
max_delay = "5ms"
source = { type = "unix", path = "/run/outpost/camera.sock" }
[pipelines.preprocess]
type = "image"
format = "raw_rgb"
input_width = 640
input_height = 480
width = 224
height = 224
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]

# On-demand requests: POST /v1/pipelines/sensors/infer?stream=NAME.
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = { type = "http" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16

# Inspection images dropped into a folder; moved to done/ or failed/.
[[pipelines]]
name = "documents"
model = "ppocr_det"
priority = "batch"
source = { type = "watch", dir = "/srv/outpost/inbox", poll_interval = "500ms", extensions = ["jpg", "jpeg", "png"] }

# A recorded session replayed (demos, tests, benchmarks).
[[pipelines]]
name = "replay"
model = "sensor_mlp"
priority = "batch"
source = { type = "replay", file = "/var/lib/outpost/recordings/session.rec", speed = "recorded", repeat = false }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16

UPLINK_MQTT
UPLINK_HTTP
# Signed updates of models and of the daemon (docs/ota.md). Offers come from
# the manifest document and/or as signed commands on the MQTT command_topic.
# [ota]
# manifest_url = "https://fleet.example.net/outpost/site-7.json"
# trusted_keys = ["/etc/outpost/keys/fleet.pub"]   # several: key rotation
# poll_interval = "5m"
# poll_jitter = "30s"
# max_bytes_per_s = "200 kB"
# probation = "60s"             # a new model serves under watch this long
# max_error_rate = 0.05
# max_p99_latency = "20ms"
# daemon_probation = "60s"      # a new daemon slot serves this long before it is good
# daemon_ready_timeout = "15m"  # ... and must be READY within this
# daemon_max_attempts = 3       # starts before the launcher falls back
"#;

const MQTT: &str = r#"# Results to the fleet broker: QoS 1, deleted from the outbox on PUBACK.
[uplink]
type = "mqtt"
host = "fleet.example.net"
port = 8883
tls = true
# ca = "/etc/outpost/fleet-ca.pem"
# cert = "/etc/outpost/device.pem"   # mTLS
# key = "/etc/outpost/device.key"
topic = "outpost/{device}/{pipeline}/{stream}"
status_topic = "outpost/{device}/status"   # retained online / offline (last will)
command_topic = "outpost/{device}/cmd"     # signed update commands (with [ota]); "" = none
batch = 1
payload = "json"                    # or "cbor"
max_bytes_per_s = 0                 # cap for metered links; 0 = none
backoff_min = "200ms"
backoff_max = "30s""#;

const HTTP: &str = r#"# Results to an HTTP ingestion endpoint: gzip NDJSON batches, deleted on 2xx.
[uplink]
type = "http"
url = "https://ingest.example.net/v1/results"
batch_records = 500
timeout = "10s"
headers = { Authorization = "Bearer ${FLEET_TOKEN}" }"#;

fn commented(s: &str) -> String {
    s.lines()
        .map(|l| {
            if l.is_empty() {
                String::new()
            } else {
                format!("# {l}")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The example with the chosen uplink active and the other commented out.
pub fn example(uplink: &str) -> String {
    let (m, h) = if uplink == "http" {
        (commented(MQTT), HTTP.to_string())
    } else {
        (MQTT.to_string(), commented(HTTP))
    };
    EXAMPLE
        .replace("UPLINK_MQTT", &m)
        .replace("UPLINK_HTTP", &format!("\n{h}\n"))
}

#[derive(Debug, clap::Subcommand)]
pub enum ConfigCommand {
    /// Print a commented example config covering every source and uplink kind.
    Example {
        /// Which uplink is active in the example.
        #[arg(long, default_value = "mqtt", value_parser = ["mqtt", "http"])]
        uplink: String,
    },
}

pub fn run(cmd: &ConfigCommand) -> anyhow::Result<()> {
    match cmd {
        ConfigCommand::Example { uplink } => {
            print!("{}", example(uplink));
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn both_examples_parse_and_validate() {
        for u in ["mqtt", "http"] {
            let text = example(u);
            let env = |k: &str| (k == "FLEET_TOKEN").then(|| "t".to_string());
            let cfg =
                Config::from_toml(&text, "example", env).unwrap_or_else(|e| panic!("{u}: {e}"));
            let kinds: std::collections::BTreeSet<&str> =
                cfg.pipelines.iter().map(|p| p.source.kind()).collect();
            assert_eq!(kinds.len(), 6, "every source kind: {kinds:?}");
            assert!(cfg.uplink.is_some());
        }
    }
}
