//! The durable outbox: every result record goes in here before anything
//! else happens to it, and leaves only when the fleet has acknowledged it
//! (or it is dropped by the `max_bytes` policy, which is counted).
//!
//! # Layout
//!
//! `<data_dir>/outbox/` is one sled 0.34 database (files `conf`, `db`,
//! `snap.*`, `blobs/`) plus `boot`, a text file mirroring the boot counter.
//! sled writes its log through zstd (`use_compression`, `compress` in the
//! config): a result record and, above all, a rewritten page of similar
//! records shrink several times, which is what keeps the flash's writes per
//! record near a plain log's (benches/outbox_wear.rs). A database of the
//! other layout (every one made before compression) is converted at open
//! ([`upgrade`]). Trees:
//!
//! - `records`: key = 16 bytes big-endian `(boot, seq)`; value = version
//!   byte, append time (u64 BE unix ns), stream (u16 BE length + UTF-8),
//!   then the record bytes ([`record`] has the exact layout).
//! - `dead_letters`: same key; value adds the time it died and a reason.
//! - `meta`: `boot` = u64 BE, the boot number of the last open.
//!
//! # Invariants
//!
//! - Keys sort in append order, because sled orders big-endian bytes and
//!   `(boot, seq)` only grows: `boot` is 1 + the highest boot found in
//!   `meta`, the sidecar or any key, and it is durable (sled flush + fsync,
//!   sidecar written atomically) before `open` returns, so no append of a
//!   later boot can reuse a key. `seq` starts at 0 each boot.
//! - Keys become visible in key order: the seq is taken and the record
//!   inserted under one lock, so an uplink reading `pending(after)` with a
//!   cursor never skips a record that shows up later with a smaller key.
//! - A record is removed only by `ack`, `dead_letter` (moved), the full
//!   policy (counted by reason) or `purge` (operator, CLI).
//! - `bytes` accounting = sum of key + value lengths of the `records` tree,
//!   `max_bytes` bounds records + dead letters (a dead-letter move over
//!   the budget drops the oldest dead letters). It is recomputed by a scan
//!   at every open, never stored, so it cannot drift across restarts.
//!   sled's log takes more disk than that (see benches/outbox.rs).
//!
//! # Durability and crashes
//!
//! `append` never waits for the disk. A background thread commits in
//! groups: every `flush_interval`, or early after `flush_records` appends,
//! or at once when someone calls `sync()`; it runs sled's `flush()` and
//! then `fdatasync` on sled's log file (and fsyncs new blob files), because
//! sled 0.34's flush uses `sync_file_range`, which does not reach the disk
//! (sled issues 1351, 1452). A record is durable once the group commit that
//! includes it has completed, at most about `flush_interval` after its
//! append; `sync()` waits for that. After a crash (SIGKILL, power loss)
//! every record whose group commit completed is there; later ones may be
//! lost, in a suffix of the log; none is half-written (sled checksums its
//! log and stops recovery at the first bad entry). Acks are committed the
//! same way, so a crash can bring back acknowledged records: the uplink
//! sends them again and the fleet drops them by id.
//!
//! # A full disk, an I/O error
//!
//! sled 0.34 keeps the first write error it meets (`ENOSPC`, `EIO`) and
//! fails every later write with it, for as long as the database is open. So
//! a failed write or commit marks the outbox *broken* with its reason
//! ([`Outbox::unavailable`], which `/readyz` reports): appends are refused
//! at once, and the flusher thread reopens the database at a growing
//! interval (0.5 s to 10 s) until it opens and commits again. A reopen
//! keeps every committed record (sled recovers its log up to the last good
//! flush) and puts back the records appended since the last good commit.
//! Those are kept in memory (`Shared::unsaved`) until a commit covers them,
//! because reading them back from the broken database can spin for good
//! inside sled. `lost_total` counts records a reopen could not put back
//! (none since then). Keys stay unique across a reopen: the seq counter
//! lives in memory and only grows.
//!
//! A file system turned read-only, or another I/O error (not a full disk),
//! does not refuse records: the outbox *holds* them in memory up to
//! `memory_when_read_only`, keeps sending the stored ones through the
//! database as it was opened, and stores the held ones once a write of its
//! own passes again ([`degraded`] has the rules).
//!
//! A database sled cannot open (or panics on) is moved to
//! `<data_dir>/quarantine/outbox-<unix-ts>`, never deleted, and a fresh one
//! is created with a boot number above the old one's (from the sidecar).
//! A database held by another process (sled's file lock) is never touched:
//! that is [`OutboxError::InUse`].

