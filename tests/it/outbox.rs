//! The outbox as a real store on disk: reopen, ordering, the full policies,
//! quarantine, a real SIGKILL, and the `outpost outbox` commands.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use outpost::outbox::{Key, Outbox, OutboxConfig, OutboxError, Purge, WhenFull};

use crate::common::KillTimes;

fn cfg() -> OutboxConfig {
    OutboxConfig::default()
}

fn small(when_full: WhenFull) -> OutboxConfig {
    OutboxConfig {
        max_bytes: 65536,
        when_full,
        ..OutboxConfig::default()
    }
}

fn rec(run: u64, i: u64) -> Vec<u8> {
    format!(
        r#"{{"run":{run},"i":{i},"pad":"{}"}}"#,
        "x".repeat((i % 97) as usize)
    )
    .into_bytes()
}

fn all_pending(ob: &Outbox) -> Vec<outpost::outbox::Entry> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let b = ob.pending(after, 500).unwrap();
        let Some(last) = b.last() else { return out };
        after = Some(last.key);
        out.extend(b);
    }
}

#[test]
fn append_pending_ack_round_trip_across_reopen() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let ob = Outbox::open(&dir, cfg()).unwrap();
    assert_eq!(ob.boot(), 1);
    let t0 = SystemTime::now();
    let mut keys = Vec::new();
    for i in 0..100 {
        keys.push(ob.append(&format!("s{}", i % 3), &rec(0, i)).unwrap());
    }
    ob.sync().unwrap();
    ob.close().unwrap();

    let ob = Outbox::open(&dir, cfg()).unwrap();
    assert_eq!(ob.boot(), 2);
    let got = ob.pending(None, 1000).unwrap();
    assert_eq!(got.len(), 100);
    for (i, e) in got.iter().enumerate() {
        assert_eq!(e.key, keys[i]);
        assert_eq!(e.stream, format!("s{}", i % 3));
        assert_eq!(e.record, rec(0, i as u64));
        assert!(e.appended_at >= t0 - Duration::from_secs(1));
    }
    // Paging with a cursor returns the rest, in order.
    let page = ob.pending(Some(keys[39]), 10).unwrap();
    assert_eq!(page.iter().map(|e| e.key).collect::<Vec<_>>(), keys[40..50]);
    let st = ob.stats();
    assert_eq!(st.records, 100);
    let bytes: u64 = got
        .iter()
        .map(|e| 16 + 11 + e.stream.len() as u64 + e.record.len() as u64)
        .sum();
    assert_eq!(st.bytes, bytes);
    assert!(st.oldest_age.is_some());

    ob.ack(&keys[..40]).unwrap();
    // Idempotent: acked and unknown keys are fine.
    ob.ack(&keys[..40]).unwrap();
    ob.ack(&[Key(99, 99)]).unwrap();
    assert_eq!(ob.stats().acked_total, 40);
    ob.close().unwrap();

    let ob = Outbox::open(&dir, cfg()).unwrap();
    let got = ob.pending(None, 1000).unwrap();
    assert_eq!(got.iter().map(|e| e.key).collect::<Vec<_>>(), keys[40..]);
    let st = ob.stats();
    assert_eq!(st.records, 60);
    let left: u64 = got
        .iter()
        .map(|e| 16 + 11 + e.stream.len() as u64 + e.record.len() as u64)
        .sum();
    assert_eq!(st.bytes, left, "byte accounting survives the restart");
}

/// A batch's records: each stored in order with its own result (one too
/// large for the store refused alone), and the uplink woken for them.
#[test]
fn append_all_answers_each_record_in_order_and_wakes_the_reader() {
    let tmp = tempfile::tempdir().unwrap();
    let ob = Outbox::open(&tmp.path().join("outbox"), small(WhenFull::RejectNew)).unwrap();
    let wake = ob.notified();
    let big = vec![b'x'; 70_000];
    let (a, b) = (rec(0, 1), rec(0, 2));
    let got = ob.append_all([
        ("s1", a.as_slice()),
        ("s2", big.as_slice()),
        ("s1", b.as_slice()),
    ]);
    assert_eq!(got.len(), 3);
    assert!(
        matches!(got[1], Err(OutboxError::TooLarge { .. })),
        "{:?}",
        got[1]
    );
    let (k0, k2) = (got[0].as_ref().unwrap(), got[2].as_ref().unwrap());
    assert!(k0 < k2, "{k0} {k2}");
    let stored: Vec<Vec<u8>> = all_pending(&ob).into_iter().map(|e| e.record).collect();
    assert_eq!(stored, vec![a, b]);
    // The permit left for a reader that was not waiting yet.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let woken =
        rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), wake.notified()).await });
    assert!(woken.is_ok(), "append_all did not wake the reader");
    ob.sync().unwrap();
    ob.close().unwrap();
}

