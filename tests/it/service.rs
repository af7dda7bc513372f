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
    let d = Daemon::start(&sensors_over_http(""));
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
    // The records' commits reached the disk: the flash's writes are counted.
    assert!(
        value(
            "outpost_process_written_bytes",
            "outpost_process_written_bytes_total",
            &[]
        ) > 0.0
    );
    // No GPU here: GPU families are absent, not zero.
    assert!(m.get("outpost_gpu_utilization_ratio").is_none());
}

#[test]
fn sigterm_under_load_finishes_what_was_taken_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let token = "sigterm-under-load-token-0123456789";
    std::fs::write(dir.path().join("token"), format!("{token}\n")).unwrap();
    let mut d = Daemon::start_in(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
token_file = "{DIR}/token"
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
        dir,
    );
    // The load is made, not hoped for: paused, the pipeline takes frames in
    // and queues them all; the stop then comes with 60 frames queued.
    assert_eq!(
        post_auth(&d.api, "/v1/pipelines/camera/pause", Some(token)),
        200
    );
    let sock = d.dir.path().join("cam.sock");
    let frame = vec![128u8; 64 * 64 * 3];
    let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    for _ in 0..60 {
        std::io::Write::write_all(&mut s, &outpost::source::framing::length_prefixed(&frame))
            .unwrap();
    }
    drop(s);
    // Wait until every frame is taken in, then stop with all of them queued.
    let t0 = std::time::Instant::now();
    while d.status()["pipelines"][0]["frames_in"] != 60 {
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", d.status());
        std::thread::sleep(Duration::from_millis(10));
    }
    let st = d.status();
    assert_eq!(st["pipelines"][0]["queue_depth"], 60, "paused: {st}");
    let st = d.terminate();
    assert_eq!(st.code(), Some(0), "{}", d.log());
    // Every frame taken in became a record, printed and stored.
    assert_eq!(d.seen.len(), 60, "records printed before exit");
    let data = d.dir.path().join("data");
    let out = run(outpost()
        .args(["outbox", "stats", "--json", "--data-dir"])
        .arg(&data));
    let v = json(&out);
    assert_eq!(v["records"], 60, "{v}");
}

