//! When the disk refuses writes: a file system that turned read-only (ext4
//! with `errors=remount-ro` after a media error) or another I/O error on
//! the store. The outbox then *holds*:
//!
//! - New records are kept in memory, up to `memory_when_read_only` bytes
//!   (keys, headers and record bytes); beyond it `when_full` picks the ones
//!   that go, each counted as dropped with reason `read_only`. Their keys
//!   continue the seq under the append lock, so every held key is above
//!   every key in the store: a read gives the store's records, then the
//!   held ones, in key order, as before.
//! - The records stored before stay readable through the database as it
//!   was opened (sled reads a read-only file system but cannot open one),
//!   so nothing is reopened while the disk refuses writes.
//! - Acknowledgements and dead-letter moves cannot be written: they are
//!   kept here (a watermark over the store's keys and the keys above it)
//!   and applied when the store opens again. A crash before that sends
//!   those records again; the fleet drops them by id.
//! - The flusher tries a write of its own (a file created, written,
//!   fsynced and removed) at the outbox's retry interval. Once every stored
//!   record is acknowledged the database is closed, so that the file
//!   system can be unmounted, checked and mounted again (a file held open
//!   for writing keeps it busy, and ext4 clears an error's read-only state
//!   only at unmount).
//! - When the write passes, the database is reopened and the held records
//!   are written in order, the acknowledged ones removed, in one commit;
//!   appends go to the store again.
//!
//! A full disk (ENOSPC, EDQUOT) is not held: the outbox refuses records
//! until space returns (the module header, "A full disk").

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;

use super::record::{self, Entry, KEY_LEN, Key};
use super::{OutboxConfig, OutboxError, Shared, WhenFull, open, range_after};

/// The file the flusher writes to learn whether the disk takes writes again.
pub const PROBE_FILE: &str = "write-probe";

/// Records and acknowledgements kept in memory while the store cannot write.
pub struct Held {
    max_bytes: u64,
    when_full: WhenFull,
    /// Fast check for appends and reads; set and cleared with `state` held.
    holding: AtomicBool,
    /// A reopen wrote the held records: appends may go to the new store
    /// although the commit still says broken until its next flush.
    reopened: AtomicBool,
    dropped: AtomicU64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The last error was EROFS (else another I/O error).
    read_only: bool,
    since: Option<SystemTime>,
    records: BTreeMap<Key, sled::IVec>,
    bytes: u64,
    acked: Acked,
    /// Records the uplink refused meanwhile, moved to the dead letters later.
    dead: BTreeMap<Key, String>,
    /// The database was closed (every stored record acknowledged).
    store_closed: bool,
    /// A drop was logged in this episode.
    drop_logged: bool,
}

/// Stored records acknowledged while holding: every key up to `upto` that
/// the store holds, and the keys in `above`.
#[derive(Default)]
struct Acked {
    upto: Option<Key>,
    above: BTreeSet<Key>,
}

impl Acked {
    fn contains(&self, k: Key) -> bool {
        self.upto.is_some_and(|u| k <= u) || self.above.contains(&k)
    }
}

/// What the outbox reports while holding.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeldStats {
    pub holding: bool,
    /// The file system is read-only (EROFS); else another I/O error.
    pub read_only: bool,
    pub records: u64,
    pub bytes: u64,
    pub max_bytes: u64,
    /// Records dropped beyond `max_bytes` since start.
    pub dropped: u64,
    pub since: Option<SystemTime>,
    /// The database was closed: the disk can be unmounted.
    pub store_closed: bool,
    pub oldest_appended_at: Option<SystemTime>,
}

/// What a reopen did with the held records.
#[derive(Debug, Default)]
pub struct Written {
    pub added: u64,
    pub added_bytes: u64,
    pub removed: u64,
    pub removed_bytes: u64,
}