#[test]
fn keys_never_repeat_across_reopen_even_without_close() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let mut all = Vec::new();
    for round in 1..=5u64 {
        let ob = Outbox::open(&dir, cfg()).unwrap();
        assert_eq!(ob.boot(), round);
        for i in 0..10 {
            all.push(ob.append("s", &rec(round, i)).unwrap());
        }
        ob.sync().unwrap();
        // Half the rounds end without close(): only the drop.
        if round % 2 == 0 {
            ob.close().unwrap();
        } else {
            drop(ob);
        }
    }
    for w in all.windows(2) {
        assert!(w[0] < w[1], "{} then {}", w[0], w[1]);
    }
    let ob = Outbox::open(&dir, cfg()).unwrap();
    let stored: Vec<Key> = all_pending(&ob).iter().map(|e| e.key).collect();
    assert_eq!(stored, all);
}

#[test]
fn ordering_with_concurrent_appenders() {
    let tmp = tempfile::tempdir().unwrap();
    let ob = Outbox::open(&tmp.path().join("outbox"), cfg()).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let ob = ob.clone();
            s.spawn(move || {
                for i in 0..500 {
                    ob.append(&format!("t{t}"), &rec(t, i)).unwrap();
                }
            });
        }
    });
    let got = all_pending(&ob);
    assert_eq!(got.len(), 2000);
    let mut next = HashMap::new();
    for w in got.windows(2) {
        assert!(w[0].key < w[1].key);
    }
    for e in &got {
        let v: serde_json::Value = serde_json::from_slice(&e.record).unwrap();
        let i = v["i"].as_u64().unwrap();
        let n = next.entry(e.stream.clone()).or_insert(0);
        assert_eq!(i, *n, "stream {} out of order", e.stream);
        *n += 1;
    }
}

/// One entry of 16 (key) + 11 (header) + 1 (stream "s") + 1000 = 1028 bytes:
/// 63 fit in 65536.
const REC_1000: usize = 1000;
const ENTRY: u64 = 1028;

#[test]
fn drop_oldest_keeps_the_newest_and_counts_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let ob = Outbox::open(&dir, small(WhenFull::DropOldest)).unwrap();
    let keys: Vec<Key> = (0..100)
        .map(|_| ob.append("s", &[7u8; REC_1000]).unwrap())
        .collect();
    let st = ob.stats();
    assert_eq!(st.records, 63);
    assert_eq!(st.bytes, 63 * ENTRY);
    assert_eq!(st.dropped.full_drop_oldest, 37);
    assert_eq!(st.dropped.total(), 37);
    assert_eq!(st.appended_total, 100);
    let got: Vec<Key> = all_pending(&ob).iter().map(|e| e.key).collect();
    assert_eq!(got, keys[37..]);
    ob.close().unwrap();
    let ob = Outbox::open(&dir, small(WhenFull::DropOldest)).unwrap();
    assert_eq!(ob.stats().bytes, 63 * ENTRY);
}

