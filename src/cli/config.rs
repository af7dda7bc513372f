//! `outpost config example`: a commented config covering every source and
//! uplink kind; it passes `outpost check --no-files` as printed, with no
//! environment set (the `${VAR}` forms are in comments).

/// The example, with the MQTT uplink active and the HTTP one commented out
/// (a daemon has one uplink); `--uplink http` swaps them.
pub const EXAMPLE: &str = r#"# outpost.toml: every key is optional unless marked required.
# ${VAR} in a string value is replaced from the environment (EnvironmentFile=/etc/default/outpost); $$ is a dollar.

# This device: its name in result ids and topics (default: host name) and the
# rollout groups it belongs to (manifest entries may list groups). The name
# alone may be given as `device = "site-0001-gw1"`.
device = { name = "site-0001-gw1", groups = ["site-a", "pilot"] }
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

[runtime.cuda]                      # sessions served by the CUDA or TensorRT provider
io_binding = true                   # device buffers per session and shape; pinned host copies
cuda_graph = false                  # record and replay CUDA graphs (static shapes, no If/Loop)

[scheduler]
workers = 0                         # inference threads; 0 = one per core
# cpus = [2, 3]                     # pin inference threads (worker i -> cpus[i % len])
# realtime_priority = 50            # SCHED_FIFO 1..99 (inference and I/O threads); needs CAP_SYS_NICE (systemd/outpost-realtime.conf)
# lock_memory = true                # mlockall; needs CAP_IPC_LOCK or LimitMEMLOCK=infinity

[outbox]
flush_interval = "10ms"             # a record is durable within this (group commit + fsync)
flush_records = 1000
max_bytes = "1 GiB"                 # records + dead letters; then when_full applies
when_full = "drop_oldest"           # or "reject_new"
memory_when_read_only = "16 MiB"    # new records held in memory while the disk refuses writes (read-only)
compress = true                     # zstd on sled's log: a third of the flash's writes per record (docs/operations.md#flash-wear)

# The system clock is trusted while it is not behind the last known good time (<data_dir>/clock.json); records made
# before get their time from the boot's offset when they are sent.
[clock]
require_sync = false                # true where a time service runs: also wait for the kernel to say it synchronised
save_interval = "10m"               # how often that time is saved (also at a sync and at stop)

[api]
listen = "127.0.0.1:8780"           # /healthz /readyz /metrics /v1/status
# token_file = "/etc/outpost/api.token"   # bearer token for reload, pause/resume, OTA
# max_connections = 512          # one more is answered 503 (lowered to keep reserved_fds free); 8 kept for /healthz /readyz /metrics
# header_read_timeout = "10s"     # also how long an idle connection stays open
# body_read_timeout = "30s"       # http source: the whole request body
# max_body_bytes = 16777216       # http source: larger bodies are answered 413
# reserved_fds = 64               # descriptors connections never take (storage, uplink)
# allowed_hosts = ["gw-1.local"]  # names besides loopback, localhost and the listen address (others: 421)

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
# when_full: unset = "block" for a QoS 1 mqtt source, "drop_oldest" for the others.
when_full = "block"
# qos = 1: a persistent session (the broker keeps frames while the daemon restarts),
# and a message is acknowledged only once its record is durable in the outbox;
# max_inflight: QoS 1 messages held unacknowledged at most (then nothing more is read);
# max_message_bytes: larger messages are counted (too_large) and dropped.
source = { type = "mqtt", topics = ["site/+/audio"], qos = 1, stream = { topic_segment = 1 }, max_inflight = 100, max_message_bytes = 16777216 }
# Stream names come from the senders (here a topic segment): state is held for
# at most max_streams of them (the least recently seen beyond that is evicted
# and starts over if it comes back), and a stream not seen for stream_idle is
# forgotten. Counted in outpost_streams_evicted_total{pipeline,reason};
# /v1/status shows `streams` per pipeline.
max_streams = 4096
stream_idle = "10m"
# Local outputs: each record also goes straight from the inference thread to
# these (best effort: a slow or absent peer drops it, counted in /metrics as
# outpost_output_dropped_total{pipeline,output,reason}); the outbox and the
# uplink are not involved. payload = "json" (default) or "cbor".
outputs = [
  { type = "mqtt", topic = "site/{pipeline}/{stream}" },  # the site broker (or the embedded one), QoS 0
  { type = "udp", to = "127.0.0.1:9500" },                # one datagram per record
  # u32 LE length + record, to every connected reader; at most max_readers
  # (one more is closed, counted in outpost_output_readers_refused_total)
  { type = "unix", path = "/run/outpost/vad.sock", max_readers = 64 },
]

