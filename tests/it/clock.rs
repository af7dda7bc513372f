//! A clock that cannot be trusted: the real daemon under libfaketime
//! (Debian's `faketime`), its wall clock set by a file that libfaketime
//! reads again every second, the monotonic clocks left real
//! (`FAKETIME_DONT_FAKE_MONOTONIC`), so the clock can be stepped under a
//! running daemon. Records come in over UDP; what the fleet gets is read
//! from a real HTTP ingestion server or a real mosquitto.

use std::io::Read;
use std::net::UdpSocket;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::common::*;

const DEVICE: &str = "gw-clock";
const FRAME: &[u8] = b"[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";
const TWO_YEARS_S: i64 = 2 * 365 * 86_400;

fn real_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_micros() as i64
}

/// The offset that puts the clock at 1970-01-02.
fn to_1970() -> i64 {
    -(real_now_us() / 1_000_000 - 86_400)
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .trim()
        .to_string()
}

fn unix_us(rfc3339: &str) -> i64 {
    let t = humantime::parse_rfc3339_weak(rfc3339).unwrap_or_else(|e| panic!("{rfc3339}: {e}"));
    t.duration_since(UNIX_EPOCH).unwrap().as_micros() as i64
}

/// libfaketime's multithreaded library (Debian's `faketime` package).
fn libfaketime() -> PathBuf {
    let p = PathBuf::from(format!(
        "/usr/lib/{}-linux-gnu/faketime/libfaketimeMT.so.1",
        std::env::consts::ARCH
    ));
    assert!(
        p.exists(),
        "{} missing: the Debian package faketime is needed",
        p.display()
    );
    p
}

/// One daemon's faked wall clock: an offset from the real time, in seconds.
struct FakeClock {
    file: PathBuf,
}

impl FakeClock {
    fn new(dir: &Path, offset_s: i64) -> FakeClock {
        let f = FakeClock {
            file: dir.join("faketime"),
        };
        f.set(offset_s);
        f
    }

    /// libfaketime reads it again within a second (FAKETIME_CACHE_DURATION).
    fn set(&self, offset_s: i64) {
        let tmp = self.file.with_extension("tmp");
        std::fs::write(&tmp, format!("{offset_s:+}\n")).unwrap();
        std::fs::rename(&tmp, &self.file).unwrap();
    }

    fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("LD_PRELOAD", libfaketime().display().to_string()),
            ("FAKETIME_TIMESTAMP_FILE", self.file.display().to_string()),
            ("FAKETIME_CACHE_DURATION", "1".into()),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".into()),
        ]
    }
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A daemon with one sensor pipeline over UDP on `port`; `extra` appended.
fn config(port: u16, extra: &str) -> String {
    format!(
        r#"
device = "{DEVICE}"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "udp", listen = "127.0.0.1:{port}" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
{extra}
"#
    )
}

/// `[clock]` trusting a clock that is not behind the last known good
/// time: this machine's kernel may well say its clock is unsynchronised
/// (no time service in a container), and libfaketime cannot change that.
const TRUST_NOT_BEHIND: &str = "[clock]\nrequire_sync = false\n";

fn send(port: u16) {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .send_to(FRAME, ("127.0.0.1", port))
        .unwrap();
}

/// Sends one frame and waits for its record (printed on stdout).
fn record(d: &mut Daemon, port: u16) -> Value {
    let n = d.seen.len();
    send(port);
    let seen = d.records_until(Duration::from_secs(20), |r| r.len() > n);
    assert!(seen.len() > n, "no record:\n{}", d.log());
    seen[n].clone()
}

