//! The fleet side: staged rollouts decided on real daemons from signed
//! manifest documents (made with the real CLI), served over HTTP on loopback.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::common::*;

mod s3;

/// Static files over HTTP/1.1 on loopback; what it serves can change.
struct Files {
    addr: String,
    files: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl Files {
    fn start() -> Files {
        Self::start_in(None)
    }

    /// Also serves the files of `dir` (read at each request).
    fn start_in(dir: Option<PathBuf>) -> Files {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let files: Arc<Mutex<HashMap<String, Vec<u8>>>> = Arc::default();
        let f = files.clone();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let (f, dir) = (f.clone(), dir.clone());
                std::thread::spawn(move || serve(s, &f, dir.as_deref()));
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

/// Reads an HTTP request's line and headers; its path (None when the
/// connection closed first).
fn request_path(s: &std::net::TcpStream) -> Option<String> {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
            break;
        }
    }
    Some(path)
}

/// The independent Sparkplug subscriber (tests/fleet/sparkplug_sub.py) on
/// `spBv1.0/#` of the broker at `port`, with its output lines once it
/// subscribed; `commands`: its stdin piped (it publishes what it reads).
fn sparkplug_subscriber(
    port: u16,
    commands: bool,
) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(root().join("tests/fleet/sparkplug_sub.py"))
        .arg(port.to_string())
        .arg("spBv1.0/#")
        .stdout(std::process::Stdio::piped());
    if commands {
        cmd.stdin(std::process::Stdio::piped());
    }
    let mut sub = KillOnDrop(cmd.spawn().expect("python3"));
    let rx = sparkplug_lines(&mut sub.0);
    (sub, rx)
}

/// The Sparkplug subscriber's output lines, once it says it subscribed.
fn sparkplug_lines(sub: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = sub.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    assert_eq!(
        first, "SUBSCRIBED",
        "the Sparkplug subscriber did not start (python3 with protobuf and paho-mqtt from models/requirements.txt is needed)"
    );
    rx
}

fn serve(mut s: std::net::TcpStream, files: &Mutex<HashMap<String, Vec<u8>>>, dir: Option<&Path>) {
    let Some(path) = request_path(&s) else {
        return;
    };
    let body = files
        .lock()
        .unwrap()
        .get(&path)
        .cloned()
        .or_else(|| dir.and_then(|d| std::fs::read(d.join(path.trim_start_matches('/'))).ok()));
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

/// A signed document dated 2100 (a key holder's wrong clock, or a document
/// made to outlive every later one) was accepted and became the replay
/// floor, so every current document after it was refused as a replay.
#[test]
fn signed_document_dated_2100_is_refused_and_the_current_one_still_installs() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let key = w.join("fleet");
    cli(&["keygen", "--out", key.to_str().unwrap()]);
    let pubkey = std::fs::read_to_string(w.join("fleet.pub"))
        .unwrap()
        .trim()
        .to_string();
    let files = Files::start();
    let bundle = model_bundle(w, &key, "1.1.0");
    files.put("/sensor_mlp-1.1.0.tar", std::fs::read(&bundle).unwrap());
    // The genuine document, re-signed with the date moved to 2100.
    let current = signed_document(w, &key, &bundle, &[]);
    let env: outpost::ota::document::Envelope = serde_json::from_slice(&current).unwrap();
    let mut dated: outpost::ota::document::SignedDocument =
        serde_json::from_str(&env.document).unwrap();
    dated.issued_ms = 4_102_444_800_000;
    let signing = outpost::ota::sign::read_signing_key(&key).unwrap();
    let far = outpost::ota::document::seal(&signing, &dated).unwrap();
    files.put("/manifest.json", serde_json::to_vec(&far).unwrap());
    let d = start_device(&device_config(
        "gw-2100",
        &[],
        &files.url("/manifest.json"),
        &pubkey,
    ));
    let t0 = Instant::now();
    while metric(&d, "outpost_ota_documents_total", "future") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        d.log().contains("ahead of this device's clock"),
        "{}",
        d.log()
    );
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
    assert_eq!(count(&d, "step=\"downloading\""), 0, "{}", d.log());
    // The current document (issued now, before 2100) is taken, not a replay.
    files.put("/manifest.json", current);
    wait_log_count(&d, "step=\"installed\"", 0, Duration::from_secs(60));
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    assert_eq!(metric(&d, "outpost_ota_documents_total", "replay"), 0.0);
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

// ---- NATS: the MQTT gateway with JetStream ----------------------------------

/// A real nats-server (Debian package nats-server) with JetStream and its
/// MQTT listener on loopback; stopped and restarted on the same store.
struct Nats {
    child: Option<std::process::Child>,
    mqtt: u16,
    dir: PathBuf,
}

impl Nats {
    fn start(dir: &Path) -> Nats {
        std::fs::create_dir_all(dir).unwrap();
        let conf = dir.join("nats.conf");
        let mqtt = free_port();
        std::fs::write(
            &conf,
            format!(
                "server_name: outpost_test\nlisten: 127.0.0.1:{}\n\
                 jetstream {{ store_dir: \"{}/js\" }}\nmqtt {{ listen: 127.0.0.1:{mqtt} }}\n",
                free_port(),
                dir.display()
            ),
        )
        .unwrap();
        let mut n = Nats {
            child: None,
            mqtt,
            dir: dir.to_path_buf(),
        };
        n.restart();
        n
    }

