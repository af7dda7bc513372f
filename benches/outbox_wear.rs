//! Flash wear of the outbox (plain harness, prints a table): the bytes the
//! kernel counts as written (`write_bytes` of `/proc/self/io`) per record,
//! for the outbox and, in the same run and side by side, for an append-only
//! JSON-lines log with an `fdatasync` at the outbox's commit interval.
//!
//! Four cases run at once, each in a fresh child process (so each one's
//! `/proc/self/io` counts only its own writes), at a steady record rate:
//!
//! - `outage`: the uplink is away, every record is kept;
//! - `plain`: the same with `compress = false` (sled's log uncompressed, the
//!   outbox's first layout);
//! - `uplink`: a reader takes pending records as they come and acknowledges
//!   them, as the uplink does while the broker answers;
//! - `log`: one JSON line per record appended to a file, `fdatasync` every
//!   `flush_interval` when something was written.
//!
//! Each is run at 500 and at 20 records/s, five runs of each. The records
//! are shaped like a sensor pipeline's result (447 bytes). The last column
//! is the disk the outage case holds at the end over the records' bytes.
//!
//! `cargo bench --bench outbox_wear` (about 4 minutes); the data lives under
//! the build's target folder, on a real disk (tmpfs counts no writes).

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[path = "support/disk.rs"]
mod disk;
use disk::disk_bytes;

use outpost::outbox::{Key, Outbox, OutboxConfig};

const CASE: &str = "OUTBOX_WEAR_CASE";
const RECORD_LEN: usize = 447;

/// `cargo bench` passes `--bench`; `cargo test --all-targets` runs this main
/// too, and then one short run keeps it working without the minutes.
fn full() -> bool {
    std::env::args().any(|a| a == "--bench") || std::env::var_os("OUTBOX_WEAR_FULL").is_some()
}

/// A result record of a sensor pipeline, `RECORD_LEN` bytes.
fn record(i: u64) -> Vec<u8> {
    let mut r = format!(
        r#"{{"id":"gw1/3/{i}","device":"gw1","pipeline":"vibration","stream":"pump-{}","seq":{i},"ts":"2026-12-02T12:00:00.{:06}Z","captured":"2026-12-02T12:00:00.{:06}Z","model":"sensor_mlp@1.0.0","ep":"cpu","latency_us":{},"outputs":{{"anomaly":0.{:04},"scores":[0.{:04},0.{:04},0.{:04},0.{:04}]}},"clock":"synced"}}"#,
        i % 4,
        i % 1_000_000,
        (i * 7) % 1_000_000,
        180 + i % 97,
        i % 10_000,
        (i * 3) % 10_000,
        (i * 11) % 10_000,
        (i * 13) % 10_000,
        (i * 17) % 10_000,
    );
    while r.len() < RECORD_LEN {
        r.insert(r.len() - 1, ' ');
    }
    r.into_bytes()
}

fn written_bytes() -> u64 {
    outpost::telemetry::device::process()
        .written_bytes
        .expect("write_bytes in /proc/self/io")
}

/// Calls `each(i)` `rate` times a second for `secs`, on a fixed schedule.
fn paced(rate: u64, secs: f64, mut each: impl FnMut(u64)) -> u64 {
    let n = (rate as f64 * secs) as u64;
    let step = Duration::from_secs_f64(1.0 / rate as f64);
    let t0 = Instant::now();
    for i in 0..n {
        let due = t0 + step * i as u32;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        each(i);
    }
    n
}