#[test]
fn reject_new_keeps_what_is_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let ob = Outbox::open(&tmp.path().join("outbox"), small(WhenFull::RejectNew)).unwrap();
    let mut ok = Vec::new();
    let mut full = 0;
    for _ in 0..100 {
        match ob.append("s", &[7u8; REC_1000]) {
            Ok(k) => ok.push(k),
            Err(OutboxError::Full { .. }) => full += 1,
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!((ok.len(), full), (63, 37));
    let st = ob.stats();
    assert_eq!(st.dropped.full_reject_new, 37);
    assert_eq!(st.bytes, 63 * ENTRY);
    // Room comes back with acks.
    ob.ack(&ok[..1]).unwrap();
    ob.append("s", &[7u8; REC_1000]).unwrap();
    assert!(matches!(
        ob.append("s", &vec![0u8; 70_000]),
        Err(OutboxError::TooLarge { .. })
    ));
}

#[test]
fn dead_letters_persist_and_are_dropped_first_when_full() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let ob = Outbox::open(&dir, small(WhenFull::RejectNew)).unwrap();
    let keys: Vec<Key> = (0..10)
        .map(|_| ob.append("s", &[1u8; REC_1000]).unwrap())
        .collect();
    ob.dead_letter(keys[2], "http 422: schema").unwrap();
    ob.dead_letter(keys[2], "again").unwrap(); // already moved: fine
    ob.dead_letter(keys[5], "http 400").unwrap();
    let st = ob.stats();
    assert_eq!(
        (st.records, st.dead_letters, st.dead_lettered_total),
        (8, 2, 2)
    );
    assert!(!all_pending(&ob).iter().any(|e| e.key == keys[2]));
    ob.close().unwrap();

    let ob = Outbox::open(&dir, small(WhenFull::RejectNew)).unwrap();
    let d = ob.dead_letters(None, 10).unwrap();
    assert_eq!(d.len(), 2);
    assert_eq!(
        (d[0].key, d[0].reason.as_str()),
        (keys[2], "http 422: schema")
    );
    assert_eq!(d[0].record, vec![1u8; REC_1000]);
    // Filling up: the two dead letters go before any append is refused.
    let mut n = 0;
    while ob.append("s", &[1u8; REC_1000]).is_ok() {
        n += 1;
    }
    let st = ob.stats();
    assert_eq!(st.dead_letters, 0);
    assert_eq!(st.dropped.full_drop_dead_letter, 2);
    assert_eq!(st.records, 8 + n);
    assert_eq!(ob.purge(Purge::All).unwrap().records, 8 + n);
    assert_eq!(ob.stats().bytes, 0);
}

#[test]
fn dead_letter_growth_stays_within_budget_and_drops_dead_letters_only() {
    for when_full in [WhenFull::RejectNew, WhenFull::DropOldest] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("outbox");
        let ob = Outbox::open(&dir, small(when_full)).unwrap();
        // Fill the budget to the last byte the records allow.
        let mut keys = Vec::new();
        while ob.stats().bytes + ENTRY <= 65536 {
            keys.push(ob.append("s", &[7u8; REC_1000]).unwrap());
        }
        let spare = 65536 - ob.stats().bytes;
        // Each dead letter is larger than its record by its reason (and
        // time); the reasons alone exceed the spare bytes.
        let reason = "r".repeat(spare as usize + 40);
        ob.dead_letter(keys[0], &reason).unwrap();
        ob.dead_letter(keys[1], &reason).unwrap();
        let st = ob.stats();
        assert!(
            st.bytes + st.dead_letter_bytes <= st.max_bytes,
            "{when_full:?}: {} + {} over {}",
            st.bytes,
            st.dead_letter_bytes,
            st.max_bytes
        );
        // No record still to be sent was dropped for it: the older dead
        // letter went.
        assert_eq!(st.records, keys.len() as u64 - 2, "{when_full:?}");
        assert_eq!(st.dropped.full_drop_oldest, 0, "{when_full:?}");
        assert_eq!(st.dropped.full_drop_dead_letter, 1, "{when_full:?}");
        let d = ob.dead_letters(None, 10).unwrap();
        assert_eq!(
            d.iter().map(|d| d.key).collect::<Vec<_>>(),
            vec![keys[1]],
            "{when_full:?}"
        );
        ob.close().unwrap();
    }
}

