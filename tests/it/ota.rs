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

/// A file the fleet server serves; `truncate` responses end halfway.
#[derive(Clone, Default)]
struct Served {
    body: Vec<u8>,
    truncate: usize,
}

/// (path, Range header) of every GET the fleet server saw.
type RequestLog = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// The fleet: a std HTTP/1.1 server on loopback.
struct Fleet {
    addr: String,
    files: Arc<Mutex<HashMap<String, Served>>>,
    /// (path, Range header) of every GET.
    log: RequestLog,
}

impl Fleet {
    fn start() -> Fleet {
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

    fn put(&self, path: &str, body: Vec<u8>) {
        self.files
            .lock()
            .unwrap()
            .insert(path.to_string(), Served { body, truncate: 0 });
    }

    fn truncate_next(&self, path: &str, n: usize) {
        self.files.lock().unwrap().get_mut(path).unwrap().truncate = n;
    }

    /// The manifest document with these entries.
    fn offer(&self, entries: &[serde_json::Value]) {
        let doc = serde_json::json!({ "bundles": entries });
        self.put("/manifest.json", serde_json::to_vec(&doc).unwrap());
    }

    fn url(&self) -> String {
        format!("http://{}/manifest.json", self.addr)
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
fn keygen(dir: &Path, name: &str) -> (PathBuf, String) {
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

fn model_bundle(fleet: &Fleet, key: &Path, dir: &Path, version: &str) -> serde_json::Value {
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

fn config(fleet: &Fleet, pubkey: &str, extra: &str) -> String {
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
fn device_dir() -> tempfile::TempDir {
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
fn start(cfg: &str, dir: tempfile::TempDir) -> Daemon {
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

fn wait_log(d: &Daemon, needle: &str, timeout: Duration) -> String {
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

fn serving(d: &Daemon) -> String {
    d.status()["pipelines"][0]["model"]
        .as_str()
        .unwrap()
        .to_string()
}

const SAMPLE: &str = "[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

/// One inference through the API; returns the model of its record.
fn infer_ok(d: &Daemon) {
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
    std::thread::sleep(Duration::from_millis(300));
    fleet.offer(&[e]);
    wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    std::thread::sleep(Duration::from_millis(300));
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
        .replace("{API}", &format!("127.0.0.1:{}", free_port()))
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

fn after_crash(cfg: &str, dir: tempfile::TempDir, step: &str, final_version: &str) {
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
        std::thread::sleep(Duration::from_millis(1500));
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
        after_crash(&cfg, dir, step, final_version);
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
    let d = start(&config(&fleet, &pubkey, ""), dir);
    assert_eq!(serving(&d), "sensor_mlp@1.0.0");
    wait_log(&d, "step=\"installed\"", Duration::from_secs(20));
    assert_eq!(serving(&d), "sensor_mlp@1.1.0");
    assert!(
        !fleet.ranges("/sensor_mlp-1.1.0.tar").is_empty(),
        "resumed with Range"
    );
    infer_ok(&d);
}