mod commit;
mod config;
mod degraded;
mod error;
mod open;
pub mod record;
mod recover;
mod stats;
mod upgrade;

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use commit::{Commit, Disk};
pub use config::{OutboxConfig, WhenFull};
pub use degraded::HeldStats;
pub use error::OutboxError;
pub use record::{DeadLetter, Entry, Key};
use recover::{Flusher, Store};
pub use stats::{Dropped, OutboxStats};

use record::{KEY_LEN, MAX_NAME};

/// The durable outbox. Cheap to clone; all clones share one database.
#[derive(Clone)]
pub struct Outbox {
    inner: Arc<Inner>,
}

/// Dropping the last clone stops the flusher after a final commit.
struct Inner {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<Result<(), OutboxError>>>>,
}

/// What the flusher thread shares with the handles.
struct Shared {
    dir: PathBuf,
    cfg: OutboxConfig,
    boot: u64,
    /// Opened by the CLI: no boot bump, appends refused.
    inspect: bool,
    closed: AtomicBool,
    /// None while a broken database is being reopened.
    store: RwLock<Option<Store>>,
    commit: Commit,
    /// Every seq below this was in a commit that completed.
    durable_seq: AtomicU64,
    /// This boot's records from `durable_seq` on (value by seq): what a
    /// reopen after a write error puts back. Kept here because reading the
    /// broken database can spin for good inside sled (an iterator that
    /// splits a node retries its log write forever). Acks, dead-letter
    /// moves and drops take records out of it as they do from sled.
    unsaved: Mutex<std::collections::BTreeMap<u64, sled::IVec>>,
    /// Databases reopened after a write error.
    reopens_total: AtomicU64,
    /// Records appended before a write error that a reopen could not put back.
    lost_total: AtomicU64,
    /// Next seq of this boot; held while a record is inserted (see header).
    append: Mutex<u64>,
    records_n: AtomicU64,
    records_bytes: AtomicU64,
    dead_n: AtomicU64,
    dead_bytes: AtomicU64,
    appended_total: AtomicU64,
    acked_total: AtomicU64,
    dead_lettered_total: AtomicU64,
    dropped: stats::DropCounters,
    quarantined_total: u64,
    notify: Arc<Notify>,
    /// Records and acknowledgements kept in memory while the disk refuses
    /// writes (see degraded.rs).
    held: degraded::Held,
}

/// What `purge` removes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purge {
    /// Records and dead letters.
    All,
    DeadLettersOnly,
}

/// What `purge` removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    pub records: u64,
    pub dead_letters: u64,
}

fn entry_size(k: &[u8], v: &[u8]) -> u64 {
    (k.len() + v.len()) as u64
}

impl Outbox {
    /// Opens `dir` (creating it) for the daemon: bumps and persists the boot
    /// counter, quarantines a database that cannot be opened.
    pub fn open(dir: &Path, cfg: OutboxConfig) -> Result<Outbox, OutboxError> {
        Self::open_with(dir, cfg, false)
    }

    /// Opens an existing outbox for inspection (the CLI on a stopped
    /// daemon): the boot counter is left alone, a damaged database is
    /// reported and left in place, appends are refused; pending, ack,
    /// export and purge work.
    pub fn open_inspect(dir: &Path, cfg: OutboxConfig) -> Result<Outbox, OutboxError> {
        Self::open_with(dir, cfg, true)
    }

