//! The uplinks against real peers: a real mosquitto (stopped, restarted,
//! behind a proxy that cuts connections), a real `outpost run` killed with
//! SIGKILL, and a real HTTP server that fails in every way the issue lists.
//!
//! What the fleet receives is collected by a rumqttc subscriber with a
//! persistent session (started before the producer), on a broker with
//! persistence on, so a broker restart loses nothing on the fleet's side
//! either: what is missing is missing from the uplink.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use outpost::source::replay::{Recorded, write as write_recording};
use serde_json::Value;

use crate::common::*;

const DEVICE: &str = "gw-up";
/// How long the broker stays down in the outage test (the issue's scenario
/// says 30 s; shorter keeps the test near 30 s, the code path is the same).
const OUTAGE: Duration = Duration::from_secs(10);

// ---- mosquitto -------------------------------------------------------------

pub(crate) struct Mosquitto {
    child: Option<Child>,
    pub(crate) port: u16,
    dir: PathBuf,
}

impl Mosquitto {
    pub(crate) fn start(dir: &Path) -> Mosquitto {
        std::fs::create_dir_all(dir).unwrap();
        let mut m = Mosquitto {
            child: None,
            port: free_port(),
            dir: dir.to_path_buf(),
        };
        m.restart();
        m
    }

    /// Starts it (again) on the same port and persistence folder.
    /// `user root`: started as root, mosquitto would otherwise switch to the
    /// `mosquitto` user, which cannot write the persistence file into the
    /// test's private tempdir nor read the test's keys (ignored when not root).
    pub(crate) fn restart(&mut self) {
        assert!(self.child.is_none());
        let conf = self.dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!(
                "user root\nlistener {} 127.0.0.1\nallow_anonymous true\n\
                 persistence true\npersistence_location {}/\n\
                 max_queued_messages 1000000\nmax_queued_bytes 0\nmax_inflight_messages 1000\n",
                self.port,
                self.dir.display()
            ),
        )
        .unwrap();
        let child = Command::new("/usr/sbin/mosquitto")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("mosquitto.log")).unwrap())
            .spawn()
            .expect("mosquitto (Debian package mosquitto) is needed");
        self.child = Some(child);
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "mosquitto did not listen:\n{}",
                std::fs::read_to_string(self.dir.join("mosquitto.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM: mosquitto saves the sessions (the fleet's subscription and
    /// its queue) and exits.
    pub(crate) fn stop(&mut self) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
        let t0 = Instant::now();
        while c.try_wait().unwrap().is_none() {
            if t0.elapsed() > Duration::from_secs(10) {
                let _ = c.kill();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// ---- the fleet: a subscriber ------------------------------------------------

/// (topic, payload) of each publish received.
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// Collects every publish under `outpost/#`, QoS 1, persistent session.
struct Fleet {
    got: Received,
    subscribed: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Fleet {
    fn start(port: u16, id: &str) -> Fleet {
        let got: Received = Arc::default();
        let subscribed = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (g, s, st, id) = (
            got.clone(),
            subscribed.clone(),
            stop.clone(),
            id.to_string(),
        );
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
                o.set_clean_session(false)
                    .set_keep_alive(Duration::from_secs(5))
                    .set_max_packet_size(4 << 20, 4 << 20);
                let (client, mut ev) = rumqttc::AsyncClient::new(o, 100);
                let poll = tokio::spawn(async move {
                    loop {
                        match ev.poll().await {
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_))) => {
                                // Again on every connect: harmless when the
                                // broker kept the session.
                                let _ =
                                    client.try_subscribe("outpost/#", rumqttc::QoS::AtLeastOnce);
                            }
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                                s.store(true, Ordering::SeqCst);
                            }
                            Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                                g.lock()
                                    .unwrap()
                                    .push((p.topic.clone(), p.payload.to_vec()));
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
        let f = Fleet {
            got,
            subscribed,
            stop,
            thread: Some(thread),
        };
        let t0 = Instant::now();
        while !f.subscribed.load(Ordering::SeqCst) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "fleet subscriber never subscribed"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        f
    }

    fn snapshot(&self) -> Vec<(String, Vec<u8>)> {
        self.got.lock().unwrap().clone()
    }

    /// Result records received so far, batches (JSON arrays) unpacked,
    /// status messages left out; every payload must parse.
    fn records(&self) -> Vec<(String, Value)> {
        let mut out = Vec::new();
        for (t, p) in self.snapshot() {
            if t.ends_with("/status") {
                continue;
            }
            let v: Value = serde_json::from_slice(&p).unwrap_or_else(|e| {
                panic!(
                    "corrupt payload on {t} ({e}): {}",
                    String::from_utf8_lossy(&p)
                )
            });
            match v {
                Value::Array(items) => out.extend(items.into_iter().map(|i| (t.clone(), i))),
                v => out.push((t, v)),
            }
        }
        out
    }

    fn ids(&self) -> HashSet<String> {
        self.records()
            .into_iter()
            .map(|(_, v)| v["id"].as_str().unwrap().to_string())
            .collect()
    }

    /// Waits until every id of `want` arrived; returns the ones missing at the timeout.
    fn wait_for(&self, want: &HashSet<String>, timeout: Duration) -> Vec<String> {
        let t0 = Instant::now();
        loop {
            let ids = self.ids();
            let missing: Vec<String> = want.difference(&ids).cloned().collect();
            if missing.is_empty() || t0.elapsed() > timeout {
                return missing;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn status_messages(&self) -> Vec<String> {
        self.snapshot()
            .into_iter()
            .filter(|(t, _)| t == &format!("outpost/{DEVICE}/status"))
            .map(|(_, p)| String::from_utf8_lossy(&p).into_owned())
            .collect()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---- a TCP proxy that cuts and delays ---------------------------------------

struct Proxy {
    port: u16,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Forwards 127.0.0.1:port -> 127.0.0.1:target, each chunk `delay` late.
    fn start(target: u16, delay: Duration) -> Proxy {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        l.set_nonblocking(true).unwrap();
        let conns: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (c, s) = (conns.clone(), stop.clone());
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let Ok((down, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let _ = down.set_nonblocking(false);
                let Ok(up) = TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let _ = up.set_nodelay(true);
                let _ = down.set_nodelay(true);
                {
                    let mut g = c.lock().unwrap();
                    g.push(down.try_clone().unwrap());
                    g.push(up.try_clone().unwrap());
                }
                for (mut from, mut to) in [
                    (down.try_clone().unwrap(), up.try_clone().unwrap()),
                    (up, down),
                ] {
                    std::thread::spawn(move || {
                        let mut buf = vec![0u8; 64 * 1024];
                        loop {
                            let n = match from.read(&mut buf) {
                                Ok(0) | Err(_) => break,
                                Ok(n) => n,
                            };
                            if !delay.is_zero() {
                                std::thread::sleep(delay);
                            }
                            if to.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        let _ = from.shutdown(std::net::Shutdown::Both);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
            }
        });
        Proxy { port, conns, stop }
    }

    /// Cuts every open connection; returns how many pairs there were.
    fn cut(&self) -> usize {
        let mut g = self.conns.lock().unwrap();
        let n = g.len() / 2;
        for s in g.drain(..) {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        n
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.cut();
    }
}

// ---- the daemon's side --------------------------------------------------------

/// `n` sensor frames (16 values as JSON) over `streams` streams.
fn recording(dir: &Path, n: usize, streams: usize) -> PathBuf {
    let frames: Vec<Recorded> = (0..n)
        .map(|i| Recorded {
            t_us: i as u64 * 100,
            stream: format!("s{}", i % streams),
            payload: serde_json::to_vec(
                &(0..16)
                    .map(|j| ((i * 16 + j) % 23) as f32 / 7.0 - 1.5)
                    .collect::<Vec<f32>>(),
            )
            .unwrap(),
        })
        .collect();
    let p = dir.join("frames.rec");
    write_recording(&p, &frames).unwrap();
    p
}

/// A daemon config: one replay pipeline into sensor_mlp, and `uplink`.
fn config(uplink: &str) -> String {
    format!(
        r#"
device = "{DEVICE}"
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
{uplink}
"#
    )
}

fn mqtt_uplink(port: u16, extra: &str) -> String {
    format!(
        "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {port}\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\nkeep_alive = \"5s\"\nconnect_timeout = \"2s\"\n{extra}"
    )
}

/// One metric value from /metrics (first sample whose line starts with `name`).
fn metric(d: &Daemon, name: &str) -> f64 {
    let (code, body) = http("GET", &d.api, "/metrics", b"").expect("metrics");
    assert_eq!(code, 200);
    let text = String::from_utf8_lossy(&body).into_owned();
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
}

fn wait_outbox_empty(d: &Daemon, timeout: Duration) {
    let t0 = Instant::now();
    loop {
        let st = d.status();
        if st["outbox"]["records"] == 0 {
            return;
        }
        assert!(
            t0.elapsed() < timeout,
            "outbox not drained: {st}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// (boot, seq) from an id `device/boot/seq`.
fn boot_seq(id: &str) -> (u64, u64) {
    let mut it = id.rsplitn(3, '/');
    let seq = it.next().unwrap().parse().unwrap();
    let boot = it.next().unwrap().parse().unwrap();
    (boot, seq)
}

/// What the fleet must see: each record on its stream's topic, duplicates
/// identical to the first copy, and per stream the first copies in the
/// order they were made (boot, then seq).
fn check_delivery(got: &[(String, Value)]) -> usize {
    let mut first: HashMap<String, &Value> = HashMap::new();
    let mut last_per_stream: HashMap<String, (u64, u64)> = HashMap::new();
    let mut dups = 0;
    for (topic, v) in got {
        let id = v["id"].as_str().expect("record without id").to_string();
        let stream = v["stream"].as_str().unwrap();
        assert_eq!(
            topic,
            &format!(
                "outpost/{DEVICE}/{}/{stream}",
                v["pipeline"].as_str().unwrap()
            )
        );
        if let Some(prev) = first.get(&id) {
            assert_eq!(*prev, v, "a duplicate of {id} differs");
            dups += 1;
            continue;
        }
        first.insert(id.clone(), v);
        let at = boot_seq(&id);
        if let Some(prev) = last_per_stream.insert(stream.to_string(), at) {
            assert!(prev < at, "stream {stream}: {id} arrived after {prev:?}");
        }
    }
    dups
}

fn printed_ids(d: &Daemon) -> HashSet<String> {
    d.seen
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect()
}

// ---- MQTT --------------------------------------------------------------------

#[test]
fn mqtt_broker_outage_loses_nothing_and_keeps_stream_order() {
    const N: usize = 20_000;
    let tmp = tempfile::tempdir().unwrap();
    let mut broker = Mosquitto::start(&tmp.path().join("mosquitto"));
    let fleet = Fleet::start(broker.port, "fleet-outage");
    let dir = tempfile::tempdir().unwrap();
    recording(dir.path(), N, 4);
    let mut d = Daemon::start_in(&config(&mqtt_uplink(broker.port, "")), dir);

    // Stop the broker while the pipeline is producing (and the uplink draining).
    let n = d
        .records_until(Duration::from_secs(30), |r| r.len() >= 2_000)
        .len();
    assert!(n >= 2_000, "{}", d.log());
    broker.stop();
    let down = Instant::now();
    let n = d
        .records_until(Duration::from_secs(60), |r| r.len() >= N)
        .len();
    assert_eq!(n, N, "records produced:\n{}", d.log());
    // Inference went on without the network, and the results wait.
    let t0 = Instant::now();
    while metric(&d, "outpost_uplink_connected") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let waiting = d.status()["outbox"]["records"].as_u64().unwrap();
    assert!(waiting > 0, "nothing waited in the outbox");
    std::thread::sleep(OUTAGE.saturating_sub(down.elapsed()));

    broker.restart();
    let want = printed_ids(&d);
    let missing = fleet.wait_for(&want, Duration::from_secs(40));
    assert!(
        missing.is_empty(),
        "{} of {N} never arrived, e.g. {:?}\n{}",
        missing.len(),
        &missing[..missing.len().min(5)],
        d.log()
    );
    let got = fleet.records();
    let dups = check_delivery(&got);
    wait_outbox_empty(&d, Duration::from_secs(10));
    assert!(metric(&d, "outpost_uplink_acked_total") >= N as f64);
    assert!(metric(&d, "outpost_uplink_disconnects_total") >= 1.0);
    assert_eq!(metric(&d, "outpost_uplink_connected"), 1.0);
    assert_eq!(d.terminate().code(), Some(0), "{}", d.log());
    let log = d.log();
    assert!(log.contains("disconnected from the fleet broker"), "{log}");
    assert!(log.contains("connected to the fleet broker"), "{log}");
    // Birth and a clean "offline" at stop, on the retained status topic.
    let t0 = Instant::now();
    while fleet.status_messages().last().map(String::as_str) != Some("offline")
        && t0.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    let status = fleet.status_messages();
    assert!(status.iter().any(|s| s == "online"), "{status:?}");
    assert_eq!(
        status.last().map(String::as_str),
        Some("offline"),
        "{status:?}"
    );
    eprintln!("outage: {N} records, {waiting} waited, {dups} duplicates");
}

#[test]
fn mqtt_connection_cut_every_few_hundred_ms_during_a_drain_loses_nothing() {
    const N: usize = 12_000;
    let tmp = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start(&tmp.path().join("mosquitto"));
    let fleet = Fleet::start(broker.port, "fleet-cuts");
    // 1 ms late each way keeps messages in flight when the cut comes.
    let proxy = Proxy::start(broker.port, Duration::from_millis(1));
    let dir = tempfile::tempdir().unwrap();
    recording(dir.path(), N, 3);
    // The byte cap (about 4,000 records/s) makes the drain last seconds, so
    // the cuts land in it; batches of 5 exercise the PUBACK -> keys table.
    let mut d = Daemon::start_in(
        &config(&mqtt_uplink(
            proxy.port,
            "max_bytes_per_s = 1200000\nbatch = 5\nmax_inflight = 64",
        )),
        dir,
    );
    let t0 = Instant::now();
    let mut cuts = 0;
    let mut want = HashSet::new();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        if proxy.cut() > 0 {
            cuts += 1;
        }
        d.records_until(Duration::from_millis(1), |_| false);
        if want.len() < N {
            want = printed_ids(&d);
        }
        if want.len() == N && fleet.wait_for(&want, Duration::ZERO).is_empty() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "drain did not finish:\n{}",
            d.log()
        );
    }
    assert!(cuts >= 5, "only {cuts} cuts landed");
    let got = fleet.records();
    let dups = check_delivery(&got);
    wait_outbox_empty(&d, Duration::from_secs(20));
    assert!(metric(&d, "outpost_uplink_disconnects_total") >= 3.0);
    assert!(metric(&d, "outpost_uplink_retries_total") > 0.0);
    assert_eq!(d.terminate().code(), Some(0), "{}", d.log());
    eprintln!(
        "cuts: {cuts} cuts, {} records received, {dups} duplicates",
        got.len()
    );
}

/// The ids of the records in a stopped daemon's outbox (`outpost outbox export`).
fn exported_ids(data: &Path) -> Vec<String> {
    let o = run(outpost().args(["outbox", "export", "--data-dir"]).arg(data));
    assert!(o.status.success(), "export failed: {}", stderr(&o));
    stdout(&o)
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("export line is JSON");
            let id = v["record"]["id"].as_str();
            id.unwrap_or_else(|| panic!("corrupt record in the outbox: {l}"))
                .to_string()
        })
        .collect()
}

#[test]
fn mqtt_sigkill_during_production_and_drain_loses_no_durable_record() {
    // Soundness: a record durable before a SIGKILL is, after the kill,
    // either still in the outbox (the outbox's guarantee) or was deleted by
    // an ack, which the uplink only does on the broker's PUBACK, and the
    // broker then holds it for the fleet's persistent session. The first
    // kind is read right after each kill with `outpost outbox export` (the
    // set `durable`); every one of them must reach the fleet. The second
    // kind reached the broker by definition. Records printed but not yet
    // durable may be lost by a kill; they are not required (but may arrive).
    const PER_RUN: usize = 3_000;
    let tmp = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start(&tmp.path().join("mosquitto"));
    let fleet = Fleet::start(broker.port, "fleet-kill");
    let mut dir = tempfile::tempdir().unwrap();
    recording(dir.path(), PER_RUN, 4);
    let data = dir.path().join("data");
    // A byte cap (about 500 records/s) below the production rate, so a
    // backlog builds up and the kills land during production and drain; the
    // last start drains uncapped.
    let cfg = config(&mqtt_uplink(broker.port, "max_bytes_per_s = 150000"));
    let last_cfg = config(&mqtt_uplink(broker.port, ""));
    let mut durable: HashSet<String> = HashSet::new();
    let mut printed = 0;
    let t0 = Instant::now();
    let mut kill_at =
        KillTimes::new("mqtt_sigkill_during_production_and_drain_loses_no_durable_record");
    for run in 0..10 {
        let mut d = Daemon::start_in(&cfg, dir);
        std::thread::sleep(kill_at.millis(100, 1200));
        d.child.kill().unwrap(); // SIGKILL
        d.child.wait().unwrap();
        d.records_until(Duration::from_millis(50), |_| false);
        printed += d.seen.len();
        dir = std::mem::replace(&mut d.dir, tempfile::tempdir().unwrap());
        drop(d);
        let ids = exported_ids(&data);
        eprintln!(
            "kill {run}: {} printed, {} in the outbox after the kill",
            printed,
            ids.len()
        );
        durable.extend(ids);
        assert!(t0.elapsed() < Duration::from_secs(90), "took too long");
    }
    // The last start: let it produce its run and drain everything.
    let mut d = Daemon::start_in(&last_cfg, dir);
    d.records_until(Duration::from_secs(60), |r| r.len() >= PER_RUN);
    wait_outbox_empty(&d, Duration::from_secs(60));
    let mut want = durable.clone();
    want.extend(printed_ids(&d));
    let missing = fleet.wait_for(&want, Duration::from_secs(30));
    assert!(
        missing.is_empty(),
        "{} durable records never arrived, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    let got = fleet.records();
    let dups = check_delivery(&got);
    assert_eq!(d.terminate().code(), Some(0), "{}", d.log());
    let boots: HashSet<u64> = got
        .iter()
        .map(|(_, v)| boot_seq(v["id"].as_str().unwrap()).0)
        .collect();
    assert!(
        boots.len() >= 5,
        "records of only {} boots arrived",
        boots.len()
    );
    eprintln!(
        "sigkill: {} durable across kills, {} received, {dups} duplicates, {} boots",
        durable.len(),
        got.len(),
        boots.len()
    );
}

// ---- HTTP ----------------------------------------------------------------------

#[derive(Default)]
struct Ingest {
    requests: AtomicUsize,
    /// id -> times accepted.
    accepted: Mutex<HashMap<String, usize>>,
    /// Idempotency-Key -> the ids of the batch.
    batches: Mutex<HashMap<String, Vec<String>>>,
    refused: AtomicUsize,
    problems: Mutex<Vec<String>>,
}

/// Records the server refuses for good (400).
fn poison(v: &Value) -> bool {
    v["seq"].as_u64().unwrap() % 97 == 13
}

async fn ingest(
    axum::extract::State(s): axum::extract::State<Arc<Ingest>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    let n = s.requests.fetch_add(1, Ordering::SeqCst);
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let mut text = String::new();
    if let Err(e) = flate2::read::GzDecoder::new(&body[..]).read_to_string(&mut text) {
        s.problems.lock().unwrap().push(format!("not gzip: {e}"));
        return StatusCode::UNPROCESSABLE_ENTITY.into_response();
    }
    let recs: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<String> = recs
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    let key = h("idempotency-key");
    if h("content-encoding") != "gzip"
        || h("content-type") != "application/x-ndjson"
        || key.len() != 64
        || h("authorization") != "Bearer test-token"
    {
        s.problems
            .lock()
            .unwrap()
            .push(format!("headers: {headers:?}"));
    }
    let prev = s.batches.lock().unwrap().insert(key.clone(), ids.clone());
    if let Some(p) = prev
        && p != ids
    {
        s.problems
            .lock()
            .unwrap()
            .push(format!("key {key} reused for another batch"));
    }
    match n {
        0 => return (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        1 => {
            return (
                StatusCode::TOO_MANY_REQUESTS,
                [("retry-after", "1")],
                "slow down",
            )
                .into_response();
        }
        2 => {
            // Stored, but answered after the client's timeout: the retry
            // brings duplicates, which the fleet drops by id.
            {
                let mut a = s.accepted.lock().unwrap();
                for r in recs.iter().filter(|r| !poison(r)) {
                    *a.entry(r["id"].as_str().unwrap().to_string()).or_default() += 1;
                }
            }
            tokio::time::sleep(Duration::from_millis(2500)).await;
            return StatusCode::OK.into_response();
        }
        _ => {}
    }
    if recs.iter().any(poison) {
        s.refused.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::BAD_REQUEST, "invalid record in batch").into_response();
    }
    let mut a = s.accepted.lock().unwrap();
    for id in ids {
        *a.entry(id).or_default() += 1;
    }
    StatusCode::OK.into_response()
}

#[test]
fn http_uplink_retries_failures_and_dead_letters_refused_records() {
    const N: usize = 3_000;
    let state = Arc::new(Ingest::default());
    let port = free_port();
    let s2 = state.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.spawn(async move {
        let app = axum::Router::new()
            .route("/ingest", axum::routing::post(ingest))
            .with_state(s2);
        let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        axum::serve(l, app).await.unwrap();
    });
    let dir = tempfile::tempdir().unwrap();
    recording(dir.path(), N, 4);
    let uplink = format!(
        "[uplink]\ntype = \"http\"\nurl = \"http://127.0.0.1:{port}/ingest\"\nbatch_records = 200\ntimeout = \"1s\"\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\n[uplink.headers]\nAuthorization = \"Bearer test-token\"\n"
    );
    let mut d = Daemon::start_in(&config(&uplink), dir);
    assert_eq!(
        d.records_until(Duration::from_secs(60), |r| r.len() >= N)
            .len(),
        N
    );
    wait_outbox_empty(&d, Duration::from_secs(60));
    let st = d.status();
    let bad: HashSet<String> = d
        .seen
        .iter()
        .filter(|r| poison(r))
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    let good: HashSet<String> = printed_ids(&d).difference(&bad).cloned().collect();
    assert!(!bad.is_empty());
    assert_eq!(st["outbox"]["dead_letters"], bad.len(), "{st}");
    assert_eq!(
        metric(&d, "outpost_uplink_dead_letters_total"),
        bad.len() as f64
    );
    assert!(metric(&d, "outpost_uplink_retries_total") >= 3.0);
    let accepted = state.accepted.lock().unwrap().clone();
    let ids: HashSet<String> = accepted.keys().cloned().collect();
    assert_eq!(ids, good, "accepted ids differ from the good records");
    assert!(
        accepted.values().any(|&n| n > 1),
        "the timed-out batch was not sent again"
    );
    assert!(state.refused.load(Ordering::SeqCst) >= bad.len());
    let problems = state.problems.lock().unwrap().clone();
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(d.terminate().code(), Some(0), "{}", d.log());

    // The refused records are in the dead-letter tree, with the reason.
    let o = run(outpost()
        .args(["outbox", "export", "--dead-letters", "--data-dir"])
        .arg(d.dir.path().join("data")));
    assert!(o.status.success(), "{}", stderr(&o));
    let dead: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let dead_ids: HashSet<String> = dead
        .iter()
        .map(|v| v["record"]["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(dead_ids, bad);
    assert!(
        dead.iter()
            .all(|v| v["reason"].as_str().unwrap().contains("HTTP 400"))
    );
    server.abort();
}

// ---- TLS -------------------------------------------------------------------------

fn openssl(dir: &Path, args: &[&str]) {
    let o = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl (Debian package openssl) is needed");
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A CA, a server certificate for 127.0.0.1 and a client certificate
/// (X.509 v3, which webpki requires: hence the extension files).
fn pki(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=test-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    for (name, ext) in [
        (
            "server",
            "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
        ),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ] {
        std::fs::write(dir.join(format!("{name}.ext")), ext).unwrap();
        let (key, csr, pem, extf) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        let subj = format!("/CN={name}");
        openssl(
            dir,
            &[
                "req", "-newkey", "rsa:2048", "-nodes", "-subj", &subj, "-keyout", &key, "-out",
                &csr,
            ],
        );
        openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                &pem,
                "-extfile",
                &extf,
            ],
        );
    }
}

#[test]
fn mqtt_uplink_over_mutual_tls_delivers_and_a_wrong_ca_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let pki_dir = tmp.path().join("pki");
    std::fs::create_dir_all(&pki_dir).unwrap();
    pki(&pki_dir);
    let (plain, tls_port) = (free_port(), free_port());
    let p = |f: &str| pki_dir.join(f).display().to_string();
    let conf = tmp.path().join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!(
            "user root\nper_listener_settings false\nallow_anonymous true\npersistence false\n\
             listener {plain} 127.0.0.1\n\
             listener {tls_port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate true\n",
            p("ca.pem"), p("server.pem"), p("server.key")
        ),
    )
    .unwrap();
    let mut broker = Command::new("/usr/sbin/mosquitto")
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto");
    let t0 = Instant::now();
    while TcpStream::connect(("127.0.0.1", tls_port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "mosquitto did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let fleet = Fleet::start(plain, "fleet-tls");

    let ob = outpost::outbox::Outbox::open(&tmp.path().join("outbox"), Default::default()).unwrap();
    let mut want = HashSet::new();
    for i in 0..500u64 {
        let id = format!("{DEVICE}/1/{i}");
        let rec = serde_json::json!({"id": id, "device": DEVICE, "pipeline": "p", "stream": "s", "seq": i});
        ob.append("s", &serde_json::to_vec(&rec).unwrap()).unwrap();
        want.insert(id);
    }
    let cfg = |ca: &str| -> outpost::uplink::UplinkConfig {
        toml::from_str(&format!(
            "type = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {tls_port}\ntls = true\nca = \"{ca}\"\ncert = \"{}\"\nkey = \"{}\"\nbackoff_min = \"100ms\"\nbackoff_max = \"500ms\"",
            p("client.pem"),
            p("client.key")
        ))
        .unwrap()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // A CA that did not sign the broker's certificate: no connection, nothing acked.
    let other = tmp.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    openssl(
        &other,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=other",
            "-keyout",
            "o.key",
            "-out",
            "o.pem",
        ],
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let up = rt
        .block_on(async {
            outpost::uplink::start(
                &cfg(&other.join("o.pem").display().to_string()),
                ob.clone(),
                DEVICE,
                stop.clone(),
            )
        })
        .unwrap();
    // Refused at the handshake, twice (a retry after the first): nothing sent.
    let t0 = Instant::now();
    while outpost::uplink::UplinkStats::get(&up.stats.disconnects_total) < 2
        || up.stats.last_error().is_none()
    {
        assert!(t0.elapsed() < Duration::from_secs(20), "no TLS refusal");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(ob.stats().records, 500);
    assert!(outpost::uplink::UplinkStats::get(&up.stats.disconnects_total) >= 1);
    let (_, err) = up.stats.last_error().unwrap();
    assert!(err.contains("TLS") || err.contains("certificate"), "{err}");
    stop.cancel();
    rt.block_on(up.task).unwrap();

    // The right CA and the client certificate: everything arrives, the outbox empties.
    let stop = tokio_util::sync::CancellationToken::new();
    let up = rt
        .block_on(async {
            outpost::uplink::start(&cfg(&p("ca.pem")), ob.clone(), DEVICE, stop.clone())
        })
        .unwrap();
    let missing = fleet.wait_for(&want, Duration::from_secs(20));
    assert!(missing.is_empty(), "{} missing", missing.len());
    let t0 = Instant::now();
    while ob.stats().records > 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "not acked");
        std::thread::sleep(Duration::from_millis(20));
    }
    check_delivery(&fleet.records());
    stop.cancel();
    rt.block_on(up.task).unwrap();
    let _ = broker.kill();
    let _ = broker.wait();
}
