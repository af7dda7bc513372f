//! The flusher's side of the store: group commits and, after a write error,
//! reopening the database (see "A full disk, an I/O error" in the module
//! header).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::commit::{Attempt, Broken, Disk, Target};
use super::degraded;
use super::record::{KEY_LEN, Key};
use super::{OutboxError, Shared, entry_size, open};
use crate::backoff::Backoff;

/// The trees appends and reads go to (replaced by a reopen).
pub struct Store {
    pub records: sled::Tree,
    pub dead: sled::Tree,
}

/// First wait before trying again after a failure; the ceiling doubles up
/// to [`RETRY_MAX`] (the daemon's one [`Backoff`]).
const RETRY_MIN: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Owned by the flusher thread.
pub struct Flusher {
    shared: Arc<Shared>,
    /// None once a broken database was closed and not yet reopened.
    disk: Option<Disk>,
    next_try: Instant,
    backoff: Backoff,
    /// Dead-letter moves the disk refused, made after the reopen that ends holding.
    dead_later: Vec<(Key, String)>,
}

impl Flusher {
    pub fn new(shared: Arc<Shared>, disk: Disk) -> Flusher {
        Flusher {
            shared,
            disk: Some(disk),
            next_try: Instant::now(),
            backoff: Backoff::new(RETRY_MIN, RETRY_MAX),
            dead_later: Vec::new(),
        }
    }

    fn failed(&mut self, e: OutboxError, reopen: bool) -> Attempt {
        self.shared.held.failed(&e);
        self.shared.commit.set_broken(e.to_string(), reopen);
        self.next_try = Instant::now() + self.backoff.next_delay();
        Attempt::Failed(e)
    }

    /// Closes the broken database and opens it again; puts back the
    /// records appended since the last good commit.
    fn reopen(&mut self) -> Result<(), OutboxError> {
        let s = &*self.shared;
        // Appends wait on this lock; the order (append, then store) is theirs.
        let seq = s.append.lock();
        let mut store = s.store.write();
        // What the broken database held in memory only. Never read from
        // it: sled can spin for good there (see `Shared::unsaved`).
        let unsaved: Vec<(sled::IVec, sled::IVec)> = s
            .unsaved
            .lock()
            .iter()
            .map(|(seq, v)| {
                (
                    sled::IVec::from(&Key(s.boot, *seq).to_bytes()[..]),
                    v.clone(),
                )
            })
            .collect();
        close_in_background((store.take(), self.disk.take()));
        let mut attempt = open::load(&s.dir, &s.cfg);
        for _ in 0..40 {
            if !matches!(attempt, Err(open::Failure::InUse(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(25));
            attempt = open::load(&s.dir, &s.cfg);
        }
        let loaded = attempt.map_err(|f| f.into_error(&s.dir))?;
        let mut disk = Disk::new(loaded.db.clone(), &s.dir)?;
        let (mut n, mut bytes) = (loaded.records_n, loaded.records_bytes);
        let mut put_back = 0u64;
        for (k, v) in &unsaved {
            if k.len() != KEY_LEN {
                continue;
            }
            let had = loaded
                .records
                .insert(k, v.clone())
                .map_err(OutboxError::db("put back"))?;
            if had.is_none() {
                n += 1;
                bytes += entry_size(k, v);
                put_back += 1;
            }
        }
        let written = s.held.write_into(&loaded.records)?;
        n = (n + written.added).saturating_sub(written.removed);
        bytes = (bytes + written.added_bytes).saturating_sub(written.removed_bytes);
        disk.flush()?;
        self.dead_later = s.held.finish(&written);
        s.records_n.store(n, Ordering::SeqCst);
        s.records_bytes.store(bytes, Ordering::SeqCst);
        s.dead_n.store(loaded.dead_n, Ordering::SeqCst);
        s.dead_bytes.store(loaded.dead_bytes, Ordering::SeqCst);
        s.durable_seq.store(*seq, Ordering::SeqCst);
        s.unsaved.lock().clear();
        s.reopens_total.fetch_add(1, Ordering::Relaxed);
        *store = Some(Store {
            records: loaded.records,
            dead: loaded.dead,
        });
        self.disk = Some(disk);
        tracing::info!(
            path = %s.dir.display(),
            records = n,
            put_back,
            "outbox database reopened after a write error"
        );
        Ok(())
    }

    /// While the disk refuses writes: one write of our own says whether it
    /// takes them again. A database with nothing left to send is closed,
    /// so that nothing holds the file system (see degraded.rs).
    fn still_refused(&mut self) -> Option<OutboxError> {
        let s = &*self.shared;
        let e = degraded::probe(&s.dir).err()?;
        if self.disk.is_some() && s.held.may_close(s.records_n.load(Ordering::SeqCst)) {
            let mut store = s.store.write();
            close_in_background((store.take(), self.disk.take()));
            s.held.store_closed();
        }
        Some(e)
    }

    /// The dead-letter moves held back while the disk refused writes.
    fn move_dead_later(&mut self) {
        for (key, reason) in std::mem::take(&mut self.dead_later) {
            if let Err(e) = self.shared.move_to_dead(key, &reason) {
                tracing::warn!(%key, error = %e, "outbox: a dead letter held back while the disk was read-only stays a record");
            }
        }
    }
}

/// Every sled handle must go before sled's file lock (and the file system)
/// is free. The last one flushes as it drops, and on a broken disk that can
/// block for long: they drop on a thread of their own, and an open after
/// this waits for the lock only so long (a later try goes on).
fn close_in_background(old: (Option<Store>, Option<Disk>)) {
    if let Err(e) = std::thread::Builder::new()
        .name("outbox-close".into())
        .spawn(move || drop(old))
    {
        tracing::warn!(error = %e, "outbox: no thread to close the broken database on");
    }
}

impl Target for Flusher {
    fn commit(&mut self, broken: Option<&Broken>) -> Attempt {
        if let Some(b) = broken {
            if Instant::now() < self.next_try {
                return Attempt::Waiting;
            }
            let holding = self.shared.held.holding();
            if holding && let Some(e) = self.still_refused() {
                return self.failed(e, true);
            }
            // Only a reopen stores the held records.
            if (b.reopen || self.disk.is_none() || holding)
                && let Err(e) = self.reopen()
            {
                return self.failed(e, true);
            }
            self.move_dead_later();
        }
        // Every seq below this is in the flush that starts now.
        let seq = *self.shared.append.lock();
        let Some(disk) = self.disk.as_mut() else {
            let e = OutboxError::Unavailable("the database is closed".into());
            return self.failed(e, true);
        };
        if let Err(e) = disk.flush_log() {
            return self.failed(e, true);
        }
        if let Err(e) = disk.sync_blobs() {
            return self.failed(e, false);
        }
        self.shared.durable_seq.store(seq, Ordering::SeqCst);
        {
            // Everything below `seq` is on the disk now.
            let mut unsaved = self.shared.unsaved.lock();
            let rest = unsaved.split_off(&seq);
            *unsaved = rest;
        }
        self.backoff.reset();
        Attempt::Done
    }
}