/// Whether a failed write is held (`Some(read_only)`) or refused (`None`:
/// a full disk, or not the disk at all).
fn kind(e: &OutboxError) -> Option<bool> {
    let io = match e {
        OutboxError::Io { source, .. } => source,
        OutboxError::Db {
            source: sled::Error::Io(io),
            ..
        }
        | OutboxError::Open {
            source: sled::Error::Io(io),
            ..
        } => io,
        _ => return None,
    };
    // By kind: sled hands back a copy of its first write error that keeps
    // the kind but not the errno.
    use std::io::ErrorKind;
    match io.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded => None,
        ErrorKind::ReadOnlyFilesystem => Some(true),
        _ => Some(false),
    }
}

/// One write of our own in the outbox's directory: whether the disk takes
/// writes again. Nothing stays open after it.
pub fn probe(dir: &Path) -> Result<(), OutboxError> {
    let p = dir.join(PROBE_FILE);
    let attempt = || -> std::io::Result<()> {
        // A file system mounted afresh may not hold the directory yet.
        std::fs::create_dir_all(dir)?;
        let mut f = std::fs::File::create(&p)?;
        f.write_all(b"outpost\n")?;
        f.sync_all()?;
        drop(f);
        std::fs::remove_file(&p)
    };
    attempt().map_err(|source| OutboxError::Io {
        op: "write probe",
        path: p.clone(),
        source,
    })
}

fn size(v: &[u8]) -> u64 {
    (KEY_LEN + v.len()) as u64
}

fn after(k: Option<Key>) -> (Bound<Key>, Bound<Key>) {
    match k {
        Some(k) => (Bound::Excluded(k), Bound::Unbounded),
        None => (Bound::Unbounded, Bound::Unbounded),
    }
}

impl Held {
    pub fn new(cfg: &OutboxConfig) -> Held {
        Held {
            max_bytes: cfg.memory_when_read_only,
            when_full: cfg.when_full,
            holding: AtomicBool::new(false),
            reopened: AtomicBool::new(false),
            dropped: AtomicU64::new(0),
            state: Mutex::new(State::default()),
        }
    }

    pub fn holding(&self) -> bool {
        self.holding.load(Ordering::SeqCst)
    }

    /// The store was just reopened with the held records in it.
    pub fn reopened(&self) -> bool {
        self.reopened.load(Ordering::SeqCst)
    }

    /// A write or commit failed with `e`: I/O trouble starts holding (a
    /// failure of another kind while holding keeps holding: the records
    /// in memory have nowhere else to go).
    pub fn failed(&self, e: &OutboxError) {
        self.reopened.store(false, Ordering::SeqCst);
        let Some(read_only) = kind(e) else {
            return;
        };
        let mut st = self.state.lock();
        st.read_only = read_only;
        if !self.holding() {
            st.since = Some(SystemTime::now());
            st.store_closed = false;
            st.drop_logged = false;
            self.holding.store(true, Ordering::SeqCst);
            tracing::error!(
                error = %e,
                read_only,
                memory_when_read_only = self.max_bytes,
                "outbox: the disk refuses writes; new records are held in memory and stored records are still sent, until the disk takes writes again"
            );
        }
    }

    /// Keeps one record in memory under `key` (the append lock's next seq).
    /// Err: it was refused (`reject_new`, or larger than the bound); with
    /// `drop_oldest` the oldest held records make room.
    pub fn hold(&self, key: Key, value: sled::IVec) -> Result<Key, OutboxError> {
        let need = size(&value);
        let mut st = self.state.lock();
        while st.bytes + need > self.max_bytes {
            let victim = match self.when_full {
                WhenFull::DropOldest => st.records.pop_first(),
                WhenFull::RejectNew => None,
            };
            self.dropped.fetch_add(1, Ordering::Relaxed);
            if !st.drop_logged {
                st.drop_logged = true;
                tracing::warn!(
                    memory_when_read_only = self.max_bytes,
                    when_full = ?self.when_full,
                    "outbox: memory for records while the disk is read-only is spent; dropping records (outpost_outbox_dropped_total{{reason=\"read_only\"}})"
                );
            }
            match victim {
                Some((k, v)) => {
                    st.bytes -= size(&v);
                    st.dead.remove(&k);
                }
                None => {
                    return Err(OutboxError::Unavailable(format!(
                        "the disk refuses writes and memory_when_read_only ({} bytes) is spent",
                        self.max_bytes
                    )));
                }
            }
        }
        st.bytes += need;
        st.records.insert(key, value);
        Ok(key)
    }

