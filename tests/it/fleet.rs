//! The fleet side: staged rollouts decided on real daemons from signed
//! manifest documents (made with the real CLI), served over HTTP on loopback.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::common::*;

/// Static files over HTTP/1.1 on loopback; what it serves can change.
struct Files {
    addr: String,
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl Files {
    fn start() -> Files {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let files: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let f = files.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let f = f.clone();
                std::thread::spawn(move || serve(s, &f));
            }
        });
        Files { addr, files }
    }

    fn put(&self, path: &str, body: Vec<u8>) {
        self.files.lock().unwrap().insert(path.to_string(), body);
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

fn serve(mut s: std::net::TcpStream, files: &Mutex<HashMap<String, Vec<u8>>>) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
            break;
        }
    }
    let body = files.lock().unwrap().get(&path).cloned();
    let _ = match body {
        Some(b) => s
            .write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    b.len()
                )
                .as_bytes(),
            )
            .and_then(|_| s.write_all(&b)),
        None => {
            s.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        }
    };
}

/// Runs the real CLI; panics with its stderr on failure.
fn cli(args: &[&str]) -> String {
    let o = run(outpost().args(args));
    assert!(o.status.success(), "outpost {args:?}: {}", stderr(&o));
    stdout(&o)
}

/// The rollout bucket as docs/ota.md defines it, computed here on its own:
/// SHA-256(salt, 0x00, device), first 8 bytes big-endian, mod 100.
fn bucket(salt: &str, device: &str) -> u8 {
    let d = Sha256::digest(format!("{salt}\0{device}").as_bytes());
    (u64::from_be_bytes(d[..8].try_into().unwrap()) % 100) as u8
}

/// sensor_mlp at `version`, bundled, signed; returns its bundle path.
fn model_bundle(dir: &Path, key: &Path, version: &str) -> PathBuf {
    let m = copy_model("sensor_mlp", &dir.join(format!("v{version}")));
    let mf = m.join("manifest.toml");
    let t = std::fs::read_to_string(&mf)
        .unwrap()
        .replace("version = \"1.0.0\"", &format!("version = \"{version}\""));
    std::fs::write(&mf, t).unwrap();
    let out = dir.join(format!("sensor_mlp-{version}.tar"));
    let o = out.to_str().unwrap();
    let check = model_dir().join("sensor_mlp/ref");
    cli(&[
        "bundle",
        "build",
        "--out",
        o,
        "--model-dir",
        m.to_str().unwrap(),
        "--check",
        check.to_str().unwrap(),
    ]);
    cli(&["bundle", "sign", "--key", key.to_str().unwrap(), o]);
    out
}

/// A signed manifest document with one entry (CLI: `bundle entry`, then
/// `bundle document`).
fn signed_document(dir: &Path, key: &Path, bundle: &Path, entry_args: &[&str]) -> Vec<u8> {
    let name = bundle.file_name().unwrap().to_str().unwrap();
    let mut args = vec!["bundle", "entry", "--url", name];
    args.extend_from_slice(entry_args);
    args.push(bundle.to_str().unwrap());
    let entry: serde_json::Value = serde_json::from_str(&cli(&args)).unwrap();
    let plain = dir.join("plain.json");
    std::fs::write(
        &plain,
        serde_json::json!({ "bundles": [entry] }).to_string(),
    )
    .unwrap();
    let out = dir.join("signed.json");
    cli(&[
        "bundle",
        "document",
        "--key",
        key.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        plain.to_str().unwrap(),
    ]);
    std::fs::read(out).unwrap()
}

fn device_config(name: &str, groups: &[&str], manifest: &str, pubkey: &str) -> String {
    let groups: Vec<String> = groups.iter().map(|g| format!("\"{g}\"")).collect();
    format!(
        r#"
device = {{ name = "{name}", groups = [{}] }}
data_dir = "{{DATA}}"
model_dir = "{{DIR}}/models"
[api]
listen = "{{API}}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
[ota]
manifest_url = "{manifest}"
trusted_keys = ["{pubkey}"]
poll_interval = "200ms"
poll_jitter = "50ms"
probation = "1s"
min_runs = 0
"#,
        groups.join(", ")
    )
}

/// A device daemon on its own copy of the models.
fn start_device(cfg: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    copy_model("sensor_mlp", &dir.path().join("models"));
    let env = [(
        "OUTPOST_MODEL_DIR",
        dir.path().join("models").display().to_string(),
    )];
    Daemon::start_full(cfg, dir, &env, true)
}

/// How often `needle` is in the daemon's log.
fn count(d: &Daemon, needle: &str) -> usize {
    d.log().matches(needle).count()
}