    fn open_with(dir: &Path, cfg: OutboxConfig, inspect: bool) -> Result<Outbox, OutboxError> {
        let problems = cfg.validate();
        if !problems.is_empty() {
            return Err(OutboxError::Invalid(problems));
        }
        let io = |op| {
            let path = dir.to_path_buf();
            move |source| OutboxError::Io { op, path, source }
        };
        if inspect {
            if !dir.join("db").is_file() {
                return Err(OutboxError::NotFound {
                    path: dir.to_path_buf(),
                });
            }
        } else {
            std::fs::create_dir_all(dir).map_err(io("create directory"))?;
        }
        // A conversion a crash interrupted is finished or discarded first;
        // then a database of the other layout than `compress` asks is
        // converted (the first layout was uncompressed).
        if let Err(e) = upgrade::resume(dir) {
            tracing::warn!(path = %dir.display(), error = %e, "outbox: could not tidy an interrupted upgrade");
        }
        if !inspect {
            let want = if cfg.compress {
                "compressed"
            } else {
                "uncompressed"
            };
            match upgrade::convert(dir, cfg.compress, cfg.cache_capacity) {
                Ok(None) => {}
                Ok(Some(records)) => tracing::info!(
                    path = %dir.display(),
                    records,
                    "outbox: converted to the {want} layout"
                ),
                // Held by another process: the open below says so.
                Err(e) if e.in_use() => {}
                Err(e) => tracing::warn!(
                    path = %dir.display(),
                    error = %e,
                    "outbox: conversion to the {want} layout failed; the database stays as it is and the conversion is tried at the next start"
                ),
            }
        }
        // Read before sled touches anything: if the database is quarantined,
        // this is what keeps the next boot number above the old ones.
        let sidecar = open::read_boot_file(dir);
        let mut quarantined_total = 0;
        // Wait briefly for sled's lock before calling the database in use.
        let attempt = open::waiting_for_lock(
            |r| matches!(r, Err(open::Failure::InUse(_))),
            || open::load(dir, &cfg),
        );
        let loaded = match attempt {
            Ok(l) => l,
            Err(open::Failure::Damaged(reason)) if !inspect => {
                let to = open::quarantine(dir)?;
                tracing::error!(
                    path = %dir.display(),
                    quarantine = %to.display(),
                    %reason,
                    "outbox database is damaged: moved aside, starting a fresh one"
                );
                quarantined_total = 1;
                std::fs::create_dir_all(dir).map_err(io("create directory"))?;
                open::load(dir, &cfg).map_err(|f| f.into_error(dir))?
            }
            Err(f) => return Err(f.into_error(dir)),
        };
        let last_boot = loaded.last_boot.max(sidecar);
        let boot = if inspect { last_boot } else { last_boot + 1 };
        let mut disk = Disk::new(loaded.db.clone(), dir)?;
        let store = Store {
            records: loaded.records.clone(),
            dead: loaded.dead.clone(),
        };
        if !inspect {
            open::store_boot(&loaded.meta, boot)?;
            disk.flush()?;
            // sled created its files; make their names durable too.
            commit::sync_dir(dir)?;
            open::write_boot_file(dir, boot)?;
        }
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            boot,
            inspect,
            closed: AtomicBool::new(false),
            store: RwLock::new(Some(store)),
            commit: Commit::new(cfg.flush_interval, cfg.flush_records),
            durable_seq: AtomicU64::new(0),
            unsaved: Mutex::new(std::collections::BTreeMap::new()),
            reopens_total: AtomicU64::new(0),
            lost_total: AtomicU64::new(0),
            held: degraded::Held::new(&cfg),
            cfg,
            append: Mutex::new(0),
            records_n: AtomicU64::new(loaded.records_n),
            records_bytes: AtomicU64::new(loaded.records_bytes),
            dead_n: AtomicU64::new(loaded.dead_n),
            dead_bytes: AtomicU64::new(loaded.dead_bytes),
            appended_total: AtomicU64::new(0),
            acked_total: AtomicU64::new(0),
            dead_lettered_total: AtomicU64::new(0),
            dropped: stats::DropCounters::default(),
            quarantined_total,
            notify: Arc::new(Notify::new()),
        });
        let s = Arc::clone(&shared);
        let flusher = std::thread::Builder::new()
            .name("outbox-flush".into())
            .spawn(move || {
                // Housekeeping yields to inference on a busy core: a group
                // commit may wait a scheduler tick, a frame should not wait
                // for a commit (Linux nice values are per thread).
                let _ = rustix::process::setpriority_process(None, 10);
                let mut f = Flusher::new(Arc::clone(&s), disk);
                s.commit.run(&mut f)
            })
            .map_err(io("spawn flusher thread"))?;
        tracing::debug!(path = %dir.display(), boot, records = shared.records_n.load(Ordering::Relaxed), "outbox open");
        Ok(Outbox {
            inner: Arc::new(Inner {
                shared,
                flusher: Mutex::new(Some(flusher)),
            }),
        })
    }

    fn s(&self) -> &Shared {
        &self.inner.shared
    }

    /// This open's boot number (1, 2, ...); for an inspection, the last one.
    pub fn boot(&self) -> u64 {
        self.s().boot
    }

    pub fn dir(&self) -> &Path {
        &self.s().dir
    }

    /// Why the outbox cannot write now (a full disk, a read-only disk, an
    /// I/O error), or None when it stores. Records are refused, or held in
    /// memory while the disk is read-only (`stats().held`). It recovers by
    /// itself (see the header).
    pub fn unavailable(&self) -> Option<String> {
        self.s().commit.broken().map(|b| b.reason)
    }

    /// Appends one serialized record for `stream` and returns its key. Does
    /// not wait for the disk: the record is durable after the next group
    /// commit (`sync()` waits for it).
    pub fn append(&self, stream: &str, record: &[u8]) -> Result<Key, OutboxError> {
        let key = self.append_quiet(stream, record)?;
        self.wake_readers();
        Ok(key)
    }

    /// Appends records made together, each as [`Outbox::append`] would (in
    /// order, each with its own result), and wakes the uplink once for all
    /// of them: a batch of results costs the uplink one wake-up, not one
    /// per record.
    pub fn append_all<'a>(
        &self,
        records: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    ) -> Vec<Result<Key, OutboxError>> {
        let out: Vec<_> = records
            .into_iter()
            .map(|(stream, record)| self.append_quiet(stream, record))
            .collect();
        if out.iter().any(|r| r.is_ok()) {
            self.wake_readers();
        }
        out
    }

    fn wake_readers(&self) {
        let s = self.s();
        // notify_waiters wakes every uplink waiting now; notify_one leaves a
        // permit for one that is between an empty `pending` and its await.
        s.notify.notify_waiters();
        s.notify.notify_one();
    }

    fn append_quiet(&self, stream: &str, record: &[u8]) -> Result<Key, OutboxError> {
        let s = self.s();
        if s.inspect {
            return Err(OutboxError::ReadOnly);
        }
        if s.closed.load(Ordering::Relaxed) {
            return Err(OutboxError::Closed);
        }
        // While the disk refuses writes records are held (below); right
        // after a reopen stored them the new database takes appends.
        if !s.held.holding() && !s.held.reopened() {
            s.commit.check()?;
        }
        if stream.len() > MAX_NAME {
            return Err(OutboxError::StreamName {
                len: stream.len(),
                max: MAX_NAME,
            });
        }
        let value = sled::IVec::from(record::encode(stream, SystemTime::now(), record));
        let size = (KEY_LEN + value.len()) as u64;
        if size > s.cfg.max_bytes {
            return Err(OutboxError::TooLarge {
                size,
                max_bytes: s.cfg.max_bytes,
            });
        }
        let mut seq = s.append.lock();
        if s.held.holding() {
            return s.hold(&mut seq, value);
        }
        let guard = s.store.read();
        let st = guard.as_ref().ok_or_else(|| s.unavailable_now())?;
        s.make_room(st, size)?;
        let key = Key(s.boot, *seq);
        // Counted before the insert so a concurrent ack of this key can never
        // subtract first and wrap the counters.
        s.records_n.fetch_add(1, Ordering::SeqCst);
        s.records_bytes.fetch_add(size, Ordering::SeqCst);
        if let Err(e) = st.records.insert(key.to_bytes(), value.clone()) {
            s.records_n.fetch_sub(1, Ordering::SeqCst);
            s.records_bytes.fetch_sub(size, Ordering::SeqCst);
            let e = s.write_failed("append", e);
            if s.held.holding() {
                drop(guard);
                return s.hold(&mut seq, value);
            }
            return Err(e);
        }
        s.unsaved.lock().insert(key.1, value);
        *seq += 1;
        drop(guard);
        drop(seq);
        s.appended_total.fetch_add(1, Ordering::Relaxed);
        s.commit.appended();
        Ok(key)
    }

    /// Blocks until everything done before the call (appends, acks, dead
    /// letters) is durable, or returns the error of the flush that failed.
    pub fn sync(&self) -> Result<(), OutboxError> {
        self.s().commit.sync()
    }

    /// Blocks until everything done before the call is durable, like
    /// [`Outbox::sync`], but waits for the regular group commit (at most
    /// about `flush_interval`) instead of asking for one now: for callers
    /// that wait often (a QoS 1 source acknowledging frames), so waiting
    /// costs no extra fsync.
    pub fn wait_committed(&self) -> Result<(), OutboxError> {
        self.s().commit.wait_durable(false)
    }

    /// [`Outbox::wait_committed`] for async callers: awaits the group
    /// commit without holding a thread, so any number of waiters (HTTP
    /// requests) costs none.
    pub async fn committed(&self) -> Result<(), OutboxError> {
        self.s().commit.durable().await
    }

    /// `flush_interval`: a record is durable about this long after its
    /// append, at most (plus the commit's own time).
    pub fn flush_interval(&self) -> std::time::Duration {
        self.s().commit.interval
    }

    /// Whether the disk failed and records are held in memory until it is
    /// back (`degraded.rs`): kept, but not durable yet.
    pub fn holding_in_memory(&self) -> bool {
        self.s().held.holding()
    }

    /// Up to `limit` unacknowledged records with key > `after` (`None`: from
    /// the start), oldest first. A value that cannot be decoded is moved to
    /// the dead letters (reason `undecodable: ...`) instead of blocking the
    /// uplink behind it.
    pub fn pending(&self, after: Option<Key>, limit: usize) -> Result<Vec<Entry>, OutboxError> {
        let s = self.s();
        {
            let guard = s.store.read();
            if s.held.holding() {
                return s
                    .held
                    .pending(guard.as_ref().map(|st| &st.records), after, limit);
            }
        }
        let mut out = Vec::with_capacity(limit.min(4096));
        let mut from = after;
        while out.len() < limit {
            let mut bad = None;
            let guard = s.store.read();
            let st = guard.as_ref().ok_or_else(|| s.unavailable_now())?;
            for kv in st.records.range(range_after(from)).take(limit - out.len()) {
                let (k, v) = kv.map_err(OutboxError::db("read pending"))?;
                let key = open::key_of(&k)?;
                match record::decode(key, &v) {
                    Ok(e) => out.push(e),
                    Err(e) => {
                        bad = Some((key, e));
                        break;
                    }
                }
            }
            drop(guard);
            match bad {
                None => break,
                Some((key, e)) => {
                    tracing::error!(%key, error = %e, "undecodable outbox record moved to dead letters");
                    s.move_to_dead(key, &format!("undecodable: {e}"))?;
                    from = Some(key);
                }
            }
        }
        Ok(out)
    }

    /// Deletes acknowledged records; keys already gone are fine (idempotent).
    pub fn ack(&self, keys: &[Key]) -> Result<(), OutboxError> {
        let s = self.s();
        let mut n = 0;
        let guard = s.store.read();
        if s.held.holding() {
            return s.held_ack(guard.as_ref().map(|st| &st.records), keys);
        }
        let st = guard.as_ref().ok_or_else(|| s.unavailable_now())?;
        s.forget_unsaved(keys.iter().copied());
        for k in keys {
            let kb = k.to_bytes();
            let removed = st
                .records
                .remove(kb)
                .map_err(|e| s.write_failed("ack", e))?;
            if let Some(v) = removed {
                s.records_n.fetch_sub(1, Ordering::SeqCst);
                s.records_bytes
                    .fetch_sub(entry_size(&kb, &v), Ordering::SeqCst);
                n += 1;
            }
        }
        if n > 0 {
            s.acked_total.fetch_add(n, Ordering::Relaxed);
            s.commit.op_done();
        }
        Ok(())
    }

    /// Moves a record the fleet refused to the dead letters, with a reason
    /// (cut to 64 KiB). A key already gone is fine (idempotent).
    pub fn dead_letter(&self, key: Key, reason: &str) -> Result<(), OutboxError> {
        let s = self.s();
        {
            let guard = s.store.read();
            if s.held.holding() {
                return s.held_refused(guard.as_ref().map(|st| &st.records), key, reason);
            }
        }
        s.move_to_dead(key, reason)
    }

    /// Up to `limit` dead letters with key > `after`, oldest first.
    pub fn dead_letters(
        &self,
        after: Option<Key>,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, OutboxError> {
        let mut out = Vec::new();
        let s = self.s();
        let guard = s.store.read();
        let st = guard.as_ref().ok_or_else(|| s.unavailable_now())?;
        for kv in st.dead.range(range_after(after)).take(limit) {
            let (k, v) = kv.map_err(OutboxError::db("read dead letters"))?;
            let key = open::key_of(&k)?;
            out.push(
                record::decode_dead(key, &v).map_err(|e| OutboxError::Corrupt {
                    key: key.to_string(),
                    reason: e.to_string(),
                })?,
            );
        }
        Ok(out)
    }

    /// Removes records and dead letters (or dead letters only), oldest
    /// first, and waits until that is durable. The operator's tool: the
    /// removed records are lost for good.
    pub fn purge(&self, what: Purge) -> Result<Purged, OutboxError> {
        let s = self.s();
        let mut p = Purged::default();
        let guard = s.store.read();
        let st = guard.as_ref().ok_or_else(|| s.unavailable_now())?;
        while let Some((k, v)) = st.dead.pop_min().map_err(|e| s.write_failed("purge", e))? {
            s.dead_n.fetch_sub(1, Ordering::SeqCst);
            s.dead_bytes.fetch_sub(entry_size(&k, &v), Ordering::SeqCst);
            p.dead_letters += 1;
        }
        if what == Purge::All {
            while let Some((k, v)) = st
                .records
                .pop_min()
                .map_err(|e| s.write_failed("purge", e))?
            {
                s.records_n.fetch_sub(1, Ordering::SeqCst);
                s.records_bytes
                    .fetch_sub(entry_size(&k, &v), Ordering::SeqCst);
                p.records += 1;
            }
        }
        drop(guard);
        s.commit.op_done();
        self.sync()?;
        Ok(p)
    }

    /// Wakes when records are appended, so an uplink can wait instead of
    /// polling: `let n = ob.notified();` then, when `pending` came back
    /// empty, `n.notified().await` (a permit left by `notify_one` covers an
    /// append between the two; meant for one consumer).
    pub fn notified(&self) -> Arc<Notify> {
        Arc::clone(&self.s().notify)
    }

    pub fn stats(&self) -> OutboxStats {
        self.s().stats()
    }

    /// Final group commit and stop. Other clones then get `Closed` on append.
    pub fn close(self) -> Result<(), OutboxError> {
        self.inner.stop()
    }
}

