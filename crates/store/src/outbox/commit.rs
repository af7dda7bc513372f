//! Group commit: one background thread makes everything written so far
//! durable, every `flush_interval`, early after `flush_records` appends, or
//! at once when someone waits in `sync()`.
//!
//! Progress is counted in *ops* (appends, acks, dead letters, drops): a
//! writer bumps `ops` after its sled write returned, the flusher reads `ops`
//! before `Db::flush`, so every op counted in that number is inside the
//! flush, and after the fsync `durable = that number`.
//!
//! A failed commit marks the store *broken* with its reason: appends and
//! `sync()` are refused at once (the caller hears it, `/readyz` says it),
//! and the flusher keeps trying to recover at a growing interval (see
//! [`Target`]). The error is logged at the first failure, then at most
//! every [`LOG_EVERY`] with the number of failures in between.

use std::collections::HashSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::OutboxError;

/// Shared between writers, waiters and the flusher thread.
pub struct Commit {
    /// Mutations issued so far (only grows).
    pub ops: AtomicU64,
    /// Appends since the flusher last started a flush.
    pub since_flush: AtomicUsize,
    pub flush_records: usize,
    pub interval: Duration,
    state: Mutex<State>,
    /// Wakes the flusher.
    wake_flusher: Condvar,
    /// Wakes `sync()` waiters after each flush attempt.
    flushed: Condvar,
    /// The same for async waiters ([`Commit::durable`]): bumped under the
    /// state lock wherever `flushed` is notified, so a waiter that
    /// subscribed before it looked at the state misses no attempt.
    attempts: tokio::sync::watch::Sender<u64>,
    pub flushes_total: AtomicU64,
    pub flush_errors_total: AtomicU64,
    pub last_flush_ns: AtomicU64,
    /// Fast check for writers; the reason lives in `State::broken`.
    broken: AtomicBool,
    /// The flusher sleeps until the next op (nothing was pending): the op
    /// that ends the sleep wakes it. An idle outbox has no timer.
    idle: AtomicBool,
}

/// How often a store that keeps failing is logged at ERROR.
pub const LOG_EVERY: Duration = Duration::from_secs(30);

/// Why the store cannot take writes now, and what recovers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Broken {
    pub reason: String,
    /// sled itself failed (it keeps its write error for good): only
    /// reopening the database recovers. Otherwise a later flush may succeed.
    pub reopen: bool,
}

/// What the flusher commits to.
pub trait Target {
    /// One group commit (or, while broken, one recovery try). `Waiting`:
    /// broken and not yet time to try again; nothing was attempted.
    fn commit(&mut self, broken: Option<&Broken>) -> Attempt;
}

pub enum Attempt {
    Done,
    Failed(OutboxError),
    Waiting,
}

#[derive(Default)]
struct State {
    /// Ops known durable.
    durable: u64,
    /// Flush attempts started.
    started: u64,
    /// The latest failed attempt and its error.
    failed: Option<(u64, String)>,
    broken: Option<Broken>,
    wake: bool,
    shutdown: bool,
    stopped: bool,
}

impl Commit {
    pub fn new(interval: Duration, flush_records: usize) -> Commit {
        Commit {
            ops: AtomicU64::new(0),
            since_flush: AtomicUsize::new(0),
            flush_records,
            interval,
            state: Mutex::new(State::default()),
            wake_flusher: Condvar::new(),
            flushed: Condvar::new(),
            attempts: tokio::sync::watch::Sender::new(0),
            flushes_total: AtomicU64::new(0),
            flush_errors_total: AtomicU64::new(0),
            last_flush_ns: AtomicU64::new(0),
            broken: AtomicBool::new(false),
            idle: AtomicBool::new(false),
        }
    }

    /// Why writes are refused now (None: the store works).
    pub fn broken(&self) -> Option<Broken> {
        if !self.broken.load(Ordering::Relaxed) {
            return None;
        }
        self.state.lock().broken.clone()
    }

    /// Marks the store broken (a write or a commit failed) and wakes the
    /// flusher to recover it. A reason that asks for a reopen is kept over
    /// one that does not.
    pub fn set_broken(&self, reason: String, reopen: bool) {
        let mut st = self.state.lock();
        let reopen = reopen || st.broken.as_ref().is_some_and(|b| b.reopen);
        st.broken = Some(Broken { reason, reopen });
        self.broken.store(true, Ordering::SeqCst);
        st.wake = true;
        self.wake_flusher.notify_one();
    }