/// Waits until the log holds `needle` more than `before` times.
fn wait_log_count(d: &Daemon, needle: &str, before: usize, timeout: Duration) {
    let t0 = Instant::now();
    while count(d, needle) <= before {
        assert!(
            t0.elapsed() < timeout,
            "no new `{needle}` in {timeout:?}:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn serving(d: &Daemon) -> String {
    d.status()["pipelines"][0]["model"]
        .as_str()
        .unwrap()
        .to_string()
}

fn metric(d: &Daemon, name: &str, label: &str) -> f64 {
    let (code, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    assert_eq!(code, 200);
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(name) && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn staged_rollout_widens_by_signed_waves_and_no_unsigned_edit_moves_a_device() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let key = w.join("fleet");
    cli(&["keygen", "--out", key.to_str().unwrap()]);
    let pubkey = std::fs::read_to_string(w.join("fleet.pub"))
        .unwrap()
        .trim()
        .to_string();
    let salt = "2026-12-sensor_mlp-1.1.0";
    // Three devices picked by their buckets: two in the pilot group, one
    // under 50 and one over, and one outside the group under 50.
    let pick = |pred: &dyn Fn(u8) -> bool, tag: &str| {
        (0..1000)
            .map(|i| format!("{tag}-{i}"))
            .find(|n| pred(bucket(salt, n)))
            .unwrap()
    };
    let early = pick(&|b| b < 50, "pilot-early");
    let late = pick(&|b| b >= 50, "pilot-late");
    let other = pick(&|b| b < 50, "plant");
    let files = Files::start();
    let bundle = model_bundle(w, &key, "1.1.0");
    files.put("/sensor_mlp-1.1.0.tar", std::fs::read(&bundle).unwrap());
    files.put("/manifest.json", br#"{"bundles": []}"#.to_vec());
    let manifest = files.url("/manifest.json");
    let devices = [
        (early.clone(), vec!["site-a", "pilot"]),
        (late.clone(), vec!["pilot"]),
        (other.clone(), vec!["site-a"]),
    ];
    let daemons: Vec<Daemon> = devices
        .iter()
        .map(|(n, g)| start_device(&device_config(n, g, &manifest, &pubkey)))
        .collect();
    for d in &daemons {
        assert_eq!(serving(d), "sensor_mlp@1.0.0");
    }

    // Wave 1: 50 % of the pilot group.
    let wave1 = signed_document(
        w,
        &key,
        &bundle,
        &["--percent", "50", "--salt", salt, "--group", "pilot"],
    );
    files.put("/manifest.json", wave1.clone());
    wait_log_count(
        &daemons[0],
        "step=\"installed\"",
        0,
        Duration::from_secs(60),
    );
    wait_log_count(
        &daemons[1],
        "step=\"not_selected\"",
        0,
        Duration::from_secs(30),
    );
    wait_log_count(
        &daemons[2],
        "step=\"not_selected\"",
        0,
        Duration::from_secs(30),
    );
    assert_eq!(serving(&daemons[0]), "sensor_mlp@1.1.0");
    assert!(daemons[1].log().contains("outside the wave"));
    assert!(daemons[2].log().contains("not in a group the entry lists"));
    for d in &daemons[1..] {
        assert_eq!(serving(d), "sensor_mlp@1.0.0");
        assert_eq!(count(d, "step=\"downloading\""), 0, "{}", d.log());
    }
    // Told upstream once, not at every poll.
    let polls = metric(&daemons[1], "outpost_ota_documents_total", "signed");
    let t0 = Instant::now();
    while metric(&daemons[1], "outpost_ota_documents_total", "signed") < polls + 3.0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(count(&daemons[1], "step=\"not_selected\""), 1);

    // An edit of the signed text (percent 50 -> 100) breaks its signature.
    let mut env: serde_json::Value = serde_json::from_slice(&wave1).unwrap();
    let text = env["document"]
        .as_str()
        .unwrap()
        .replace("\"percent\":50", "\"percent\":100");
    assert!(text.contains("\"percent\":100"));
    env["document"] = serde_json::Value::String(text);
    let before = count(&daemons[1], "manifest document signature");
    files.put("/manifest.json", serde_json::to_vec(&env).unwrap());
    wait_log_count(
        &daemons[1],
        "manifest document signature",
        before,
        Duration::from_secs(30),
    );
    // Stripped to a plain document without any targeting: refused, since
    // these devices accepted a signed one.
    let entry = serde_json::from_str::<serde_json::Value>(&cli(&[
        "bundle",
        "entry",
        "--url",
        "sensor_mlp-1.1.0.tar",
        bundle.to_str().unwrap(),
    ]))
    .unwrap();
    let before = count(&daemons[1], "is not signed");
    files.put(
        "/manifest.json",
        serde_json::to_vec(&serde_json::json!({ "bundles": [entry] })).unwrap(),
    );
    wait_log_count(
        &daemons[1],
        "is not signed",
        before,
        Duration::from_secs(30),
    );
    wait_log_count(&daemons[2], "is not signed", 0, Duration::from_secs(30));
    for d in &daemons[1..] {
        assert_eq!(serving(d), "sensor_mlp@1.0.0");
        assert_eq!(count(d, "step=\"downloading\""), 0, "{}", d.log());
        assert!(metric(d, "outpost_ota_documents_total", "unsigned") >= 1.0);
    }

    // Wave 2: the whole pilot group. The late device joins; the device
    // outside the group stays where it is.
    let wave2 = signed_document(
        w,
        &key,
        &bundle,
        &["--percent", "100", "--salt", salt, "--group", "pilot"],
    );
    files.put("/manifest.json", wave2);
    wait_log_count(
        &daemons[1],
        "step=\"installed\"",
        0,
        Duration::from_secs(60),
    );
    assert_eq!(serving(&daemons[1]), "sensor_mlp@1.1.0");
    assert_eq!(
        count(&daemons[0], "step=\"downloading\""),
        1,
        "installed once"
    );
    wait_log_count(
        &daemons[2],
        "step=\"not_selected\"",
        1,
        Duration::from_secs(30),
    );
    assert_eq!(serving(&daemons[2]), "sensor_mlp@1.0.0");

    // The first wave's document again (issued earlier): a replay.
    let before = count(&daemons[2], "a replay");
    files.put("/manifest.json", wave1);
    wait_log_count(&daemons[2], "a replay", before, Duration::from_secs(30));
    assert!(metric(&daemons[2], "outpost_ota_documents_total", "replay") >= 1.0);
}
