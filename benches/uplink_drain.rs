//! Drain rate of the MQTT uplink: an outbox filled with N records drained
//! to a local mosquitto at QoS 1, timed until the outbox is empty.
//!
//! `cargo bench --bench uplink_drain` (env: RECORDS=100000, BATCHES="1 10 100",
//! INFLIGHT=256). Needs /usr/sbin/mosquitto. Prints one table row per batch size.

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use outpost::outbox::{Outbox, OutboxConfig};
use outpost::uplink::{self, UplinkConfig};

struct Mosquitto(Child);

impl Drop for Mosquitto {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn mosquitto(dir: &std::path::Path) -> (Mosquitto, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port");
    let conf = dir.join("mosquitto.conf");
    std::fs::write(
        &conf,
        format!(
            "user root\nlistener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nmax_queued_messages 1000000\nmax_inflight_messages 1000\n"
        ),
    )
    .expect("write mosquitto.conf");
    let child = Command::new("/usr/sbin/mosquitto")
        .arg("-c")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("mosquitto (Debian package mosquitto) is needed");
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "mosquitto did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (Mosquitto(child), port)
}

fn record(i: u64) -> Vec<u8> {
    let stream = format!("sensor-{}", i % 8);
    format!(
        r#"{{"id":"bench/1/{i}","device":"bench","pipeline":"sensors","stream":"{stream}","seq":{i},"ts":"2026-11-30T12:00:00.000000Z","model":"sensor_mlp@1.0.0","ep":"cpu","latency_us":87,"outputs":{{"top":[{{"class":2,"score":0.6113}},{{"class":0,"score":0.2011}},{{"class":3,"score":0.1102}},{{"class":1,"score":0.0774}}]}}}}"#
    )
    .into_bytes()
}

fn main() {
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` a small smoke run.
    let full = std::env::args().any(|a| a == "--bench");
    let n: u64 = std::env::var("RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if full { 100_000 } else { 2_000 });
    let batches: Vec<usize> = std::env::var("BATCHES")
        .unwrap_or_else(|_| if full { "1 10 100".into() } else { "1".into() })
        .split_whitespace()
        .filter_map(|b| b.parse().ok())
        .collect();
    let inflight: u16 = std::env::var("INFLIGHT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let tmp = tempfile::tempdir().expect("tempdir");
    let (_broker, port) = mosquitto(tmp.path());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!("| batch | records | record bytes | seconds | results/s | MB/s payload |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for (run, batch) in batches.iter().enumerate() {
        let dir = tmp.path().join(format!("outbox-{run}"));
        let ob = Outbox::open(&dir, OutboxConfig::default()).expect("outbox");
        let rec_bytes = record(0).len();
        for i in 0..n {
            ob.append(&format!("sensor-{}", i % 8), &record(i))
                .expect("append");
        }
        ob.sync().expect("sync");
        let cfg: UplinkConfig = toml::from_str(&format!(
            "type = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {port}\nbatch = {batch}\nmax_inflight = {inflight}\nclient_id = \"bench-{run}\""
        ))
        .expect("config");
        let stop = tokio_util::sync::CancellationToken::new();
        let t0 = Instant::now();
        let up = rt
            .block_on(async { uplink::start(&cfg, ob.clone(), "bench", stop.clone()) })
            .expect("start uplink");
        while ob.stats().records > 0 {
            assert!(t0.elapsed() < Duration::from_secs(300), "drain stalled");
            std::thread::sleep(Duration::from_millis(2));
        }
        let secs = t0.elapsed().as_secs_f64();
        let bytes = outpost::uplink::UplinkStats::get(&up.stats.bytes_total);
        stop.cancel();
        let _ = rt.block_on(up.task);
        println!(
            "| {batch} | {n} | {rec_bytes} | {secs:.3} | {:.0} | {:.1} |",
            n as f64 / secs,
            bytes as f64 / secs / 1e6
        );
        ob.close().expect("close");
    }
}
