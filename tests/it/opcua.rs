//! The OPC UA server against a real client: asyncua (tests/opcua/client.py,
//! pinned in tests/floor/requirements.txt) reads and subscribes to the
//! variables of a sensors-over-HTTP pipeline, logs in with a password over
//! Basic256Sha256 sign and encrypt, and is refused without a user or with a
//! wrong password.

use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

const PASSWORD: &str = "floor-Secret-42";

/// The `[opcua]` keys of the secure server with its one user.
const SECURE: &str = r#"security = ["basic256sha256_sign_encrypt"]
[[opcua.users]]
user = "scada"
password_env = "OPCUA_PASSWORD""#;

/// A sensors pipeline named line3 with an OPC UA server on a free loopback
/// port; `opcua` goes into `[opcua]` (its security, users).
fn config(opcua: &str) -> String {
    format!(
        r#"
device = "gw-opcua"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "line3"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16

[opcua]
listen = "opc.tcp://127.0.0.1:0"
trusted_clients = "{{DIR}}/certs"
{opcua}
[[opcua.variables]]
pipeline = "line3"
field = "/top/0/index"
kind = "int32"
[[opcua.variables]]
pipeline = "line3"
field = "/top/0/score"
"#
    )
}

/// The client's certificate, made before the daemon starts so the
/// server trusts it (`trusted_clients`).
fn make_client_certs(dir: &std::path::Path) {
    let o = client(dir, "opc.tcp://127.0.0.1:1", &["certs"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Starts the daemon with its client certificates trusted and the
/// password in its environment; returns it with the server's URL.
fn start(opcua: &str) -> (Daemon, String) {
    let dir = tempfile::tempdir().unwrap();
    make_client_certs(dir.path());
    let d = Daemon::start_full(
        &config(opcua),
        dir,
        &[("OPCUA_PASSWORD", PASSWORD.to_string())],
        true,
    );
    let url = server_url(&d);
    (d, url)
}

/// The URL from the "opcua server listening" log line (port 0 in the config).
fn server_url(d: &Daemon) -> String {
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("opcua server listening"))
        .unwrap_or_else(|| panic!("no opcua listening line:\n{log}"));
    let at = line.find(" listen=").unwrap() + " listen=".len();
    format!(
        "opc.tcp://{}",
        line[at..].split_whitespace().next().unwrap()
    )
}

fn client(dir: &std::path::Path, url: &str, args: &[&str]) -> Command {
    let mut c = Command::new("python3");
    c.arg(root().join("tests/opcua/client.py"))
        .arg(url)
        .arg("--certs")
        .arg(dir.join("certs"))
        .args(args)
        .env("OPCUA_PASSWORD", PASSWORD)
        .env("OPCUA_WRONG", "not-the-password")
        .stdin(Stdio::null());
    c
}

/// Runs a one-shot client command; its one JSON line.
fn once(d: &Daemon, url: &str, args: &[&str]) -> Value {
    let o = client(d.dir.path(), url, args).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    let line = text.lines().last().unwrap_or_else(|| {
        panic!(
            "client printed nothing: {}\n{}",
            String::from_utf8_lossy(&o.stderr),
            d.log()
        )
    });
    serde_json::from_str(line).unwrap()
}

/// A subscribing client and its lines as they come.
struct Subscriber {
    child: Child,
    lines: Receiver<Value>,
    /// Every line so far.
    seen: Vec<Value>,
}

impl Subscriber {
    fn start(d: &Daemon, url: &str, nodes: &[&str]) -> Subscriber {
        let mut args = vec!["--user", "scada", "subscribe"];
        args.extend_from_slice(nodes);
        let mut child = client(d.dir.path(), url, &args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&l) {
                    let _ = tx.send(v);
                }
            }
        });
        let mut s = Subscriber {
            child,
            lines,
            seen: Vec::new(),
        };
        s.until(d, "the subscription", |v| v["subscribed"] == true);
        s
    }

    /// The first line from now on that `pred` accepts.
    fn until(&mut self, d: &Daemon, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        loop {
            let left = Duration::from_secs(30).saturating_sub(t0.elapsed());
            match self.lines.recv_timeout(left) {
                Ok(v) => {
                    self.seen.push(v.clone());
                    if pred(&v) {
                        return v;
                    }
                }
                Err(_) => panic!("no {what} in 30 s:\n{}", d.log()),
            }
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Posts one frame to line3; the record made of it.
fn infer(d: &Daemon, k: usize) -> Value {
    let body = format!(
        "[{}]",
        (0..16)
            .map(|i| format!("{}", ((i * 7 + k * 3) % 11) as f32 / 3.0))
            .collect::<Vec<_>>()
            .join(",")
    );
    let (code, out) = http("POST", &d.api, "/v1/pipelines/line3/infer", body.as_bytes()).unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&out));
    let v: Value = serde_json::from_slice(&out).unwrap();
    v["records"][0].clone()
}

