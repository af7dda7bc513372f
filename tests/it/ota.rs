//! Fleet OTA end to end: bundles built and signed with the real CLI from the
//! real sensor_mlp model, served by a small HTTP server on loopback (Range,
//! ETag, truncation on demand), installed by a real daemon; SIGKILL at every
//! step of an update.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;

/// A file the fleet server serves; `truncate` responses end halfway; while
/// `held`, requests for it wait before the response is written.
#[derive(Clone, Default)]
struct Served {
    body: Vec<u8>,
    truncate: usize,
    held: bool,
}

/// (path, Range header) of every GET the fleet server saw.
type RequestLog = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// The fleet: a std HTTP/1.1 server on loopback.
pub(crate) struct Fleet {
    addr: String,
    files: Arc<Mutex<HashMap<String, Served>>>,
    /// (path, Range header) of every GET.
    pub(crate) log: RequestLog,
}

impl Fleet {
    pub(crate) fn start() -> Fleet {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let files: Arc<Mutex<HashMap<String, Served>>> = Arc::default();
        let log: RequestLog = Arc::default();
        let (f, lg) = (files.clone(), log.clone());
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let (f, lg) = (f.clone(), lg.clone());
                std::thread::spawn(move || serve(s, &f, &lg));
            }
        });
        Fleet { addr, files, log }
    }

    pub(crate) fn put(&self, path: &str, body: Vec<u8>) {
        self.files.lock().unwrap().insert(
            path.to_string(),
            Served {
                body,
                ..Served::default()
            },
        );
    }

    /// Requests for `path` wait (after they are logged) until `release`.
    fn hold(&self, path: &str, held: bool) {
        self.files.lock().unwrap().get_mut(path).unwrap().held = held;
    }

    fn truncate_next(&self, path: &str, n: usize) {
        self.files.lock().unwrap().get_mut(path).unwrap().truncate = n;
    }

    /// The manifest document with these entries.
    pub(crate) fn offer(&self, entries: &[serde_json::Value]) {
        let doc = serde_json::json!({ "bundles": entries });
        self.put("/manifest.json", serde_json::to_vec(&doc).unwrap());
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}/manifest.json", self.addr)
    }

    /// Waits until the device fetched the manifest document `n` more times:
    /// polls are sequential, so when the n-th is requested every earlier
    /// one was acted on. What a check of "nothing happened" waits on.
    pub(crate) fn wait_polls(&self, n: usize) {
        let count = || {
            self.log
                .lock()
                .unwrap()
                .iter()
                .filter(|(p, _)| p == "/manifest.json")
                .count()
        };
        let (start, t0) = (count(), Instant::now());
        while count() < start + n {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the device stopped polling the manifest document"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn ranges(&self, path: &str) -> Vec<String> {
        self.log
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == path)
            .filter_map(|(_, r)| r.clone())
            .collect()
    }
}

fn serve(
    mut s: std::net::TcpStream,
    files: &Mutex<HashMap<String, Served>>,
    log: &Mutex<Vec<(String, Option<String>)>>,
) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let (mut range, mut inm) = (None, None);
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
            break;
        }
        let (k, v) = h.split_once(':').unwrap_or(("", ""));
        match k.to_ascii_lowercase().as_str() {
            "range" => range = Some(v.trim().to_string()),
            "if-none-match" => inm = Some(v.trim().to_string()),
            _ => {}
        }
    }
    log.lock().unwrap().push((path.clone(), range.clone()));
    // A held file: the test releases it once it has seen this request.
    while files.lock().unwrap().get(&path).is_some_and(|f| f.held) {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let found = {
        let mut m = files.lock().unwrap();
        m.get_mut(&path).map(|f| {
            let t = f.truncate > 0;
            if t {
                f.truncate -= 1;
            }
            (f.body.clone(), t)
        })
    };
    let Some((body, truncate)) = found else {
        let _ = s
            .write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    let etag = format!(
        "\"{}\"",
        body.len() ^ body.iter().map(|b| *b as usize).sum::<usize>()
    );
    if inm.as_deref() == Some(etag.as_str()) {
        let _ = write!(
            s,
            "HTTP/1.1 304 Not Modified\r\nETag: {etag}\r\nConnection: close\r\n\r\n"
        );
        return;
    }
    let from = range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.trim_end_matches('-').parse::<usize>().ok())
        .filter(|f| *f < body.len());
    let (head, part) = match from {
        Some(f) => (
            format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {f}-{}/{}\r\n",
                body.len() - 1,
                body.len()
            ),
            &body[f..],
        ),
        None => ("HTTP/1.1 200 OK\r\n".to_string(), &body[..]),
    };
    let _ = write!(
        s,
        "{head}Content-Length: {}\r\nETag: {etag}\r\nConnection: close\r\n\r\n",
        part.len()
    );
    let send = if truncate {
        &part[..part.len() / 2]
    } else {
        part
    };
    let _ = s.write_all(send);
}

/// Runs the real CLI; panics with its stderr on failure.
fn cli(args: &[&str]) -> String {
    let o = run(outpost().args(args));
    assert!(o.status.success(), "outpost {args:?}: {}", stderr(&o));
    stdout(&o)
}

