//! `outpost outbox stats|export|purge --data-dir DIR`: a stopped daemon's
//! outbox (`<data-dir>/outbox`). Opened for inspection: the boot counter is
//! not bumped and a damaged database is reported, not quarantined.

use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::config::Config;
use crate::outbox::{Key, Outbox, OutboxConfig, OutboxStats, Purge};

#[derive(Debug, clap::Subcommand)]
pub enum OutboxCommand {
    /// Records waiting, their size and age, dead letters.
    Stats {
        #[command(flatten)]
        dir: DataDir,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Every waiting record (or dead letter) as NDJSON, oldest first.
    Export {
        #[command(flatten)]
        dir: DataDir,
        /// Write here instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Export the dead letters (with reason and dead_at) instead.
        #[arg(long)]
        dead_letters: bool,
    },
    /// Delete every waiting record and dead letter. They are lost for good.
    Purge {
        #[command(flatten)]
        dir: DataDir,
        /// Really delete (refused without it).
        #[arg(long)]
        yes: bool,
        /// Delete only the dead letters.
        #[arg(long)]
        dead_letters_only: bool,
    },
}

#[derive(Debug, Clone, clap::Args)]
pub struct DataDir {
    /// The daemon's data directory (default: the config's `data_dir`).
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
}

pub fn run(cli: &super::Cli, cmd: &OutboxCommand) -> anyhow::Result<()> {
    match cmd {
        OutboxCommand::Stats { dir, json } => {
            let ob = open(cli, dir)?;
            let st = ob.stats();
            if *json {
                println!("{}", serde_json::to_string_pretty(&stats_json(&ob, &st))?);
            } else {
                print_stats(&ob, &st);
            }
            Ok(ob.close()?)
        }
        OutboxCommand::Export {
            dir,
            out,
            dead_letters,
        } => {
            let ob = open(cli, dir)?;
            let n = match out {
                Some(p) => {
                    let f = std::fs::File::create(p)
                        .with_context(|| format!("{}: cannot create", p.display()))?;
                    let mut w = BufWriter::new(f);
                    let n = export(&ob, *dead_letters, &mut w)?;
                    w.into_inner()
                        .map_err(|e| e.into_error())
                        .and_then(|f| f.sync_all())
                        .with_context(|| format!("{}: cannot write", p.display()))?;
                    n
                }
                None => {
                    let mut w = BufWriter::new(std::io::stdout().lock());
                    let n = export(&ob, *dead_letters, &mut w)?;
                    w.flush().context("stdout")?;
                    n
                }
            };
            let what = if *dead_letters {
                "dead letters"
            } else {
                "records"
            };
            eprintln!("exported {n} {what}");
            Ok(ob.close()?)
        }
        OutboxCommand::Purge {
            dir,
            yes,
            dead_letters_only,
        } => {
            let ob = open(cli, dir)?;
            let st = ob.stats();
            if !*yes {
                let what = if *dead_letters_only {
                    format!("{} dead letters", st.dead_letters)
                } else {
                    format!(
                        "{} records and {} dead letters",
                        st.records, st.dead_letters
                    )
                };
                bail!(
                    "purge would delete {what} in {} for good; add --yes to do it",
                    ob.dir().display()
                );
            }
            let what = if *dead_letters_only {
                Purge::DeadLettersOnly
            } else {
                Purge::All
            };
            let p = ob.purge(what)?;
            println!(
                "purged {} records and {} dead letters from {}",
                p.records,
                p.dead_letters,
                ob.dir().display()
            );
            Ok(ob.close()?)
        }
    }
}

fn outbox_dir(cli: &super::Cli, d: &DataDir) -> anyhow::Result<PathBuf> {
    let data = match (&d.data_dir, &cli.config) {
        (Some(d), _) => d.clone(),
        (None, Some(c)) => Config::load(c)?.data_dir,
        (None, None) => Config::default().data_dir,
    };
    Ok(data.join("outbox"))
}

fn open(cli: &super::Cli, d: &DataDir) -> anyhow::Result<Outbox> {
    let dir = outbox_dir(cli, d)?;
    // The config's [outbox] settings do not matter for reading; defaults do.
    Ok(Outbox::open_inspect(&dir, OutboxConfig::default())?)
}

fn rfc3339(t: SystemTime) -> String {
    humantime_serde::re::humantime::format_rfc3339_micros(t).to_string()
}

fn stats_json(ob: &Outbox, s: &OutboxStats) -> Value {
    json!({
        "path": ob.dir(),
        "boot": s.boot,
        "records": s.records,
        "bytes": s.bytes,
        "oldest_appended_at": s.oldest_appended_at.map(rfc3339),
        "oldest_age_s": s.oldest_age.map(|d| d.as_secs_f64()),
        "dead_letters": s.dead_letters,
        "dead_letter_bytes": s.dead_letter_bytes,
        "disk_bytes": disk_bytes(ob.dir()),
    })
}

fn print_stats(ob: &Outbox, s: &OutboxStats) {
    println!("outbox        {}", ob.dir().display());
    println!("last boot     {}", s.boot);
    println!("records       {} ({} bytes)", s.records, s.bytes);
    match (s.oldest_appended_at, s.oldest_age) {
        (Some(t), Some(age)) => println!(
            "oldest        {} ({} ago)",
            rfc3339(t),
            humantime_serde::re::humantime::format_duration(std::time::Duration::from_secs(
                age.as_secs()
            ))
        ),
        _ => println!("oldest        -"),
    }
    println!(
        "dead letters  {} ({} bytes)",
        s.dead_letters, s.dead_letter_bytes
    );
    println!("on disk       {} bytes", disk_bytes(ob.dir()));
}

/// Size of the files under `dir` (sled's log is larger than the records).
fn disk_bytes(dir: &Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    rd.flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

/// The record as JSON when it is JSON, else as hex.
fn put_record(obj: &mut serde_json::Map<String, Value>, record: &[u8]) {
    match serde_json::from_slice::<Value>(record) {
        Ok(v) => obj.insert("record".into(), v),
        Err(_) => obj.insert("record_hex".into(), Value::String(hex::encode(record))),
    };
}

/// Writes NDJSON in batches, so a million-record backlog is never in memory.
fn export(ob: &Outbox, dead: bool, w: &mut impl Write) -> anyhow::Result<u64> {
    const BATCH: usize = 1000;
    let mut after: Option<Key> = None;
    let mut n = 0u64;
    loop {
        let mut lines = Vec::new();
        if dead {
            for d in ob.dead_letters(after, BATCH)? {
                after = Some(d.key);
                let mut o = serde_json::Map::new();
                o.insert("key".into(), json!(d.key.to_string()));
                o.insert("stream".into(), json!(d.stream));
                o.insert("appended_at".into(), json!(rfc3339(d.appended_at)));
                o.insert("dead_at".into(), json!(rfc3339(d.dead_at)));
                o.insert("reason".into(), json!(d.reason));
                put_record(&mut o, &d.record);
                lines.push(Value::Object(o));
            }
        } else {
            for e in ob.pending(after, BATCH)? {
                after = Some(e.key);
                let mut o = serde_json::Map::new();
                o.insert("key".into(), json!(e.key.to_string()));
                o.insert("stream".into(), json!(e.stream));
                o.insert("appended_at".into(), json!(rfc3339(e.appended_at)));
                put_record(&mut o, &e.record);
                lines.push(Value::Object(o));
            }
        }
        if lines.is_empty() {
            return Ok(n);
        }
        for l in &lines {
            serde_json::to_writer(&mut *w, l)?;
            w.write_all(b"\n")?;
            n += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_records_are_embedded_others_hex() {
        let mut o = serde_json::Map::new();
        put_record(&mut o, br#"{"a":1}"#);
        assert_eq!(o["record"], json!({"a": 1}));
        let mut o = serde_json::Map::new();
        put_record(&mut o, &[0xff, 0x00]);
        assert_eq!(o["record_hex"], json!("ff00"));
        assert!(!o.contains_key("record"));
    }
}
