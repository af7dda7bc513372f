//! What comes in from outside stays inside its bounds: a camera URL is only
//! data, stalled unix-socket writers cannot starve the others, unix output
//! readers cannot take the descriptors storage needs, and camera
//! credentials never reach status, events or the log. Each with the real
//! daemon and real peers.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

/// A JSON frame the sensor_mlp pipelines take (16 values).
const FRAME: &[u8] = b"[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

/// Polls `cond` until it holds, panicking with `what` and the log after `limit`.
fn wait_for(d: &Daemon, limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < limit,
            "{what}: not within {limit:?}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn drops(d: &Daemon, reason: &str) -> u64 {
    d.status()["pipelines"][0]["drops"][reason]
        .as_u64()
        .unwrap_or(0)
}

// ---- camera URLs -------------------------------------------------------------

/// The device text of a `v4l2://` URL was pasted into a launch string: this
/// URL passed `check`, and the daemon ran the pipeline it spelled, whose
/// filesink truncated VICTIM to 0 bytes. Now `check` refuses it, naming the
/// key, and `run` refuses the config; VICTIM keeps its bytes.
#[test]
fn v4l2_url_with_pipeline_syntax_is_refused_and_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let victim = dir.path().join("VICTIM");
    std::fs::write(&victim, b"precious").unwrap();
    let cfg = dir.path().join("outpost.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"
data_dir = "{data}"
[api]
listen = "127.0.0.1:0"
[[pipelines]]
name = "cam"
model = "classifier"
source = {{ type = "camera", url = "v4l2:///dev/null ! fakesink videotestsrc num-buffers=3 ! tee name=t ! queue ! filesink location={victim} t. ! queue" }}
"#,
            data = dir.path().join("data").display(),
            victim = victim.display()
        ),
    )
    .unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "source.url");
    assert!(
        stderr(&o).contains("device path holds a space"),
        "{}",
        stderr(&o)
    );

    let mut child = outpost()
        .arg("--config")
        .arg(&cfg)
        .arg("run")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t0.elapsed() > Duration::from_secs(30) || std::fs::read(&victim).unwrap() != b"precious"
        {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the daemon ran the URL's pipeline (VICTIM now {:?})",
                std::fs::read(&victim).unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "{err}");
    assert!(err.contains("source.url"), "{err}");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
}

// ---- unix socket source -------------------------------------------------------

/// Two connections each announced a 64 MiB frame, sent 63 MiB and went
/// silent: their reservations took the whole 128 MiB budget, and a
/// well-behaved writer on the same socket got 0 of 10 frames recorded in
/// 60 s. Now a frame that fits its connection's share is read at once
/// whatever the others hold, and a writer silent inside a frame is closed
/// and counted after `frame_read_timeout` (5 s by default; the defaults are
/// what this test runs with).
#[test]
fn stalled_unix_writers_never_starve_a_good_one_and_are_timed_out() {
    let mut d = Daemon::start(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
[[pipelines]]
name = "sock"
model = "sensor_mlp"
source = { type = "unix", path = "{DIR}/in.sock" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#,
    );
    let sock = d.dir.path().join("in.sock");
    let (tx, rx) = std::sync::mpsc::channel::<&'static str>();
    let stalled: Vec<_> = (0..2)
        .map(|_| {
            let (sock, tx) = (sock.clone(), tx.clone());
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&sock).unwrap();
                s.set_write_timeout(Some(Duration::from_secs(60))).unwrap();
                s.write_all(&(64u32 << 20).to_le_bytes()).unwrap();
                tx.send("announced").unwrap();
                let chunk = vec![b' '; 1 << 20];
                for _ in 0..63 {
                    if s.write_all(&chunk).is_err() {
                        return false;
                    }
                }
                tx.send("sent").unwrap();
                // Silent from here on: the daemon must close it.
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let mut b = [0u8; 1];
                match s.read(&mut b) {
                    Ok(0) => true,
                    Ok(_) => false,
                    Err(e) => !matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                }
            })
        })
        .collect();
    // Both frames announced and one of them 63 MiB in before the good writer comes.
    let (mut announced, mut sent) = (0, 0);
    while announced < 2 || sent < 1 {
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok("announced") => announced += 1,
            Ok(_) => sent += 1,
            Err(_) => panic!("the stalled writers did not start:\n{}", d.log()),
        }
    }

    let t0 = Instant::now();
    let mut good = UnixStream::connect(&sock).unwrap();
    for _ in 0..10 {
        good.write_all(&(FRAME.len() as u32).to_le_bytes()).unwrap();
        good.write_all(FRAME).unwrap();
    }
    d.records_until(Duration::from_secs(30), |r| r.len() >= 10);
    let took = t0.elapsed();
    assert_eq!(
        d.seen.len(),
        10,
        "good frames recorded in {took:?}\n{}",
        d.log()
    );
    // Promptly: not freed by the stalled writers' timeouts.
    assert_eq!(drops(&d, "frame_read_timeout"), 0, "{took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    // Each stalled writer is closed after 5 s of silence (the second one
    // gets its room once the first is gone), and counted.
    wait_for(&d, Duration::from_secs(40), "two timed-out frames", || {
        drops(&d, "frame_read_timeout") >= 2
    });
    for t in stalled {
        assert!(t.join().unwrap(), "a stalled writer was not closed");
    }
    assert_eq!(drops(&d, "frame_read_timeout"), 2);
    assert!(
        d.log().contains("frame_read_timeout"),
        "no log line:\n{}",
        d.log()
    );
    // The good writer's connection still works.
    good.write_all(&(FRAME.len() as u32).to_le_bytes()).unwrap();
    good.write_all(FRAME).unwrap();
    d.records_until(Duration::from_secs(30), |r| r.len() >= 11);
    assert_eq!(d.seen.len(), 11);
}

