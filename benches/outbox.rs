//! Outbox benchmark (plain harness, prints a table):
//!
//! - durable append throughput: 200k records of ~200 bytes with the default
//!   group commit, then `sync()`, with sled's log compressed (the default)
//!   and with `compress = false`;
//! - drain throughput: `pending` + `ack` in batches of 1000, then `sync()`;
//! - disk bytes per stored record (allocated blocks of the directory);
//! - resident memory with a 1,000,000-record backlog, measured in a fresh
//!   child process (so the earlier phases' heap does not count), after the
//!   appends and again after a reopen (which scans the backlog).
//!
//! `cargo bench --bench outbox`

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Instant;

#[path = "support/disk.rs"]
mod disk;
use disk::disk_bytes;

use outpost::outbox::{Key, Outbox, OutboxConfig};

const N_FULL: u64 = 200_000;
const BACKLOG_FULL: u64 = 1_000_000;

/// `cargo bench` passes `--bench`; `cargo test --all-targets` runs this main
/// too, and then a small smoke run keeps it working without the minutes.
fn full() -> bool {
    std::env::args().any(|a| a == "--bench") || std::env::var_os("OUTBOX_BENCH_FULL").is_some()
}

fn n() -> u64 {
    if full() { N_FULL } else { 2_000 }
}

fn backlog() -> u64 {
    if full() { BACKLOG_FULL } else { 5_000 }
}
const PHASE: &str = "OUTBOX_BENCH_PHASE";

/// ~200 bytes, shaped like a result record.
fn record(i: u64) -> Vec<u8> {
    let mut r = format!(
        r#"{{"id":"gw1/1/{i}","device":"gw1","pipeline":"vad","stream":"mic-{}","seq":{i},"ts":"2026-11-30T12:00:00.000000Z","model":"silero_vad@6.2.3","ep":"cpu","latency_us":231,"outputs":{{"speech":0.{:04}}}}}"#,
        i % 4,
        i % 10_000
    );
    while r.len() < 200 {
        r.push(' ');
    }
    r.into_bytes()
}

/// `VmRSS` or `VmHWM` from /proc/self/status, in bytes.
fn proc_status(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn append_all(ob: &Outbox, n: u64) -> f64 {
    let recs: Vec<Vec<u8>> = (0..1000).map(record).collect();
    let t = Instant::now();
    for i in 0..n {
        ob.append("mic", &recs[(i % 1000) as usize])
            .expect("append");
    }
    ob.sync().expect("sync");
    t.elapsed().as_secs_f64()
}

fn throughput_phase(compress: bool) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("outbox");
    let cfg = OutboxConfig {
        compress,
        ..OutboxConfig::default()
    };
    let layout = if compress { "" } else { ", compress = false" };
    let ob = Outbox::open(&dir, cfg).expect("open");
    let secs = append_all(&ob, n());
    let st = ob.stats();
    let disk = disk_bytes(&dir);
    row(
        &format!("durable append (200 B, default group commit, then sync{layout})"),
        &format!("{:.0} records/s", n() as f64 / secs),
        &format!(
            "{} records in {secs:.2} s, {} flushes",
            n(),
            st.flushes_total
        ),
    );
    row(
        "stored bytes per record (key + header + record)",
        &format!("{:.1} B", st.bytes as f64 / n() as f64),
        "",
    );
    row(
        &format!("disk bytes per stored record (allocated blocks / records{layout})"),
        &format!("{:.1} B", disk as f64 / n() as f64),
        &format!("{:.1} MiB on disk", disk as f64 / 1048576.0),
    );

    let t = Instant::now();
    let mut after: Option<Key> = None;
    let mut drained = 0u64;
    loop {
        let batch = ob.pending(after, 1000).expect("pending");
        let Some(last) = batch.last() else { break };
        after = Some(last.key);
        let keys: Vec<Key> = batch.iter().map(|e| e.key).collect();
        ob.ack(&keys).expect("ack");
        drained += keys.len() as u64;
    }
    ob.sync().expect("sync");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(drained, n());
    row(
        &format!("drain (pending 1000 + ack, then sync{layout})"),
        &format!("{:.0} records/s", drained as f64 / secs),
        &format!("{drained} records in {secs:.2} s"),
    );
    ob.close().expect("close");
}

fn rss_phase() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().join("outbox");
    let before = proc_status("VmRSS:");
    let ob = Outbox::open(&dir, OutboxConfig::default()).expect("open");
    let secs = append_all(&ob, backlog());
    let after_append = proc_status("VmRSS:");
    let disk = disk_bytes(&dir);
    ob.close().expect("close");
    let t = Instant::now();
    let ob = Outbox::open(&dir, OutboxConfig::default()).expect("reopen");
    let reopen = t.elapsed().as_secs_f64();
    let first = ob.pending(None, 1000).expect("pending");
    assert_eq!(ob.stats().records, backlog());
    assert_eq!(first.len(), 1000);
    let after_reopen = proc_status("VmRSS:");
    let hwm = proc_status("VmHWM:");
    let mb = |b: u64| format!("{:.1} MB", b as f64 / 1e6);
    row(
        "RSS with a 1,000,000-record backlog, after appending",
        &mb(after_append),
        &format!(
            "appended at {:.0} records/s; {} before open; {:.0} MiB on disk",
            backlog() as f64 / secs,
            mb(before),
            disk as f64 / 1048576.0
        ),
    );
    row(
        "RSS with the backlog, after reopen (scan) + first pending",
        &mb(after_reopen),
        &format!("reopen took {reopen:.2} s; peak (VmHWM) {}", mb(hwm)),
    );
    ob.close().expect("close");
}

fn row(what: &str, value: &str, note: &str) {
    println!("| {what} | {value} | {note} |");
}

fn main() {
    if std::env::var_os(PHASE).is_some() {
        rss_phase();
        return;
    }
    println!("| measure | value | note |");
    println!("|---|---:|---|");
    throughput_phase(true);
    throughput_phase(false);
    // A fresh process, so RSS is the backlog's and not the earlier phase's.
    let exe = std::env::current_exe().expect("current_exe");
    let mut child = Command::new(exe);
    child.env(PHASE, "rss");
    if full() {
        child.env("OUTBOX_BENCH_FULL", "1");
    }
    let status = child.status().expect("spawn");
    assert!(status.success(), "rss phase failed: {status}");
}
