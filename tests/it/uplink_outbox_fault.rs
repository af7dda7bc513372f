//! A local outbox fault against a real mosquitto: the outbox on a tmpfs
//! that fills up (as in `hardening.rs`), so every outbox operation of the
//! uplink fails until space comes back.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{Daemon, http, sensors_over_http};
use crate::uplink::Mosquitto;

const FRAME: &[u8] = b"[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

/// A tmpfs mounted for the test's life (the test runs as root, as `.ci/run` does).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).unwrap();
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(at)
            .status()
            .expect("run mount");
        assert!(
            st.success(),
            "mounting a tmpfs at {} failed: the test needs root (as .ci/run runs it)",
            at.display()
        );
        Tmpfs(at.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Writes zeros to `path` until the file system is full.
fn fill(path: &Path) {
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0u8; 64 << 10];
    loop {
        match f.write(&block) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(28) => break, // ENOSPC
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    let small = [0u8; 512];
    while let Ok(n) = f.write(&small) {
        if n == 0 {
            break;
        }
    }
}

/// A metric's value from /metrics (0 when absent).
fn metric(d: &Daemon, line_start: &str) -> f64 {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn infer(d: &Daemon) -> u16 {
    http(
        "POST",
        &d.api,
        "/v1/pipelines/sensors/infer?stream=s1",
        FRAME,
    )
    .map_or(0, |(code, _)| code)
}

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

/// The uplink used to end its broker connection on any outbox error
/// (`End::Lost`): a full disk made it reconnect again and again, each new
/// connection failing at its first outbox read. Now the connection stays
/// up: the failures are counted (`outpost_uplink_outbox_errors_total`),
/// logged at a limited rate and retried with backoff, and once space
/// returns every record goes out and leaves the outbox on the same
/// connection.
#[test]
fn a_full_disk_no_longer_drops_the_mqtt_connection() {
    let tmp = tempfile::tempdir().unwrap();
    let mut broker = Mosquitto::start(&tmp.path().join("mosquitto"));
    // Down until the outbox is broken, so the uplink's first read meets it.
    broker.stop();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let fs = Tmpfs::mount(&data, "8m");
    let cfg = sensors_over_http("").replace("data_dir", "device = \"gw-disk\"\ndata_dir")
        + &format!(
            "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {}\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\nkeep_alive = \"5s\"\nconnect_timeout = \"2s\"\n",
            broker.port
        );
    let d = Daemon::start_in(&cfg, dir);

    for _ in 0..20 {
        assert_eq!(infer(&d), 200, "{}", d.log());
    }
    wait_for(&d, Duration::from_secs(30), "first commits", || {
        metric(&d, "outpost_outbox_flushes_total") >= 1.0
    });
    let filler = data.join("filler");
    fill(&filler);
    // Records go on until a commit meets the full disk.
    wait_for(&d, Duration::from_secs(60), "an append refused", || {
        infer(&d) == 503
    });
    assert_eq!(metric(&d, "outpost_outbox_unavailable"), 1.0);
    let stored = d.status()["outbox"]["records"].as_u64().unwrap();
    assert!(stored >= 20, "{stored}");

    broker.restart();
    wait_for(&d, Duration::from_secs(20), "connected", || {
        metric(&d, "outpost_uplink_connected") == 1.0
    });
    let disconnects = metric(&d, "outpost_uplink_disconnects_total");
    // Outbox operations fail and are retried; the connection stays.
    let t0 = Instant::now();
    while metric(&d, "outpost_uplink_outbox_errors_total") < 3.0 {
        assert_eq!(
            metric(&d, "outpost_uplink_connects_total"),
            1.0,
            "the outbox fault dropped the broker connection:\n{}",
            d.log()
        );
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no outbox errors counted:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(&d, "outpost_outbox_unavailable"), 1.0);
    assert_eq!(metric(&d, "outpost_uplink_connected"), 1.0);

    // Space comes back: the outbox reopens, the uplink's next retry reads,
    // sends and acks everything, on the same connection.
    std::fs::remove_file(&filler).unwrap();
    wait_for(&d, Duration::from_secs(60), "the outbox drained", || {
        d.status()["outbox"]["records"] == 0
    });
    assert!(metric(&d, "outpost_uplink_acked_total") >= stored as f64);
    assert_eq!(
        metric(&d, "outpost_uplink_connects_total"),
        1.0,
        "{}",
        d.log()
    );
    assert_eq!(
        metric(&d, "outpost_uplink_disconnects_total"),
        disconnects,
        "{}",
        d.log()
    );
    assert_eq!(metric(&d, "outpost_uplink_connected"), 1.0);
    // Logged at a limited rate, not once per retry.
    let log = d.log();
    let lines = log.matches("uplink: outbox operation failed").count();
    let errors = metric(&d, "outpost_uplink_outbox_errors_total");
    assert!(
        lines >= 1 && (lines as f64) < errors.max(2.0),
        "{lines} lines for {errors} errors:\n{log}"
    );
    drop(d);
    drop(fs);
}
