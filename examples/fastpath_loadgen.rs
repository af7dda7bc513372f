//! The load generator of `perf/compare_fastpath`: compiled, so the
//! generator is not what saturates first (a Python paho generator tops out
//! near the rates it is meant to measure).
//!
//! Frames are 512 PCM16 samples at 16 kHz (1024 bytes, a tone with noise),
//! published at QoS 0 with TCP_NODELAY. Every mode prints one JSON line.
//!
//! - `broker`: the generator alone against the broker: publishes to
//!   `loadgen/<s>/audio` and subscribes to `loadgen/#` itself, closed loop
//!   with `--window` in flight: the rate the generator and broker sustain
//!   with nothing else in the path.
//! - `closed`: `--streams` streams published to `--pub` (`{s}` = stream
//!   name), at most `--window` frames in flight; each message received on
//!   `--sub` completes one frame. Frames/s after `--warm` completions.
//! - `latency`: each stream paced at `--rate` frames/s for `--seconds`;
//!   each result (JSON with a `stream` field, else the topic's second
//!   segment names the stream) is matched to its stream's oldest
//!   unanswered frame: publish -> receive latency p50/p90/p99/max.
//! - `udp-latency`: the same over UDP: frames go to `--to` as named frames
//!   (one length byte, the stream name, the payload); results are
//!   datagrams (record JSON) received on `--listen`.
//!
//! Usage: cargo run --release --example fastpath_loadgen -- MODE [options]

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use rumqttc::{AsyncClient, Event, MqttOptions, NetworkOptions, Packet, QoS};
use tokio::sync::Semaphore;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Mode {
    Broker,
    Closed,
    Latency,
    UdpLatency,
}

#[derive(Parser, Debug)]
struct Args {
    mode: Mode,
    #[arg(long, default_value_t = 1883)]
    port: u16,
    #[arg(long, default_value_t = 8)]
    streams: usize,
    #[arg(long, default_value_t = 64)]
    window: usize,
    /// Closed loop: frames in all (after the warm-up).
    #[arg(long, default_value_t = 20000)]
    frames: u64,
    #[arg(long, default_value_t = 256)]
    warm: u64,
    #[arg(long, default_value_t = 15.0)]
    max_seconds: f64,
    #[arg(long, default_value = "bench/{s}/audio")]
    r#pub: String,
    #[arg(long, default_value = "bench/+/vad")]
    sub: String,
    /// Latency: frames/s per stream.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// udp-latency: where frames go.
    #[arg(long, default_value = "127.0.0.1:9500")]
    to: String,
    /// udp-latency: where results arrive.
    #[arg(long, default_value = "127.0.0.1:9501")]
    listen: String,
}

fn frame() -> Vec<u8> {
    let mut seed = 20261130u64;
    (0..512)
        .flat_map(|i| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = ((seed >> 33) % 200) as f64 - 100.0;
            let v = (i as f64 * 0.07).sin() * 6000.0 + noise;
            (v as i16).to_le_bytes()
        })
        .collect()
}

fn stream_name(i: usize) -> String {
    format!("s{i}")
}