/// A key pair; returns (private key path, public key text).
pub(crate) fn keygen(dir: &Path, name: &str) -> (PathBuf, String) {
    let k = dir.join(name);
    cli(&["keygen", "--out", k.to_str().unwrap()]);
    let p = std::fs::read_to_string(dir.join(format!("{name}.pub"))).unwrap();
    (k, p.trim().to_string())
}

/// sensor_mlp copied into `dir/<tag>/sensor_mlp` at `version`.
fn model_version(dir: &Path, tag: &str, version: &str) -> PathBuf {
    let to = copy_model("sensor_mlp", &dir.join(tag));
    let m = to.join("manifest.toml");
    let t = std::fs::read_to_string(&m)
        .unwrap()
        .replace("version = \"1.0.0\"", &format!("version = \"{version}\""));
    std::fs::write(&m, t).unwrap();
    to
}

fn ref_check() -> String {
    model_dir().join("sensor_mlp/ref").display().to_string()
}

/// Builds, signs and describes a bundle; returns its manifest entry.
fn bundle(
    fleet: &Fleet,
    key: &Path,
    build: &[&str],
    out: &Path,
    entry: &[&str],
) -> serde_json::Value {
    let o = out.to_str().unwrap();
    let mut args = vec!["bundle", "build", "--out", o];
    args.extend_from_slice(build);
    cli(&args);
    cli(&["bundle", "sign", "--key", key.to_str().unwrap(), o]);
    let name = out.file_name().unwrap().to_str().unwrap();
    let mut args = vec!["bundle", "entry", "--url", name, o];
    args.extend_from_slice(entry);
    let e: serde_json::Value = serde_json::from_str(&cli(&args)).unwrap();
    fleet.put(&format!("/{name}"), std::fs::read(out).unwrap());
    e
}

pub(crate) fn model_bundle(
    fleet: &Fleet,
    key: &Path,
    dir: &Path,
    version: &str,
) -> serde_json::Value {
    let m = model_version(dir, &format!("v{version}"), version);
    let check = ref_check();
    bundle(
        fleet,
        key,
        &["--model-dir", m.to_str().unwrap(), "--check", &check],
        &dir.join(format!("sensor_mlp-{version}.tar")),
        &[],
    )
}

pub(crate) fn config(fleet: &Fleet, pubkey: &str, extra: &str) -> String {
    format!(
        r#"
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
manifest_url = "{}"
trusted_keys = ["{pubkey}"]
poll_interval = "200ms"
poll_jitter = "50ms"
probation = "1s"
min_runs = 5
{extra}
"#,
        fleet.url()
    )
}

/// A daemon folder with sensor_mlp 1.0.0 in its model dir.
pub(crate) fn device_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    copy_model("sensor_mlp", &d.path().join("models"));
    d
}