    /// Up to `limit` records with key > `from`, oldest first: the store's
    /// not yet acknowledged, then the held ones. A value that cannot be
    /// decoded goes to the dead letters later.
    pub fn pending(
        &self,
        store: Option<&sled::Tree>,
        from: Option<Key>,
        limit: usize,
    ) -> Result<Vec<Entry>, OutboxError> {
        let mut out = Vec::new();
        if let Some(store) = store {
            // Copied out: appends wait on this lock, a read of the store may
            // wait on the disk.
            let (upto, skip) = {
                let st = self.state.lock();
                let mut skip = st.acked.above.clone();
                skip.extend(st.dead.keys().copied());
                (st.acked.upto, skip)
            };
            let start = match (from, upto) {
                (Some(f), Some(u)) => Some(f.max(u)),
                (f, u) => f.or(u),
            };
            for kv in store.range(range_after(start)) {
                if out.len() >= limit {
                    return Ok(out);
                }
                let (k, v) = kv.map_err(OutboxError::db("read pending"))?;
                let key = open::key_of(&k)?;
                if skip.contains(&key) {
                    continue;
                }
                match record::decode(key, &v) {
                    Ok(e) => out.push(e),
                    Err(e) => {
                        tracing::error!(%key, error = %e, "undecodable outbox record: a dead letter once the disk takes writes");
                        self.refused(Some(store), key, &format!("undecodable: {e}"))?;
                    }
                }
            }
        }
        let from = out.last().map(|e| e.key).or(from);
        let mut st = self.state.lock();
        let mut bad = Vec::new();
        for (k, v) in st.records.range(after(from)) {
            if out.len() >= limit {
                break;
            }
            if st.dead.contains_key(k) {
                continue;
            }
            match record::decode(*k, v) {
                Ok(e) => out.push(e),
                Err(e) => bad.push((*k, format!("undecodable: {e}"))),
            }
        }
        st.dead.extend(bad);
        Ok(out)
    }

    /// Acknowledged records, while holding: held ones leave memory, stored
    /// ones are marked. Returns (stored records, their bytes, all) newly
    /// acknowledged, for the outbox's counters.
    pub fn ack(
        &self,
        store: Option<&sled::Tree>,
        keys: &[Key],
    ) -> Result<(u64, u64, u64), OutboxError> {
        let (mut n, mut bytes, mut all) = (0, 0, 0);
        for &k in keys {
            {
                let mut st = self.state.lock();
                if let Some(v) = st.records.remove(&k) {
                    st.bytes -= size(&v);
                    st.dead.remove(&k);
                    all += 1;
                    continue;
                }
            }
            if let Some(b) = self.mark_stored(store, k)? {
                n += 1;
                bytes += b;
                all += 1;
            }
        }
        Ok((n, bytes, all))
    }

    /// A record the uplink refused, while holding: it leaves the reads now
    /// and moves to the dead letters when the store opens again. Returns
    /// the bytes of a stored record that left the count (None: held or gone).
    pub fn refused(
        &self,
        store: Option<&sled::Tree>,
        key: Key,
        reason: &str,
    ) -> Result<Option<u64>, OutboxError> {
        let reason = record::cut(reason, 64 << 10).to_string();
        {
            let mut st = self.state.lock();
            if st.records.contains_key(&key) {
                st.dead.insert(key, reason);
                return Ok(None);
            }
        }
        let left = self.mark_stored(store, key)?;
        if left.is_some() {
            self.state.lock().dead.insert(key, reason);
        }
        Ok(left)
    }