# Sensor vectors as datagrams: `[len][stream name][16 little-endian f32]`.
# recv_buffer_bytes: the socket's receive buffer (SO_RCVBUF; unset: the system's
# default; above net.core.rmem_max only with CAP_NET_ADMIN); datagrams the kernel
# drops on a full buffer count as `kernel_overflow`.
[[pipelines]]
name = "vibration"
model = "sensor_mlp"
source = { type = "udp", listen = "127.0.0.1:9400", framing = "named", recv_buffer_bytes = 4194304 }
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
# At most 64 writers; frames being read hold 128 MiB at most (half of it a
# share per writer, read at once; larger frames wait for room in the other
# half); a writer silent for 5 s inside a frame is closed (frame_read_timeout).
source = { type = "unix", path = "/run/outpost/camera.sock", max_connections = 64, max_buffered_bytes = 134217728, frame_read_timeout = "5s" }
[pipelines.preprocess]
type = "image"
format = "raw_rgb"
input_width = 640
input_height = 480
width = 224
height = 224
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]

CAMERAS
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
# Text read from them: text boxes (ppocr_det), each box's crop turned upright
# (ppocr_cls) and read (ppocr_rec). GET /v1/pipelines/documents/snapshot.jpg
# shows the latest page with its boxes.
[[pipelines]]
name = "documents"
model = "ppocr_det"
priority = "batch"
source = { type = "watch", dir = "/srv/outpost/inbox", poll_interval = "500ms", extensions = ["jpg", "jpeg", "png"] }
[[pipelines.stages]]
model = "ppocr_cls"          # 0/180 degrees: rotates the crop for the next stage
[[pipelines.stages]]
model = "ppocr_rec"          # CTC text with its dictionary
# padding = 0.0              # each side of a box grows by this fraction of its height
# max_boxes = 256            # boxes per frame at most (highest scores); the rest counted
# max_batch = 8              # crops per inference run
# rotate = true              # turn crops by the box's `angle`

# Faces in camera stills: MTCNN (P-Net over an image pyramid, R-Net and
# O-Net on the crops): boxes, scores and five landmarks per face.
[[pipelines]]
name = "faces"
model = "mtcnn_pnet"
source = { type = "watch", dir = "/srv/outpost/faces", poll_interval = "500ms", extensions = ["jpg", "jpeg", "png"] }
# A small JPEG of each face in its record (base64), at most max_bytes: the
# one exception to results-only records; off unless set.
thumbnails = { max_bytes = 20000 }
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"

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

FLOOR
UPLINK_MQTT
UPLINK_HTTP
# outpost's OPC UA server (a build with the `opcua` feature; docs/floor.md):
# each pipeline's latest result as variables under urn:outpost:<device>,
# NodeIds "<pipeline>/<field>" and "<pipeline>/record", with subscriptions.
# [opcua]
# listen = "opc.tcp://0.0.0.0:4840"
# security = ["basic256sha256_sign_encrypt"]   # "none" only when written explicitly
# anonymous = false             # true lets clients in without a user or certificate
# trusted_clients = "/etc/outpost/opcua-trusted"   # client certificates to trust
# min_publishing_interval = "10ms"
# [[opcua.users]]
# user = "scada"
# password_env = "OPCUA_SCADA_PASSWORD"   # or password_file = "...", or certificate = "scada.der"
# [[opcua.variables]]
# pipeline = "line3"
# field = "/top/0/index"        # a JSON pointer into the record's outputs
# kind = "int32"                # double (default), float, int16..uint64, boolean, string

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
# max_bundle_bytes = 2147483648 # larger entries are skipped before any download
# max_command_skew = "10m"      # commands and signed documents dated further ahead are refused
# require_signed_manifest = true   # refuse manifest documents not signed as a whole (staged rollouts)
"#;

