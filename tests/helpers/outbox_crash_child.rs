//! Helper process for the integration test `outbox::sigkill_keeps_every_synced_record`
//! (not shipped: cross/build packages `--bin outpost` only).
//!
//! `outbox-crash-child DIR RUN` opens the outbox in DIR, appends records in
//! batches of 1..=64 and prints `durable <boot> <seq> <i>` for each once
//! `sync()` returned, until it is killed. The test kills it with SIGKILL and
//! checks that every record printed is still there.

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use outpost::outbox::{Outbox, OutboxConfig};

/// The record the test expects for (run, i).
fn rec(run: u64, i: u64) -> Vec<u8> {
    format!(
        r#"{{"run":{run},"i":{i},"pad":"{}"}}"#,
        "x".repeat((i % 97) as usize)
    )
    .into_bytes()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(Ok(run))) = (args.get(1), args.get(2).map(|r| r.parse::<u64>())) else {
        eprintln!("usage: outbox-crash-child DIR RUN");
        return ExitCode::from(2);
    };
    let ob = match Outbox::open(Path::new(dir), OutboxConfig::default()) {
        Ok(ob) => ob,
        Err(e) => {
            eprintln!("outbox-crash-child: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    let mut i = 0u64;
    let mut batch = 1u64;
    loop {
        let mut keys = Vec::new();
        for _ in 0..batch {
            match ob.append("s", &rec(run, i)) {
                Ok(k) => keys.push((k, i)),
                Err(e) => {
                    eprintln!("outbox-crash-child: append: {e}");
                    return ExitCode::FAILURE;
                }
            }
            i += 1;
        }
        if let Err(e) = ob.sync() {
            eprintln!("outbox-crash-child: sync: {e}");
            return ExitCode::FAILURE;
        }
        let mut out = String::new();
        for (k, i) in keys {
            out.push_str(&format!("durable {} {} {}\n", k.0, k.1, i));
        }
        // One write per batch, flushed: a line on stdout means durable.
        if stdout
            .write_all(out.as_bytes())
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return ExitCode::FAILURE;
        }
        batch = batch % 64 + 1;
    }
}