    /// The error every write gets while the store is broken.
    pub fn check(&self) -> Result<(), OutboxError> {
        match self.broken() {
            None => Ok(()),
            Some(b) => Err(OutboxError::Unavailable(b.reason)),
        }
    }

    /// Counts a mutation whose sled write has returned.
    pub fn op_done(&self) {
        self.ops.fetch_add(1, Ordering::SeqCst);
        // The flusher sets `idle` under the state lock and then reads `ops`
        // before it waits; the lock taken here is only had once it waits.
        // So either it saw this op, or this notify reaches it.
        if self.idle.load(Ordering::SeqCst) && self.idle.swap(false, Ordering::SeqCst) {
            let _st = self.state.lock();
            self.wake_flusher.notify_one();
        }
    }

    /// Counts an append; wakes the flusher when a burst reaches `flush_records`.
    pub fn appended(&self) {
        self.op_done();
        if self.since_flush.fetch_add(1, Ordering::Relaxed) + 1 == self.flush_records {
            self.wake();
        }
    }

    fn wake(&self) {
        self.state.lock().wake = true;
        self.wake_flusher.notify_one();
    }

    /// Blocks until every op issued before the call is durable.
    pub fn sync(&self) -> Result<(), OutboxError> {
        self.wait_durable(true)
    }

    /// Blocks until every op issued before the call is durable, without
    /// asking for an early commit (`early` = false): the next group commit
    /// covers it, so many waiters cost no extra fsync.
    pub fn wait_durable(&self, early: bool) -> Result<(), OutboxError> {
        let target = self.ops.load(Ordering::SeqCst);
        let mut st = self.state.lock();
        let entered = match entry(&st, target) {
            Ok(entered) => entered,
            Err(done) => return done,
        };
        if early {
            st.wake = true;
            self.wake_flusher.notify_one();
        }
        loop {
            if let Some(done) = settled(&st, target, entered) {
                return done;
            }
            self.flushed.wait(&mut st);
        }
    }

    /// [`Commit::wait_durable`] without asking for an early commit, for
    /// async callers: it awaits the flusher's attempts instead of blocking
    /// a thread, so any number of waiters costs no thread (an HTTP request
    /// waiting for its records' commit).
    pub async fn durable(&self) -> Result<(), OutboxError> {
        // Subscribed before the state is read: an attempt that ends after
        // this marks the channel changed, so none is missed.
        let mut attempts = self.attempts.subscribe();
        let target = self.ops.load(Ordering::SeqCst);
        let entered = match entry(&self.state.lock(), target) {
            Ok(entered) => entered,
            Err(done) => return done,
        };
        loop {
            // The guard goes with this statement, before any await.
            let done = settled(&self.state.lock(), target, entered);
            if let Some(done) = done {
                return done;
            }
            if attempts.changed().await.is_err() {
                return Err(OutboxError::Closed);
            }
        }
    }