const FLOOR: &str = r#"# The floor (docs/floor.md): results written into a PLC over Modbus TCP, the
# PLC's registers read as a sensor source, and outpost's own Modbus server.
# `outpost modbus map --config FILE` prints the register map.
[[pipelines]]
name = "line3"
model = "sensor_mlp"
source = { type = "http" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
# outpost is the client, the PLC the server. Registers are 0-based, as on the
# wire (holding register 40101 in the PLC's manual is address 100). A slow or
# absent PLC never blocks the pipeline: each register keeps only its newest
# value until it is written; the connection comes back with backoff.
[[pipelines.outputs]]
type = "modbus"
target = "10.0.0.5:502"
unit = 1
word_order = "big"                  # f32/u32/i32: high word first; "little" swaps the words
write = "record"                    # or "change": only values that changed
timeout = "1s"                      # an unanswered request closes the connection
registers = [ { field = "/top/0/index", address = 100, kind = "u16" },
              { field = "/top/0/score", address = 101, kind = "f32" },           # 101-102
              { field = "/top/0/score", address = 103, kind = "u16", scale = 1000 } ] # per mille

# Sixteen holding registers polled five times a second, one frame each.
[[pipelines]]
name = "polled"
model = "sensor_mlp"
source = { type = "modbus", target = "10.0.0.5:502", unit = 1, address = 200, count = 16, kind = "u16", table = "holding", interval = "200ms" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16

# Read-only: the latest value of each mapped field, for PLCs and SCADA that poll
# (FC 3 and 4 read the registers, FC 1 and 2 the coils).
[modbus_server]
listen = "127.0.0.1:1502"           # 502 needs CAP_NET_BIND_SERVICE
allow = ["10.0.0.5", "127.0.0.1"]   # client addresses or networks; everyone else closed and counted
max_connections = 16
idle_timeout = "60s"
[[modbus_server.registers]]
pipeline = "line3"
field = "/top/0/index"
address = 0
kind = "u16"
[[modbus_server.registers]]
pipeline = "line3"
field = "/top/0/score"
address = 1
kind = "f32"
"#;

/// Cameras: active in a build with the `camera` feature, commented out in
/// one without (where `outpost check` refuses a camera source).
const CAMERAS: &str = r#"# A camera: RTSP H.264/H.265 decoded (nvv4l2decoder on a Jetson) once for
# every pipeline that names it (one RTSP session), RGB frames straight to the
# models; rebuilt after an error, end of stream, or no frame for
# `stall_timeout`. Credentials never reach the logs.
[[cameras]]
name = "gate"
url = "rtsp://192.0.2.7:554/stream1"
transport = "tcp"                  # or "udp"
stall_timeout = "5s"
decode = "auto"                    # keyframes only while every reader's fps <= the keyframe rate; or "all", "keyframes"
# width = 1280                     # scaled to (RTSP), asked of V4L2 and CSI cameras
# height = 720
# A camera that wants credentials: the password from the environment
# (EnvironmentFile); while CAMERA_PASSWORD is unset, check and run refuse the config.
# url = "rtsp://viewer:${CAMERA_PASSWORD}@192.0.2.7:554/stream1"
# A USB camera, a Jetson CSI sensor (nvarguscamerasrc), or any GStreamer
# pipeline whose frames reach `appsink name=outpost`:
# url = "v4l2:///dev/video0"
# url = "csi://0"
# pipeline = "videotestsrc ! video/x-raw,width=640,height=480 ! appsink name=outpost"

# Each pipeline on a camera takes its own `fps` (subsampled at the source) and
# keeps at most `queue` frames (the oldest is dropped as `stale`).
[[pipelines]]
name = "gate-camera"
model = "classifier"
priority = "realtime"
source = { type = "camera", camera = "gate", fps = 10, queue = 1 }
# Or a camera of its own, inline (the keys of a [[cameras]] entry but `name`):
# source = { type = "camera", url = "rtsp://192.0.2.8:554/stream1", width = 1280, height = 720, fps = 15, transport = "tcp", stall_timeout = "5s", decode = "all", queue = 1 }

# Faces at a gate, tracked (docs/tracking.md): the outbox gets what happened
# (track_start, zone_enter, zone_leave, loiter, line_cross, speeding,
# zone_occupancy, track_end), not a
# record per frame; local outputs still get every frame with its track ids.
[[pipelines]]
name = "gate-faces"
model = "mtcnn_pnet"
source = { type = "camera", url = "rtsp://192.0.2.8:554/stream1", fps = 10 }
emit = "events"              # the default with [pipelines.track]; "frames": a record per frame
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"
[pipelines.track]
min_hits = 3                 # frames before a track is announced
max_age = "1s"               # unseen this long: track_end
occluded_max_age = "3s"      # lost under another object's box: coasts this long
iou = 0.3                    # overlap a detection needs with the predicted box
high_score = 0.5             # weaker detections only continue tracks (second pass)
stationary_after = "10s"     # still this long: stationary (a parked vehicle)
stationary_max_age = "10m"   # how long a stationary object survives missed detections
max_tracks = 256             # open tracks per stream, at most
snapshot_bytes = "16 MiB"    # best crop per track on disk, all within this; GET /v1/pipelines/gate-faces/tracks/{id}/snapshot.jpg
snapshot_max_bytes = 20000   # one crop's JPEG at most
# Motion-gated detection (docs/performance.md): on by default for a camera
# pipeline with a detector; no motion and no moving tracks, no model run.
[pipelines.motion]
enabled = true               # false: the model runs on every frame
frame_height = 100           # rows of the grey frame motion is looked for in
threshold = 30               # grey difference (0..255) from the background that moves
min_area = 10                # smaller blobs (grey-frame pixels) are noise
alpha = 0.02                 # how fast the background learns a changing pixel (steady ones: 0.25)
merge_distance = 5           # blobs closer than this (grey-frame pixels) are one mover
mask = [[560, 0], [640, 0], [640, 60], [560, 60]]   # motion never counts here (a clock); or a list of polygons
regions = false              # true: crops of the moving regions at full resolution (detectors)
max_regions = 4              # more crops run the whole frame
[[pipelines.zones]]
name = "yard"
polygon = [[0, 240], [640, 240], [640, 480], [0, 480]]   # source-frame pixels
inertia = 3                  # frames in (or out) before zone_enter (zone_leave)
loiter = "30s"               # one loiter event per visit this long
classes = []                 # labels counted (empty: all)
occupancy = true             # zone_occupancy when a label's count changed (and held inertia frames)
direction = "both"           # "in": only zone_enter; "out": only zone_leave
# after = "street"           # only tracks that were in zone "street" first
distances = [6, 12, 6, 12]   # real lengths of the 4 sides (corner 0-1, 1-2, 2-3, 3-0): speeds
speed_unit = "km/h"          # "km/h", "mph" (distances in feet) or "m/s"
speed_limit = 20             # one speeding event per track faster than this
[[pipelines.lines]]
name = "gate"
points = [[320, 0], [320, 480]]   # crossing from the left side to the right is "in"
inertia = 2                  # frames on the new side before a crossing counts
classes = []
direction = "both"           # "in" or "out": only crossings that way count
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
payload = "json"                    # or "cbor", or "sparkplug_b" (needs batch = 1)
# sparkplug_group = "outpost"       # Sparkplug B group id: spBv1.0/{group}/NBIRTH/{device}...
# sparkplug_max_metrics_per_device = 4096  # beyond, least recently seen streams leave the birth
# sparkplug_rebirth_interval = "2s" # a device is born again (new streams) at most this often
max_bytes_per_s = 0                 # cap for metered links (Sparkplug births count); 0 = none
max_packet_bytes = "1 MiB"          # largest message (and Sparkplug DBIRTH); larger records are dead-lettered
backoff_min = "200ms"
backoff_max = "30s""#;

const HTTP: &str = r#"# Results to an HTTP ingestion endpoint: gzip NDJSON batches, deleted on 2xx.
[uplink]
type = "http"
url = "https://ingest.example.net/v1/results"
batch_records = 500
timeout = "10s"
# The token from the environment (EnvironmentFile); while FLEET_TOKEN is
# unset, check and run refuse the config.
# headers = { Authorization = "Bearer ${FLEET_TOKEN}" }"#;

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
    let cameras = if cfg!(feature = "camera") {
        CAMERAS.to_string()
    } else {
        format!(
            "# Cameras need outpost built with the `camera` feature (GStreamer):\n{}\n",
            commented(CAMERAS)
        )
    };
    let floor = if cfg!(feature = "modbus") {
        FLOOR.to_string()
    } else {
        format!(
            "# Modbus needs outpost built with the `modbus` feature:\n{}\n",
            commented(FLOOR)
        )
    };
    EXAMPLE
        .replace("CAMERAS\n", &cameras)
        .replace("FLOOR\n", &floor)
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
            // As printed, with no environment.
            let cfg = Config::from_toml(&text, "example", |_| None)
                .unwrap_or_else(|e| panic!("{u}: {e}"));
            let kinds: std::collections::BTreeSet<&str> =
                cfg.pipelines.iter().map(|p| p.source.kind()).collect();
            let all =
                6 + usize::from(cfg!(feature = "camera")) + usize::from(cfg!(feature = "modbus"));
            assert_eq!(kinds.len(), all, "every source kind: {kinds:?}");
            assert!(cfg.uplink.is_some());
            let outputs: std::collections::BTreeSet<&str> = cfg
                .pipelines
                .iter()
                .flat_map(|p| &p.outputs)
                .map(|o| o.kind())
                .collect();
            let all = 3 + usize::from(cfg!(feature = "modbus"));
            assert_eq!(outputs.len(), all, "every output kind: {outputs:?}");
            assert_eq!(cfg.modbus_server.is_some(), cfg!(feature = "modbus"));
        }
    }
}