    fn restart(&mut self) {
        assert!(self.child.is_none());
        let child = std::process::Command::new("nats-server")
            .arg("-c")
            .arg(self.dir.join("nats.conf"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("nats.log")).unwrap())
            .spawn()
            .expect("nats-server (Debian package nats-server) is needed for the NATS tests");
        self.child = Some(child);
        let t0 = Instant::now();
        while !std::fs::read_to_string(self.dir.join("nats.log"))
            .unwrap_or_default()
            .contains("Listening for MQTT clients")
            || std::net::TcpStream::connect(("127.0.0.1", self.mqtt)).is_err()
        {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "nats-server did not listen:\n{}",
                std::fs::read_to_string(self.dir.join("nats.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM; JetStream keeps the sessions, retained messages and queues.
    fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let t0 = Instant::now();
        while c.try_wait().unwrap().is_none() {
            if t0.elapsed() > Duration::from_secs(15) {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// (topic, payload, retain) of each publish a subscriber received.
type Got = Arc<Mutex<Vec<(String, Vec<u8>, bool)>>>;

/// A rumqttc subscriber (QoS 1; persistent session unless `clean`) on one
/// filter; reconnects by itself.
struct Subscriber {
    got: Got,
    subacks: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Subscriber {
    fn start(port: u16, id: &str, filter: &str, clean: bool) -> Subscriber {
        use std::sync::atomic::Ordering;
        let got: Got = Arc::default();
        let subacks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (g, s, st, id, filter) = (
            got.clone(),
            subacks.clone(),
            stop.clone(),
            id.to_string(),
            filter.to_string(),
        );
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
                o.set_clean_session(clean)
                    .set_keep_alive(Duration::from_secs(5))
                    .set_max_packet_size(4 << 20, 4 << 20);
                let (client, mut ev) = rumqttc::AsyncClient::new(o, 100);
                let poll = tokio::spawn(async move {
                    loop {
                        match ev.poll().await {
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => {
                                let _ = client.try_subscribe(&filter, rumqttc::QoS::AtLeastOnce);
                            }
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                                s.fetch_add(1, Ordering::SeqCst);
                            }
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                                g.lock().unwrap().push((
                                    p.topic.clone(),
                                    p.payload.to_vec(),
                                    p.retain,
                                ));
                            }
                            Ok(_) => {}
                            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
                        }
                    }
                });
                while !st.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                poll.abort();
            });
        });
        let sub = Subscriber {
            got,
            subacks,
            stop,
            thread: Some(thread),
        };
        sub.wait_subscribed(0);
        sub
    }

    /// Waits for more than `before` SUBACKs.
    fn wait_subscribed(&self, before: usize) {
        let t0 = Instant::now();
        while self.subacks.load(std::sync::atomic::Ordering::SeqCst) <= before {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the subscriber never subscribed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn snapshot(&self) -> Vec<(String, Vec<u8>, bool)> {
        self.got.lock().unwrap().clone()
    }

    /// Waits until `pred` holds for what was received.
    fn wait(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&[(String, Vec<u8>, bool)]) -> bool,
    ) {
        let t0 = Instant::now();
        while !pred(&self.snapshot()) {
            assert!(t0.elapsed() < timeout, "{what}: not within {timeout:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Publishes one message at QoS 1 and waits for its PUBACK.
fn publish(port: u16, topic: &str, payload: Vec<u8>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let o = rumqttc::MqttOptions::new(format!("fleet-pub-{}", free_port()), "127.0.0.1", port);
        let (client, mut ev) = rumqttc::AsyncClient::new(o, 10);
        client
            .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload)
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            assert!(t0.elapsed() < Duration::from_secs(20), "no PUBACK");
            if let Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)))) =
                tokio::time::timeout(Duration::from_secs(1), ev.poll()).await
            {
                break;
            }
        }
        let _ = client.disconnect().await;
    });
}

/// `n` sensor frames (16 values as JSON) over two streams.
fn recording(dir: &Path, n: usize) -> PathBuf {
    use outpost::source::replay::{Recorded, write};
    let frames: Vec<Recorded> = (0..n)
        .map(|i| Recorded {
            t_us: i as u64 * 100,
            stream: format!("s{}", i % 2),
            payload: serde_json::to_vec(
                &(0..16)
                    .map(|j| ((i * 16 + j) % 23) as f32 / 7.0 - 1.5)
                    .collect::<Vec<f32>>(),
            )
            .unwrap(),
        })
        .collect();
    let p = dir.join("frames.rec");
    write(&p, &frames).unwrap();
    p
}