/// One case in this (child) process; prints `written records disk record_bytes`.
fn child(case: &str, rate: u64, secs: f64, dir: &Path) {
    let recs: Vec<Vec<u8>> = (0..1000).map(record).collect();
    let cfg = OutboxConfig::default();
    let interval = cfg.flush_interval;
    let start = written_bytes();
    let (n, disk) = match case {
        "log" => {
            std::fs::create_dir_all(dir).expect("mkdir");
            let f = Arc::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(dir.join("records.jsonl"))
                    .expect("open log"),
            );
            let dirty = Arc::new(AtomicBool::new(false));
            let done = Arc::new(AtomicBool::new(false));
            let syncer = {
                let (f, dirty, done) = (Arc::clone(&f), Arc::clone(&dirty), Arc::clone(&done));
                std::thread::spawn(move || {
                    while !done.load(Ordering::SeqCst) {
                        std::thread::sleep(interval);
                        if dirty.swap(false, Ordering::SeqCst) {
                            f.sync_data().expect("fdatasync");
                        }
                    }
                    f.sync_data().expect("fdatasync");
                })
            };
            let n = paced(rate, secs, |i| {
                let mut line = recs[(i % 1000) as usize].clone();
                line.push(b'\n');
                (&*f).write_all(&line).expect("write");
                dirty.store(true, Ordering::SeqCst);
            });
            done.store(true, Ordering::SeqCst);
            syncer.join().expect("syncer");
            (n, disk_bytes(dir))
        }
        "outage" | "uplink" | "plain" => {
            let cfg = OutboxConfig {
                compress: case != "plain",
                ..cfg
            };
            let ob = Outbox::open(dir, cfg).expect("open outbox");
            let done = Arc::new(AtomicBool::new(false));
            let reader = (case == "uplink").then(|| {
                let (ob, done) = (ob.clone(), Arc::clone(&done));
                std::thread::spawn(move || {
                    let mut after: Option<Key> = None;
                    let mut acked = 0u64;
                    loop {
                        let page = ob.pending(after, 64).expect("pending");
                        match page.last() {
                            Some(last) => {
                                after = Some(last.key);
                                let keys: Vec<Key> = page.iter().map(|e| e.key).collect();
                                ob.ack(&keys).expect("ack");
                                acked += keys.len() as u64;
                            }
                            None if done.load(Ordering::SeqCst) => return acked,
                            None => std::thread::sleep(Duration::from_millis(2)),
                        }
                    }
                })
            });
            let n = paced(rate, secs, |i| {
                ob.append("pump-0", &recs[(i % 1000) as usize])
                    .expect("append");
            });
            ob.sync().expect("sync");
            done.store(true, Ordering::SeqCst);
            if let Some(r) = reader {
                assert_eq!(r.join().expect("reader"), n, "every record acknowledged");
            }
            ob.sync().expect("sync");
            let disk = disk_bytes(dir);
            ob.close().expect("close");
            (n, disk)
        }
        other => panic!("unknown case {other}"),
    };
    let written = written_bytes() - start;
    println!("{written} {n} {disk} {}", n * RECORD_LEN as u64);
}

struct Figures {
    per_record: f64,
    disk_ratio: f64,
}

fn spawn(case: &str, rate: u64, secs: f64, dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().expect("exe"))
        .env(CASE, format!("{case} {rate} {secs} {}", dir.display()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn case")
}

fn collect(c: std::process::Child) -> Figures {
    let out = c.wait_with_output().expect("case output");
    assert!(out.status.success(), "a case failed: {:?}", out.status);
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Vec<u64> = text
        .split_whitespace()
        .map(|x| x.parse().expect("number"))
        .collect();
    let [written, n, disk, bytes] = v[..] else {
        panic!("case printed {text:?}")
    };
    Figures {
        per_record: written as f64 / n as f64,
        disk_ratio: disk as f64 / bytes as f64,
    }
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("outbox_wear")
}

fn main() {
    if let Ok(spec) = std::env::var(CASE) {
        let mut it = spec.splitn(4, ' ');
        let case = it.next().expect("case");
        let rate: u64 = it.next().and_then(|r| r.parse().ok()).expect("rate");
        let secs: f64 = it.next().and_then(|r| r.parse().ok()).expect("secs");
        let dir = PathBuf::from(it.next().expect("dir"));
        child(case, rate, secs, &dir);
        return;
    }
    let (runs, rates): (usize, &[(u64, f64)]) = if full() {
        (5, &[(500, 12.0), (20, 30.0)])
    } else {
        (1, &[(500, 0.5), (20, 1.0)])
    };
    let _ = std::fs::remove_dir_all(root());
    println!(
        "| records/s | run | outage B/record | uplink B/record | log B/record | outage / log | uplink / log | outage disk / records | plain outage / log | plain disk / records |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut worst = Vec::new();
    for &(rate, secs) in rates {
        let (mut wo, mut wu, mut wd) = (0f64, 0f64, 0f64);
        for run in 1..=runs {
            let base = root().join(format!("{rate}-{run}"));
            let kids: Vec<_> = ["outage", "uplink", "log", "plain"]
                .iter()
                .map(|c| spawn(c, rate, secs, &base.join(c)))
                .collect();
            let f: Vec<Figures> = kids.into_iter().map(collect).collect();
            let (o, u, l, p) = (&f[0], &f[1], &f[2], &f[3]);
            println!(
                "| {rate} | {run} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                o.per_record,
                u.per_record,
                l.per_record,
                o.per_record / l.per_record,
                u.per_record / l.per_record,
                o.disk_ratio,
                p.per_record / l.per_record,
                p.disk_ratio
            );
            wo = wo.max(o.per_record / l.per_record);
            wu = wu.max(u.per_record / l.per_record);
            wd = wd.max(o.disk_ratio);
            let _ = std::fs::remove_dir_all(&base);
        }
        worst.push((rate, wo, wu, wd));
    }
    println!();
    println!(
        "| records/s | worst outage / log | worst uplink / log | worst outage disk / records |"
    );
    println!("|---:|---:|---:|---:|");
    for (rate, wo, wu, wd) in worst {
        println!("| {rate} | {wo:.2} | {wu:.2} | {wd:.2} |");
    }
}