fn post_auth(api: &str, path: &str, token: Option<&str>) -> u16 {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(api).unwrap();
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(s, "POST {path} HTTP/1.1\r\nHost: {api}\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut buf = String::new();
    s.read_to_string(&mut buf).unwrap();
    buf.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
}

#[test]
fn state_changes_need_the_bearer_token() {
    // No token file: every state change is refused.
    let d = Daemon::start(&sensors_over_http(""));
    assert_eq!(post_auth(&d.api, "/v1/reload", None), 403);
    assert_eq!(
        post_auth(
            &d.api,
            "/v1/pipelines/sensors/pause",
            Some("anything-at-all-123")
        ),
        403
    );
    drop(d);

    let dir = tempfile::tempdir().unwrap();
    let token = "s3cret-token-for-the-test-0123456789";
    std::fs::write(dir.path().join("token"), format!("{token}\n")).unwrap();
    let d = Daemon::start_in(&sensors_over_http("token_file = \"{DIR}/token\""), dir);
    assert_eq!(post_auth(&d.api, "/v1/pipelines/sensors/pause", None), 401);
    assert_eq!(
        post_auth(
            &d.api,
            "/v1/pipelines/sensors/pause",
            Some("s3cret-token-for-the-test-012345678X")
        ),
        401
    );
    assert_eq!(
        d.status()["pipelines"][0]["paused"],
        false,
        "refused requests change nothing"
    );
    assert_eq!(
        post_auth(&d.api, "/v1/pipelines/sensors/pause", Some(token)),
        200
    );
    assert_eq!(d.status()["pipelines"][0]["paused"], true);
    assert_eq!(
        post_auth(&d.api, "/v1/pipelines/sensors/resume", Some(token)),
        200
    );
    assert_eq!(
        post_auth(&d.api, "/v1/pipelines/nope/pause", Some(token)),
        404
    );
    assert_eq!(post_auth(&d.api, "/v1/reload", Some(token)), 200);
    // Reading stays open.
    assert_eq!(http("GET", &d.api, "/v1/status", b"").unwrap().0, 200);
}

#[test]
fn sighup_reloads_pipelines_without_losing_the_outbox() {
    let mut d = Daemon::start(&sensors_over_http(""));
    let good = format!("[{}]", vec!["0.5"; 16].join(","));
    for _ in 0..3 {
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
    // Add a second pipeline and rename nothing: the config file changes, then SIGHUP.
    let cfg = d.dir.path().join("outpost.toml");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str(
        r#"
[[pipelines]]
name = "sensors2"
model = "sensor_mlp"
priority = "batch"
source = { type = "http" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#,
    );
    std::fs::write(&cfg, &text).unwrap();
    let _ = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(d.child.id().to_string())
        .status();
    let t0 = std::time::Instant::now();
    while d.status()["pipelines"].as_array().unwrap().len() != 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "not reloaded:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        http(
            "POST",
            &d.api,
            "/v1/pipelines/sensors2/infer",
            good.as_bytes()
        )
        .unwrap()
        .0,
        200
    );
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
    let st = d.status();
    assert_eq!(
        st["outbox"]["records"], 5,
        "records from before the reload are kept: {st}"
    );
    // A broken config is refused and the running one keeps serving.
    std::fs::write(&cfg, text.replace("[[pipelines]]", "[[pipelinez]]")).unwrap();
    let _ = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(d.child.id().to_string())
        .status();
    // The daemon says when it has read (and refused) the file.
    let t0 = std::time::Instant::now();
    while !d.log().contains("reload failed") {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no refusal logged:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        http(
            "POST",
            &d.api,
            "/v1/pipelines/sensors2/infer",
            good.as_bytes()
        )
        .unwrap()
        .0,
        200
    );
    // Record ids never repeat across the reload.
    let recs = d
        .records_until(Duration::from_secs(5), |r| r.len() >= 6)
        .to_vec();
    let mut ids: Vec<&str> = recs.iter().map(|r| r["id"].as_str().unwrap()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 6);
    assert_eq!(d.terminate().code(), Some(0));
}

#[test]
fn ready_is_sent_to_systemd_only_after_warm_up_and_the_watchdog_is_fed() {
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let envs = [
        ("NOTIFY_SOCKET", sock_path.display().to_string()),
        ("WATCHDOG_USEC", "900000".to_string()),
    ];
    let mut d = Daemon::start_full(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
[[pipelines]]
name = "camera"
model = "classifier"
source = { type = "http" }
"#,
        dir,
        &envs,
        false,
    );
    let mut buf = [0u8; 4096];
    let mut messages = Vec::new();
    loop {
        let n = sock.recv(&mut buf).expect("a READY=1 from the daemon");
        let m = String::from_utf8_lossy(&buf[..n]).into_owned();
        let ready = m.lines().any(|l| l == "READY=1");
        messages.push(m);
        if ready {
            break;
        }
    }
    // When READY arrives the model is loaded and warmed and the API answers
    // (the daemon logs the address it bound before it says READY).
    assert!(d.log().contains("model loaded"), "{}", d.log());
    assert!(
        d.learn_api(),
        "no API address logged before READY:\n{}",
        d.log()
    );
    assert_eq!(http("GET", &d.api, "/readyz", b"").unwrap().0, 200);
    assert!(
        messages
            .iter()
            .any(|m| m.contains("STATUS=loading and warming models")),
        "{messages:?}"
    );
    // Watchdog pings at a third of WATCHDOG_USEC.
    let t0 = std::time::Instant::now();
    let mut pings = 0;
    while t0.elapsed() < Duration::from_secs(2) && pings < 2 {
        let n = sock.recv(&mut buf).unwrap();
        if String::from_utf8_lossy(&buf[..n])
            .lines()
            .any(|l| l == "WATCHDOG=1")
        {
            pings += 1;
        }
    }
    assert!(pings >= 2, "watchdog pings: {pings}");
}

/// systemd-analyze on the shipped unit, pointed at the built binary.
fn unit_for_test(dir: &std::path::Path) -> std::path::PathBuf {
    let unit = std::fs::read_to_string(root().join("systemd/outpost.service")).unwrap();
    let unit = unit.replace("/usr/bin/outpost", env!("CARGO_BIN_EXE_outpost"));
    let p = dir.join("outpost.service");
    std::fs::write(&p, unit).unwrap();
    p
}

#[test]
fn systemd_unit_verifies_and_rates_ok_or_better() {
    if std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        // The check runs where systemd-analyze exists (CI installs systemd); say so loudly elsewhere.
        eprintln!("systemd-analyze not installed: unit not verified on this machine");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let unit = unit_for_test(tmp.path());
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&unit)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify: {err}");
    assert!(
        !err.contains("outpost.service:"),
        "warnings about the unit: {err}"
    );
    let out = std::process::Command::new("systemd-analyze")
        .args(["security", "--offline=yes"])
        .arg(&unit)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| panic!("{text}"));
    let rating = line
        .split_whitespace()
        .rev()
        .find(|w| w.chars().all(|c| c.is_ascii_uppercase()))
        .unwrap_or("");
    assert!(matches!(rating, "OK" | "SAFE"), "rated {rating}: {line}");
}

#[test]
fn config_example_covers_every_kind_and_passes_check() {
    let tmp = tempfile::tempdir().unwrap();
    for uplink in ["mqtt", "http"] {
        let out = run(outpost().args(["config", "example", "--uplink", uplink]));
        assert!(out.status.success());
        let text = stdout(&out);
        for kind in ["mqtt", "udp", "unix", "http", "watch", "replay", "camera"] {
            assert!(
                text.contains(&format!("type = \"{kind}\"")),
                "source {kind} missing"
            );
        }
        let p = tmp.path().join(format!("{uplink}.toml"));
        std::fs::write(&p, &text).unwrap();
        // --no-files: the example's replay recording is not on this machine.
        // As printed: no FLEET_TOKEN or CAMERA_PASSWORD needed.
        let o = run(outpost()
            .env_remove("FLEET_TOKEN")
            .env_remove("CAMERA_PASSWORD")
            .args(["check", "--no-files"])
            .arg(&p));
        assert!(o.status.success(), "{uplink}: {}", stderr(&o));
    }
}