/// The MQTT uplink against NATS: records made while the broker is down
/// are all delivered after it restarts, to a fleet subscriber whose
/// persistent session JetStream kept across the restart; the retained
/// status says online, and the will says offline after a SIGKILL.
#[test]
fn nats_uplink_delivers_everything_across_a_broker_restart_with_retained_status_and_will() {
    const N: usize = 3000;
    let work = tempfile::tempdir().unwrap();
    let mut nats = Nats::start(&work.path().join("nats"));
    let fleet = Subscriber::start(nats.mqtt, "fleet-ingest", "outpost/#", false);
    nats.stop();
    let dir = tempfile::tempdir().unwrap();
    recording(dir.path(), N);
    let cfg = format!(
        r#"
device = "gw-nats"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[scheduler]
workers = 1
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
when_full = "block"
source = {{ type = "replay", file = "{{DIR}}/frames.rec", speed = "max" }}
[pipelines.preprocess]
type = "sensor"
length = 16
format = "json"
[uplink]
type = "mqtt"
host = "127.0.0.1"
port = {}
batch = 20
backoff_min = "100ms"
backoff_max = "1s"
keep_alive = "5s"
connect_timeout = "2s"
"#,
        nats.mqtt
    );
    let mut d = Daemon::start_in(&cfg, dir);
    // Everything is made (and kept in the outbox) while the broker is down.
    d.records_until(Duration::from_secs(120), |r| r.len() >= N);
    assert_eq!(d.seen.len(), N);
    let want: std::collections::HashSet<String> = d
        .seen
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    let subs = fleet.subacks.load(std::sync::atomic::Ordering::SeqCst);
    nats.restart();
    fleet.wait_subscribed(subs);
    let ids = |got: &[(String, Vec<u8>, bool)]| -> std::collections::HashSet<String> {
        got.iter()
            .filter(|(t, _, _)| t.starts_with("outpost/gw-nats/sensors/"))
            .flat_map(|(_, p, _)| {
                let v: serde_json::Value = serde_json::from_slice(p).unwrap();
                match v {
                    serde_json::Value::Array(a) => a,
                    v => vec![v],
                }
            })
            .map(|v| v["id"].as_str().unwrap().to_string())
            .collect()
    };
    fleet.wait("every record at the fleet", Duration::from_secs(120), |g| {
        ids(g).is_superset(&want)
    });
    assert_eq!(ids(&fleet.snapshot()), want, "nothing but what was made");
    let t0 = Instant::now();
    while d.status()["outbox"]["records"] != 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "outbox not drained");
        std::thread::sleep(Duration::from_millis(50));
    }
    // A newcomer gets the retained status: online.
    let watcher = Subscriber::start(nats.mqtt, "fleet-status", "outpost/+/status", true);
    watcher.wait("retained online", Duration::from_secs(20), |g| {
        g.iter()
            .any(|(t, p, r)| t == "outpost/gw-nats/status" && p == b"online" && *r)
    });
    // SIGKILL: the broker publishes the will.
    d.child.kill().unwrap();
    let _ = d.child.wait();
    watcher.wait("the will: offline", Duration::from_secs(30), |g| {
        g.iter()
            .any(|(t, p, _)| t == "outpost/gw-nats/status" && p == b"offline")
    });
}

/// Signed commands through NATS: a stranger's is refused; one sent while
/// the device is down waits in its persistent session and installs when it
/// comes back; its replay is refused.
#[test]
fn nats_signed_commands_wait_in_the_session_and_replays_are_refused() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let nats = Nats::start(&w.join("nats"));
    let key = w.join("fleet");
    cli(&["keygen", "--out", key.to_str().unwrap()]);
    let stranger = w.join("stranger");
    cli(&["keygen", "--out", stranger.to_str().unwrap()]);
    let pubkey = std::fs::read_to_string(w.join("fleet.pub"))
        .unwrap()
        .trim()
        .to_string();
    let files = Files::start();
    let bundle = model_bundle(w, &key, "1.1.0");
    files.put("/sensor_mlp-1.1.0.tar", std::fs::read(&bundle).unwrap());
    let url = files.url("/sensor_mlp-1.1.0.tar");
    let command = |key: &Path| -> Vec<u8> {
        cli(&[
            "bundle",
            "command",
            "--key",
            key.to_str().unwrap(),
            "--device",
            "gw-cmd",
            "--expires-in",
            "10m",
            "--url",
            &url,
            bundle.to_str().unwrap(),
        ])
        .trim()
        .as_bytes()
        .to_vec()
    };
    let cfg = format!(
        r#"
device = "gw-cmd"
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
[uplink]
type = "mqtt"
host = "127.0.0.1"
port = {}
backoff_min = "100ms"
backoff_max = "1s"
[ota]
trusted_keys = ["{pubkey}"]
probation = "1s"
min_runs = 0
"#,
        nats.mqtt
    );
    let topic = "outpost/gw-cmd/cmd";
    let d = start_device(&cfg);
    wait_log_count(
        &d,
        "subscribed to update commands",
        0,
        Duration::from_secs(30),
    );
    publish(nats.mqtt, topic, command(&stranger));
    let t0 = Instant::now();
    while metric(&d, "outpost_ota_commands_total", "signature") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");

    // Down (SIGTERM: a clean disconnect, the session stays at the broker).
    let env = [(
        "OUTPOST_MODEL_DIR",
        d.dir.path().join("models").display().to_string(),
    )];
    let dir = d.stop_keep_dir();
    let update = command(&key);
    publish(nats.mqtt, topic, update.clone());
    let d = Daemon::start_full(&cfg, dir, &env, true);
    wait_log_count(&d, "step=\"installed\"", 0, Duration::from_secs(60));
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    publish(nats.mqtt, topic, update);
    let t0 = Instant::now();
    while metric(&d, "outpost_ota_commands_total", "replay") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count(&d, "step=\"downloading\""), 1);
}

