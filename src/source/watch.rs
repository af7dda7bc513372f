//! A watched directory of files (imagery dropped by another system).
//!
//! Each file is processed once: its records are made durable in the outbox,
//! its name is appended (fsynced) to `<data_dir>/watch/<pipeline>.done`, and
//! it is moved to `done/` — or to `failed/` with `<name>.reason.txt` beside it.
//! After a restart, a file already in the journal is only moved, never
//! processed again; a file not in it is processed. The one window left: a
//! crash after the outbox commit and before the journal write repeats that
//! file's record (same content, new id); no crash loses a file or a result.
//! Files still being written are skipped until their size stops changing.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;

use super::{Frame, Source, SourceCtx, SourceError};
use crate::fsio::move_into;

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
            // name -> size seen at the previous scan (a file is taken once its size is stable).
            let mut sizes: HashMap<String, u64> = HashMap::new();
            loop {
                let mut files: Vec<(String, PathBuf, u64)> = Vec::new();
                if let Ok(rd) = std::fs::read_dir(&self.dir) {
                    for e in rd.flatten() {
                        let p = e.path();
                        let Ok(md) = e.metadata() else { continue };
                        if !md.is_file() {
                            continue;
                        }
                        let name = e.file_name().to_string_lossy().into_owned();
                        if name.starts_with('.') {
                            continue;
                        }
                        let ext = p
                            .extension()
                            .map(|x| x.to_string_lossy().to_lowercase())
                            .unwrap_or_default();
                        if !self.extensions.is_empty() && !self.extensions.contains(&ext) {
                            continue;
                        }
                        files.push((name, p, md.len()));
                    }
                }
                files.sort();
                let mut seen = HashSet::new();
                for (name, path, size) in files {
                    seen.insert(name.clone());
                    if journal.done.contains(&name) {
                        // Processed before a restart; only the move was missing.
                        if let Err(e) = move_into(&path, &done_dir) {
                            tracing::warn!(file = %path.display(), error = %e, "cannot move processed file");
                        }
                        continue;
                    }
                    if sizes.insert(name.clone(), size) != Some(size) {
                        continue; // new or still growing: look again next scan
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