/// The device's own model dir. `outpost()` points OUTPOST_MODEL_DIR (which
/// beats the config) at the checkout's models/, which an update must never
/// touch: every daemon here gets its own.
fn device_env(dir: &tempfile::TempDir) -> [(&'static str, String); 1] {
    [(
        "OUTPOST_MODEL_DIR",
        dir.path().join("models").display().to_string(),
    )]
}

/// Starts a device daemon on its own model dir; waits for /readyz.
pub(crate) fn start(cfg: &str, dir: tempfile::TempDir) -> Daemon {
    let env = device_env(&dir);
    let d = Daemon::start_full(cfg, dir, &env, true);
    assert!(
        !d.log()
            .contains(&model_dir().join("sensor_mlp").display().to_string()),
        "the daemon must not serve the checkout's models:\n{}",
        d.log()
    );
    d
}

pub(crate) fn wait_log(d: &Daemon, needle: &str, timeout: Duration) -> String {
    let t0 = Instant::now();
    loop {
        let log = d.log();
        if log.contains(needle) {
            return log;
        }
        assert!(
            t0.elapsed() < timeout,
            "no `{needle}` in {timeout:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub(crate) fn serving(d: &Daemon) -> String {
    d.status()["pipelines"][0]["model"]
        .as_str()
        .unwrap()
        .to_string()
}

const SAMPLE: &str = "[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

/// One inference through the API; returns the model of its record.
pub(crate) fn infer_ok(d: &Daemon) {
    let (code, body) = http(
        "POST",
        &d.api,
        "/v1/pipelines/sensors/infer",
        SAMPLE.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
}

#[test]
fn model_update_under_load_loses_no_request_then_downgrade_refused_and_signed_rollback_installs() {
    let work = tempfile::tempdir().unwrap();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(work.path(), "fleet");
    let e = model_bundle(&fleet, &key, work.path(), "1.1.0");
    fleet.offer(&[]);
    let mut d = start(&config(&fleet, &pubkey, ""), device_dir());
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");

    // Steady load through the swap.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let bad = Arc::new(Mutex::new(Vec::new()));
    let hammer = {
        let (stop, ok, bad, api) = (stop.clone(), ok.clone(), bad.clone(), d.api.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match http(
                    "POST",
                    &api,
                    "/v1/pipelines/sensors/infer",
                    SAMPLE.as_bytes(),
                ) {
                    Ok((200, _)) => {
                        ok.fetch_add(1, Ordering::SeqCst);
                    }
                    other => bad.lock().unwrap().push(format!("{other:?}")),
                }
            }
        })
    };
    // Requests answered before the offer, through the swap, and after it.
    let answered = |n: usize| {
        let t0 = Instant::now();
        while ok.load(Ordering::SeqCst) < n {
            assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    answered(10);
    fleet.offer(&[e]);
    wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    answered(ok.load(Ordering::SeqCst) + 10);
    stop.store(true, Ordering::SeqCst);
    hammer.join().unwrap();
    assert!(bad.lock().unwrap().is_empty(), "{:?}", bad.lock().unwrap());
    let n = ok.load(Ordering::SeqCst);
    assert!(n > 20, "only {n} requests");
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    let recs = d
        .records_until(Duration::from_secs(10), |r| r.len() >= n)
        .to_vec();
    assert_eq!(recs.len(), n, "every answered request is a record");
    let versions: std::collections::BTreeSet<_> = recs
        .iter()
        .map(|r| r["model"].as_str().unwrap().to_string())
        .collect();
    assert!(
        versions.contains("sensor_mlp@1.0.0") && versions.contains("sensor_mlp@1.1.0"),
        "{versions:?}"
    );
    // Installed on disk: the link, the previous version kept.
    let link = d.dir.path().join("models/sensor_mlp");
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    let data = d.dir.path().join("data/ota/models");
    assert!(
        data.join("sensor_mlp@1.0.0/sensor_mlp/sensor_mlp.onnx")
            .exists()
    );

    // Plain downgrade: refused before any download.
    let old = bundle(
        &fleet,
        &key,
        &[
            "--model-dir",
            model_dir().join("sensor_mlp").to_str().unwrap(),
        ],
        &work.path().join("sensor_mlp-1.0.0.tar"),
        &[],
    );
    fleet.offer(&[old]);
    wait_log(&d, "without a signed rollback", Duration::from_secs(10));
    assert!(fleet.ranges("/sensor_mlp-1.0.0.tar").is_empty());
    assert!(
        !fleet
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|(p, _)| p == "/sensor_mlp-1.0.0.tar")
    );
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");

    // A restart serves the installed version.
    let dir = d.stop_keep_dir();
    fleet.offer(&[]);
    let mut d = start(&config(&fleet, &pubkey, ""), dir);
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    infer_ok(&d);

    // Signed rollback: goes down to 1.0.0.
    let rb = bundle(
        &fleet,
        &key,
        &[
            "--model-dir",
            model_dir().join("sensor_mlp").to_str().unwrap(),
            "--rollback",
        ],
        &work.path().join("sensor_mlp-1.0.0-rb.tar"),
        &["--rollback"],
    );
    fleet.offer(&[rb]);
    wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
    infer_ok(&d);
    assert_eq!(d.terminate().code(), Some(0));
}

#[test]
fn bad_bundles_are_refused_and_the_old_model_keeps_serving() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(w, "fleet");
    let (stranger, _) = keygen(w, "stranger");

    // Corrupt in transit: the served bytes differ from the offer's sha256.
    let corrupt = model_bundle(&fleet, &key, w, "1.2.0");
    let mut bytes = std::fs::read(w.join("sensor_mlp-1.2.0.tar")).unwrap();
    let n = bytes.len();
    bytes[n - 2000] ^= 0xff;
    fleet.put("/sensor_mlp-1.2.0.tar", bytes);
    // Bad signature: another bundle's signature.
    let mut badsig = model_bundle(&fleet, &key, w, "1.3.0");
    badsig["signature"] = corrupt["signature"].clone();
    // Unknown key.
    let m = model_version(w, "v1.4.0", "1.4.0");
    let unknown = bundle(
        &fleet,
        &stranger,
        &["--model-dir", m.to_str().unwrap()],
        &w.join("sensor_mlp-1.4.0.tar"),
        &[],
    );
    // A daemon for another target.
    let bin = w.join("outpost-aarch64");
    std::fs::write(&bin, b"\x7fELF pretend aarch64").unwrap();
    let daemon = bundle(
        &fleet,
        &key,
        &[
            "--daemon",
            bin.to_str().unwrap(),
            "--target",
            "riscv64gc-unknown-linux-gnu",
            "--version",
            "9.0.0",
        ],
        &w.join("outpost-9.0.0.tar"),
        &[],
    );
    // Garbage model file with a matching sha256: fails at load / warm-up.
    let g = model_version(w, "v1.5.0", "1.5.0");
    let junk = b"this is not an onnx model".to_vec();
    std::fs::write(g.join("sensor_mlp.onnx"), &junk).unwrap();
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&junk))
    };
    let mt = g.join("manifest.toml");
    let t = std::fs::read_to_string(&mt).unwrap();
    let t = t
        .lines()
        .map(|l| {
            if l.starts_with("sha256") {
                format!("sha256 = \"{sha}\"")
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&mt, t).unwrap();
    let garbage = bundle(
        &fleet,
        &key,
        &["--model-dir", g.to_str().unwrap(), "--no-check"],
        &w.join("sensor_mlp-1.5.0.tar"),
        &[],
    );
    // Fails its check: expected outputs changed.
    let chk = w.join("wrongcheck");
    std::fs::create_dir_all(chk.join("in")).unwrap();
    std::fs::create_dir_all(chk.join("out")).unwrap();
    std::fs::copy(
        model_dir().join("sensor_mlp/ref/in/input.npy"),
        chk.join("in/input.npy"),
    )
    .unwrap();
    let mut out = std::fs::read(model_dir().join("sensor_mlp/ref/out/probs.npy")).unwrap();
    let l = out.len();
    out[l - 3] ^= 0x40; // one float's exponent bits of the last value
    std::fs::write(chk.join("out/probs.npy"), out).unwrap();
    let c = model_version(w, "v1.6.0", "1.6.0");
    let failing = bundle(
        &fleet,
        &key,
        &[
            "--model-dir",
            c.to_str().unwrap(),
            "--check",
            chk.to_str().unwrap(),
        ],
        &w.join("sensor_mlp-1.6.0.tar"),
        &[],
    );
    // The CLI tells a foreign signature apart.
    let o = run(outpost().args([
        "bundle",
        "verify",
        "--pub",
        &pubkey,
        w.join("sensor_mlp-1.4.0.tar").to_str().unwrap(),
    ]));
    assert_fails(&o, 1, "not trusted");
    cli(&[
        "bundle",
        "verify",
        "--pub",
        &pubkey,
        w.join("sensor_mlp-1.3.0.tar").to_str().unwrap(),
    ]);

    fleet.offer(&[corrupt, badsig, unknown, daemon, garbage, failing]);
    let d = start(&config(&fleet, &pubkey, ""), device_dir());
    let log = wait_log(&d, "step=\"check_failed\"", Duration::from_secs(30));
    let line = |needle: &str| {
        log.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no `{needle}`:\n{log}"))
            .to_string()
    };
    assert!(line("step=\"corrupt\"").contains("sha256"));
    assert!(
        line("version=1.3.0").contains("bad signature") || log.contains("bad signature"),
        "{log}"
    );
    assert!(log.contains("not trusted here"), "{log}");
    assert!(
        log.contains("built for riscv64gc-unknown-linux-gnu"),
        "{log}"
    );
    assert!(line("step=\"load_failed\"").contains("1.5.0"));
    assert!(line("step=\"check_failed\"").contains("probs"));
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
    infer_ok(&d);
    // Nothing of the refused bundles stays unpacked; the model dir is untouched.
    let models = d.dir.path().join("data/ota/models");
    // (The refusal's clean-up follows its status line.)
    let t0 = Instant::now();
    loop {
        let left: Vec<_> = std::fs::read_dir(&models)
            .map(|r| r.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        if left.is_empty() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "{left:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        std::fs::symlink_metadata(d.dir.path().join("models/sensor_mlp"))
            .unwrap()
            .is_dir()
    );
}

#[test]
fn truncated_download_resumes_with_range_under_a_bandwidth_cap() {
    let work = tempfile::tempdir().unwrap();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(work.path(), "fleet");
    let e = model_bundle(&fleet, &key, work.path(), "1.1.0");
    fleet.truncate_next("/sensor_mlp-1.1.0.tar", 1);
    fleet.offer(&[e]);
    let d = start(
        &config(&fleet, &pubkey, "max_bytes_per_s = 200000"),
        device_dir(),
    );
    let log = wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    assert!(log.contains("step=\"download_failed\""), "{log}");
    assert!(log.contains("resuming download"), "{log}");
    assert_eq!(fleet.ranges("/sensor_mlp-1.1.0.tar").len(), 1);
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
}

/// Runs a daemon that will SIGKILL itself at `step` (it may do so before
/// it is ready) and waits for the kill.
fn crash_at(cfg: &str, dir: tempfile::TempDir, step: &str) -> tempfile::TempDir {
    let text = cfg
        .replace("{API}", "127.0.0.1:0")
        .replace("{DATA}", &dir.path().join("data").display().to_string())
        .replace("{DIR}", &dir.path().display().to_string());
    let path = dir.path().join("outpost.toml");
    std::fs::write(&path, text).unwrap();
    let log = dir.path().join("crash.log");
    let mut child = outpost()
        .arg("--config")
        .arg(&path)
        .arg("run")
        .env("RUST_LOG", "info,ort=warn")
        .env("OUTPOST_OTA_FAILPOINT", step)
        .envs(device_env(&dir))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            panic!(
                "no crash at {step}:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        st.signal(),
        Some(9),
        "{step}: {st}\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    dir
}

fn after_crash(fleet: &Fleet, cfg: &str, dir: tempfile::TempDir, step: &str, final_version: &str) {
    let d = start(cfg, dir);
    let now = serving(&d);
    assert!(
        now == "sensor_mlp@1.0.0" || now == "sensor_mlp@1.1.0",
        "{step}: serving {now}"
    );
    infer_ok(&d);
    // Then it settles: installed for good, or refused after a crash in probation.
    let t0 = Instant::now();
    while serving(&d) != final_version
        || (final_version.ends_with("1.1.0")
            && !d.dir.path().join("models/sensor_mlp").is_symlink())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{step}: serving {}\n{}",
            serving(&d),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    infer_ok(&d);
    if final_version.ends_with("1.0.0") {
        wait_log(&d, "step=\"rolled_back\"", Duration::from_secs(5));
        fleet.wait_polls(3);
        assert_eq!(
            serving(&d),
            final_version,
            "{step}: the refused version came back"
        );
    }
}

fn sigkill_steps(steps: &[(&str, &str)]) {
    let work = tempfile::tempdir().unwrap();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(work.path(), "fleet");
    let e = model_bundle(&fleet, &key, work.path(), "1.1.0");
    fleet.offer(&[e]);
    let cfg = config(&fleet, &pubkey, "");
    for (step, final_version) in steps {
        let dir = crash_at(&cfg, device_dir(), step);
        after_crash(&fleet, &cfg, dir, step, final_version);
    }
}

#[test]
fn sigkill_before_the_swap_leaves_the_old_version_and_the_update_completes() {
    sigkill_steps(&[
        ("downloaded", "sensor_mlp@1.1.0"),
        ("verified", "sensor_mlp@1.1.0"),
        ("staged", "sensor_mlp@1.1.0"),
        ("loaded", "sensor_mlp@1.1.0"),
    ]);
}

#[test]
fn sigkill_after_the_swap_serves_one_complete_version() {
    sigkill_steps(&[
        ("checked", "sensor_mlp@1.1.0"),
        // In probation: the restart serves 1.0.0 and refuses 1.1.0.
        ("swapped", "sensor_mlp@1.0.0"),
        ("switched", "sensor_mlp@1.1.0"),
        ("committed", "sensor_mlp@1.1.0"),
    ]);
}

#[test]
fn sigkill_mid_download_resumes() {
    let work = tempfile::tempdir().unwrap();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(work.path(), "fleet");
    let e = model_bundle(&fleet, &key, work.path(), "1.1.0");
    let size = e["size"].as_u64().unwrap();
    let sha = e["sha256"].as_str().unwrap().to_string();
    fleet.offer(&[e]);
    // About 2 s for the whole bundle.
    let slow = config(&fleet, &pubkey, &format!("max_bytes_per_s = {}", size / 2));
    let mut d = start(&slow, device_dir());
    let part = d.dir.path().join("data/ota/downloads").join(&sha);
    let t0 = Instant::now();
    while std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = d.child.kill();
    let _ = d.child.wait();
    let have = std::fs::metadata(&part).unwrap().len();
    assert!(have < size, "killed mid-download ({have} of {size})");
    let dir = std::mem::replace(&mut d.dir, tempfile::tempdir().unwrap());
    drop(d);
    // The rest of the bundle is held back until the restarted daemon has
    // asked for it with a Range and the old version is seen serving: without
    // the hold an uncapped download can install before the check.
    let tar = "/sensor_mlp-1.1.0.tar";
    fleet.hold(tar, true);
    let d = start(&config(&fleet, &pubkey, ""), dir);
    let t0 = Instant::now();
    while fleet.ranges(tar).is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
    fleet.hold(tar, false);
    wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    assert!(
        !fleet.ranges("/sensor_mlp-1.1.0.tar").is_empty(),
        "resumed with Range"
    );
    infer_ok(&d);
}

/// A model whose p99 latency passes the probation threshold is rolled back
/// while it serves: the old version serves again, in memory and after a
/// restart, and the bundle is refused for good.
#[test]
fn probation_rolls_back_a_model_that_breaks_its_latency_threshold() {
    let work = tempfile::tempdir().unwrap();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(work.path(), "fleet");
    let e = model_bundle(&fleet, &key, work.path(), "1.1.0");
    fleet.offer(&[]);
    // No sensor_mlp run takes under 1 µs: once min_runs frames ran on the
    // new version, its p99 passes the threshold.
    let cfg = config(&fleet, &pubkey, "max_p99_latency = \"1us\"")
        .replace("probation = \"1s\"", "probation = \"30s\"");
    let d = start(&cfg, device_dir());
    fleet.offer(&[e]);
    wait_log(&d, "step=\"probation\"", Duration::from_secs(20));
    assert_eq!(serving(&d), "sensor_mlp@1.1.0", "serves on probation");
    let t0 = Instant::now();
    while !d.log().contains("step=\"rolled_back\"") {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
        infer_ok(&d);
    }
    let log = d.log();
    assert!(log.contains("passes max_p99_latency"), "{log}");
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
    infer_ok(&d);
    // Not committed: the model dir still holds the packaged folder.
    assert!(!d.dir.path().join("models/sensor_mlp").is_symlink());
    // Refused for good: the offer stays, nothing is downloaded again.
    let gets = fleet
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == "/sensor_mlp-1.1.0.tar")
        .count();
    fleet.wait_polls(3);
    let again = fleet
        .log
        .lock()
        .unwrap()
        .iter()
        .filter(|(p, _)| p == "/sensor_mlp-1.1.0.tar")
        .count();
    assert_eq!(gets, again, "a refused bundle is not fetched again");
    let dir = d.stop_keep_dir();
    // Every step went into the outbox, to go upstream like a result.
    let data = dir.path().join("data");
    let out = cli(&["outbox", "export", "--data-dir", data.to_str().unwrap()]);
    let steps: Vec<String> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|r| r["record"]["pipeline"] == "ota")
        .map(|r| {
            r["record"]["event"]["step"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(
        steps,
        [
            "downloading",
            "verified",
            "staged",
            "loaded",
            "checked",
            "probation",
            "rolled_back"
        ],
        "{out}"
    );
    let d = start(&cfg, dir);
    fleet.wait_polls(3);
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
}

/// Publishes one MQTT message at QoS 1 and waits for its PUBACK.
pub(crate) fn publish(port: u16, topic: &str, payload: Vec<u8>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let o = rumqttc::MqttOptions::new(format!("fleet-cmd-{}", free_port()), "127.0.0.1", port);
        let (client, mut ev) = rumqttc::AsyncClient::new(o, 10);
        client
            .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload)
            .await
            .unwrap();
        let t0 = Instant::now();
        loop {
            assert!(t0.elapsed() < Duration::from_secs(10), "no PUBACK");
            if let Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_)))) =
                tokio::time::timeout(Duration::from_secs(1), ev.poll()).await
            {
                break;
            }
        }
        let _ = client.disconnect().await;
    });
}