// ---- Sparkplug B --------------------------------------------------------------

/// Leaves of a record's outputs as docs/fleet.md names them:
/// `{stream}/{path}` (null skipped), numbers as f64.
fn leaves(v: &serde_json::Value, path: String, out: &mut HashMap<String, serde_json::Value>) {
    match v {
        serde_json::Value::Null => {}
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                leaves(x, format!("{path}/{i}"), out);
            }
        }
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                leaves(x, format!("{path}/{k}"), out);
            }
        }
        serde_json::Value::Number(n) => {
            out.insert(path, serde_json::json!(n.as_f64().unwrap()));
        }
        v => {
            out.insert(path, v.clone());
        }
    }
}

/// The Sparkplug B uplink, decoded by an independent subscriber (Python's
/// protobuf runtime with message classes built from the published
/// sparkplug_b.proto field numbers) on a real mosquitto: NBIRTH with bdSeq
/// at seq 0, a DBIRTH before the data, one DDATA per record whose metrics
/// are the record's outputs, seq 0..255 wrapping, and the NDEATH will with
/// the NBIRTH's bdSeq after a SIGKILL.
#[test]
fn sparkplug_b_uplink_decoded_independently() {
    const N: usize = 300;
    let work = tempfile::tempdir().unwrap();
    let broker = crate::uplink::Mosquitto::start(&work.path().join("mosquitto"));
    let (_sub, rx) = sparkplug_subscriber(broker.port, false);
    let dir = tempfile::tempdir().unwrap();
    recording(dir.path(), N);
    let cfg = format!(
        r#"
device = "gw-sp"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[scheduler]
workers = 1
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
when_full = "block"
source = {{ type = "replay", file = "{{DIR}}/frames.rec", speed = "max" }}
[pipelines.preprocess]
type = "sensor"
length = 16
format = "json"
[pipelines.postprocess]
type = "softmax_topk"
output = "probs"
k = 2
[uplink]
type = "mqtt"
host = "127.0.0.1"
port = {}
payload = "sparkplug_b"
sparkplug_group = "plant"
"#,
        broker.port
    );
    let mut d = Daemon::start_in(&cfg, dir);
    d.records_until(Duration::from_secs(120), |r| r.len() >= N);
    let mut msgs: Vec<serde_json::Value> = Vec::new();
    let t0 = Instant::now();
    while msgs
        .iter()
        .filter(|m| m["topic"] == "spBv1.0/plant/DDATA/gw-sp/sensors")
        .count()
        < N
    {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "only {} messages",
            msgs.len()
        );
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            msgs.push(serde_json::from_str(&l).unwrap());
        }
    }
    // NBIRTH first, seq 0, with bdSeq and the rebirth control.
    assert_eq!(msgs[0]["topic"], "spBv1.0/plant/NBIRTH/gw-sp");
    assert_eq!(msgs[0]["seq"], 0);
    let names: Vec<&str> = msgs[0]["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["bdSeq", "Node Control/Rebirth"]);
    let bd_seq = msgs[0]["metrics"][0]["value"].clone();
    assert_eq!(msgs[0]["metrics"][0]["datatype"], 8, "bdSeq is UInt64");
    // Sequence numbers: one more per message, wrapping after 255.
    for w in msgs.windows(2) {
        let (a, b) = (w[0]["seq"].as_u64().unwrap(), w[1]["seq"].as_u64().unwrap());
        assert_eq!(b, (a + 1) % 256, "{} then {}", w[0], w[1]);
    }
    assert!(msgs.len() > 256, "the sequence wrapped");
    // A DBIRTH comes before the first DDATA and declares its metrics.
    let dbirth = msgs
        .iter()
        .position(|m| m["topic"] == "spBv1.0/plant/DBIRTH/gw-sp/sensors")
        .expect("a DBIRTH");
    let ddata = msgs
        .iter()
        .position(|m| m["topic"] == "spBv1.0/plant/DDATA/gw-sp/sensors")
        .unwrap();
    assert!(dbirth < ddata);
    let born: std::collections::HashSet<String> = msgs
        .iter()
        .filter(|m| m["topic"] == "spBv1.0/plant/DBIRTH/gw-sp/sensors")
        .flat_map(|m| m["metrics"].as_array().unwrap().clone())
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect();
    // Every record arrived as one DDATA with its outputs as metrics.
    let by_id: HashMap<String, &serde_json::Value> = d
        .seen
        .iter()
        .map(|r| (r["id"].as_str().unwrap().to_string(), r))
        .collect();
    let mut seen_ids = std::collections::HashSet::new();
    for m in msgs
        .iter()
        .filter(|m| m["topic"] == "spBv1.0/plant/DDATA/gw-sp/sensors")
    {
        let metrics: HashMap<String, serde_json::Value> = m["metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| (x["name"].as_str().unwrap().to_string(), x.clone()))
            .collect();
        let id_metric = metrics
            .iter()
            .find(|(k, _)| k.ends_with("/id"))
            .map(|(_, v)| v["value"].as_str().unwrap().to_string())
            .expect("an id metric");
        let r = by_id[&id_metric];
        let stream = r["stream"].as_str().unwrap();
        let mut want = HashMap::new();
        leaves(&r["outputs"], stream.to_string(), &mut want);
        assert!(!want.is_empty());
        for (name, v) in &want {
            let got = &metrics
                .get(name)
                .unwrap_or_else(|| panic!("{name} missing in {m}"))["value"];
            assert_eq!(got, v, "{name}");
            assert!(born.contains(name), "{name} never born");
        }
        assert_eq!(metrics[&format!("{stream}/seq")]["value"], r["seq"]);
        assert_eq!(metrics[&format!("{stream}/seq")]["datatype"], 8);
        assert_eq!(metrics[&format!("{stream}/model")]["value"], r["model"]);
        seen_ids.insert(id_metric);
    }
    assert_eq!(seen_ids.len(), N, "every record once");
    // SIGKILL: the broker publishes the will, NDEATH with the same bdSeq.
    d.child.kill().unwrap();
    let _ = d.child.wait();
    let t0 = Instant::now();
    let death = loop {
        assert!(t0.elapsed() < Duration::from_secs(60), "no NDEATH");
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            let v: serde_json::Value = serde_json::from_str(&l).unwrap();
            if v["topic"] == "spBv1.0/plant/NDEATH/gw-sp" {
                break v;
            }
        }
    };
    assert_eq!(death["metrics"][0]["name"], "bdSeq");
    assert_eq!(death["metrics"][0]["value"], bd_seq);
    assert!(death["seq"].is_null(), "NDEATH carries no seq");
}