    /// Marks a stored record acknowledged; its bytes when it was stored and
    /// not yet marked. Moves the watermark over the keys marked in a row.
    fn mark_stored(&self, store: Option<&sled::Tree>, k: Key) -> Result<Option<u64>, OutboxError> {
        let Some(store) = store else {
            return Ok(None);
        };
        if self.state.lock().acked.contains(k) {
            return Ok(None);
        }
        let Some(v) = store
            .get(k.to_bytes())
            .map_err(OutboxError::db("read for ack"))?
        else {
            return Ok(None);
        };
        let mut st = self.state.lock();
        if !st.acked.above.insert(k) {
            return Ok(None);
        }
        loop {
            let next = store.range(range_after(st.acked.upto)).next();
            let Some(kv) = next else { break };
            let (nk, _) = kv.map_err(OutboxError::db("read for ack"))?;
            let nk = open::key_of(&nk)?;
            if !st.acked.above.remove(&nk) {
                break;
            }
            st.acked.upto = Some(nk);
        }
        Ok(Some(size(&v)))
    }

    /// Whether the database may be closed now: holding, still open, and
    /// no stored record left to send.
    pub fn may_close(&self, stored_records: u64) -> bool {
        self.holding() && stored_records == 0 && !self.state.lock().store_closed
    }

    pub fn store_closed(&self) {
        self.state.lock().store_closed = true;
        tracing::warn!(
            "outbox: every stored record was sent; the database is closed so that the read-only disk can be unmounted, checked and mounted again (records stay in memory meanwhile)"
        );
    }

    /// At a reopen, under the append and store locks: writes the held
    /// records into the new database and removes the ones acknowledged
    /// meanwhile (dead-letter moves excepted: [`Held::finish`] hands them
    /// back). Nothing is cleared until `finish`: a reopen that fails later
    /// writes them again into the next try.
    pub fn write_into(&self, records: &sled::Tree) -> Result<Written, OutboxError> {
        let st = self.state.lock();
        let mut w = Written::default();
        if !self.holding() {
            return Ok(w);
        }
        for (k, v) in &st.records {
            let kb = k.to_bytes();
            let had = records
                .insert(kb, v.clone())
                .map_err(OutboxError::db("store held records"))?;
            if had.is_none() {
                w.added += 1;
                w.added_bytes += size(v);
            }
        }
        let mut gone: Vec<Key> = st
            .acked
            .above
            .iter()
            .copied()
            .filter(|k| !st.dead.contains_key(k))
            .collect();
        if let Some(upto) = st.acked.upto {
            for kv in records.range(..=upto.to_bytes()) {
                let (k, _) = kv.map_err(OutboxError::db("read acknowledged"))?;
                let k = open::key_of(&k)?;
                if !st.dead.contains_key(&k) {
                    gone.push(k);
                }
            }
        }
        for k in gone {
            if let Some(v) = records
                .remove(k.to_bytes())
                .map_err(OutboxError::db("remove acknowledged"))?
            {
                w.removed += 1;
                w.removed_bytes += size(&v);
            }
        }
        Ok(w)
    }

    /// The reopen that wrote the held records committed: stop holding.
    /// Returns the dead-letter moves to make now.
    pub fn finish(&self, w: &Written) -> Vec<(Key, String)> {
        let mut st = self.state.lock();
        if !self.holding() {
            return Vec::new();
        }
        let dead = std::mem::take(&mut st.dead).into_iter().collect();
        tracing::info!(
            stored = w.added,
            acknowledged_removed = w.removed,
            held_for_s = st
                .since
                .and_then(|t| t.elapsed().ok())
                .map_or(0, |d| d.as_secs()),
            "outbox: the disk takes writes again; the records held in memory are stored"
        );
        *st = State::default();
        self.holding.store(false, Ordering::SeqCst);
        self.reopened.store(true, Ordering::SeqCst);
        dead
    }