#[test]
fn corrupt_database_is_quarantined_and_replaced() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let ob = Outbox::open(&dir, cfg()).unwrap();
    for i in 0..50 {
        ob.append("s", &rec(0, i)).unwrap();
    }
    ob.close().unwrap();
    let ob = Outbox::open(&dir, cfg()).unwrap();
    assert_eq!(ob.boot(), 2);
    ob.close().unwrap();
    // Garbage over sled's files (not the boot sidecar).
    let mut x: u32 = 0x9e37_79b9;
    let garbage: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    for name in ["conf", "db"] {
        std::fs::write(dir.join(name), &garbage).unwrap();
    }

    let ob = Outbox::open(&dir, cfg()).unwrap();
    let st = ob.stats();
    assert_eq!(st.quarantined_total, 1);
    assert_eq!(st.records, 0);
    assert_eq!(
        ob.boot(),
        3,
        "boot continues from the sidecar, keys cannot repeat"
    );
    let q: Vec<PathBuf> = std::fs::read_dir(tmp.path().join("quarantine"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(q.len(), 1);
    let name = q[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("outbox-"), "{name}");
    assert_eq!(
        std::fs::read(q[0].join("db")).unwrap(),
        garbage,
        "kept as it was"
    );
    let k = ob.append("s", b"{}").unwrap();
    assert_eq!(ob.pending(None, 10).unwrap()[0].key, k);
    ob.close().unwrap();
    let ob = Outbox::open(&dir, cfg()).unwrap();
    assert_eq!(ob.stats().quarantined_total, 0);
    assert_eq!(ob.stats().records, 1);
}

#[test]
fn second_open_is_in_use_and_inspection_keeps_the_boot() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let ob = Outbox::open(&dir, cfg()).unwrap();
    ob.append("s", b"{}").unwrap();
    let e = Outbox::open(&dir, cfg())
        .err()
        .expect("second open must fail");
    assert!(matches!(e, OutboxError::InUse { .. }), "{e}");
    assert!(e.to_string().contains("in use by a running daemon"), "{e}");
    assert!(
        !tmp.path().join("quarantine").exists(),
        "a held db is never moved"
    );
    ob.close().unwrap();

    let ins = Outbox::open_inspect(&dir, cfg()).unwrap();
    assert_eq!(ins.boot(), 1);
    assert!(matches!(ins.append("s", b"{}"), Err(OutboxError::ReadOnly)));
    ins.close().unwrap();
    assert_eq!(Outbox::open(&dir, cfg()).unwrap().boot(), 2);
    let e = Outbox::open_inspect(&tmp.path().join("nothing"), cfg()).err();
    assert!(matches!(e, Some(OutboxError::NotFound { .. })));
}

#[test]
fn notified_wakes_a_waiting_uplink() {
    let tmp = tempfile::tempdir().unwrap();
    let ob = Outbox::open(&tmp.path().join("outbox"), cfg()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let n = ob.notified();
    let ob2 = ob.clone();
    let got = rt.block_on(async move {
        let waiter = tokio::spawn(async move {
            tokio::time::timeout(Duration::from_secs(5), n.notified()).await
        });
        tokio::task::yield_now().await;
        ob2.append("s", b"{}").unwrap();
        waiter.await.unwrap()
    });
    assert!(got.is_ok(), "not woken");
}

#[test]
fn sync_makes_acks_durable_too() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let ob = Outbox::open(&dir, cfg()).unwrap();
    let k = ob.append("s", b"{}").unwrap();
    ob.sync().unwrap();
    ob.ack(&[k]).unwrap();
    ob.sync().unwrap();
    let st = ob.stats();
    assert!(st.flushes_total >= 2 && st.flush_errors_total == 0);
    assert!(st.last_flush_duration.is_some());
    drop(ob);
    assert_eq!(Outbox::open(&dir, cfg()).unwrap().stats().records, 0);
}

// ---- SIGKILL --------------------------------------------------------------

#[test]
fn sigkill_keeps_every_synced_record() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    // tests/helpers/outbox_crash_child.rs: appends, prints what is durable.
    let exe = env!("CARGO_BIN_EXE_outbox-crash-child");
    let mut kill_at = KillTimes::new("sigkill_keeps_every_synced_record");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last_boot = 0;
    for run in 0..10u64 {
        assert!(Instant::now() < deadline, "took too long");
        let log = tmp.path().join(format!("child-{run}.out"));
        let mut child = Command::new(exe)
            .arg(&dir)
            .arg(run.to_string())
            .stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        // Wait for the first durable record, then kill at a random moment.
        let t0 = Instant::now();
        while !std::fs::read_to_string(&log).unwrap().contains("durable ") {
            assert!(t0.elapsed() < Duration::from_secs(20), "child never synced");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(kill_at.millis(0, 300));
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();

        let mut durable = Vec::new();
        let out = std::fs::read_to_string(&log).unwrap();
        // Only whole lines: the text after the last newline may be cut by
        // the kill ("durable 1 5 5" of "durable 1 5 57").
        let whole = &out[..out.rfind('\n').map_or(0, |n| n + 1)];
        for line in whole.lines() {
            let Some(at) = line.find("durable ") else {
                continue;
            };
            let f: Vec<&str> = line[at..].split(' ').collect();
            assert_eq!(f.len(), 4, "bad line {line:?}");
            durable.push((
                Key(f[1].parse().unwrap(), f[2].parse().unwrap()),
                f[3].parse::<u64>().unwrap(),
            ));
        }
        assert!(!durable.is_empty());

        let ob = Outbox::open(&dir, cfg()).unwrap();
        let stored: HashMap<Key, Vec<u8>> = all_pending(&ob)
            .into_iter()
            .map(|e| (e.key, e.record))
            .collect();
        for (k, i) in &durable {
            let got = stored.get(k).unwrap_or_else(|| {
                panic!(
                    "run {run}: {k} was reported durable but is gone ({} stored)",
                    stored.len()
                )
            });
            assert_eq!(got, &rec(run, *i), "run {run}: {k} corrupted");
        }
        let child_boot = durable[0].0.0;
        assert!(child_boot > last_boot, "boots only grow");
        assert!(ob.boot() > child_boot);
        last_boot = ob.boot();
        // Everything stored is whole, also what was never reported.
        for (k, v) in &stored {
            let j: serde_json::Value = serde_json::from_slice(v)
                .unwrap_or_else(|e| panic!("run {run}: {k} is not whole: {e}"));
            assert_eq!(j["run"], run);
        }
        let keys: Vec<Key> = stored.keys().copied().collect();
        ob.ack(&keys).unwrap();
        ob.close().unwrap();
    }
}