    /// Wakes every waiter after a flush attempt (or the stop).
    fn notify_flushed(&self) {
        self.flushed.notify_all();
        self.attempts.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Asks the flusher for a last flush and to stop.
    pub fn shutdown(&self) {
        self.state.lock().shutdown = true;
        self.wake_flusher.notify_one();
    }

    /// The flusher thread's body; returns the last flush's result.
    pub fn run(&self, target_store: &mut dyn Target) -> Result<(), OutboxError> {
        let mut last = Ok(());
        let mut next = Instant::now() + self.interval;
        let mut log = FailureLog::default();
        loop {
            let (shutdown, started, broken) = {
                let mut st = self.state.lock();
                while !st.wake && !st.shutdown {
                    let now = Instant::now();
                    if now >= next {
                        break;
                    }
                    self.wake_flusher.wait_for(&mut st, next - now);
                }
                st.wake = false;
                let target = self.ops.load(Ordering::SeqCst);
                if target <= st.durable && st.broken.is_none() {
                    // Idle: no fsync, so an idle device does not wear its flash.
                    if st.shutdown {
                        st.stopped = true;
                        self.notify_flushed();
                        return last;
                    }
                    // Sleep until the next op: an idle device wakes for nothing.
                    self.idle.store(true, Ordering::SeqCst);
                    while !st.wake
                        && !st.shutdown
                        && st.broken.is_none()
                        && self.ops.load(Ordering::SeqCst) <= st.durable
                    {
                        self.wake_flusher.wait(&mut st);
                    }
                    self.idle.store(false, Ordering::SeqCst);
                    // What comes now is grouped for one interval, as always.
                    next = Instant::now() + self.interval;
                    continue;
                }
                st.started += 1;
                (st.shutdown, (st.started, target), st.broken.clone())
            };
            let (attempt, target) = started;
            self.since_flush.store(0, Ordering::Relaxed);
            let t0 = Instant::now();
            let r = target_store.commit(broken.as_ref());
            let took = t0.elapsed();
            next = Instant::now() + self.interval;
            let mut st = self.state.lock();
            match r {
                Attempt::Done => {
                    self.flushes_total.fetch_add(1, Ordering::Relaxed);
                    self.last_flush_ns.store(
                        u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                    st.durable = st.durable.max(target);
                    if st.broken.take().is_some() {
                        self.broken.store(false, Ordering::SeqCst);
                        tracing::info!(
                            failed_commits = log.since_ok,
                            "outbox recovered: storing again"
                        );
                    }
                    log.since_ok = 0;
                    last = Ok(());
                }
                Attempt::Failed(e) => {
                    self.flush_errors_total.fetch_add(1, Ordering::Relaxed);
                    log.failed(&e);
                    st.failed = Some((attempt, e.to_string()));
                    if st.broken.is_none() {
                        // The target did not say what recovers it: a later flush may.
                        st.broken = Some(Broken {
                            reason: e.to_string(),
                            reopen: false,
                        });
                        self.broken.store(true, Ordering::SeqCst);
                    }
                    last = Err(e);
                }
                Attempt::Waiting => {}
            }
            if shutdown {
                st.stopped = true;
                self.notify_flushed();
                return last;
            }
            self.notify_flushed();
        }
    }
}

/// Where a wait for `target` starts: `Ok(attempts started so far)`, or
/// `Err(the answer)` when it is already durable or the store is broken.
fn entry(st: &State, target: u64) -> Result<u64, Result<(), OutboxError>> {
    if st.durable >= target {
        return Err(Ok(()));
    }
    if let Some(b) = &st.broken {
        return Err(Err(OutboxError::Unavailable(b.reason.clone())));
    }
    Ok(st.started)
}

/// The answer to a wait for `target` that began when `entered` attempts
/// had started, once there is one.
fn settled(st: &State, target: u64, entered: u64) -> Option<Result<(), OutboxError>> {
    if st.durable >= target {
        return Some(Ok(()));
    }
    // An attempt started after we entered read `ops` after us, so it
    // covered our target: its failure is ours.
    if let Some((n, e)) = &st.failed
        && *n > entered
    {
        return Some(Err(OutboxError::Flush(e.clone())));
    }
    if let Some(b) = &st.broken {
        return Some(Err(OutboxError::Unavailable(b.reason.clone())));
    }
    if st.stopped {
        return Some(Err(OutboxError::Closed));
    }
    None
}

/// Rate-limits the flusher's ERROR lines: a disk that stays full would
/// otherwise log at every attempt.
#[derive(Default)]
struct FailureLog {
    last: Option<Instant>,
    suppressed: u64,
    /// Failed attempts since the last good commit.
    since_ok: u64,
}

impl FailureLog {
    fn failed(&mut self, e: &OutboxError) {
        self.since_ok += 1;
        let due = self.last.is_none_or(|t| t.elapsed() >= LOG_EVERY);
        if self.since_ok == 1 || due {
            tracing::error!(
                error = %e,
                suppressed = self.suppressed,
                failed_commits = self.since_ok,
                "outbox cannot store; retrying"
            );
            self.last = Some(Instant::now());
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
    }
}

/// What a flush must reach: sled's log, then the disk itself.
pub struct Disk {
    pub db: sled::Db,
    dir: PathBuf,
    /// sled's log file, opened once for fsync.
    log: File,
    /// Blob files already fsynced (sled writes a value above ~1/4 of a
    /// segment to its own file under blobs/ and never fsyncs it).
    synced_blobs: HashSet<std::ffi::OsString>,
}

impl Disk {
    pub fn new(db: sled::Db, dir: &Path) -> Result<Disk, OutboxError> {
        let p = dir.join("db");
        let log = File::open(&p).map_err(|source| OutboxError::Io {
            op: "open for fsync",
            path: p,
            source,
        })?;
        Ok(Disk {
            db,
            dir: dir.to_path_buf(),
            log,
            synced_blobs: HashSet::new(),
        })
    }

    /// `Db::flush` writes sled's buffers and calls sync_file_range, which
    /// neither flushes the drive's cache nor the file's metadata (sled issues
    /// 1351, 1452); fdatasync does both.
    /// sled's log to the disk. A failure here needs a reopen: sled keeps
    /// its write error for good, and a failed fsync may have dropped the
    /// dirty pages, so a later fsync that passes would prove nothing.
    pub fn flush_log(&mut self) -> Result<(), OutboxError> {
        self.db.flush().map_err(OutboxError::db("flush"))?;
        self.log.sync_data().map_err(|source| OutboxError::Io {
            op: "fsync",
            path: self.dir.join("db"),
            source,
        })
    }

    /// Both steps of a commit (used at open).
    pub fn flush(&mut self) -> Result<(), OutboxError> {
        self.flush_log()?;
        self.sync_blobs()
    }

    /// New blob files to the disk. A failure here (say, no descriptor left
    /// to open one) leaves sled sound: the next commit tries again.
    pub fn sync_blobs(&mut self) -> Result<(), OutboxError> {
        let dir = self.dir.join("blobs");
        let io = |op, path: &Path| {
            let path = path.to_path_buf();
            move |source| OutboxError::Io { op, path, source }
        };
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io("read", &dir)(e)),
        };
        let mut new = false;
        let mut present = HashSet::new();
        for e in rd {
            let e = e.map_err(io("read", &dir))?;
            let name = e.file_name();
            if !self.synced_blobs.contains(&name) {
                let p = e.path();
                match File::open(&p) {
                    Ok(f) => f.sync_all().map_err(io("fsync", &p))?,
                    // sled collected it meanwhile.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(io("open", &p)(e)),
                }
                new = true;
            }
            present.insert(name);
        }
        self.synced_blobs = present;
        if new {
            sync_dir(&dir)?;
        }
        Ok(())
    }
}

/// fsyncs a directory, so the names in it (new files, renames) are durable.
pub fn sync_dir(dir: &Path) -> Result<(), OutboxError> {
    crate::fsio::fsync_dir(dir).map_err(|source| OutboxError::Io {
        op: "fsync directory",
        path: dir.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;

    /// Counts the commits it is asked for.
    struct Counting(Arc<AtomicU64>);

    impl Target for Counting {
        fn commit(&mut self, _broken: Option<&Broken>) -> Attempt {
            self.0.fetch_add(1, Ordering::SeqCst);
            Attempt::Done
        }
    }

    fn start(interval: Duration) -> (Arc<Commit>, Arc<AtomicU64>, std::thread::JoinHandle<()>) {
        let c = Arc::new(Commit::new(interval, 1000));
        let n = Arc::new(AtomicU64::new(0));
        let (c2, n2) = (Arc::clone(&c), Arc::clone(&n));
        let h = std::thread::spawn(move || {
            c2.run(&mut Counting(n2)).unwrap();
        });
        (c, n, h)
    }

    /// Every op that ends an idle sleep is made durable without anyone
    /// asking early: the wake-up is never lost, however the op and the
    /// flusher's going to sleep interleave.
    #[test]
    fn an_op_after_idle_wakes_the_flusher() {
        let (c, n, h) = start(Duration::from_micros(200));
        let (tx, rx) = mpsc::channel();
        let c2 = Arc::clone(&c);
        std::thread::spawn(move || {
            for i in 0..2000u32 {
                c2.op_done();
                c2.wait_durable(false).unwrap();
                if i % 7 == 0 {
                    std::thread::yield_now();
                }
            }
            tx.send(()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("an op after an idle flusher was never made durable");
        assert!(n.load(Ordering::SeqCst) >= 1);
        c.shutdown();
        h.join().unwrap();
    }

    /// Async waiters hold no thread: a thousand of them on a
    /// current-thread runtime all end with the one group commit that
    /// covers their ops, and none misses it however the ops and the
    /// commits interleave.
    #[test]
    fn async_waiters_end_with_the_commit_that_covers_them() {
        let (c, n, h) = start(Duration::from_millis(20));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let mut waits = tokio::task::JoinSet::new();
            for _ in 0..1000 {
                c.op_done();
                let c = Arc::clone(&c);
                waits.spawn(async move { c.durable().await });
            }
            while let Some(r) = waits.join_next().await {
                r.unwrap().unwrap();
            }
            // Nothing new: answered at once.
            c.durable().await.unwrap();
        });
        assert!(n.load(Ordering::SeqCst) >= 1);
        c.shutdown();
        h.join().unwrap();
        // Stopped: a new op's waiter hears it.
        c.op_done();
        assert!(matches!(rt.block_on(c.durable()), Err(OutboxError::Closed)));
    }
}
