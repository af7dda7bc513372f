//! The daemon as a service: readiness, metrics scraped and parsed by a real
//! OpenMetrics parser, stop on SIGTERM without losing what was taken in.

use std::time::Duration;

use crate::common::*;

/// Parses OpenMetrics text with the Python prometheus_client parser (strict:
/// it rejects malformed exposition) and returns {family: [samples]}.
fn parse_openmetrics(text: &str) -> serde_json::Value {
    use std::io::Write;
    let script = r#"
import json, sys
from prometheus_client.openmetrics.parser import text_string_to_metric_families
out = {}
for fam in text_string_to_metric_families(sys.stdin.read()):
    out[fam.name] = {"type": fam.type, "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in fam.samples]}
print(json.dumps(out))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 with prometheus_client (models/requirements.txt)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "OpenMetrics parse failed: {}\n{text}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn metrics_scraped_from_a_running_daemon_parse_and_count() {
    let d = Daemon::start(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = { type = "http" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#,
    );
    let good = format!("[{}]", vec!["0.25"; 16].join(","));
    for _ in 0..5 {
        assert_eq!(
            http(
                "POST",
                &d.api,
                "/v1/pipelines/sensors/infer",
                good.as_bytes()
            )
            .unwrap()
            .0,
            200
        );
    }
    assert_eq!(
        http("POST", &d.api, "/v1/pipelines/sensors/infer", b"[1]")
            .unwrap()
            .0,
        422
    );
    let (code, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    assert_eq!(code, 200);
    let text = String::from_utf8(body).unwrap();
    let m = parse_openmetrics(&text);
    let value = |fam: &str, sample: &str, want: &[(&str, &str)]| -> f64 {
        let f = m
            .get(fam)
            .unwrap_or_else(|| panic!("no family {fam}:\n{text}"));
        f["samples"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == sample && want.iter().all(|(k, v)| s["labels"][*k] == *v))
            .unwrap_or_else(|| panic!("no sample {sample} {want:?} in {f}"))["value"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(
        value(
            "outpost_frames_in",
            "outpost_frames_in_total",
            &[("pipeline", "sensors")]
        ),
        6.0
    );
    assert_eq!(
        value(
            "outpost_records",
            "outpost_records_total",
            &[("pipeline", "sensors")]
        ),
        5.0
    );
    assert_eq!(
        value(
            "outpost_frames_dropped",
            "outpost_frames_dropped_total",
            &[("pipeline", "sensors"), ("reason", "bad_shape")]
        ),
        1.0
    );
    assert_eq!(m["outpost_inference_latency_seconds"]["type"], "histogram");
    assert_eq!(
        value(
            "outpost_inference_latency_seconds",
            "outpost_inference_latency_seconds_count",
            &[("pipeline", "sensors"), ("provider", "cpu")]
        ),
        5.0
    );
    assert_eq!(
        value(
            "outpost_model_info",
            "outpost_model_info",
            &[
                ("model", "sensor_mlp"),
                ("version", "1.0.0"),
                ("provider", "cpu")
            ]
        ),
        1.0
    );
    assert_eq!(
        value("outpost_outbox_records", "outpost_outbox_records", &[]),
        5.0
    );
    assert!(
        value(
            "outpost_process_resident_memory_bytes",
            "outpost_process_resident_memory_bytes",
            &[]
        ) > 1e6
    );
    // No GPU here: GPU families are absent, not zero.
    assert!(m.get("outpost_gpu_utilization_ratio").is_none());
}

#[test]
fn sigterm_under_load_finishes_what_was_taken_and_loses_nothing() {
    let mut d = Daemon::start(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
[scheduler]
workers = 1
[[pipelines]]
name = "camera"
model = "classifier"
queue = 10000
when_full = "block"
source = { type = "unix", path = "{DIR}/cam.sock" }
[pipelines.preprocess]
type = "image"
format = "raw_rgb"
input_width = 64
input_height = 64
width = 224
height = 224
"#,
    );
    // 60 raw frames, queued faster than the classifier takes them.
    let sock = d.dir.path().join("cam.sock");
    let frame = vec![128u8; 64 * 64 * 3];
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    for _ in 0..60 {
        std::io::Write::write_all(&mut s, &outpost::source::framing::length_prefixed(&frame))
            .unwrap();
    }
    drop(s);
    // Wait until every frame is taken in, then stop while most are still queued.
    let t0 = std::time::Instant::now();
    while d.status()["pipelines"][0]["frames_in"] != 60 {
        assert!(t0.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(10));
    }
    let queued = d.status()["pipelines"][0]["queue_depth"].as_u64().unwrap();
    let st = d.terminate();
    assert_eq!(st.code(), Some(0), "{}", d.log());
    assert!(queued > 0, "the stop must happen under load");
    // Every frame taken in became a record, printed and stored.
    assert_eq!(d.seen.len(), 60, "records printed before exit");
    let data = d.dir.path().join("data");
    let out = run(outpost()
        .args(["outbox", "stats", "--json", "--data-dir"])
        .arg(&data));
    let v = json(&out);
    assert_eq!(v["records"], 60, "{v}");
}