// ---- unix output readers --------------------------------------------------------

/// Sum of a metric's samples whose line holds every one of `parts`.
fn metric_sum(d: &Daemon, name: &str, parts: &[&str]) -> f64 {
    let (code, body) = http("GET", &d.api, "/metrics", b"").expect("/metrics");
    assert_eq!(code, 200);
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
                && parts.iter().all(|p| l.contains(p))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// 1,500 idle readers of a unix output with the daemon at 1,024
/// descriptors took every descriptor: `/healthz` failed, the outbox failed
/// its commits with EMFILE and frames were dropped as `store_error`. Here the
/// same at 300 readers and 256 descriptors: now a unix output serves at most
/// `max_readers` (64 by default), the rest are closed and counted, and the
/// API, storage and the readers it kept go on.
#[test]
fn idle_unix_output_readers_are_capped_and_never_take_storage_descriptors() {
    crate::common::wrap_next_daemon(&["prlimit", "--nofile=256:256", "--"]);
    let mut d = Daemon::start(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = { type = "http" }
outputs = [{ type = "unix", path = "{DIR}/out.sock" }]
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#,
    );
    let sock = d.dir.path().join("out.sock");
    let mut readers: Vec<UnixStream> = (0..300)
        .map(|i| {
            UnixStream::connect(&sock).unwrap_or_else(|e| panic!("reader {i}: {e}\n{}", d.log()))
        })
        .collect();
    let refused = |d: &Daemon| {
        metric_sum(
            d,
            "outpost_output_readers_refused_total",
            &["pipeline=\"sensors\""],
        )
    };
    wait_for(&d, Duration::from_secs(30), "236 readers refused", || {
        refused(&d) >= 236.0
    });
    assert_eq!(refused(&d), 236.0);
    assert_eq!(
        metric_sum(&d, "outpost_output_readers", &["pipeline=\"sensors\""]),
        64.0
    );
    let out = &d.status()["pipelines"][0]["outputs"][0];
    assert_eq!(out["readers"], 64, "{out}");
    assert_eq!(
        out["readers_refused"]["max_readers"].as_u64().unwrap_or(0)
            + out["readers_refused"]["descriptors"].as_u64().unwrap_or(0),
        236,
        "{out}"
    );

    // The API answers and every record is stored.
    for _ in 0..20 {
        let (code, _) = http("GET", &d.api, "/healthz", b"").expect("/healthz");
        assert_eq!(code, 200);
    }
    for i in 0..20 {
        let (code, body) = http(
            "POST",
            &d.api,
            &format!("/v1/pipelines/sensors/infer?stream=s{i}"),
            FRAME,
        )
        .expect("infer");
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    }
    d.records_until(Duration::from_secs(30), |r| r.len() >= 20);
    assert_eq!(d.seen.len(), 20);
    let st = d.status();
    assert_eq!(
        st["pipelines"][0]["drops"]["store_error"],
        serde_json::Value::Null,
        "{st}"
    );
    assert_eq!(
        metric_sum(&d, "outpost_outbox_flush_errors_total", &[]),
        0.0
    );
    // A reader that was kept gets the records, whole.
    let first = &mut readers[0];
    first
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut len = [0u8; 4];
    first.read_exact(&mut len).unwrap();
    let mut rec = vec![0u8; u32::from_le_bytes(len) as usize];
    first.read_exact(&mut rec).unwrap();
    let rec: serde_json::Value = serde_json::from_slice(&rec).unwrap();
    assert_eq!(rec["pipeline"], "sensors");
    // A refused reader was closed: it reads the end of the stream.
    let last = readers.last_mut().unwrap();
    last.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut b = [0u8; 1];
    assert!(matches!(last.read(&mut b), Ok(0) | Err(_)));
    assert!(
        d.log().matches("reader refused and closed").count() <= 2,
        "refusals are logged at a limited rate"
    );
}

/// With `max_readers` set above what the descriptor limit allows, readers
/// stop at the descriptors storage keeps (`api.reserved_fds`), counted
/// `descriptors`, and storage and the API keep working.
#[test]
fn unix_output_readers_stop_at_the_reserved_descriptors() {
    crate::common::wrap_next_daemon(&["prlimit", "--nofile=256:256", "--"]);
    let mut d = Daemon::start(
        r#"
data_dir = "{DATA}"
[api]
listen = "{API}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = { type = "http" }
outputs = [{ type = "unix", path = "{DIR}/out.sock", max_readers = 1000 }]
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#,
    );
    let sock = d.dir.path().join("out.sock");
    let _readers: Vec<UnixStream> = (0..300)
        .map(|i| {
            UnixStream::connect(&sock).unwrap_or_else(|e| panic!("reader {i}: {e}\n{}", d.log()))
        })
        .collect();
    let counted = |d: &Daemon| {
        metric_sum(d, "outpost_output_readers", &[])
            + metric_sum(d, "outpost_output_readers_refused_total", &[])
    };
    wait_for(&d, Duration::from_secs(30), "300 readers seen", || {
        counted(&d) >= 300.0
    });
    let kept = metric_sum(&d, "outpost_output_readers", &[]);
    let refused = metric_sum(
        &d,
        "outpost_output_readers_refused_total",
        &["reason=\"descriptors\""],
    );
    assert!(kept > 0.0 && kept < 192.0, "{kept} readers kept");
    assert_eq!(kept + refused, 300.0);
    let open = std::fs::read_dir(format!("/proc/{}/fd", d.child.id()))
        .unwrap()
        .count();
    assert!(open <= 256 - 64, "{open} descriptors open");
    for i in 0..10 {
        let (code, body) = http(
            "POST",
            &d.api,
            &format!("/v1/pipelines/sensors/infer?stream=s{i}"),
            FRAME,
        )
        .expect("infer");
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    }
    d.records_until(Duration::from_secs(30), |r| r.len() >= 10);
    assert_eq!(d.seen.len(), 10);
    assert_eq!(
        metric_sum(&d, "outpost_outbox_flush_errors_total", &[]),
        0.0
    );
}

// ---- camera credentials -----------------------------------------------------------

/// An RTSP server on loopback that asks for Basic credentials, then refuses
/// them with a reason phrase that echoes the `Authorization` header (as some
/// cameras do in their errors). Serves until the test process ends.
#[cfg(feature = "camera")]
fn echoing_rtsp_server() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for c in l.incoming().map_while(Result::ok) {
            std::thread::spawn(move || {
                let mut c = c;
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while let Ok(n) = c.read(&mut chunk) {
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let req = String::from_utf8_lossy(&buf[..end]).into_owned();
                        buf.drain(..end + 4);
                        let header = |name: &str| {
                            req.lines()
                                .find(|l| l.to_ascii_lowercase().starts_with(name))
                                .map(str::to_string)
                        };
                        let seq = header("cseq").unwrap_or_default();
                        let answer = match header("authorization") {
                            Some(auth) => format!(
                                "RTSP/1.0 403 Forbidden ({auth})\r\n{seq}\r\nContent-Length: 0\r\n\r\n"
                            ),
                            None => format!(
                                "RTSP/1.0 401 Unauthorized\r\n{seq}\r\nWWW-Authenticate: Basic realm=\"cam\"\r\nContent-Length: 0\r\n\r\n"
                            ),
                        };
                        if c.write_all(answer.as_bytes()).is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    port
}

/// The first `tick` of `/v1/events` (the status and records a console sees).
#[cfg(feature = "camera")]
fn first_tick(api: &str) -> String {
    let mut s = std::net::TcpStream::connect(api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    write!(s, "GET /v1/events HTTP/1.1\r\nHost: {api}\r\n\r\n").unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let text = String::from_utf8_lossy(&got);
        if let Some(at) = text.find("event: tick")
            && text[at..].contains("\n\n")
        {
            return text[at..].to_string();
        }
        let n = s.read(&mut chunk).expect("reading /v1/events");
        assert!(n > 0, "events ended: {text}");
        got.extend_from_slice(&chunk[..n]);
    }
}

/// A server that echoed the `Authorization` header in its error put the
/// base64 of `user:pass` into `last_error`, `/v1/events`, the log and the
/// `camera_down` record; a hand-written `pipeline` with
/// `rtspsrc location=rtsp://user:pass@...` was shown as written. Now every
/// camera text is scrubbed: neither the credentials nor their base64 appear
/// anywhere (and an `rtsp://` camera's error shows the status, not the
/// server's reason phrase).
#[cfg(feature = "camera")]
#[test]
fn camera_credentials_never_reach_status_events_log_or_records() {
    use base64::Engine;
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
    let echo = echoing_rtsp_server();
    let closed = free_port();
    let cfg = format!(
        r#"
device = "gw-cam"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "echoed"
model = "classifier"
source = {{ type = "camera", url = "rtsp://viewer:right-horse@127.0.0.1:{echo}/cam", stall_timeout = "3s" }}
[[pipelines]]
name = "custom"
model = "classifier"
source = {{ type = "camera", stall_timeout = "3s", pipeline = "rtspsrc location=rtsp://viewer:battery-staple@127.0.0.1:{closed}/cam protocols=tcp ! rtph264depay ! avdec_h264 ! videoconvert ! appsink name=outpost" }}
"#
    );
    let mut d = Daemon::start(&cfg);
    let camera = |d: &Daemon, name: &str| {
        d.status()["pipelines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap()["camera"]
            .clone()
    };
    wait_for(
        &d,
        Duration::from_secs(60),
        "both cameras failed twice",
        || {
            let e = camera(&d, "echoed");
            let c = camera(&d, "custom");
            e["reconnects"].as_u64().unwrap_or(0) >= 2
                && e["last_error"]
                    .as_str()
                    .is_some_and(|m| m.contains("Forbidden"))
                && c["reconnects"].as_u64().unwrap_or(0) >= 2
        },
    );
    let secrets = [
        "right-horse".to_string(),
        "battery-staple".to_string(),
        STANDARD.encode("viewer:right-horse"),
        STANDARD_NO_PAD.encode("right-horse"),
        STANDARD.encode("viewer:battery-staple"),
    ];
    // The daemon's RTSP client reports the status with its standard reason,
    // never the server's own words (where this server echoes the header).
    let echoed = camera(&d, "echoed");
    assert!(
        echoed["last_error"]
            .as_str()
            .unwrap()
            .contains("the camera answered 403 Forbidden"),
        "{echoed}"
    );
    let custom = camera(&d, "custom");
    assert!(
        custom["camera"]
            .as_str()
            .unwrap()
            .contains("rtsp://***@127.0.0.1"),
        "{custom}"
    );
    let texts = [
        ("status", d.status().to_string()),
        ("events", first_tick(&d.api)),
        ("log", d.log()),
    ];
    assert!(d.terminate().success());
    let out = run(outpost().args([
        "outbox",
        "export",
        "--data-dir",
        d.dir.path().join("data").to_str().unwrap(),
    ]));
    let records = stdout(&out);
    assert!(
        records.contains("camera_down"),
        "no camera_down record: {records}"
    );
    for (what, text) in texts.iter().chain([&("records", records.clone())]) {
        for s in &secrets {
            assert!(!text.contains(s.as_str()), "{s} in the {what}:\n{text}");
        }
    }
}