async fn client(port: u16, id: &str, cap: usize) -> (AsyncClient, rumqttc::EventLoop) {
    let mut o = MqttOptions::new(id, "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(30));
    o.set_max_packet_size(1 << 20, 1 << 20);
    o.set_inflight(1000);
    let (c, mut ev) = AsyncClient::new(o, cap);
    let mut net = NetworkOptions::new();
    net.set_tcp_nodelay(true);
    ev.set_network_options(net);
    (c, ev)
}

/// A subscriber that calls `on_msg(topic, payload)` for each publish; returns once subscribed.
async fn subscriber(
    port: u16,
    filter: &str,
    mut on_msg: impl FnMut(&str, &[u8]) + Send + 'static,
) -> AsyncClient {
    let (c, mut ev) = client(port, &format!("loadgen-sub-{}", std::process::id()), 100).await;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut tx = Some(tx);
    let sub = c.clone();
    let filter = filter.to_string();
    tokio::spawn(async move {
        loop {
            match ev.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(_))) => {
                    let _ = sub.subscribe(filter.clone(), QoS::AtMostOnce).await;
                }
                Ok(Event::Incoming(Packet::SubAck(_))) => {
                    if let Some(t) = tx.take() {
                        let _ = t.send(());
                    }
                }
                Ok(Event::Incoming(Packet::Publish(p))) => on_msg(&p.topic, &p.payload),
                Ok(_) => {}
                Err(e) => {
                    eprintln!("loadgen: subscriber: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    });
    let _ = tokio::time::timeout(Duration::from_secs(10), rx).await;
    c
}

async fn publisher(port: u16) -> AsyncClient {
    let (c, mut ev) = client(port, &format!("loadgen-pub-{}", std::process::id()), 4096).await;
    tokio::spawn(async move {
        loop {
            if let Err(e) = ev.poll().await {
                eprintln!("loadgen: publisher: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    });
    c
}

async fn closed_loop(a: &Args, pub_tpl: &str, sub: &str, mode: &str) {
    let permits = Arc::new(Semaphore::new(a.window));
    let done = Arc::new(AtomicU64::new(0));
    let (p2, d2) = (permits.clone(), done.clone());
    let _sub = subscriber(a.port, sub, move |_, payload| {
        let n = records_in(payload);
        d2.fetch_add(n as u64, Ordering::Relaxed);
        p2.add_permits(n);
    })
    .await;
    let c = publisher(a.port).await;
    let topics: Vec<String> = (0..a.streams)
        .map(|i| pub_tpl.replace("{s}", &stream_name(i)))
        .collect();
    let payload = frame();
    let total = a.frames + a.warm;
    let t_start = Instant::now();
    let mut t_warm: Option<Instant> = None;
    let mut sent = 0u64;
    let deadline = t_start + Duration::from_secs_f64(a.max_seconds);
    while done.load(Ordering::Relaxed) < total && Instant::now() < deadline {
        if t_warm.is_none() && done.load(Ordering::Relaxed) >= a.warm {
            t_warm = Some(Instant::now());
        }
        if sent < total {
            match tokio::time::timeout(Duration::from_millis(50), permits.acquire()).await {
                Ok(Ok(p)) => {
                    p.forget();
                    let t = &topics[(sent as usize) % topics.len()];
                    let _ = c
                        .publish(t.clone(), QoS::AtMostOnce, false, payload.clone())
                        .await;
                    sent += 1;
                }
                _ => continue,
            }
        } else {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let end = Instant::now();
    let n = done.load(Ordering::Relaxed);
    let t0 = t_warm.unwrap_or(t_start);
    let counted = n.saturating_sub(a.warm.min(n));
    let secs = end.duration_since(t0).as_secs_f64().max(1e-9);
    println!(
        "{}",
        serde_json::json!({
            "mode": mode, "streams": a.streams, "window": a.window,
            "sent": sent, "completed": n, "counted": counted,
            "seconds": secs, "frames_per_s": counted as f64 / secs,
            "timed_out": n < total,
        })
    );
}

/// Records in one result message: an uplink with `batch > 1` sends a JSON
/// array of records, everything else one record per message.
fn records_in(payload: &[u8]) -> usize {
    if payload.first() == Some(&b'[') {
        serde_json::from_slice::<Vec<serde::de::IgnoredAny>>(payload).map_or(1, |v| v.len().max(1))
    } else {
        1
    }
}

type Pending = Arc<std::sync::Mutex<HashMap<String, VecDeque<Instant>>>>;

fn summary(mut lat: Vec<f64>, sent: u64, extra: serde_json::Value) {
    lat.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| {
        if lat.is_empty() {
            None
        } else {
            Some(lat[((lat.len() - 1) as f64 * p).round() as usize])
        }
    };
    let mut v = serde_json::json!({
        "sent": sent, "received": lat.len(),
        "p50_us": q(0.5), "p90_us": q(0.9), "p99_us": q(0.99), "max_us": q(1.0),
    });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    println!("{v}");
}

/// Stream of a result: the record's `stream` field, else the topic's second segment.
fn result_stream(topic: &str, payload: &[u8]) -> Option<String> {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload)
        && let Some(s) = v.get("stream").and_then(|s| s.as_str())
    {
        return Some(s.to_string());
    }
    topic.split('/').nth(1).map(str::to_string)
}

async fn paced<F, Fut>(a: &Args, pending: Pending, mut send: F) -> u64
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let period = Duration::from_secs_f64(1.0 / a.rate);
    let end = Instant::now() + Duration::from_secs_f64(a.seconds);
    // Streams offset evenly within the period, so they do not arrive together.
    let mut next: Vec<tokio::time::Instant> = (0..a.streams)
        .map(|i| tokio::time::Instant::now() + period.mul_f64(i as f64 / a.streams as f64))
        .collect();
    let mut sent = 0;
    while Instant::now() < end {
        let (i, at) = next
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| **t)
            .map(|(i, t)| (i, *t))
            .unwrap_or((0, tokio::time::Instant::now()));
        tokio::time::sleep_until(at).await;
        pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(stream_name(i))
            .or_default()
            .push_back(Instant::now());
        send(i).await;
        sent += 1;
        next[i] = at + period;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    sent
}

fn matcher(pending: &Pending, lat: &Arc<std::sync::Mutex<Vec<f64>>>, stream: Option<String>) {
    let now = Instant::now();
    if let Some(s) = stream
        && let Some(t) = pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(&s)
            .and_then(|q| q.pop_front())
    {
        lat.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(now.duration_since(t).as_secs_f64() * 1e6);
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = Args::parse();
    match a.mode {
        Mode::Broker => {
            let a2 = Args {
                frames: a.frames.max(50_000),
                window: a.window.max(256),
                ..Args::parse()
            };
            closed_loop(&a2, "loadgen/{s}/audio", "loadgen/#", "broker").await;
        }
        Mode::Closed => closed_loop(&a, &a.r#pub, &a.sub, "closed").await,
        Mode::Latency => {
            let pending: Pending = Arc::default();
            let lat: Arc<std::sync::Mutex<Vec<f64>>> = Arc::default();
            let (p2, l2) = (pending.clone(), lat.clone());
            let _sub = subscriber(a.port, &a.sub, move |t, p| {
                matcher(&p2, &l2, result_stream(t, p));
            })
            .await;
            let c = publisher(a.port).await;
            let payload = frame();
            let topics: Vec<String> = (0..a.streams)
                .map(|i| a.r#pub.replace("{s}", &stream_name(i)))
                .collect();
            let sent = paced(&a, pending, |i| {
                let (c, t, p) = (c.clone(), topics[i].clone(), payload.clone());
                async move {
                    let _ = c.publish(t, QoS::AtMostOnce, false, p).await;
                }
            })
            .await;
            let l = lat.lock().unwrap_or_else(|p| p.into_inner()).clone();
            summary(
                l,
                sent,
                serde_json::json!({"mode": "latency", "streams": a.streams, "rate": a.rate}),
            );
        }
        Mode::UdpLatency => {
            let pending: Pending = Arc::default();
            let lat: Arc<std::sync::Mutex<Vec<f64>>> = Arc::default();
            let rx = match tokio::net::UdpSocket::bind(&a.listen).await {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("loadgen: bind {}: {e}", a.listen);
                    std::process::exit(2);
                }
            };
            let (p2, l2) = (pending.clone(), lat.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                while let Ok(n) = rx.recv(&mut buf).await {
                    matcher(&p2, &l2, result_stream("", &buf[..n]));
                }
            });
            let tx = match tokio::net::UdpSocket::bind("127.0.0.1:0").await {
                Ok(s) => Arc::new(s),
                Err(e) => {
                    eprintln!("loadgen: {e}");
                    std::process::exit(2);
                }
            };
            let payload = frame();
            let bodies: Vec<Vec<u8>> = (0..a.streams)
                .map(|i| {
                    let name = stream_name(i);
                    let mut b = vec![name.len() as u8];
                    b.extend(name.as_bytes());
                    b.extend(&payload);
                    b
                })
                .collect();
            let to = a.to.clone();
            let sent = paced(&a, pending, |i| {
                let (tx, b, to) = (tx.clone(), bodies[i].clone(), to.clone());
                async move {
                    let _ = tx.send_to(&b, &to).await;
                }
            })
            .await;
            let l = lat.lock().unwrap_or_else(|p| p.into_inner()).clone();
            summary(
                l,
                sent,
                serde_json::json!({"mode": "udp-latency", "streams": a.streams, "rate": a.rate}),
            );
        }
    }
}