/// A metric's value from /metrics (0 when absent).
pub(crate) fn metric(d: &Daemon, line_start: &str) -> f64 {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Signed commands on the MQTT uplink's command topic, without any manifest
/// document: an update and a signed rollback install; a stranger's
/// signature, a replay, a command dated far ahead of the device's clock and
/// another device's command are refused and counted.
#[test]
fn signed_mqtt_commands_update_and_roll_back_and_bad_ones_are_refused() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let broker = crate::uplink::Mosquitto::start(&w.join("mosquitto"));
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(w, "fleet");
    let (stranger, _) = keygen(w, "stranger");
    model_bundle(&fleet, &key, w, "1.1.0");
    let up = w.join("sensor_mlp-1.1.0.tar");
    let rb = w.join("sensor_mlp-1.0.0-rb.tar");
    bundle(
        &fleet,
        &key,
        &[
            "--model-dir",
            model_dir().join("sensor_mlp").to_str().unwrap(),
            "--rollback",
        ],
        &rb,
        &["--rollback"],
    );
    let cfg = format!(
        r#"
data_dir = "{{DATA}}"
model_dir = "{{DIR}}/models"
device = "gw-7"
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
[ota]
trusted_keys = ["{pubkey}"]
probation = "1s"
min_runs = 5
"#,
        broker.port
    );
    let d = start(&cfg, device_dir());
    wait_log(&d, "subscribed to update commands", Duration::from_secs(20));
    let url = |p: &Path| {
        format!(
            "http://{}/{}",
            fleet.addr,
            p.file_name().unwrap().to_str().unwrap()
        )
    };
    let command = |key: &Path, device: &str, extra: &[&str], b: &Path| -> Vec<u8> {
        let mut args = vec![
            "bundle",
            "command",
            "--key",
            key.to_str().unwrap(),
            "--device",
            device,
            "--expires-in",
            "10m",
        ];
        let u = url(b);
        args.extend_from_slice(&["--url", &u]);
        args.extend_from_slice(extra);
        args.push(b.to_str().unwrap());
        cli(&args).trim().as_bytes().to_vec()
    };
    let topic = "outpost/gw-7/cmd";
    let refused = |reason: &str| format!("outpost_ota_commands_total{{result=\"{reason}\"}}");

    // A stranger's signature.
    publish(broker.port, topic, command(&stranger, "gw-7", &[], &up));
    wait_log(&d, "step=\"commands_refused\"", Duration::from_secs(10));
    assert_eq!(metric(&d, &refused("signature")), 1.0);
    // Garbage.
    publish(broker.port, topic, b"not a command".to_vec());
    let t0 = Instant::now();
    while metric(&d, &refused("malformed")) < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");

    // Genuinely signed but dated in 2100: a key holder's wrong clock or a
    // command made to outlive every later one. Refused as from the future,
    // and it must not raise the replay floor: the genuine update that
    // follows is taken.
    let mut env: outpost::ota::command::Envelope =
        serde_json::from_slice(&command(&key, "gw-7", &[], &up)).unwrap();
    let mut dated: outpost::ota::command::Command = serde_json::from_str(&env.command).unwrap();
    dated.issued_ms = 4_102_444_800_000;
    dated.expires_ms = Some(dated.issued_ms + 600_000);
    let signing = outpost::ota::sign::read_signing_key(&key).unwrap();
    env = outpost::ota::command::seal(&signing, &dated).unwrap();
    publish(broker.port, topic, serde_json::to_vec(&env).unwrap());
    let t0 = Instant::now();
    while metric(&d, &refused("future")) < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_log(&d, "ahead of this device's clock", Duration::from_secs(5));
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");

    // The update.
    let update = command(&key, "gw-7", &[], &up);
    publish(broker.port, topic, update.clone());
    wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    infer_ok(&d);
    // Replayed: refused.
    publish(broker.port, topic, update);
    // Another device's (signed, fresh): refused.
    publish(broker.port, topic, command(&key, "gw-8", &[], &rb));
    let t0 = Instant::now();
    while metric(&d, &refused("replay")) < 1.0 || metric(&d, &refused("other_device")) < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");

    // The signed rollback.
    publish(
        broker.port,
        topic,
        command(&key, "gw-7", &["--rollback"], &rb),
    );
    let t0 = Instant::now();
    while serving(&d) != "sensor_mlp@1.0.0" || d.log().matches("step=\"installed\"").count() < 2 {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    infer_ok(&d);
    assert_eq!(metric(&d, &refused("accepted")), 2.0);
    assert_eq!(
        fleet
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == "/manifest.json")
            .count(),
        0,
        "no manifest document involved"
    );
}