// ---- CLI ------------------------------------------------------------------

fn outpost(data: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_outpost"))
        .arg("outbox")
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .env_remove("OUTPOST_CONFIG")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn ok(o: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "failed: {}\n{err}", o.status);
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn cli_stats_export_purge_on_a_stopped_daemon() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path();
    let ob = Outbox::open(&data.join("outbox"), cfg()).unwrap();
    let mut keys = Vec::new();
    for i in 0..5 {
        keys.push(ob.append("cam-1", &rec(0, i)).unwrap());
    }
    keys.push(ob.append("raw", &[0xde, 0xad]).unwrap());
    ob.dead_letter(keys[1], "http 422").unwrap();

    // While "the daemon" holds it.
    let o = outpost(data, &["stats"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("in use by a running daemon"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    ob.close().unwrap();

    let s: serde_json::Value =
        serde_json::from_str(&ok(&outpost(data, &["stats", "--json"]))).unwrap();
    assert_eq!(s["records"], 5);
    assert_eq!(s["dead_letters"], 1);
    assert_eq!(s["boot"], 1);
    assert!(ok(&outpost(data, &["stats"])).contains("records       5"));

    let out = ok(&outpost(data, &["export"]));
    let lines: Vec<serde_json::Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    assert_eq!(lines[0]["key"], keys[0].to_string());
    assert_eq!(lines[0]["stream"], "cam-1");
    assert_eq!(lines[0]["record"]["i"], 0);
    assert_eq!(lines[1]["record"]["i"], 2);
    assert_eq!(lines[4]["record_hex"], "dead");
    let at = lines[0]["appended_at"].as_str().unwrap();
    assert!(at.ends_with('Z') && at.contains('T'), "{at}");

    let file = data.join("export.ndjson");
    ok(&outpost(data, &["export", "--out", file.to_str().unwrap()]));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), out);
    let dl = ok(&outpost(data, &["export", "--dead-letters"]));
    let d: serde_json::Value = serde_json::from_str(dl.trim()).unwrap();
    assert_eq!(
        (d["reason"].as_str(), d["record"]["i"].as_u64()),
        (Some("http 422"), Some(1))
    );

    let o = outpost(data, &["purge"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--yes"));
    ok(&outpost(data, &["purge", "--yes", "--dead-letters-only"]));
    let s: serde_json::Value =
        serde_json::from_str(&ok(&outpost(data, &["stats", "--json"]))).unwrap();
    assert_eq!(
        (s["records"].as_u64(), s["dead_letters"].as_u64()),
        (Some(5), Some(0))
    );
    ok(&outpost(data, &["purge", "--yes"]));
    let s: serde_json::Value =
        serde_json::from_str(&ok(&outpost(data, &["stats", "--json"]))).unwrap();
    assert_eq!(
        (s["records"].as_u64(), s["bytes"].as_u64()),
        (Some(0), Some(0))
    );

    // None of that bumped the boot.
    assert_eq!(Outbox::open(&data.join("outbox"), cfg()).unwrap().boot(), 2);
    let o = outpost(&data.join("missing"), &["stats"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no outbox here"));
}
