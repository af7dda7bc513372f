//! A watched directory of files (imagery dropped by another system).
//!
//! Each file is processed once: its records are made durable in the outbox,
//! its name is appended (fsynced) to `<data_dir>/watch/<pipeline>.done`, and
//! it is moved to `done/` — or to `failed/` with `<name>.reason.txt` beside it.
//! After a restart, a file already in the journal is only moved, never
//! processed again; a file not in it is processed. The one window left: a
//! crash after the outbox commit and before the journal write repeats that
//! file's record (same content, new id); no crash loses a file or a result.
//! A file is taken once it is stable: its size and mtime unchanged across
//! two polls (a writer that pauses for less than that is waited for).
//! Symlinks, FIFOs, sockets and directories are never read: each is counted
//! once (`frames_dropped_total{reason="not_a_regular_file"}`) and logged once.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use super::{Frame, FrameErrorKind, Source, SourceCtx, SourceError};
use crate::fsio::move_into;

/// Polls a file must look the same across before it is taken.
const STABLE_POLLS: u32 = 2;

/// What a scan saw of a file, and for how many polls it has not changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    size: u64,
    mtime: Option<SystemTime>,
    stable: u32,
}

/// Records this scan's view of a file; true once it has been the same
/// across [`STABLE_POLLS`] polls.
fn is_stable(
    seen: &mut HashMap<String, Seen>,
    name: &str,
    size: u64,
    mtime: Option<SystemTime>,
) -> bool {
    let stable = match seen.get(name) {
        Some(s) if s.size == size && s.mtime == mtime => s.stable + 1,
        _ => 0,
    };
    seen.insert(
        name.to_string(),
        Seen {
            size,
            mtime,
            stable,
        },
    );
    stable >= STABLE_POLLS
}

pub struct WatchSource {
    pub dir: PathBuf,
    pub poll_interval: Duration,
    pub extensions: Vec<String>,
}

struct Journal {
    path: PathBuf,
    done: HashSet<String>,
}

impl Journal {
    fn open(path: PathBuf) -> std::io::Result<Journal> {
        if let Some(d) = path.parent() {
            std::fs::create_dir_all(d)?;
        }
        let done = match std::fs::read_to_string(&path) {
            Ok(s) => s
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => HashSet::new(),
            Err(e) => return Err(e),
        };
        Ok(Journal { path, done })
    }

    fn record(&mut self, name: &str) -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        writeln!(f, "{name}")?;
        f.sync_all()?;
        self.done.insert(name.to_string());
        Ok(())
    }
}