fn range_after(after: Option<Key>) -> (Bound<[u8; KEY_LEN]>, Bound<[u8; KEY_LEN]>) {
    match after {
        Some(k) => (Bound::Excluded(k.to_bytes()), Bound::Unbounded),
        None => (Bound::Unbounded, Bound::Unbounded),
    }
}

impl Inner {
    fn stop(&self) -> Result<(), OutboxError> {
        let s = &self.shared;
        s.closed.store(true, Ordering::SeqCst);
        s.commit.shutdown();
        let handle = self.flusher.lock().take();
        match handle {
            None => Ok(()),
            Some(h) => {
                let r = h.join().unwrap_or_else(|_| {
                    Err(OutboxError::Flush("the flusher thread panicked".into()))
                });
                let held = s.held.stats().records;
                if held > 0 {
                    tracing::error!(
                        records = held,
                        "outbox: stopped while the disk refuses writes; the records held in memory are lost"
                    );
                }
                r
            }
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::error!(error = %e, "outbox: final flush at drop failed");
        }
    }
}

impl Shared {
    /// The error while the store is being reopened.
    fn unavailable_now(&self) -> OutboxError {
        OutboxError::Unavailable(
            self.commit
                .broken()
                .map(|b| b.reason)
                .unwrap_or_else(|| "the database is being reopened".into()),
        )
    }

