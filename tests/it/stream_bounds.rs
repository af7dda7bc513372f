//! Per-stream state is bounded: stream names come from the senders (here
//! the prefix of each UDP datagram), so a pipeline holds state for at most
//! `max_streams` of them, evicts the least recently seen, forgets streams
//! idle for `stream_idle` without any new frame, and a stream that comes
//! back starts over exactly like a new one. A real daemon with silero VAD.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use outpost::source::framing::named;
use serde_json::Value;

use crate::common::*;
use crate::streams::{noise, speak};

/// A free UDP port on loopback.
fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn pcm(samples: &[i16]) -> Vec<u8> {
    samples.iter().flat_map(|s| s.to_le_bytes()).collect()
}

/// A silero VAD pipeline fed by UDP with named framing (PCM16 at 16 kHz,
/// 512 samples per frame: one window each).
fn vad_pipeline(name: &str, port: u16, extra: &str) -> String {
    format!(
        r#"
[[pipelines]]
name = "{name}"
model = "silero_vad"
when_full = "block"
queue = 4096
{extra}
source = {{ type = "udp", listen = "127.0.0.1:{port}", framing = "named" }}
"#
    )
}

fn daemon(pipelines: &str) -> Daemon {
    Daemon::start(&format!(
        r#"
device = "gw-streams"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[runtime]
intra_threads = 1
{pipelines}
"#
    ))
}

fn pipeline(status: &Value, name: &str) -> Value {
    status["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no pipeline {name} in {status:#}"))
        .clone()
}

