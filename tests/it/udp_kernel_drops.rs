//! Datagrams the kernel drops before the udp source reads them (its
//! receive buffer full): counted, against the kernel's own count.

use std::net::UdpSocket;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{Daemon, free_port, http, post_with_token};

const TOKEN: &str = "udp-drops-test-token-0123456789";

/// A JSON frame the pipeline takes (16 values).
const FRAME: &[u8] = b"[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

fn pipeline(d: &Daemon) -> Value {
    d.status()["pipelines"][0].clone()
}

fn kernel_overflow(d: &Daemon) -> u64 {
    pipeline(d)["drops"]["kernel_overflow"]
        .as_u64()
        .unwrap_or(0)
}

/// The kernel's drop count of the UDP socket bound to `port` on loopback
/// (the last column of /proc/net/udp, what RcvbufErrors sums).
fn proc_net_udp_drops(port: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/udp").ok()?;
    let local = format!("0100007F:{port:04X}");
    table
        .lines()
        .find(|l| l.split_whitespace().nth(1) == Some(local.as_str()))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
}

fn wait_for(d: &Daemon, limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < limit,
            "{what}: not within {limit:?}\npipeline: {}\n{}",
            pipeline(d),
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Datagrams the kernel dropped (1,374 to 18,924 a run) were invisible:
/// no counter, no log. Now a udp source with a tiny receive buffer
/// (`recv_buffer_bytes`), paused (its queue fills, so it stops reading)
/// while a burst arrives, counts each datagram the kernel dropped as
/// `kernel_overflow`; with the frames it received, that is every datagram
/// sent, and it is the count the kernel itself keeps for the socket.
#[test]
fn udp_datagrams_the_kernel_drops_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    let port = free_port();
    let config = format!(
        r#"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
token_file = "{{DIR}}/token"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
queue = 4
when_full = "block"
source = {{ type = "udp", listen = "127.0.0.1:{port}", recv_buffer_bytes = 4096 }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#
    );
    let mut d = Daemon::start_in(&config, dir);
    // The size the kernel granted is logged (it doubles what it is asked).
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("udp source listening"))
        .unwrap_or_else(|| panic!("no listening line:\n{log}"));
    assert!(line.contains("recv_buffer_bytes=8192"), "{line}");

    assert_eq!(
        post_with_token(&d.api, "/v1/pipelines/sensors/pause", TOKEN),
        200
    );
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let sent = 1_000u64;
    for _ in 0..sent {
        tx.send_to(FRAME, ("127.0.0.1", port)).expect("send");
    }
    // Counted while the pipeline still does not read (the drop count is
    // read once a second, not only from the next datagram).
    wait_for(&d, Duration::from_secs(10), "kernel drops counted", || {
        kernel_overflow(&d) > 0
    });
    assert_eq!(pipeline(&d)["frames_done"], 0);
    assert_eq!(
        post_with_token(&d.api, "/v1/pipelines/sensors/resume", TOKEN),
        200
    );
    // Every datagram is accounted for: received (and turned into a
    // record) or dropped by the kernel.
    wait_for(
        &d,
        Duration::from_secs(30),
        "every datagram accounted",
        || {
            let p = pipeline(&d);
            p["frames_in"] == sent
                && p["records"].as_u64().unwrap_or(0) + kernel_overflow(&d) == sent
        },
    );
    let dropped = kernel_overflow(&d);
    let received = sent - dropped;
    assert!(dropped > 0 && received > 0, "{dropped} dropped");
    let printed = d.records_until(Duration::from_secs(30), |r| r.len() as u64 >= received);
    assert_eq!(printed.len() as u64, received);
    // The kernel's own count for the socket.
    assert_eq!(proc_net_udp_drops(port), Some(dropped));
    let (_, metrics) = http("GET", &d.api, "/metrics", b"").unwrap();
    let metrics = String::from_utf8_lossy(&metrics);
    let row = format!(
        "outpost_frames_dropped_total{{pipeline=\"sensors\",reason=\"kernel_overflow\"}} {dropped}"
    );
    assert!(
        metrics.lines().any(|l| l == row),
        "no `{row}` in:\n{metrics}"
    );
    assert!(d.log().contains("dropped by the kernel"), "{}", d.log());
    println!("udp burst of {sent}: {received} received, {dropped} dropped by the kernel");
}