fn wait_clock(d: &Daemon, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let c = d.status()["clock"].clone();
        if cond(&c) {
            return c;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{what}: not within 20 s\n{c:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn metric(d: &Daemon, series: &str) -> Option<f64> {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

// ---- the fleet: an HTTP ingestion endpoint ------------------------------------

#[derive(Default)]
struct IngestState {
    open: AtomicBool,
    got: Mutex<Vec<Value>>,
    /// The `Date` its answers carry (None: the server's own).
    date: Mutex<Option<FleetDate>>,
}

/// What a fleet says the time is.
#[derive(Clone)]
enum FleetDate {
    /// This `Date` header, as it is.
    Fixed(&'static str),
    /// The real time moved by this many seconds (a fleet whose clock
    /// agrees with a daemon's faked one).
    Offset(i64),
}

/// Takes gzip NDJSON batches while open; answers 503 while closed.
struct Ingest {
    state: Arc<IngestState>,
    port: u16,
    _rt: tokio::runtime::Runtime,
}

async fn ingest(
    axum::extract::State(s): axum::extract::State<Arc<IngestState>>,
    body: axum::body::Bytes,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let code = stored(&s, &body);
    let date = s.date.lock().unwrap().clone();
    match date {
        None => code.into_response(),
        Some(d) => {
            let value = match d {
                FleetDate::Fixed(v) => v.to_string(),
                FleetDate::Offset(off) => {
                    let t = (real_now_us() / 1_000_000 + off) as u64;
                    httpdate::fmt_http_date(UNIX_EPOCH + Duration::from_secs(t))
                }
            };
            (code, [(axum::http::header::DATE, value)]).into_response()
        }
    }
}

fn stored(s: &IngestState, body: &[u8]) -> axum::http::StatusCode {
    if !s.open.load(Ordering::SeqCst) {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE;
    }
    let mut text = String::new();
    if flate2::read::GzDecoder::new(body)
        .read_to_string(&mut text)
        .is_err()
    {
        return axum::http::StatusCode::BAD_REQUEST;
    }
    let mut got = s.got.lock().unwrap();
    for l in text.lines() {
        got.push(serde_json::from_str(l).unwrap());
    }
    axum::http::StatusCode::OK
}

impl Ingest {
    fn start(open: bool) -> Ingest {
        let state = Arc::new(IngestState::default());
        state.open.store(open, Ordering::SeqCst);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let l = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let port = l.local_addr().unwrap().port();
        let s = state.clone();
        rt.spawn(async move {
            let app = axum::Router::new()
                .route("/ingest", axum::routing::post(ingest))
                .with_state(s);
            axum::serve(l, app).await.unwrap();
        });
        Ingest {
            state,
            port,
            _rt: rt,
        }
    }

    fn uplink(&self) -> String {
        format!(
            "[uplink]\ntype = \"http\"\nurl = \"http://127.0.0.1:{}/ingest\"\nbackoff_min = \"100ms\"\nbackoff_max = \"300ms\"\n",
            self.port
        )
    }

    fn set_open(&self, open: bool) {
        self.state.open.store(open, Ordering::SeqCst);
    }

    /// Its answers carry this `Date` from now on.
    fn set_date(&self, date: FleetDate) {
        *self.state.date.lock().unwrap() = Some(date);
    }

    /// Waits until `cond` holds for what arrived; returns it.
    fn wait(&self, what: &str, cond: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        let t0 = Instant::now();
        loop {
            let got = self.state.got.lock().unwrap().clone();
            if cond(&got) {
                return got;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "{what}: not within 30 s; got {got:#?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn by_id<'a>(got: &'a [Value], id: &Value) -> Vec<&'a Value> {
    got.iter().filter(|v| v["id"] == *id).collect()
}

fn events<'a>(got: &'a [Value], event: &str) -> Vec<&'a Value> {
    got.iter()
        .filter(|v| v["pipeline"] == "clock" && v["event"] == event)
        .collect()
}

// ---- the cases -------------------------------------------------------------------

/// A device that boots in 1970: its records carry the boot id and the time
/// since boot; one sent before the clock is set goes as it is, and the
/// `clock_sync` event gives the fleet the offset for it; the ones still in
/// the outbox when the clock is set go with their real time.
#[test]
fn records_made_in_1970_are_sent_with_their_real_time_once_the_clock_is_set() {
    let fleet = Ingest::start(true);
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeClock::new(dir.path(), to_1970());
    let port = free_udp_port();
    let cfg = config(port, &format!("{TRUST_NOT_BEHIND}{}", fleet.uplink()));
    let mut d = Daemon::start_full(&cfg, dir, &fake.env(), true);
    let c = wait_clock(&d, "not trusted in 1970", |c| c["synced"] == false);
    assert_eq!(c["reason"], "behind", "{c:#}");
    assert!(
        c["system"].as_str().unwrap().starts_with("1970-01-0"),
        "{c:#}"
    );
    // The last known good time is at least the build time.
    assert!(
        unix_us(c["last_good"].as_str().unwrap()) > 1_700_000_000_000_000,
        "{c:#}"
    );
    assert_eq!(metric(&d, "outpost_clock_synced"), Some(0.0));
    let boot = boot_id();

    // Sent at once, before the clock is set: as it was made.
    let t1 = real_now_us();
    let first = record(&mut d, port);
    assert_eq!(first["clock"], "unsynced", "{first}");
    assert_eq!(first["boot_id"], boot.as_str());
    assert!(
        first["ts"].as_str().unwrap().starts_with("1970-01-0"),
        "{first}"
    );
    let got = fleet.wait("the first record", |g| !by_id(g, &first["id"]).is_empty());
    assert_eq!(by_id(&got, &first["id"])[0]["clock"], "unsynced");

    // The link goes down; two more wait in the outbox.
    fleet.set_open(false);
    let later = [record(&mut d, port), record(&mut d, port)];
    let t2 = real_now_us();
    for r in &later {
        assert_eq!(r["clock"], "unsynced", "{r}");
    }

    // The clock is set (NTP reached the device).
    fake.set(0);
    let c = wait_clock(&d, "trusted once set", |c| c["synced"] == true);
    let step = c["last_sync"]["step_s"].as_f64().unwrap();
    assert!(step > 1.7e9, "{c:#}");
    fleet.set_open(true);
    let got = fleet.wait("the waiting records and the clock_sync event", |g| {
        later.iter().all(|r| !by_id(g, &r["id"]).is_empty()) && !events(g, "clock_sync").is_empty()
    });
    for r in &later {
        let sent = by_id(&got, &r["id"])[0];
        assert_eq!(sent["clock"], "corrected", "{sent}");
        assert_eq!(sent["boot_id"], boot.as_str());
        assert_eq!(sent["outputs"], r["outputs"]);
        let ts = unix_us(sent["ts"].as_str().unwrap());
        assert!(
            ts >= t1 - 2_000_000 && ts <= t2 + 2_000_000,
            "{sent}: not between the real times it was made in"
        );
    }
    // The record sent before is not sent again; the event's offset gives
    // its real time.
    assert_eq!(by_id(&got, &first["id"]).len(), 1);
    let ev = events(&got, "clock_sync")[0];
    assert_eq!(ev["boot_id"], boot.as_str(), "{ev}");
    let real = ev["offset_us"].as_i64().unwrap() + first["since_boot_us"].as_i64().unwrap();
    assert!(
        real >= t1 - 2_000_000 && real <= t2 + 2_000_000,
        "offset {ev} does not give the first record's real time"
    );
    assert_eq!(metric(&d, "outpost_clock_synced"), Some(1.0));
    assert_eq!(
        metric(&d, "outpost_clock_unsynced_records_total"),
        Some(3.0)
    );
    assert!(metric(&d, "outpost_clock_corrected_records_total") >= Some(2.0));
    assert_eq!(metric(&d, "outpost_clock_syncs_total"), Some(1.0));
    // Records made now carry no mark.
    let now = record(&mut d, port);
    assert!(now.get("clock").is_none(), "{now}");
}

/// A daemon that ran with the right time, restarted with the clock an hour
/// behind (a battery-less box back at its last shutdown): not trusted, its
/// records marked, and sent with the real time (this boot's offset is
/// known from before); once the clock passes the last known good time it
/// is trusted again and a `clock_sync` event notes the step.
#[test]
fn a_clock_behind_the_last_known_good_time_is_not_trusted_until_it_is_set() {
    let port = free_udp_port();
    let d = Daemon::start(&config(port, TRUST_NOT_BEHIND));
    let c = wait_clock(&d, "trusted at the real time", |c| c["synced"] == true);
    let good = unix_us(c["last_good"].as_str().unwrap());
    assert!((good - real_now_us()).abs() < 10_000_000, "{c:#}");
    let dir = d.stop_keep_dir();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/clock.json")).unwrap())
            .unwrap();
    assert!(saved["last_good_us"].as_i64().unwrap() >= good, "{saved}");

    let fleet = Ingest::start(true);
    let fake = FakeClock::new(dir.path(), -3600);
    let cfg = config(port, &format!("{TRUST_NOT_BEHIND}{}", fleet.uplink()));
    let mut d = Daemon::start_full(&cfg, dir, &fake.env(), true);
    let c = wait_clock(&d, "not trusted an hour behind", |c| c["synced"] == false);
    assert_eq!(c["reason"], "behind", "{c:#}");
    assert!(unix_us(c["last_good"].as_str().unwrap()) >= good, "{c:#}");
    let off = c["offset_s"].as_f64().unwrap();
    assert!((-3700.0..-3500.0).contains(&off), "{c:#}");
    assert!(metric(&d, "outpost_clock_offset_seconds").unwrap() < -3500.0);

    let t0 = real_now_us();
    let r = record(&mut d, port);
    assert_eq!(r["clock"], "unsynced", "{r}");
    assert!(
        unix_us(r["ts"].as_str().unwrap()) < t0 - 3_500_000_000,
        "{r}"
    );
    let got = fleet.wait("the record", |g| !by_id(g, &r["id"]).is_empty());
    let sent = by_id(&got, &r["id"])[0];
    assert_eq!(sent["clock"], "corrected", "{sent}");
    let ts = unix_us(sent["ts"].as_str().unwrap());
    assert!((ts - t0).abs() < 5_000_000, "{sent}: not the real time");

    fake.set(0);
    let c = wait_clock(&d, "trusted once set", |c| c["synced"] == true);
    let step = c["last_sync"]["step_s"].as_f64().unwrap();
    assert!((3590.0..3610.0).contains(&step), "{c:#}");
    let got = fleet.wait("the clock_sync event", |g| {
        !events(g, "clock_sync").is_empty()
    });
    let step_us = events(&got, "clock_sync")[0]["step_us"].as_i64().unwrap();
    assert!((step_us - 3_600_000_000).abs() < 10_000_000, "{got:#?}");
    let r = record(&mut d, port);
    assert!(r.get("clock").is_none(), "{r}");
}

/// A trusted clock jumps two years ahead and back (a bad time source, then
/// the right one): the last known good time does not follow the jump, so
/// after the step back the clock is still trusted and nothing is marked;
/// both steps are events for the fleet.
#[test]
fn a_jump_two_years_ahead_and_back_leaves_the_clock_trusted() {
    let fleet = Ingest::start(true);
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeClock::new(dir.path(), 0);
    let port = free_udp_port();
    let cfg = config(port, &format!("{TRUST_NOT_BEHIND}{}", fleet.uplink()));
    let mut d = Daemon::start_full(&cfg, dir, &fake.env(), true);
    wait_clock(&d, "trusted", |c| c["synced"] == true);

    fake.set(TWO_YEARS_S);
    let c = wait_clock(&d, "the step ahead seen", |c| c["steps_total"] == 1);
    assert_eq!(c["synced"], true, "{c:#}");
    let off = c["offset_s"].as_f64().unwrap();
    assert!((off - TWO_YEARS_S as f64).abs() < 60.0, "{c:#}");
    let good = unix_us(c["last_good"].as_str().unwrap());
    assert!(
        good < real_now_us() + 60_000_000,
        "the last known good time followed: {c:#}"
    );
    let ahead = record(&mut d, port);
    assert!(ahead.get("clock").is_none(), "{ahead}");
    assert!(unix_us(ahead["ts"].as_str().unwrap()) > real_now_us() + 700 * 86_400_000_000);

    fake.set(0);
    let c = wait_clock(&d, "the step back seen", |c| c["steps_total"] == 2);
    assert_eq!(c["synced"], true, "{c:#}");
    assert!(c["reason"].is_null(), "{c:#}");
    assert!(c["offset_s"].as_f64().unwrap().abs() < 60.0, "{c:#}");
    let back = record(&mut d, port);
    assert!(back.get("clock").is_none(), "{back}");
    assert!((unix_us(back["ts"].as_str().unwrap()) - real_now_us()).abs() < 5_000_000);
    assert_eq!(metric(&d, "outpost_clock_steps_total"), Some(2.0));
    assert_eq!(metric(&d, "outpost_clock_synced"), Some(1.0));
    assert_eq!(
        metric(&d, "outpost_clock_unsynced_records_total"),
        Some(0.0)
    );
    let got = fleet.wait("both clock_step events", |g| {
        events(g, "clock_step").len() == 2
    });
    let steps: Vec<i64> = events(&got, "clock_step")
        .iter()
        .map(|e| e["step_us"].as_i64().unwrap() / 1_000_000)
        .collect();
    assert!((steps[0] - TWO_YEARS_S).abs() < 60, "{steps:?}");
    assert!((steps[1] + TWO_YEARS_S).abs() < 60, "{steps:?}");
    assert!(events(&got, "clock_sync").is_empty());
}

// ---- TLS and signed commands from 1970 ---------------------------------------------

fn openssl(dir: &Path, args: &[&str]) {
    // Made two years ago, valid three years: current, and older than any
    // build of this binary.
    let o = Command::new("faketime")
        .args(["-f", "-730d", "openssl"])
        .args(args)
        .current_dir(dir)
        .output()
        .expect("faketime and openssl (Debian packages) are needed");
    assert!(
        o.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A CA and a server certificate for 127.0.0.1, current today.
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
            "1095",
            "-subj",
            "/CN=clock-ca",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=server",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1095",
            "-out",
            "server.pem",
            "-extfile",
            "server.ext",
        ],
    );
}

/// (topic, payload) of each publish received.
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// Every publish under `outpost/#` on `port`, collected from a real subscriber.
struct Subscriber {
    got: Received,
    stop: Arc<AtomicBool>,
}

impl Subscriber {
    fn start(port: u16) -> Subscriber {
        let got: Received = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let subscribed = Arc::new(AtomicBool::new(false));
        let (g, st, sub) = (got.clone(), stop.clone(), subscribed.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let o = rumqttc::MqttOptions::new("fleet-clock", "127.0.0.1", port);
                let (client, mut ev) = rumqttc::AsyncClient::new(o, 100);
                client
                    .subscribe("outpost/#", rumqttc::QoS::AtLeastOnce)
                    .await
                    .unwrap();
                while !st.load(Ordering::SeqCst) {
                    match tokio::time::timeout(Duration::from_millis(200), ev.poll()).await {
                        Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_)))) => {
                            sub.store(true, Ordering::SeqCst);
                        }
                        Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p)))) => {
                            g.lock()
                                .unwrap()
                                .push((p.topic.clone(), p.payload.to_vec()));
                        }
                        Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(100)).await,
                        _ => {}
                    }
                }
            });
        });
        let t0 = Instant::now();
        while !subscribed.load(Ordering::SeqCst) {
            assert!(t0.elapsed() < Duration::from_secs(10), "never subscribed");
            std::thread::sleep(Duration::from_millis(20));
        }
        Subscriber { got, stop }
    }

    fn records(&self) -> Vec<Value> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, _)| !t.ends_with("/status"))
            .filter_map(|(_, p)| serde_json::from_slice(p).ok())
            .collect()
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