/// A Sparkplug host asks for a rebirth with an NCMD (encoded by the
/// independent Python subscriber): the node publishes a fresh NBIRTH with
/// seq 0 and the same bdSeq, then the DBIRTH of its pipeline with every
/// metric, and DDATA goes on after them with the sequence running on. A
/// malformed command and one the node does not take are ignored, logged
/// and counted.
#[test]
fn sparkplug_ncmd_rebirth_births_the_node_again_with_the_same_bdseq() {
    let work = tempfile::tempdir().unwrap();
    let broker = crate::uplink::Mosquitto::start(&work.path().join("mosquitto"));
    let (mut sub, rx) = sparkplug_subscriber(broker.port, true);
    let mut host = sub.0.stdin.take().unwrap();
    let cfg = sensors_over_http("").replace("data_dir", "device = \"gw-rb\"\ndata_dir")
        + &format!(
            "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {}\npayload = \"sparkplug_b\"\nsparkplug_group = \"plant\"\n",
            broker.port
        );
    let d = Daemon::start(&cfg);
    crate::ota::wait_log(
        &d,
        "subscribed to Sparkplug node commands",
        Duration::from_secs(30),
    );
    assert!(d.log().contains("spBv1.0/plant/NCMD/gw-rb"), "{}", d.log());
    let mut msgs: Vec<serde_json::Value> = Vec::new();
    // Messages of the node (not the host's own commands) until `pred`.
    let until = |msgs: &mut Vec<serde_json::Value>,
                 what: &str,
                 pred: &dyn Fn(&[serde_json::Value]) -> bool| {
        let t0 = Instant::now();
        while !pred(msgs) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what}: not within 60 s; got {msgs:#?}"
            );
            if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
                if l == "PUBLISHED" {
                    continue;
                }
                let v: serde_json::Value = serde_json::from_str(&l).unwrap();
                if !v["topic"].as_str().unwrap().contains("/NCMD/") {
                    msgs.push(v);
                }
            }
        }
    };
    let ddata = |m: &[serde_json::Value]| {
        m.iter()
            .filter(|m| m["topic"] == "spBv1.0/plant/DDATA/gw-rb/sensors")
            .count()
    };
    let post = |i: usize| {
        let sample: Vec<f32> = (0..16).map(|j| (i * 16 + j) as f32 / 10.0).collect();
        let (code, body) = http(
            "POST",
            &d.api,
            "/v1/pipelines/sensors/infer?stream=s0",
            serde_json::to_string(&sample).unwrap().as_bytes(),
        )
        .unwrap();
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    };
    for i in 0..3 {
        post(i);
    }
    until(&mut msgs, "three DDATA", &|m| ddata(m) >= 3);
    assert_eq!(msgs[0]["topic"], "spBv1.0/plant/NBIRTH/gw-rb");
    let bd_seq = msgs[0]["metrics"][0]["value"].clone();
    let births = msgs.len();

    // Junk and a command the node does not take: ignored and counted.
    let ncmd = "spBv1.0/plant/NCMD/gw-rb";
    writeln!(host, "raw {ncmd} ffffff").unwrap();
    writeln!(host, "metric {ncmd} Node Control/Reboot").unwrap();
    let t0 = Instant::now();
    while metric(
        &d,
        "outpost_uplink_sparkplug_commands_ignored_total",
        "mqtt",
    ) < 2.0
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(d.log().contains("Sparkplug node command ignored"));
    assert!(d.log().contains("not a Sparkplug B payload"));

    // Rebirth.
    writeln!(host, "rebirth {ncmd}").unwrap();
    until(&mut msgs, "a second NBIRTH and a DBIRTH", &|m| {
        m[births..]
            .iter()
            .any(|m| m["topic"] == "spBv1.0/plant/DBIRTH/gw-rb/sensors")
    });
    let nbirth = &msgs[births];
    assert_eq!(nbirth["topic"], "spBv1.0/plant/NBIRTH/gw-rb", "{msgs:#?}");
    assert_eq!(nbirth["seq"], 0);
    assert_eq!(nbirth["metrics"][0]["name"], "bdSeq");
    assert_eq!(nbirth["metrics"][0]["value"], bd_seq, "the same bdSeq");
    assert_eq!(nbirth["metrics"][1]["name"], "Node Control/Rebirth");
    assert_eq!(nbirth["metrics"][1]["value"], false);
    let dbirth = &msgs[births + 1];
    assert_eq!(dbirth["topic"], "spBv1.0/plant/DBIRTH/gw-rb/sensors");
    assert_eq!(dbirth["seq"], 1);
    let born: Vec<&str> = dbirth["metrics"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert!(
        born.contains(&"s0/id") && born.contains(&"s0/model"),
        "{born:?}"
    );
    // DDATA goes on after the births, the sequence running on from them.
    for i in 3..5 {
        post(i);
    }
    until(&mut msgs, "two more DDATA", &|m| ddata(m) >= 5);
    let after = &msgs[births + 2..];
    assert!(
        after
            .iter()
            .all(|m| m["topic"] == "spBv1.0/plant/DDATA/gw-rb/sensors"),
        "{after:#?}"
    );
    assert_eq!(after[0]["seq"], 2);
    assert_eq!(after[1]["seq"], 3);
    assert_eq!(
        metric(&d, "outpost_uplink_sparkplug_rebirths_total", "mqtt"),
        1.0
    );
    assert!(d.log().contains("Sparkplug rebirth"));
}