/// Polls the status until `cond` holds for pipeline `name`; returns that pipeline.
fn wait_for(
    d: &Daemon,
    name: &str,
    limit: Duration,
    what: &str,
    cond: impl Fn(&Value) -> bool,
) -> Value {
    let t0 = Instant::now();
    loop {
        let p = pipeline(&d.status(), name);
        if cond(&p) {
            return p;
        }
        assert!(
            t0.elapsed() < limit,
            "{what}: not within {limit:?}\n{p:#}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A metric's value from /metrics (None when absent).
fn metric(d: &Daemon, series: &str) -> Option<f64> {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Sends one frame per name (in bursts small enough for the socket's
/// receive buffer), each burst waited for until processed.
fn send_names(d: &Daemon, pipe: &str, port: u16, names: &[String], frame: &[u8]) {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    let done0 = pipeline(&d.status(), pipe)["frames_done"].as_u64().unwrap();
    let mut sent = 0u64;
    for burst in names.chunks(25) {
        for n in burst {
            sock.send_to(&named(n, frame), ("127.0.0.1", port)).unwrap();
        }
        sent += burst.len() as u64;
        wait_for(d, pipe, Duration::from_secs(30), "frames processed", |p| {
            p["frames_done"].as_u64() == Some(done0 + sent)
        });
    }
}

#[test]
fn many_stream_names_hold_state_for_at_most_max_streams() {
    let (one, batched) = (free_udp_port(), free_udp_port());
    // The second pipeline batches 8 streams per run with room for only 4: the
    // streams of a run are held while it runs and trimmed after.
    let mut d = daemon(&format!(
        "{}{}",
        vad_pipeline("vad", one, "max_streams = 100"),
        vad_pipeline(
            "vad_batched",
            batched,
            "max_streams = 4\nmax_batch = 8\nmax_delay = \"5ms\""
        )
    ));
    let mut seed = 3;
    let frame = pcm(&noise(512, &mut seed));
    let names: Vec<String> = (0..2000).map(|i| format!("mic-{i}")).collect();
    send_names(&d, "vad", one, &names, &frame);
    send_names(&d, "vad_batched", batched, &names, &frame);

    for (pipe, max) in [("vad", 100u64), ("vad_batched", 4)] {
        let p = pipeline(&d.status(), pipe);
        let s = &p["streams"];
        assert_eq!(s["max"], max, "{p:#}");
        assert_eq!(s["held"], max, "{p:#}");
        assert_eq!(s["evicted_lru"], 2000 - max, "{p:#}");
        assert_eq!(s["evicted_idle"], 0, "{p:#}");
        assert_eq!(p["frames_done"], 2000, "{p:#}");
        assert_eq!(
            metric(
                &d,
                &format!("outpost_streams_evicted_total{{pipeline=\"{pipe}\",reason=\"lru\"}}")
            ),
            Some((2000 - max) as f64)
        );
        assert_eq!(
            metric(&d, &format!("outpost_streams{{pipeline=\"{pipe}\"}}")),
            Some(max as f64)
        );
    }
    assert!(d.terminate().success());
}

#[test]
fn idle_streams_are_forgotten_without_new_frames() {
    let port = free_udp_port();
    let d = daemon(&vad_pipeline("vad", port, "stream_idle = \"1s\""));
    let mut seed = 5;
    let frame = pcm(&noise(512, &mut seed));
    let names: Vec<String> = (0..50).map(|i| format!("room-{i}")).collect();
    send_names(&d, "vad", port, &names, &frame);
    // Every stream was held (some may have gone idle already on a slow machine).
    let p = pipeline(&d.status(), "vad");
    let s = &p["streams"];
    assert_eq!(
        s["held"].as_u64().unwrap() + s["evicted_idle"].as_u64().unwrap(),
        50,
        "{p:#}"
    );
    // No frame arrives from here on; the streams still go.
    let p = wait_for(
        &d,
        "vad",
        Duration::from_secs(20),
        "idle streams expired",
        |p| p["streams"]["held"] == 0,
    );
    assert_eq!(p["streams"]["evicted_idle"], 50, "{p:#}");
    assert_eq!(p["streams"]["evicted_lru"], 0, "{p:#}");
    assert_eq!(
        metric(
            &d,
            "outpost_streams_evicted_total{pipeline=\"vad\",reason=\"idle\"}"
        ),
        Some(50.0)
    );
}

#[test]
fn an_evicted_stream_starts_over_like_a_new_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (speech, _, (first, _)) = speak(tmp.path(), "s", "the pump on line three is running hot");
    // Two 512-sample chunks of speech (read as 16 kHz: one window each).
    let f1 = pcm(&speech[first..first + 512]);
    let f2 = pcm(&speech[first + 512..first + 1024]);
    let port = free_udp_port();
    // `raw` postprocessing: every window is a record with its probability.
    let mut d = daemon(&vad_pipeline(
        "vad",
        port,
        "max_streams = 2\npostprocess = { type = \"raw\" }",
    ));
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    // Sends one frame and waits for its record; returns the probability.
    let mut send = |stream: &str, frame: &[u8]| -> Value {
        let before = d.seen.len();
        sock.send_to(&named(stream, frame), ("127.0.0.1", port))
            .unwrap();
        let recs = d.records_until(Duration::from_secs(20), |r| r.len() > before);
        assert!(recs.len() > before, "no record for {stream}");
        assert_eq!(recs[before]["stream"], stream);
        recs[before]["outputs"]["output"]["data"].clone()
    };
    send("a", &f1);
    let a_second = send("a", &f2);
    // The same chunk as a new stream's first: no context, zero state.
    let fresh = send("z", &f2);
    assert_ne!(a_second, fresh, "the stream's state is carried over");
    // A third stream: `a` is the least recently seen of the two held.
    send("b", &f1);
    let a_again = send("a", &f2);
    assert_eq!(
        a_again, fresh,
        "an evicted stream starts from zero state and no context"
    );
    let p = pipeline(&d.status(), "vad");
    // b evicted a; a evicted z.
    assert_eq!(p["streams"]["evicted_lru"], 2, "{p:#}");
    assert_eq!(p["streams"]["held"], 2, "{p:#}");
}