    /// A sled write failed: sled keeps that error for good, so the store is
    /// broken until the flusher reopens it.
    fn write_failed(&self, op: &'static str, source: sled::Error) -> OutboxError {
        let e = OutboxError::Db { op, source };
        self.held.failed(&e);
        self.commit.set_broken(e.to_string(), true);
        e
    }

    /// Frees `size` bytes under `max_bytes`: dead letters go first (they
    /// will never be sent), then the policy decides. Called with the append
    /// lock held, so two appends cannot both count the same free space.
    fn make_room(&self, st: &Store, size: u64) -> Result<(), OutboxError> {
        let max = self.cfg.max_bytes;
        loop {
            let used = self.used_bytes();
            if used + size <= max {
                return Ok(());
            }
            if self.drop_oldest_dead_letter(st)? {
                continue;
            }
            let popped = match self.cfg.when_full {
                WhenFull::DropOldest => st
                    .records
                    .pop_min()
                    .map_err(|e| self.write_failed("drop oldest", e))?,
                WhenFull::RejectNew => None,
            };
            match popped {
                Some((k, v)) => {
                    if let Ok(key) = open::key_of(&k) {
                        self.forget_unsaved([key]);
                    }
                    self.records_n.fetch_sub(1, Ordering::SeqCst);
                    self.records_bytes
                        .fetch_sub(entry_size(&k, &v), Ordering::SeqCst);
                    self.dropped
                        .full_drop_oldest
                        .fetch_add(1, Ordering::Relaxed);
                    self.commit.op_done();
                }
                // reject_new, or nothing left to drop (size <= max was checked,
                // so only a racing accounting update gets here): refuse.
                None => {
                    self.dropped.full_reject_new.fetch_add(1, Ordering::Relaxed);
                    return Err(OutboxError::Full {
                        needed: used + size - max,
                        max_bytes: max,
                    });
                }
            }
        }
    }