/// A child process killed when the test ends, however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

// ---- outpost fleet status -----------------------------------------------------

/// `outpost fleet status` on a real mosquitto: a device online with the
/// version its records name, then offline (its will) after a SIGKILL.
#[test]
fn fleet_status_lists_devices_online_with_versions_then_offline() {
    let work = tempfile::tempdir().unwrap();
    let broker = crate::uplink::Mosquitto::start(&work.path().join("mosquitto"));
    let cfg = format!(
        r#"
device = "gw-status"
data_dir = "{{DATA}}"
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
[uplink]
type = "mqtt"
host = "127.0.0.1"
port = {}
"#,
        broker.port
    );
    let mut d = Daemon::start(&cfg);
    let t0 = Instant::now();
    while metric(&d, "outpost_uplink_connected", "mqtt") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let broker_addr = format!("127.0.0.1:{}", broker.port);
    let mut cli = KillOnDrop(
        outpost()
            .args([
                "fleet",
                "status",
                "--json",
                "--listen",
                "20s",
                "--broker",
                &broker_addr,
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Once it listens, make a record.
    let mut err = BufReader::new(cli.0.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.starts_with("listening on outpost/#"), "{line}");
    let sample = "[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";
    let (code, _) = http(
        "POST",
        &d.api,
        "/v1/pipelines/sensors/infer",
        sample.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200);
    let out = cli.0.wait_with_output_kept();
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let dev = v
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["device"] == "gw-status")
        .unwrap_or_else(|| panic!("{v}"));
    assert_eq!(dev["status"], "online");
    assert_eq!(dev["models"]["sensor_mlp"], "1.0.0");
    assert!(dev["records"].as_u64().unwrap() >= 1);

    d.child.kill().unwrap();
    let _ = d.child.wait();
    // The will is published once the broker notices the dead connection.
    let t0 = Instant::now();
    loop {
        let o = run(outpost().args([
            "fleet",
            "status",
            "--listen",
            "1s",
            "--broker",
            &broker_addr,
        ]));
        assert!(o.status.success(), "{}", stderr(&o));
        let table = stdout(&o);
        let row = table
            .lines()
            .find(|l| l.starts_with("gw-status"))
            .unwrap_or("");
        if row.contains("offline") {
            assert!(table.starts_with("DEVICE"));
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{table}");
    }
}

trait WaitKept {
    /// Waits for the exit; returns stdout (asserting success).
    fn wait_with_output_kept(&mut self) -> String;
}

impl WaitKept for std::process::Child {
    fn wait_with_output_kept(&mut self) -> String {
        use std::io::Read;
        let mut s = String::new();
        self.stdout.take().unwrap().read_to_string(&mut s).unwrap();
        assert!(self.wait().unwrap().success());
        s
    }
}

// ---- outpost fleet rollout ----------------------------------------------------

fn rollout_device(name: &str, manifest: &str, pubkey: &str, broker: u16) -> Daemon {
    let cfg = device_config(name, &["pilot"], manifest, pubkey)
        + &format!(
            "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {broker}\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\n"
        );
    // [uplink] after [ota] in the file is fine: both are top-level tables.
    start_device(&cfg)
}

/// The plan file for a rollout of `bundle` over `waves` (TOML lines).
#[allow(clippy::too_many_arguments)]
fn plan_file(
    w: &Path,
    tag: &str,
    bundle: &Path,
    key: &Path,
    out: Option<&Path>,
    broker: u16,
    rollback: Option<&Path>,
    waves: &str,
) -> PathBuf {
    let rb = rollback
        .map(|r| {
            format!(
                "[rollback]\nbundle = \"{}\"\nurl = \"{}\"\n",
                r.display(),
                r.file_name().unwrap().to_str().unwrap()
            )
        })
        .unwrap_or_default();
    // No out_dir: `waves` ends with the `[s3]` table.
    let out = out
        .map(|o| format!("out_dir = \"{}\"\n", o.display()))
        .unwrap_or_default();
    let text = format!(
        "bundle = \"{}\"\nurl = \"{}\"\nkey = \"{}\"\nsalt = \"{tag}\"\n{out}broker = \"127.0.0.1:{broker}\"\nstate = \"{}\"\n{rb}[abort]\nmin_finished = 1\nmax_failure_percent = 0\n{waves}",
        bundle.display(),
        bundle.file_name().unwrap().to_str().unwrap(),
        key.display(),
        w.join(format!("{tag}.state.json")).display(),
    );
    let p = w.join(format!("{tag}.toml"));
    std::fs::write(&p, text).unwrap();
    p
}

/// Bundles the folder's model with check data whose expected outputs are
/// wrong: it fails its check on every device.
fn failing_bundle(dir: &Path, key: &Path, version: &str) -> PathBuf {
    let check = dir.join("bad-check");
    copy_dir(&model_dir().join("sensor_mlp/ref"), &check);
    for e in std::fs::read_dir(check.join("out")).unwrap().flatten() {
        let mut b = std::fs::read(e.path()).unwrap();
        let n = b.len();
        // The last value (f32 little-endian) becomes 1e6.
        b[n - 4..].copy_from_slice(&1.0e6f32.to_le_bytes());
        std::fs::write(e.path(), b).unwrap();
    }
    let m = copy_model("sensor_mlp", &dir.join(format!("v{version}")));
    let mf = m.join("manifest.toml");
    let t = std::fs::read_to_string(&mf)
        .unwrap()
        .replace("version = \"1.0.0\"", &format!("version = \"{version}\""));
    std::fs::write(&mf, t).unwrap();
    let out = dir.join(format!("sensor_mlp-{version}.tar"));
    let o = out.to_str().unwrap();
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

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let t = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &t);
        } else {
            std::fs::copy(e.path(), &t).unwrap();
        }
    }
}