struct Broker(std::process::Child);

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A device in 1970 connects over TLS to a broker whose certificate is
/// current (issued two years ago): the check uses the later of the system
/// clock and the last known good time (here the build time).
#[test]
fn tls_to_a_broker_with_a_current_certificate_works_from_a_daemon_in_1970() {
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
             listener {tls_port} 127.0.0.1\ncafile {}\ncertfile {}\nkeyfile {}\n",
            p("ca.pem"),
            p("server.pem"),
            p("server.key")
        ),
    )
    .unwrap();
    let _broker = Broker(
        Command::new("/usr/sbin/mosquitto")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto (Debian package mosquitto) is needed"),
    );
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "mosquitto did not listen"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let fleet = Subscriber::start(plain);

    let dir = tempfile::tempdir().unwrap();
    let fake = FakeClock::new(dir.path(), to_1970());
    let port = free_udp_port();
    let uplink = format!(
        "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {tls_port}\ntls = true\nca = \"{}\"\nbackoff_min = \"100ms\"\nbackoff_max = \"500ms\"\n",
        p("ca.pem")
    );
    let mut d = Daemon::start_full(&config(port, &uplink), dir, &fake.env(), true);
    let r = record(&mut d, port);
    let t0 = Instant::now();
    while !fleet.records().iter().any(|v| v["id"] == r["id"]) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the record never reached the broker over TLS; uplink {:#}\n{}",
            d.status()["uplink"],
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(d.status()["uplink"]["connected"], true);
    assert_eq!(r["clock"], "unsynced", "{r}");
    let c = d.status()["clock"].clone();
    assert_eq!(c["synced"], false, "{c:#}");
    assert!(
        c["system"].as_str().unwrap().starts_with("1970-01-0"),
        "{c:#}"
    );
}