    /// Takes records that left the store out of the unsaved ones (a reopen
    /// must not put them back).
    fn forget_unsaved(&self, keys: impl IntoIterator<Item = Key>) {
        let mut unsaved = self.unsaved.lock();
        if unsaved.is_empty() {
            return;
        }
        for k in keys {
            if k.0 == self.boot {
                unsaved.remove(&k.1);
            }
        }
    }

    /// Moves one record to the dead letters in one sled transaction.
    ///
    /// A dead letter is larger than its record (reason and time added), so
    /// the move can take the outbox past `max_bytes`; the oldest dead
    /// letters then go (counted as full drops of dead letters), never a
    /// record still to be sent, whatever `when_full` says. Dropping every
    /// dead letter always suffices: the records alone were within budget.
    fn move_to_dead(&self, key: Key, reason: &str) -> Result<(), OutboxError> {
        use sled::Transactional;
        self.forget_unsaved([key]);
        let kb = key.to_bytes();
        let now = SystemTime::now();
        // The append lock, as in an append: make_room must not count space
        // this move is about to take.
        let _seq = self.append.lock();
        let guard = self.store.read();
        let st = guard.as_ref().ok_or_else(|| self.unavailable_now())?;
        let moved = (&st.records, &st.dead)
            .transaction(|(rec, dead)| {
                let Some(v) = rec.remove(&kb)? else {
                    return Ok(None);
                };
                let dv = match record::decode(key, &v) {
                    Ok(e) => record::encode_dead(&e, now, reason),
                    // Keep the raw value: an operator can still read it in the export.
                    Err(_) => record::encode_dead(
                        &Entry {
                            key,
                            stream: String::new(),
                            appended_at: SystemTime::UNIX_EPOCH,
                            record: v.to_vec(),
                        },
                        now,
                        reason,
                    ),
                };
                let sizes = (entry_size(&kb, &v), entry_size(&kb, &dv));
                dead.insert(&kb, dv)?;
                Ok(Some(sizes))
            })
            .map_err(|e: sled::transaction::TransactionError<()>| match e {
                sled::transaction::TransactionError::Storage(source) => {
                    self.write_failed("dead letter", source)
                }
                // Nothing in the closure aborts.
                sled::transaction::TransactionError::Abort(()) => OutboxError::Corrupt {
                    key: key.to_string(),
                    reason: "dead letter transaction aborted".into(),
                },
            })?;
        if let Some((old, new)) = moved {
            self.records_n.fetch_sub(1, Ordering::SeqCst);
            self.records_bytes.fetch_sub(old, Ordering::SeqCst);
            self.dead_n.fetch_add(1, Ordering::SeqCst);
            self.dead_bytes.fetch_add(new, Ordering::SeqCst);
            self.dead_lettered_total.fetch_add(1, Ordering::Relaxed);
            self.commit.op_done();
            self.trim_dead(st)?;
        }
        Ok(())
    }