/// `outpost fleet rollout` over three real daemons: waves of 50 % and
/// 100 % complete; then a bundle that fails its check on the device stops
/// the rollout after its first wave, the signed rollback is published, and
/// no device outside that wave ever downloads it.
#[test]
fn fleet_rollout_completes_in_waves_then_a_failing_bundle_stops_itself() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let broker = crate::uplink::Mosquitto::start(&w.join("mosquitto"));
    let key = w.join("fleet");
    cli(&["keygen", "--out", key.to_str().unwrap()]);
    let pubkey = std::fs::read_to_string(w.join("fleet.pub"))
        .unwrap()
        .trim()
        .to_string();
    let out = w.join("www");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("manifest.json"), br#"{"bundles": []}"#).unwrap();
    let files = Files::start_in(Some(out.clone()));
    let good = model_bundle(w, &key, "1.1.0");
    std::fs::copy(&good, out.join("sensor_mlp-1.1.0.tar")).unwrap();
    // Devices picked by bucket: one in the first wave of each rollout, two outside.
    let (s1, s2) = ("roll-1.1.0", "roll-1.2.0");
    let name = |pred: &dyn Fn(u8, u8) -> bool, tag: &str| {
        (0..5000)
            .map(|i| format!("{tag}-{i}"))
            .find(|n| pred(bucket(s1, n), bucket(s2, n)))
            .unwrap()
    };
    let first = name(&|a, b| a < 50 && b < 34, "gw-first");
    let later = [
        name(&|a, b| a >= 50 && b >= 34, "gw-later"),
        name(&|a, b| a >= 50 && b >= 34, "gw-late2"),
    ];
    let manifest = files.url("/manifest.json");
    let daemons: Vec<Daemon> = std::iter::once(&first)
        .chain(later.iter())
        .map(|n| rollout_device(n, &manifest, &pubkey, broker.port))
        .collect();
    for d in &daemons {
        wait_log_count(d, "uplink: connected", 0, Duration::from_secs(30));
    }

    let plan = plan_file(
        w,
        s1,
        &good,
        &key,
        Some(&out),
        broker.port,
        None,
        "[[waves]]\npercent = 50\nmin_devices = 1\nsoak = \"1s\"\n[[waves]]\npercent = 100\nmin_devices = 3\nsoak = \"1s\"\n",
    );
    let o = run_within(outpost().args(["fleet", "rollout"]).arg(&plan), w);
    assert!(o.status.success(), "{}\n{}", stderr(&o), daemons[1].log());
    assert!(
        stdout(&o).contains("done: 3 device(s) finished, 0 failed"),
        "{}",
        stdout(&o)
    );
    assert!(out.join("wave-1.json").is_file() && out.join("wave-2.json").is_file());
    for d in &daemons {
        assert_eq!(serving(d), "sensor_mlp@1.1.0");
    }
    // The first wave reached only the first device.
    let first_install = count(&daemons[0], "step=\"installed\"");
    assert_eq!(first_install, 1);
    assert!(daemons[1].log().contains("outside the wave"));
    // Done is done: a second run does nothing.
    let again = run_within(outpost().args(["fleet", "rollout"]).arg(&plan), w);
    assert!(again.status.success() && stdout(&again).contains("already over"));

    // A bundle that fails its check: stops after the first wave, rolls back.
    let bad = failing_bundle(w, &key, "1.2.0");
    std::fs::copy(&bad, out.join("sensor_mlp-1.2.0.tar")).unwrap();
    let rb_model = copy_model("sensor_mlp", &w.join("rb"));
    let mf = rb_model.join("manifest.toml");
    let t = std::fs::read_to_string(&mf)
        .unwrap()
        .replace("version = \"1.0.0\"", "version = \"1.1.0\"");
    std::fs::write(&mf, t).unwrap();
    let rb = w.join("sensor_mlp-1.1.0-rb.tar");
    let check = model_dir().join("sensor_mlp/ref");
    cli(&[
        "bundle",
        "build",
        "--out",
        rb.to_str().unwrap(),
        "--model-dir",
        rb_model.to_str().unwrap(),
        "--check",
        check.to_str().unwrap(),
        "--rollback",
    ]);
    cli(&[
        "bundle",
        "sign",
        "--key",
        key.to_str().unwrap(),
        rb.to_str().unwrap(),
    ]);
    std::fs::copy(&rb, out.join("sensor_mlp-1.1.0-rb.tar")).unwrap();
    let plan = plan_file(
        w,
        s2,
        &bad,
        &key,
        Some(&out),
        broker.port,
        Some(&rb),
        "[[waves]]\npercent = 34\nmin_devices = 1\nsoak = \"1s\"\n[[waves]]\npercent = 100\nmin_devices = 3\nsoak = \"1s\"\n",
    );
    let o = run_within(outpost().args(["fleet", "rollout"]).arg(&plan), w);
    assert!(!o.status.success(), "it must stop itself: {}", stdout(&o));
    let err = stderr(&o);
    assert!(
        err.contains("aborted in wave 1") && err.contains("1 of 1 finished devices failed"),
        "{err}"
    );
    assert_eq!(
        std::fs::read(out.join("rollback.json")).unwrap(),
        std::fs::read(out.join("manifest.json")).unwrap(),
        "the rollback is what devices poll now"
    );
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("rollback.json")).unwrap()).unwrap();
    let inner: serde_json::Value = serde_json::from_str(doc["document"].as_str().unwrap()).unwrap();
    assert_eq!(inner["bundles"][0]["rollback"], true);
    assert_eq!(inner["bundles"][0]["version"], "1.1.0");
    wait_log_count(
        &daemons[0],
        "step=\"check_failed\"",
        0,
        Duration::from_secs(10),
    );
    let state: serde_json::Value =
        serde_json::from_slice(&std::fs::read(w.join(format!("{s2}.state.json"))).unwrap())
            .unwrap();
    assert!(
        state["finished"].as_str().unwrap().starts_with("aborted"),
        "{state}"
    );
    assert_eq!(state["wave"], 0, "no second wave: {state}");
    for d in &daemons {
        assert_eq!(serving(d), "sensor_mlp@1.1.0");
    }
    for d in &daemons[1..] {
        assert_eq!(
            count(d, "step=\"downloading\" name=sensor_mlp version=1.2.0"),
            0,
            "{}",
            d.log()
        );
        // Whether a device outside the wave polled the wave's document
        // before the rollback replaced it depends on its poll timing; that
        // it never downloaded the bundle is what must hold.
    }
}

/// Runs a command to its end, killing it after 5 minutes (a rollout that
/// hangs fails the test instead of blocking it).
fn run_within(c: &mut std::process::Command, dir: &Path) -> std::process::Output {
    let n = free_port();
    let (o, e) = (dir.join(format!("out-{n}")), dir.join(format!("err-{n}")));
    let mut child = c
        .stdout(std::fs::File::create(&o).unwrap())
        .stderr(std::fs::File::create(&e).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            panic!(
                "still running after 5 min:\n{}",
                std::fs::read_to_string(&e).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    std::process::Output {
        status,
        stdout: std::fs::read(&o).unwrap(),
        stderr: std::fs::read(&e).unwrap(),
    }
}