/// Emulates systemd's `Restart=on-failure` for `outpost run`: starts the
/// packaged binary again whenever it exits with a non-zero code (75: a
/// daemon update asks for it), up to a limit; collects the exit codes.
struct Supervisor {
    stop: Arc<AtomicBool>,
    exits: Arc<Mutex<Vec<i32>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Supervisor {
    fn start(cfg: &Path, env: Vec<(&'static str, String)>, log: PathBuf) -> Supervisor {
        let stop = Arc::new(AtomicBool::new(false));
        let exits: Arc<Mutex<Vec<i32>>> = Arc::default();
        let (s, e, cfg) = (stop.clone(), exits.clone(), cfg.to_path_buf());
        let thread = std::thread::spawn(move || {
            for _ in 0..12 {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap();
                let mut c = outpost()
                    .arg("--config")
                    .arg(&cfg)
                    .arg("run")
                    .env("RUST_LOG", "info,ort=warn")
                    .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                    .stdout(std::process::Stdio::null())
                    .stderr(f)
                    .spawn()
                    .unwrap();
                let st = loop {
                    if let Some(st) = c.try_wait().unwrap() {
                        break st;
                    }
                    if s.load(Ordering::SeqCst) {
                        let _ = std::process::Command::new("kill")
                            .arg("-TERM")
                            .arg(c.id().to_string())
                            .status();
                        break c.wait().unwrap();
                    }
                    std::thread::sleep(Duration::from_millis(20));
                };
                let code = st.code().unwrap_or(-1);
                e.lock().unwrap().push(code);
                if code == 0 || s.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        Supervisor {
            stop,
            exits,
            thread: Some(thread),
        }
    }

    fn exits(&self) -> Vec<i32> {
        self.exits.lock().unwrap().clone()
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits for the running daemon to answer /v1/status with `version` from `slot`.
fn wait_daemon(api: &str, version: &str, slot: &str, log: &Path) -> serde_json::Value {
    let t0 = Instant::now();
    loop {
        if let Ok((200, body)) = http("GET", api, "/v1/status", b"") {
            let st: serde_json::Value = serde_json::from_slice(&body).unwrap();
            if st["daemon"]["version"] == version
                && st["daemon"]["slot"] == slot
                && st["ready"] == true
            {
                return st;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "daemon {version} from slot {slot} not serving in 60 s:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Signed daemon bundles: 0.9.0 holds the daemon under test (stripped: the
/// debug build is ~280 MB), 0.9.1 a binary that exits 1 at once.
fn daemon_bundles(w: &Path, fleet: &Fleet, key: &Path) -> (serde_json::Value, serde_json::Value) {
    let target = format!(
        "{}-unknown-linux-{}",
        std::env::consts::ARCH,
        if cfg!(target_env = "musl") {
            "musl"
        } else {
            "gnu"
        }
    );
    let bin = w.join("outpost");
    let st = std::process::Command::new("strip")
        .arg("-o")
        .arg(&bin)
        .arg(env!("CARGO_BIN_EXE_outpost"))
        .status()
        .expect("strip (binutils)");
    assert!(st.success());
    let good = bundle(
        fleet,
        key,
        &[
            "--daemon",
            bin.to_str().unwrap(),
            "--target",
            &target,
            "--version",
            "0.9.0",
        ],
        &w.join("outpost-0.9.0.tar"),
        &[],
    );
    // A binary that cannot serve: exits 1 at once.
    let broken = w.join("broken");
    std::fs::write(&broken, "#!/bin/sh\necho 'broken build' >&2\nexit 1\n").unwrap();
    let bad = bundle(
        fleet,
        key,
        &[
            "--daemon",
            broken.to_str().unwrap(),
            "--target",
            &target,
            "--version",
            "0.9.1",
        ],
        &w.join("outpost-0.9.1.tar"),
        &[],
    );
    (good, bad)
}

/// The device config for the daemon-update tests, written into `dir`;
/// returns (config path, API address).
fn daemon_device(dir: &tempfile::TempDir, fleet: &Fleet, pubkey: &str) -> (PathBuf, String) {
    let api = format!("127.0.0.1:{}", free_port());
    let cfg_path = dir.path().join("outpost.toml");
    let cfg = config(
        fleet,
        pubkey,
        "daemon_probation = \"1s\"\ndaemon_max_attempts = 2\ndaemon_ready_timeout = \"60s\"",
    )
    .replace("{API}", &api)
    .replace("{DATA}", &dir.path().join("data").display().to_string())
    .replace("{DIR}", &dir.path().display().to_string());
    std::fs::write(&cfg_path, cfg).unwrap();
    (cfg_path, api)
}

/// Waits until boot.json names `slot` good with no trial.
fn wait_good(slots: &Path, slot: &str, log: &Path) {
    let t0 = Instant::now();
    loop {
        if let Ok(b) = std::fs::read(slots.join("boot.json")) {
            let boot: serde_json::Value = serde_json::from_slice(&b).unwrap();
            if boot["good"] == slot && boot["trying"].is_null() {
                return;
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "slot {slot} not good:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGKILL right after a daemon slot was activated (boot.json and the
/// `current` link written, before the graceful restart): the next start
/// runs the new slot, which proves itself.
#[test]
fn sigkill_after_a_daemon_slot_is_activated_starts_the_new_slot() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(w, "fleet");
    let (good, _) = daemon_bundles(w, &fleet, &key);
    fleet.offer(&[good]);
    let dir = device_dir();
    let (cfg_path, api) = daemon_device(&dir, &fleet, &pubkey);
    let log = dir.path().join("daemon.log");
    let mut child = outpost()
        .arg("--config")
        .arg(&cfg_path)
        .arg("run")
        .env("RUST_LOG", "info,ort=warn")
        .env("OUTPOST_OTA_FAILPOINT", "activated")
        .envs(device_env(&dir))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        st.signal(),
        Some(9),
        "{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    let slots = dir.path().join("data/slots");
    let sup = Supervisor::start(&cfg_path, device_env(&dir).to_vec(), log.clone());
    wait_daemon(&api, "0.9.0", "a", &log);
    wait_good(&slots, "a", &log);
    assert!(
        sup.exits().is_empty(),
        "no restart needed: {:?}",
        sup.exits()
    );
    drop(sup);
}

/// Daemon updates end to end under an emulated service manager: a signed
/// daemon bundle is installed into slot a, the daemon restarts into it
/// (exit 75), proves itself and is marked good; then a bundle whose binary
/// cannot start is tried in slot b, fails its starts, and the launcher's boot
/// counter falls back to slot a, which reports the rollback and refuses that
/// bundle for good.
#[test]
fn daemon_update_runs_from_a_new_slot_and_a_broken_one_falls_back() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let fleet = Fleet::start();
    let (key, pubkey) = keygen(w, "fleet");
    let (good, bad) = daemon_bundles(w, &fleet, &key);
    fleet.offer(&[good]);
    let dir = device_dir();
    let (cfg_path, api) = daemon_device(&dir, &fleet, &pubkey);
    let log = dir.path().join("daemon.log");
    let sup = Supervisor::start(&cfg_path, device_env(&dir).to_vec(), log.clone());
    let slots = dir.path().join("data/slots");

    // The update: downloaded, verified, put in slot a; the daemon restarts into it.
    let st = wait_daemon(&api, "0.9.0", "a", &log);
    assert_eq!(st["pipelines"][0]["model"], "sensor_mlp@1.0.0");
    assert_eq!(sup.exits(), [75], "one graceful stop for the restart");
    assert_eq!(
        std::fs::read_link(slots.join("current")).unwrap(),
        Path::new("a")
    );
    // Marked good after READY + daemon_probation.
    wait_good(&slots, "a", &log);
    let (code, _) = http(
        "POST",
        &api,
        "/v1/pipelines/sensors/infer",
        SAMPLE.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200);

    // The broken update: tried in slot b, fails twice, falls back to a.
    fleet.offer(&[bad]);
    let t0 = Instant::now();
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("step=\"rolled_back\"")
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "exits {:?}\n{}",
            sup.exits(),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let st = wait_daemon(&api, "0.9.0", "a", &log);
    assert_eq!(st["ready"], true);
    assert_eq!(
        sup.exits(),
        [75, 75, 1, 1],
        "restart, then two failed starts of slot b"
    );
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("broken build").count(), 2, "{text}");
    assert!(
        text.contains("slot b did not stay up after 2 start(s)"),
        "{text}"
    );
    let boot: serde_json::Value =
        serde_json::from_slice(&std::fs::read(slots.join("boot.json")).unwrap()).unwrap();
    assert_eq!(boot["good"], "a");
    assert!(
        boot["trying"].is_null() && boot["fell_back"].is_null(),
        "{boot}"
    );
    assert_eq!(
        std::fs::read_link(slots.join("current")).unwrap(),
        Path::new("a")
    );
    // Refused for good: the offer stays, the bundle is not fetched again.
    let fetched = || {
        fleet
            .log
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, _)| p == "/outpost-0.9.1.tar")
            .count()
    };
    let n = fetched();
    fleet.wait_polls(3);
    assert_eq!(fetched(), n);
    assert_eq!(sup.exits().len(), 4, "no more restarts");
    let (code, _) = http(
        "POST",
        &api,
        "/v1/pipelines/sensors/infer",
        SAMPLE.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200);
    drop(sup);
}