    /// Drops the oldest dead letters while the outbox is over `max_bytes`.
    fn trim_dead(&self, st: &Store) -> Result<(), OutboxError> {
        while self.used_bytes() > self.cfg.max_bytes && self.drop_oldest_dead_letter(st)? {}
        Ok(())
    }

    /// Records + dead letters, the bytes `max_bytes` bounds.
    fn used_bytes(&self) -> u64 {
        self.records_bytes.load(Ordering::SeqCst) + self.dead_bytes.load(Ordering::SeqCst)
    }

    /// Drops the oldest dead letter to make room (counted as a full drop);
    /// false when there is none.
    fn drop_oldest_dead_letter(&self, st: &Store) -> Result<bool, OutboxError> {
        let Some((k, v)) = st
            .dead
            .pop_min()
            .map_err(|e| self.write_failed("drop dead letter", e))?
        else {
            return Ok(false);
        };
        self.dead_n.fetch_sub(1, Ordering::SeqCst);
        self.dead_bytes
            .fetch_sub(entry_size(&k, &v), Ordering::SeqCst);
        self.dropped
            .full_drop_dead_letter
            .fetch_add(1, Ordering::Relaxed);
        self.commit.op_done();
        Ok(true)
    }

    fn stats(&self) -> OutboxStats {
        // Never waits on the store: while a broken database is being reopened
        // (on a full disk that can take long) /metrics and /v1/status still
        // answer, without the oldest record's age.
        let oldest_appended_at = match self.store.try_read() {
            Some(guard) => match guard.as_ref().map(|st| st.records.first()) {
                Some(Ok(Some((_, v)))) => record::appended_at(&v).ok(),
                _ => None,
            },
            None => None,
        };
        let held = self.held.stats();
        let records = self.records_n.load(Ordering::SeqCst);
        // While holding, the store's first record may be acknowledged already.
        let oldest_appended_at = match (held.holding, records) {
            (true, 0) => held.oldest_appended_at,
            _ => oldest_appended_at.or(held.oldest_appended_at),
        };
        let mut dropped = self.dropped.snapshot();
        dropped.read_only = held.dropped;
        let c = &self.commit;
        let last_ns = c.last_flush_ns.load(Ordering::Relaxed);
        OutboxStats {
            boot: self.boot,
            records,
            bytes: self.records_bytes.load(Ordering::SeqCst),
            oldest_appended_at,
            oldest_age: oldest_appended_at
                .map(|t| SystemTime::now().duration_since(t).unwrap_or_default()),
            dead_letters: self.dead_n.load(Ordering::SeqCst),
            dead_letter_bytes: self.dead_bytes.load(Ordering::SeqCst),
            max_bytes: self.cfg.max_bytes,
            appended_total: self.appended_total.load(Ordering::Relaxed),
            acked_total: self.acked_total.load(Ordering::Relaxed),
            dead_lettered_total: self.dead_lettered_total.load(Ordering::Relaxed),
            dropped,
            held,
            flushes_total: c.flushes_total.load(Ordering::Relaxed),
            flush_errors_total: c.flush_errors_total.load(Ordering::Relaxed),
            quarantined_total: self.quarantined_total,
            unavailable: c.broken().map(|b| b.reason),
            reopens_total: self.reopens_total.load(Ordering::Relaxed),
            lost_total: self.lost_total.load(Ordering::Relaxed),
            last_flush_duration: (c.flushes_total.load(Ordering::Relaxed) > 0)
                .then(|| Duration::from_nanos(last_ns)),
        }
    }
}