/// A device that ran with the right time and rebooted into 1970 takes a
/// fresh signed update command (the skew bound uses the last known good
/// time), and one that expired an hour ago is refused as expired (a clock
/// stepped back does not make it valid again).
#[test]
fn a_signed_command_is_taken_while_the_clock_is_in_1970() {
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let broker = crate::uplink::Mosquitto::start(&w.join("mosquitto"));
    let fleet = crate::ota::Fleet::start();
    let (key, pubkey) = crate::ota::keygen(w, "fleet");
    crate::ota::model_bundle(&fleet, &key, w, "1.1.0");
    let bundle = w.join("sensor_mlp-1.1.0.tar");
    let cfg = format!(
        r#"
data_dir = "{{DATA}}"
model_dir = "{{DIR}}/models"
device = "{DEVICE}"
[api]
listen = "{{API}}"
[clock]
require_sync = false
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
    // It ran once with the right time.
    let d = crate::ota::start(&cfg, crate::ota::device_dir());
    wait_clock(&d, "trusted at the real time", |c| c["synced"] == true);
    let dir = d.stop_keep_dir();

    // Rebooted into 1970.
    let fake = FakeClock::new(dir.path(), to_1970());
    let mut env = fake.env();
    env.push((
        "OUTPOST_MODEL_DIR",
        dir.path().join("models").display().to_string(),
    ));
    let d = Daemon::start_full(&cfg, dir, &env, true);
    crate::ota::wait_log(&d, "subscribed to update commands", Duration::from_secs(20));

    let command = || -> Vec<u8> {
        let url = fleet.url().replace("manifest.json", "sensor_mlp-1.1.0.tar");
        let o = run(outpost().args([
            "bundle",
            "command",
            "--key",
            key.to_str().unwrap(),
            "--device",
            DEVICE,
            "--expires-in",
            "10m",
            "--url",
            &url,
            bundle.to_str().unwrap(),
        ]));
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o).trim().as_bytes().to_vec()
    };
    let topic = format!("outpost/{DEVICE}/cmd");
    let count = |result: &str| {
        crate::ota::metric(
            &d,
            &format!("outpost_ota_commands_total{{result=\"{result}\"}}"),
        )
    };

    // Signed two hours ago, expired an hour ago: refused as expired.
    let mut env: outpost::ota::command::Envelope = serde_json::from_slice(&command()).unwrap();
    let mut old: outpost::ota::command::Command = serde_json::from_str(&env.command).unwrap();
    old.issued_ms -= 2 * 3_600_000;
    old.expires_ms = Some(old.issued_ms + 3_600_000);
    let signing = outpost::ota::sign::read_signing_key(&key).unwrap();
    env = outpost::ota::command::seal(&signing, &old).unwrap();
    crate::ota::publish(broker.port, &topic, serde_json::to_vec(&env).unwrap());
    let t0 = Instant::now();
    while count("expired") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the expired command was not refused as expired:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(count("future"), 0.0);

    // Fresh: taken and installed.
    crate::ota::publish(broker.port, &topic, command());
    crate::ota::wait_log(&d, "step=\"installed\"", Duration::from_secs(30));
    assert_eq!(crate::ota::serving(&d), "sensor_mlp@1.1.0");
    assert_eq!(count("accepted"), 1.0);
    assert_eq!(count("future"), 0.0);
    let c = d.status()["clock"].clone();
    assert_eq!(c["synced"], false, "{c:#}");
    assert!(
        c["system"].as_str().unwrap().starts_with("1970-01-0"),
        "{c:#}"
    );
}

