//! `outpost fleet rollout` into an S3-compatible bucket: a real server
//! (s3s-fs, the `s3s-fs` crate's binary, pinned in scripts/deps; it keeps
//! a bucket as a folder and checks SigV4 signatures), real daemons, a real
//! mosquitto.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use super::*;

/// The version scripts/deps installs.
const S3S_FS_VERSION: &str = "0.14.1";
const ACCESS_KEY: &str = "outpost-test";
const SECRET_KEY: &str = "s3cr3t-of-the-test-only";
const BUCKET: &str = "fleet";

/// The s3s-fs binary: on PATH or where `cargo install` puts it.
fn s3s_fs_bin() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("s3s-fs"))
            .find(|f| f.is_file())
    });
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    on_path
        .or_else(|| {
            cargo_home
                .map(|c| c.join("bin/s3s-fs"))
                .filter(|f| f.is_file())
        })
        .unwrap_or_else(|| {
            panic!(
                "s3s-fs (the S3-compatible server of these tests) is not installed: \
                 cargo install --locked s3s-fs --version ={S3S_FS_VERSION} --features binary \
                 (scripts/test installs it)"
            )
        })
}

/// A real S3-compatible server on loopback with one bucket, `fleet`, kept
/// in `root/fleet/`; stopped with SIGKILL and started again on its port.
struct S3Server {
    child: Option<Child>,
    root: PathBuf,
    log: PathBuf,
    port: u16,
}

impl S3Server {
    fn start(dir: &Path) -> S3Server {
        let root = dir.join("root");
        // s3s-fs serves each folder of its root as a bucket.
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let mut s = S3Server {
            child: None,
            root,
            log: dir.join("s3s-fs.log"),
            port: 0,
        };
        s.restart();
        s
    }