    pub fn stats(&self) -> HeldStats {
        let st = self.state.lock();
        HeldStats {
            holding: self.holding(),
            read_only: self.holding() && st.read_only,
            records: st.records.len() as u64,
            bytes: st.bytes,
            max_bytes: self.max_bytes,
            dropped: self.dropped.load(Ordering::Relaxed),
            since: st.since,
            store_closed: st.store_closed,
            oldest_appended_at: st
                .records
                .first_key_value()
                .and_then(|(_, v)| record::appended_at(v).ok()),
        }
    }
}

/// The outbox's side: counters follow what the held records do.
impl Shared {
    /// Holds one record under the next seq (the append lock is `seq`).
    pub(super) fn hold(&self, seq: &mut u64, value: sled::IVec) -> Result<Key, OutboxError> {
        let key = self.held.hold(Key(self.boot, *seq), value)?;
        *seq += 1;
        self.appended_total.fetch_add(1, Ordering::Relaxed);
        Ok(key)
    }

    /// `ack` while holding; `store` is the read guard's store.
    pub(super) fn held_ack(
        &self,
        store: Option<&sled::Tree>,
        keys: &[Key],
    ) -> Result<(), OutboxError> {
        let (n, bytes, all) = self.held.ack(store, keys)?;
        self.forget_unsaved(keys.iter().copied());
        self.records_n.fetch_sub(n, Ordering::SeqCst);
        self.records_bytes.fetch_sub(bytes, Ordering::SeqCst);
        self.acked_total.fetch_add(all, Ordering::Relaxed);
        Ok(())
    }