// ---- a clock from the future ---------------------------------------------------------

/// The offset that puts the clock at 2100-01-01.
fn to_2100() -> i64 {
    4_102_444_800 - real_now_us() / 1_000_000
}

/// 2099-01-01: a `ts` at or after it came from the clock at 2100.
const Y2099_US: i64 = 4_070_908_800_000_000;

/// A device whose first start finds the clock at 2100 (a bad RTC), then
/// restarts with the real time on the same data dir. The first start does
/// not trust a clock that far ahead of everything it knows (the build
/// time here: the fleet is down), marks its records and does not make
/// 2100 its last known good time; the second start is trusted at once,
/// its records carry no mark, and the first start's records reach the
/// fleet with their real time. Before: 2100 became the last known good
/// time, every record of the second start was `unsynced` and the fleet got
/// all of them dated 2100.
#[test]
fn a_first_start_in_2100_does_not_poison_the_later_starts() {
    const LATER: usize = 5;
    let fleet = Ingest::start(false);
    let dir = tempfile::tempdir().unwrap();
    let fake = FakeClock::new(dir.path(), to_2100());
    let port = free_udp_port();
    let cfg = config(port, &format!("{TRUST_NOT_BEHIND}{}", fleet.uplink()));
    let mut d = Daemon::start_full(&cfg, dir, &fake.env(), true);
    let first = wait_clock(&d, "the clock read in 2100", |c| {
        c["system"].as_str().is_some_and(|s| s.starts_with("2100-"))
    });
    let t1 = real_now_us();
    let early = [record(&mut d, port), record(&mut d, port)];
    let t2 = real_now_us();
    let dir = d.stop_keep_dir();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/clock.json")).unwrap())
            .unwrap();
    let saved_good = saved["last_good_us"].as_i64().unwrap();

    // The real clock, the same data dir; the fleet is back.
    fleet.set_open(true);
    let mut d = Daemon::start_full(&cfg, dir, &[], true);
    let later: Vec<Value> = (0..LATER).map(|_| record(&mut d, port)).collect();
    let all: Vec<&Value> = early.iter().chain(&later).collect();
    let got = fleet.wait("every record", |g| {
        all.iter().all(|r| !by_id(g, &r["id"]).is_empty())
    });
    let unsynced = later.iter().filter(|r| r["clock"] == "unsynced").count();
    let at_fleet: Vec<&Value> = all.iter().map(|r| by_id(&got, &r["id"])[0]).collect();
    let dated_2100 = at_fleet
        .iter()
        .filter(|v| unix_us(v["ts"].as_str().unwrap()) >= Y2099_US)
        .count();
    let c = d.status()["clock"].clone();
    assert!(
        unsynced == 0 && dated_2100 == 0 && saved_good < Y2099_US,
        "second start: {unsynced} of {LATER} records unsynced; the fleet got {dated_2100} of {} \
         records dated 2100; last known good time saved by the first start: {}\n\
         first start's clock {first:#}\nsecond start's clock {c:#}\nat the fleet {at_fleet:#?}",
        all.len(),
        saved["last_good_us"],
    );

    // The first start did not trust 2100, and said why.
    assert_eq!(first["synced"], false, "{first:#}");
    assert_eq!(first["reason"], "ahead", "{first:#}");
    assert!(
        unix_us(first["last_good"].as_str().unwrap()) < real_now_us(),
        "{first:#}"
    );
    assert!(
        unix_us(first["trusted_time"].as_str().unwrap()) < Y2099_US,
        "{first:#}"
    );
    for r in &early {
        assert_eq!(r["clock"], "unsynced", "{r}");
    }
    // The second start trusts the real clock, and the first start's records
    // reach the fleet with the real time they were made at.
    let c = wait_clock(&d, "trusted at the real time", |c| c["synced"] == true);
    assert!(c["reason"].is_null(), "{c:#}");
    let good = unix_us(c["last_good"].as_str().unwrap());
    assert!((good - real_now_us()).abs() < 60_000_000, "{c:#}");
    for (r, sent) in all.iter().zip(&at_fleet).take(early.len()) {
        assert_eq!(sent["clock"], "corrected", "{sent}");
        let ts = unix_us(sent["ts"].as_str().unwrap());
        assert!(
            ts >= t1 - 2_000_000 && ts <= t2 + 2_000_000,
            "{sent}: not the real time {r} was made at"
        );
    }
    for (r, sent) in later.iter().zip(&at_fleet[early.len()..]) {
        assert!(r.get("clock").is_none(), "{r}");
        assert!(sent.get("clock").is_none(), "{sent}");
        assert!((unix_us(sent["ts"].as_str().unwrap()) - real_now_us()).abs() < 60_000_000);
    }
    assert_eq!(
        metric(&d, "outpost_clock_unsynced_records_total"),
        Some(0.0)
    );
    let dir = d.stop_keep_dir();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/clock.json")).unwrap())
            .unwrap();
    assert!(
        saved["last_good_us"].as_i64().unwrap() < Y2099_US,
        "{saved}"
    );
}