    /// Starts it; the first time on port 0, read back from its
    /// "server is running at" line, then on the same port.
    fn restart(&mut self) {
        assert!(self.child.is_none());
        let log = std::fs::File::create(&self.log).unwrap();
        let child = Command::new(s3s_fs_bin())
            .args(["--host", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(&self.root)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start s3s-fs");
        self.child = Some(child);
        let t0 = Instant::now();
        let addr = loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(at) = text.find("server is running at http://") {
                let rest = &text[at + "server is running at http://".len()..];
                break rest.split_whitespace().next().unwrap().to_string();
            }
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("s3s-fs exited ({st}):\n{text}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "s3s-fs did not listen:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
        assert!(self.port == 0 || self.port == port);
        self.port = port;
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn bucket(&self) -> rusty_s3::Bucket {
        rusty_s3::Bucket::new(
            self.endpoint().parse().unwrap(),
            rusty_s3::UrlStyle::Path,
            BUCKET,
            "us-east-1",
        )
        .unwrap()
    }

    /// A signed request for `key` with the right credentials: (status, body).
    fn request(&self, method: &str, key: &str, body: &[u8]) -> (u16, Vec<u8>) {
        use rusty_s3::S3Action as _;
        let creds = rusty_s3::Credentials::new(ACCESS_KEY, SECRET_KEY);
        let b = self.bucket();
        let url = match method {
            "GET" => b
                .get_object(Some(&creds), key)
                .sign(Duration::from_secs(600)),
            "PUT" => b
                .put_object(Some(&creds), key)
                .sign(Duration::from_secs(600)),
            m => panic!("{m}"),
        };
        let pq = format!("{}?{}", url.path(), url.query().unwrap());
        http(method, &format!("127.0.0.1:{}", self.port), &pq, body).unwrap()
    }

    fn get(&self, key: &str) -> Option<Vec<u8>> {
        match self.request("GET", key, b"") {
            (200, b) => Some(b),
            (404, _) => None,
            (code, b) => panic!("GET {key}: {code} {}", String::from_utf8_lossy(&b)),
        }
    }

    fn put(&self, key: &str, body: &[u8]) {
        let (code, b) = self.request("PUT", key, body);
        assert_eq!(code, 200, "PUT {key}: {}", String::from_utf8_lossy(&b));
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What devices poll: a read-only HTTP front on loopback that serves
/// `GET /fleet/{key}` from the bucket with signed requests, as a CDN with
/// its own read credentials in front of a private bucket does (s3s-fs
/// refuses unsigned requests once it checks signatures, so the bucket
/// cannot be public here).
fn start_front(server: &S3Server) -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (endpoint, port) = (server.endpoint(), server.port);
    std::thread::spawn(move || {
        for s in l.incoming().flatten() {
            let endpoint = endpoint.clone();
            std::thread::spawn(move || front(s, &endpoint, port));
        }
    });
    addr
}

fn front(mut s: std::net::TcpStream, endpoint: &str, port: u16) {
    use rusty_s3::S3Action as _;
    let Some(path) = super::request_path(&s) else {
        return;
    };
    let key = path
        .strip_prefix(&format!("/{BUCKET}/"))
        .unwrap_or("")
        .to_string();
    let creds = rusty_s3::Credentials::new(ACCESS_KEY, SECRET_KEY);
    let b = rusty_s3::Bucket::new(
        endpoint.parse().unwrap(),
        rusty_s3::UrlStyle::Path,
        BUCKET,
        "us-east-1",
    )
    .unwrap();
    let url = b
        .get_object(Some(&creds), &key)
        .sign(Duration::from_secs(600));
    let pq = format!("{}?{}", url.path(), url.query().unwrap());
    let (code, body) = http("GET", &format!("127.0.0.1:{port}"), &pq, b"").unwrap_or((502, vec![]));
    let (code, body) = if code == 200 {
        (200, body)
    } else {
        (404, vec![])
    };
    let _ = s
        .write_all(
            format!(
                "HTTP/1.1 {code} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        )
        .and_then(|_| s.write_all(&body));
}

/// The `[s3]` table of a plan (after the waves: a table of its own).
fn s3_table(server: &S3Server) -> String {
    format!(
        "[s3]\nendpoint = \"{}\"\nbucket = \"{BUCKET}\"\nprefix = \"outpost/\"\n",
        server.endpoint()
    )
}

/// `outpost fleet rollout` with the bucket's credentials in its environment.
fn rollout_cmd(plan: &Path, secret: Option<&str>) -> Command {
    let mut c = outpost();
    c.args(["fleet", "rollout"]).arg(plan);
    c.env_remove("AWS_SESSION_TOKEN");
    match secret {
        Some(s) => c
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", s),
        None => c
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY"),
    };
    c
}

/// Opens a signed document with the project's own verification (what a
/// device does): its single entry.
fn verified_entry(body: &[u8], pubkey: &str) -> serde_json::Value {
    let policy = outpost::ota::document::Policy {
        trusted: vec![outpost::ota::sign::parse_public_key(pubkey).unwrap()],
        require_signed: true,
        last_signed: None,
        ..outpost::ota::document::Policy::default()
    };
    let opened = outpost::ota::document::open(body, &policy, outpost::ota::command::unix_ms_now())
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)));
    assert!(opened.signed.is_some());
    assert_eq!(opened.offers.len(), 1);
    serde_json::to_value(&opened.offers[0]).unwrap()
}

fn keypair(w: &Path) -> (PathBuf, String) {
    let key = w.join("fleet");
    cli(&["keygen", "--out", key.to_str().unwrap()]);
    let pubkey = std::fs::read_to_string(w.join("fleet.pub"))
        .unwrap()
        .trim()
        .to_string();
    (key, pubkey)
}

/// A staged rollout whose documents go to a bucket of a real S3-compatible
/// server while two real daemons poll the bucket (through a signed read
/// front): each wave's signed document lands as `outpost/wave-N.json` and
/// `outpost/manifest.json`, verifies with the fleet key, and the devices
/// follow it wave by wave.
#[test]
fn fleet_rollout_writes_signed_waves_to_an_s3_bucket_that_devices_poll() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let broker = crate::uplink::Mosquitto::start(&w.join("mosquitto"));
    let server = S3Server::start(&w.join("s3"));
    let (key, pubkey) = keypair(w);
    let good = model_bundle(w, &key, "1.1.0");
    // The operator uploads the bundle beside where the documents will go
    // (any S3 client does; here a signed PUT), and an empty manifest.
    server.put(
        "outpost/sensor_mlp-1.1.0.tar",
        &std::fs::read(&good).unwrap(),
    );
    server.put("outpost/manifest.json", br#"{"bundles": []}"#);
    let front = start_front(&server);
    let manifest = format!("http://{front}/{BUCKET}/outpost/manifest.json");
    let salt = "s3-1.1.0";
    let pick = |inside: bool, tag: &str| {
        (0..5000)
            .map(|i| format!("{tag}-{i}"))
            .find(|n| (bucket(salt, n) < 50) == inside)
            .unwrap()
    };
    let names = [pick(true, "gw-s3a"), pick(false, "gw-s3b")];
    let daemons: Vec<Daemon> = names
        .iter()
        .map(|n| rollout_device(n, &manifest, &pubkey, broker.port))
        .collect();
    for d in &daemons {
        wait_log_count(d, "uplink: connected", 0, Duration::from_secs(30));
    }
    let waves = format!(
        "[[waves]]\npercent = 50\nmin_devices = 1\nsoak = \"1s\"\n[[waves]]\npercent = 100\nmin_devices = 2\nsoak = \"1s\"\n{}",
        s3_table(&server)
    );
    let plan = plan_file(w, salt, &good, &key, None, broker.port, None, &waves);
    let o = run_within(&mut rollout_cmd(&plan, Some(SECRET_KEY)), w);
    assert!(o.status.success(), "{}\n{}", stderr(&o), daemons[1].log());
    assert!(
        stdout(&o).contains("done: 2 device(s) finished, 0 failed"),
        "{}",
        stdout(&o)
    );
    assert!(!stderr(&o).contains(SECRET_KEY));
    // The objects, read back with signed GETs and verified with the fleet key.
    let w1 = server.get("outpost/wave-1.json").expect("wave-1.json");
    let w2 = server.get("outpost/wave-2.json").expect("wave-2.json");
    let m = server.get("outpost/manifest.json").expect("manifest.json");
    assert_eq!(m, w2, "manifest.json is the last wave's document");
    for (doc, percent) in [(&w1, 50), (&w2, 100)] {
        let e = verified_entry(doc, &pubkey);
        assert_eq!(e["name"], "sensor_mlp");
        assert_eq!(e["version"], "1.1.0");
        assert_eq!(e["url"], "sensor_mlp-1.1.0.tar");
        assert_eq!(e["rollout"]["percent"], percent);
        assert_eq!(e["rollout"]["salt"], salt);
    }
    // What the server keeps in its folder is the same bytes.
    let on_disk = server.root.join(BUCKET).join("outpost");
    assert_eq!(std::fs::read(on_disk.join("wave-1.json")).unwrap(), w1);
    // The devices followed the waves: the first in wave 1 only once.
    for d in &daemons {
        assert_eq!(serving(d), "sensor_mlp@1.1.0");
    }
    assert_eq!(count(&daemons[0], "step=\"installed\""), 1);
    assert!(daemons[1].log().contains("outside the wave"));
}

/// Lines of a child's stderr, as they come.
fn lines_of(child: &mut Child) -> Receiver<String> {
    let (tx, rx) = channel();
    let err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    rx
}

/// Waits for a line with `needle`; returns it and the lines before.
fn wait_line(rx: &Receiver<String>, needle: &str, seen: &mut Vec<String>) -> String {
    let t0 = Instant::now();
    loop {
        let left = Duration::from_secs(60).saturating_sub(t0.elapsed());
        match rx.recv_timeout(left) {
            Ok(l) if l.contains(needle) => {
                seen.push(l.clone());
                return l;
            }
            Ok(l) => seen.push(l),
            Err(_) => panic!("no line with `{needle}` in 60 s:\n{}", seen.join("\n")),
        }
    }
}

/// Wrong credentials end the rollout at its start with the server's 403
/// and S3 error code, nothing written and no state; missing credentials
/// are named. Then, with the right ones, the server goes down mid-rollout:
/// the next wave's write fails with a clear message, is retried with
/// backoff while the state stays at "wave 2 not written", and lands once
/// the server is back.
#[test]
fn fleet_rollout_to_s3_refuses_bad_credentials_and_retries_while_the_server_is_down() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let broker = crate::uplink::Mosquitto::start(&w.join("mosquitto"));
    let mut server = S3Server::start(&w.join("s3"));
    let (key, pubkey) = keypair(w);
    let good = model_bundle(w, &key, "1.1.0");
    let salt = "s3-retry";
    // Wave 1 waits for one finished device; wave 2 follows at once.
    let waves = format!(
        "[[waves]]\npercent = 50\nmin_devices = 1\n[[waves]]\npercent = 100\n{}",
        s3_table(&server)
    );
    let plan = plan_file(w, salt, &good, &key, None, broker.port, None, &waves);
    let state = w.join(format!("{salt}.state.json"));
    let objects = server.root.join(BUCKET).join("outpost");

    // A wrong secret: the server's 403 SignatureDoesNotMatch, at the start.
    let o = run_within(&mut rollout_cmd(&plan, Some("not-the-secret")), w);
    assert_fails(&o, 1, "HTTP 403 Forbidden, S3 error SignatureDoesNotMatch");
    let err = stderr(&o);
    for want in [
        format!("bucket `{BUCKET}`"),
        "key `outpost/manifest.json`".to_string(),
        server.endpoint(),
        "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".to_string(),
    ] {
        assert!(err.contains(&want), "`{want}` missing:\n{err}");
    }
    assert!(!err.contains("not-the-secret") && !err.contains("X-Amz-Signature"));
    assert!(!state.exists(), "no state after a refused start");
    assert!(!objects.exists(), "nothing written");
    // No credentials at all.
    let o = run_within(&mut rollout_cmd(&plan, None), w);
    assert_fails(
        &o,
        1,
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set in the environment",
    );

    // The right credentials; the server stops after wave 1 is written.
    let mut child = KillOnDrop(
        rollout_cmd(&plan, Some(SECRET_KEY))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let rx = lines_of(&mut child.0);
    let mut seen = Vec::new();
    wait_line(&rx, "wave 1: sensor_mlp@1.1.0 to 50 %", &mut seen);
    let w1 = std::fs::read(objects.join("wave-1.json")).unwrap();
    assert_eq!(verified_entry(&w1, &pubkey)["rollout"]["percent"], 50);
    server.stop();
    // A device finishes: wave 1 is done and wave 2 is due, with the server down.
    publish(
        broker.port,
        "outpost/gw-x/ota/sensor_mlp",
        serde_json::to_vec(&serde_json::json!({
            "id": "gw-x/1/1", "device": "gw-x", "pipeline": "ota", "stream": "sensor_mlp",
            "event": {"name": "sensor_mlp", "version": "1.1.0", "step": "installed"}
        }))
        .unwrap(),
    );
    let failed = wait_line(&rx, "wave 2: not written (attempt 1)", &mut seen);
    assert!(
        failed.contains("PUT of key `outpost/wave-2.json` in bucket `fleet`")
            && failed.contains("no answer from the endpoint")
            && failed.contains("retrying in"),
        "{failed}"
    );
    wait_line(&rx, "wave 2: not written (attempt 2)", &mut seen);
    // The state says where it is: wave 2, not written; the device counted.
    let st: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert_eq!(st["wave"], 1, "{st}");
    assert!(st["wave_written_ms"].is_null(), "{st}");
    assert!(st["finished"].is_null(), "{st}");
    assert_eq!(st["devices"]["gw-x"]["outcome"], "succeeded", "{st}");
    assert!(child.0.try_wait().unwrap().is_none(), "it keeps running");
    // Back: the retry lands, the rollout finishes.
    server.restart();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "still running:\n{}",
            seen.join("\n")
        );
        while let Ok(l) = rx.try_recv() {
            seen.push(l);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut out = String::new();
    child
        .0
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(status.success(), "{out}\n{}", seen.join("\n"));
    assert!(
        out.contains("done: 1 device(s) finished, 0 failed"),
        "{out}"
    );
    let w2 = server.get("outpost/wave-2.json").expect("wave-2.json");
    assert_eq!(verified_entry(&w2, &pubkey)["rollout"]["percent"], 100);
    assert_eq!(server.get("outpost/manifest.json").unwrap(), w2);
    let st: serde_json::Value = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
    assert_eq!(st["finished"], "done");
}