/// A metric's value from /metrics (0 when absent).
fn metric(d: &Daemon, line_start: &str) -> f64 {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[test]
fn a_scada_client_reads_and_subscribes_to_the_latest_record_over_an_encrypted_login() {
    let (d, url) = start(SECURE);
    // Every variable waits for its first record.
    let v = once(
        &d,
        &url,
        &[
            "--user",
            "scada",
            "read",
            "line3/top/0/index",
            "line3/record",
        ],
    );
    assert_eq!(
        v["values"]["line3/top/0/index"], "status:BadWaitingForInitialData",
        "{v}"
    );
    let mut sub = Subscriber::start(
        &d,
        &url,
        &["line3/record", "line3/top/0/index", "line3/top/0/score"],
    );
    // Each record reaches the subscriber as a data change of the record
    // variable (its JSON, same id) and of each mapped field.
    let mut first_index = None;
    for k in 0..3 {
        let rec = infer(&d, k);
        first_index = first_index.or(rec["outputs"]["top"][0]["index"].as_i64());
        let id = rec["id"].as_str().unwrap().to_string();
        let got = sub.until(&d, &format!("record {id}"), |v| {
            v["node"] == "line3/record"
                && v["value"]
                    .as_str()
                    .and_then(|s| serde_json::from_str::<Value>(s).ok())
                    .is_some_and(|r| r["id"] == id.as_str())
        });
        let seen: Value = serde_json::from_str(got["value"].as_str().unwrap()).unwrap();
        assert_eq!(seen["outputs"], rec["outputs"], "{seen}");
        // Read back: the fields equal the record's.
        let v = once(
            &d,
            &url,
            &[
                "--user",
                "scada",
                "read",
                "line3/top/0/index",
                "line3/top/0/score",
            ],
        );
        assert_eq!(
            v["values"]["line3/top/0/index"],
            rec["outputs"]["top"][0]["index"]
        );
        let score = v["values"]["line3/top/0/score"].as_f64().unwrap();
        let want = rec["outputs"]["top"][0]["score"].as_f64().unwrap();
        assert!((score - want).abs() < 1e-6, "{score} vs {want}");
    }
    // The mapped fields came as data changes too: each change of the
    // index is the index of a record made by then (equal values make no
    // change), the first record's among them.
    let indexes: Vec<i64> = sub
        .seen
        .iter()
        .filter(|v| v["node"] == "line3/top/0/index")
        .filter_map(|v| v["value"].as_i64())
        .collect();
    assert_eq!(
        indexes.first().copied(),
        first_index,
        "index changes {indexes:?} of {:?}",
        sub.seen
    );
    let st = d.status()["opcua"].clone();
    assert!(st["sessions"].as_u64().unwrap() >= 1, "{st}");
    assert!(st["notifications"].as_u64().unwrap() >= 3, "{st}");
    assert_eq!(st["records"], 3, "{st}");
    assert!(metric(&d, "outpost_opcua_notifications_total") >= 3.0);
    assert!(metric(&d, "outpost_opcua_logins_total") >= 2.0);
}

#[test]
fn anonymous_clients_and_wrong_passwords_are_refused_and_counted() {
    let (d, url) = start(&format!("anonymous = false\n{SECURE}"));
    let v = once(&d, &url, &["login"]);
    assert_eq!(v["ok"], false, "anonymous got in: {v}");
    let v = once(
        &d,
        &url,
        &["--user", "scada", "--password-env", "OPCUA_WRONG", "login"],
    );
    assert_eq!(v["ok"], false, "a wrong password got in: {v}");
    let v = once(&d, &url, &["--user", "scada", "login"]);
    assert_eq!(
        v["ok"],
        true,
        "the right password was refused: {v}\n{}",
        d.log()
    );
    let st = d.status()["opcua"].clone();
    assert_eq!(st["logins_refused"]["anonymous"], 1, "{st}");
    assert_eq!(st["logins_refused"]["password"], 1, "{st}");
    assert_eq!(
        metric(
            &d,
            "outpost_opcua_logins_refused_total{reason=\"password\"}"
        ),
        1.0
    );
    // The password never reaches the log.
    assert!(!d.log().contains(PASSWORD));
    assert!(!d.log().contains("not-the-password"));
}

#[test]
fn anonymous_clients_get_in_over_security_none_only_when_both_are_written() {
    let (d, url) = start("anonymous = true\nsecurity = [\"none\"]");
    let v = once(&d, &url, &["--security", "none", "read", "line3/record"]);
    assert_eq!(
        v["values"]["line3/record"], "status:BadWaitingForInitialData",
        "{v}"
    );
}