// ---- a fleet's Date over plain HTTP ------------------------------------------------

/// `/v1/status` until `cond` holds of it; every answer must be a 200 (a
/// panic in the handler closes the connection instead).
fn status_until(d: &Daemon, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let got = http("GET", &d.api, "/v1/status", b"");
        let st = match got {
            Ok((200, body)) => serde_json::from_slice::<Value>(&body).unwrap(),
            other => panic!(
                "{what}: /v1/status stopped answering: {:?}\n{}",
                other.map(|(c, b)| (c, String::from_utf8_lossy(&b).into_owned())),
                d.log()
            ),
        };
        if cond(&st) {
            return st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{what}: not within 30 s\n{st:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn acked(st: &Value) -> u64 {
    st["uplink"]["acked_total"].as_u64().unwrap_or(0)
}

/// Issue 50, item 9: one answer of a plain-HTTP fleet dated
/// `Fri, 31 Dec 9999 23:59:59 GMT` was taken as a confirmed time; the
/// clock's ceiling (three years past it) could not be formatted, so
/// `/v1/status` and `/metrics` panicked from then on, and every later
/// start exited 101 until clock.json was removed by hand. Now a `Date`
/// over plain HTTP is not evidence of the time: nothing is confirmed, the
/// daemon keeps answering, and it starts again on the same data.
#[test]
fn a_plain_http_fleet_dated_9999_stops_nothing_and_confirms_nothing() {
    let fleet = Ingest::start(true);
    fleet.set_date(FleetDate::Fixed("Fri, 31 Dec 9999 23:59:59 GMT"));
    let port = free_udp_port();
    let cfg = config(port, &format!("{TRUST_NOT_BEHIND}{}", fleet.uplink()));
    let mut d = Daemon::start(&cfg);
    let r = record(&mut d, port);
    // The confirmation (if any) happens before the batch's ack.
    let st = status_until(&d, "the batch acknowledged", |st| acked(st) >= 1);
    fleet.wait("the record", |g| !by_id(g, &r["id"]).is_empty());
    let c = &st["clock"];
    assert!(c["confirmed"].is_null(), "{c:#}");
    assert_eq!(c["synced"], true, "{c:#}");
    assert!(c["ceiling"].as_str().unwrap() < "2100", "{c:#}");
    let (code, body) = http("GET", &d.api, "/metrics", b"").expect("/metrics answers");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(metric(&d, "outpost_clock_synced"), Some(1.0));
    // More records, more answers dated 9999: still answering.
    let r2 = record(&mut d, port);
    status_until(&d, "the second batch acknowledged", |st| acked(st) >= 2);
    fleet.wait("the second record", |g| !by_id(g, &r2["id"]).is_empty());
    assert!(r2.get("clock").is_none(), "{r2}");

    // A restart on the same data starts and trusts the clock.
    let dir = d.stop_keep_dir();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/clock.json")).unwrap())
            .unwrap();
    assert!(saved.get("confirmed_us").is_none(), "{saved}");
    let mut d = Daemon::start_in(&cfg, dir);
    let c = wait_clock(&d, "trusted after the restart", |c| c["synced"] == true);
    assert!(c["confirmed"].is_null(), "{c:#}");
    let r3 = record(&mut d, port);
    assert!(r3.get("clock").is_none(), "{r3}");
}

/// Issue 50, item 9: a device whose clock says 2100 and a plain-HTTP fleet
/// whose `Date` says the same. Before, the `Date` was kept as a confirmed
/// time, the clock at 2100 became trusted and its last known good time,
/// and back on the real clock every record was `unsynced` (`behind`). Now
/// the `Date` is no evidence over plain HTTP: the clock stays "ahead", and
/// a restart on the real clock is trusted at once.
#[test]
fn a_plain_http_fleet_dated_2100_does_not_make_2100_trusted() {
    let fleet = Ingest::start(true);
    let dir = tempfile::tempdir().unwrap();
    let to = to_2100();
    let fake = FakeClock::new(dir.path(), to);
    fleet.set_date(FleetDate::Offset(to));
    let port = free_udp_port();
    let cfg = config(port, &format!("{TRUST_NOT_BEHIND}{}", fleet.uplink()));
    let mut d = Daemon::start_full(&cfg, dir, &fake.env(), true);
    wait_clock(&d, "the clock read in 2100", |c| {
        c["system"].as_str().is_some_and(|s| s.starts_with("2100-"))
    });
    let early = record(&mut d, port);
    assert_eq!(early["clock"], "unsynced", "{early}");
    let st = status_until(&d, "the batch acknowledged", |st| acked(st) >= 1);
    let got = fleet.wait("the record", |g| !by_id(g, &early["id"]).is_empty());
    assert!(
        by_id(&got, &early["id"])[0]["ts"]
            .as_str()
            .unwrap()
            .starts_with("2100-")
    );
    let c = &st["clock"];
    assert!(
        c["confirmed"].is_null(),
        "the plain-HTTP Date was taken: {c:#}"
    );
    assert_eq!(c["synced"], false, "{c:#}");
    assert_eq!(c["reason"], "ahead", "{c:#}");
    // A record made after the answer is still marked.
    let later = record(&mut d, port);
    assert_eq!(later["clock"], "unsynced", "{later}");
    let c = d.status()["clock"].clone();
    assert_eq!(c["synced"], false, "{c:#}");
    assert!(c["confirmed"].is_null(), "{c:#}");

    // Back on the real clock, the same data: trusted, records unmarked.
    let dir = d.stop_keep_dir();
    let saved: Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("data/clock.json")).unwrap())
            .unwrap();
    assert!(
        saved["last_good_us"].as_i64().unwrap() < Y2099_US,
        "{saved}"
    );
    assert!(saved.get("confirmed_us").is_none(), "{saved}");
    let mut d = Daemon::start_full(&cfg, dir, &[], true);
    let c = wait_clock(&d, "trusted at the real time", |c| c["synced"] == true);
    assert!(c["reason"].is_null(), "{c:#}");
    let r = record(&mut d, port);
    assert!(r.get("clock").is_none(), "{r}");
}