    /// `dead_letter` while holding: the move is made when the store opens
    /// again (a record appended before the failure stays among the unsaved
    /// ones, so the reopen puts it back to be moved).
    pub(super) fn held_refused(
        &self,
        store: Option<&sled::Tree>,
        key: Key,
        reason: &str,
    ) -> Result<(), OutboxError> {
        if let Some(bytes) = self.held.refused(store, key, reason)? {
            self.records_n.fetch_sub(1, Ordering::SeqCst);
            self.records_bytes.fetch_sub(bytes, Ordering::SeqCst);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io_of(source: std::io::Error) -> OutboxError {
        OutboxError::Db {
            op: "flush",
            source: sled::Error::Io(source),
        }
    }

    fn io(op: &'static str, errno: rustix::io::Errno) -> OutboxError {
        OutboxError::Io {
            op,
            path: "/x".into(),
            source: std::io::Error::from_raw_os_error(errno.raw_os_error()),
        }
    }

    #[test]
    fn read_only_and_io_errors_are_held_a_full_disk_is_refused() {
        assert_eq!(kind(&io("fsync", rustix::io::Errno::ROFS)), Some(true));
        assert_eq!(kind(&io("fsync", rustix::io::Errno::IO)), Some(false));
        assert_eq!(kind(&io("fsync", rustix::io::Errno::NOSPC)), None);
        assert_eq!(kind(&io("fsync", rustix::io::Errno::DQUOT)), None);
        let sled_ro = OutboxError::Db {
            op: "flush",
            source: sled::Error::Io(std::io::Error::from_raw_os_error(
                rustix::io::Errno::ROFS.raw_os_error(),
            )),
        };
        assert_eq!(kind(&sled_ro), Some(true));
        // sled's copy of its error: the kind stays, the errno goes.
        let copied = std::io::Error::new(std::io::ErrorKind::ReadOnlyFilesystem, "Os { code: 30 }");
        assert_eq!(kind(&io_of(copied)), Some(true));
        let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "Os { code: 28 }");
        assert_eq!(kind(&io_of(full)), None);
        assert_eq!(kind(&OutboxError::Flush("x".into())), None);
    }

    fn held(max: u64, when_full: WhenFull) -> Held {
        let h = Held::new(&OutboxConfig {
            memory_when_read_only: max,
            when_full,
            ..OutboxConfig::default()
        });
        h.failed(&io("flush", rustix::io::Errno::ROFS));
        h
    }

    fn value(i: u64) -> sled::IVec {
        sled::IVec::from(record::encode(
            "s",
            SystemTime::now(),
            format!("{{\"i\":{i}}}").as_bytes(),
        ))
    }

    #[test]
    fn the_bound_drops_the_oldest_held_records_and_counts_them() {
        let one = size(&value(0));
        let h = held(3 * one, WhenFull::DropOldest);
        for i in 0..5 {
            h.hold(Key(1, i), value(i)).unwrap();
        }
        let s = h.stats();
        assert!(s.holding && s.read_only);
        assert_eq!((s.records, s.dropped), (3, 2));
        let keys: Vec<u64> = h
            .pending(None, None, 10)
            .unwrap()
            .iter()
            .map(|e| e.key.1)
            .collect();
        assert_eq!(keys, [2, 3, 4]);
    }

    #[test]
    fn reject_new_keeps_the_held_records_and_refuses_the_next() {
        let one = size(&value(0));
        let h = held(2 * one, WhenFull::RejectNew);
        h.hold(Key(1, 0), value(0)).unwrap();
        h.hold(Key(1, 1), value(1)).unwrap();
        let e = h.hold(Key(1, 2), value(2)).unwrap_err();
        assert!(e.is_transient() && e.to_string().contains("memory_when_read_only"));
        assert_eq!(h.stats().dropped, 1);
        let zero = held(0, WhenFull::DropOldest);
        assert!(zero.hold(Key(1, 0), value(0)).is_err());
    }

    #[test]
    fn stored_records_read_until_acknowledged_then_held_ones_and_a_reopen_applies_both() {
        let tmp = tempfile::tempdir().unwrap();
        let db = sled::Config::new()
            .temporary(true)
            .path(tmp.path())
            .open()
            .unwrap();
        let store = db.open_tree("records").unwrap();
        for i in 0..4 {
            store.insert(Key(1, i).to_bytes(), value(i)).unwrap();
        }
        let h = held(1 << 20, WhenFull::DropOldest);
        h.hold(Key(1, 4), value(4)).unwrap();
        h.hold(Key(1, 5), value(5)).unwrap();
        let seqs = |v: Vec<Entry>| v.iter().map(|e| e.key.1).collect::<Vec<_>>();
        assert_eq!(
            seqs(h.pending(Some(&store), None, 10).unwrap()),
            [0, 1, 2, 3, 4, 5]
        );
        assert_eq!(
            seqs(h.pending(Some(&store), Some(Key(1, 2)), 2).unwrap()),
            [3, 4]
        );
        // Out of order: 1 first, then 0 moves the watermark over both.
        let (n, _, all) = h.ack(Some(&store), &[Key(1, 1), Key(1, 4)]).unwrap();
        assert_eq!((n, all), (1, 2));
        h.ack(Some(&store), &[Key(1, 0), Key(1, 0)]).unwrap();
        assert_eq!(h.state.lock().acked.upto, Some(Key(1, 1)));
        assert!(
            h.refused(Some(&store), Key(1, 3), "too large")
                .unwrap()
                .is_some()
        );
        assert_eq!(seqs(h.pending(Some(&store), None, 10).unwrap()), [2, 5]);
        // Nothing was written to the store meanwhile.
        assert_eq!(store.len(), 4);
        let w = h.write_into(&store).unwrap();
        assert_eq!((w.added, w.removed), (1, 2));
        let keys: Vec<u64> = store
            .iter()
            .keys()
            .map(|k| Key::from_bytes(&k.unwrap()).unwrap().1)
            .collect();
        assert_eq!(keys, [2, 3, 5]);
        let dead = h.finish(&w);
        assert_eq!(dead, [(Key(1, 3), "too large".to_string())]);
        assert!(!h.holding() && h.reopened());
        assert_eq!(h.stats().records, 0);
    }

    #[test]
    fn the_probe_writes_and_removes_its_file() {
        let tmp = tempfile::tempdir().unwrap();
        probe(tmp.path()).unwrap();
        assert!(!tmp.path().join(PROBE_FILE).exists());
        std::fs::write(tmp.path().join("file"), b"").unwrap();
        assert!(probe(&tmp.path().join("file/outbox")).is_err());
    }
}