impl Source for WatchSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let setup = |detail: String| SourceError::Setup {
            pipeline: ctx.pipeline.clone(),
            kind: "watch",
            detail,
        };
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| setup(format!("{}: {e}", self.dir.display())))?;
        let mut journal = Journal::open(
            ctx.data_dir
                .join("watch")
                .join(format!("{}.done", ctx.pipeline)),
        )
        .map_err(|e| setup(format!("journal: {e}")))?;
        tracing::info!(pipeline = %ctx.pipeline, dir = %self.dir.display(), "watch source");
        Ok(tokio::spawn(async move {
            let done_dir = self.dir.join("done");
            let failed_dir = self.dir.join("failed");
            // What earlier scans saw (a file is taken once it is stable).
            let mut sizes: HashMap<String, Seen> = HashMap::new();
            // Entries that are not regular files, already counted and logged.
            let mut odd: HashSet<String> = HashSet::new();
            loop {
                let mut files: Vec<(String, PathBuf, u64, Option<SystemTime>)> = Vec::new();
                let mut odd_now = HashSet::new();
                if let Ok(rd) = std::fs::read_dir(&self.dir) {
                    for e in rd.flatten() {
                        let p = e.path();
                        // Not followed: a symlink is reported, never read.
                        let Ok(md) = e.metadata() else { continue };
                        let name = e.file_name().to_string_lossy().into_owned();
                        if name.starts_with('.') {
                            continue;
                        }
                        if !md.is_file() {
                            if md.is_dir() && (name == "done" || name == "failed") {
                                continue;
                            }
                            if odd.insert(name.clone()) {
                                let what = file_kind(&md);
                                ctx.count_drop(
                                    "not_a_regular_file",
                                    &format!("{} is a {what}", p.display()),
                                );
                                tracing::warn!(pipeline = %ctx.pipeline, path = %p.display(), kind = what, "watched folder: not a regular file; left in place, not read");
                            }
                            odd_now.insert(name);
                            continue;
                        }
                        let ext = p
                            .extension()
                            .map(|x| x.to_string_lossy().to_lowercase())
                            .unwrap_or_default();
                        if !self.extensions.is_empty() && !self.extensions.contains(&ext) {
                            continue;
                        }
                        files.push((name, p, md.len(), md.modified().ok()));
                    }
                }
                // A name that went away and comes back is reported again.
                odd.retain(|n| odd_now.contains(n));
                files.sort();
                let mut seen = HashSet::new();
                for (name, path, size, mtime) in files {
                    seen.insert(name.clone());
                    if journal.done.contains(&name) {
                        // Processed before a restart; only the move was missing.
                        if let Err(e) = move_into(&path, &done_dir) {
                            tracing::warn!(file = %path.display(), error = %e, "cannot move processed file");
                        }
                        continue;
                    }
                    if !is_stable(&mut sizes, &name, size, mtime) {
                        continue; // new or still being written: look again next scan
                    }
                    let payload = match std::fs::read(&path) {
                        Ok(b) => Bytes::from(b),
                        Err(e) => {
                            tracing::warn!(file = %path.display(), error = %e, "cannot read");
                            continue;
                        }
                    };
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    let mut frame = Frame::new(name.as_str(), payload);
                    frame.reply = Some(tx);
                    if !ctx.submit(frame).await {
                        return;
                    }
                    let outcome = match rx.await {
                        Ok(r) => r,
                        // Dropped unanswered: the daemon is stopping (or the frame was evicted); retry next start/scan.
                        Err(_) => continue,
                    };
                    match outcome {
                        Ok(_) => {
                            if let Some(ob) = ctx.outbox.clone() {
                                let synced = tokio::task::spawn_blocking(move || ob.sync()).await;
                                if !matches!(synced, Ok(Ok(()))) {
                                    tracing::error!(file = %path.display(), "outbox sync failed; the file stays for the next scan");
                                    continue;
                                }
                            }
                            if let Err(e) = journal.record(&name) {
                                tracing::error!(file = %path.display(), error = %e, "cannot write the watch journal");
                                continue;
                            }
                            if let Err(e) = move_into(&path, &done_dir) {
                                tracing::warn!(file = %path.display(), error = %e, "cannot move to done/");
                            }
                        }
                        Err(reason)
                            if matches!(
                                reason.kind,
                                FrameErrorKind::Unavailable | FrameErrorKind::Dropped
                            ) =>
                        {
                            // Outbox full, disk full or a full queue: the file waits for a later scan.
                            tracing::warn!(pipeline = %ctx.pipeline, file = %name, %reason, "file not stored now; it stays for a later scan");
                            continue;
                        }
                        Err(reason) => {
                            match move_into(&path, &failed_dir) {
                                Ok(to) => {
                                    let note = to.with_file_name(format!(
                                        "{}.reason.txt",
                                        to.file_name().unwrap_or_default().to_string_lossy()
                                    ));
                                    let _ = std::fs::write(note, format!("{reason}\n"));
                                }
                                Err(e) => {
                                    tracing::warn!(file = %path.display(), error = %e, "cannot move to failed/")
                                }
                            }
                            tracing::warn!(pipeline = %ctx.pipeline, file = %name, %reason, "file failed");
                        }
                    }
                    sizes.remove(&name);
                }
                sizes.retain(|n, _| seen.contains(n));
                tokio::select! {
                    _ = tokio::time::sleep(self.poll_interval) => {}
                    _ = ctx.stopped() => return,
                }
            }
        }))
    }
}

fn file_kind(md: &std::fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = md.file_type();
    if t.is_symlink() {
        "symlink"
    } else if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "fifo"
    } else if t.is_socket() {
        "socket"
    } else {
        "device or other special file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_taken_after_two_unchanged_polls() {
        let mut m = HashMap::new();
        let t = Some(SystemTime::UNIX_EPOCH);
        assert!(!is_stable(&mut m, "a", 10, t));
        assert!(!is_stable(&mut m, "a", 10, t));
        assert!(is_stable(&mut m, "a", 10, t));
        // A change starts over.
        let t2 = Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1));
        assert!(!is_stable(&mut m, "a", 10, t2));
        assert!(!is_stable(&mut m, "a", 20, t2));
    }
}
