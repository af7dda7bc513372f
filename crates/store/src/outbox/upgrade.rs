//! Converting the on-disk layout: a database written without compression
//! (every outbox made before compressed logs) is copied, tree by tree, into
//! a compressed one at the daemon's open and swapped in by two renames; and
//! back, when `compress = false` is set.
//!
//! sled keeps `use_compression` in its `conf` file and refuses to open a
//! database with the other setting, so a database is always opened the way
//! its `conf` says ([`compressed_on_disk`]); the conversion only decides
//! which one that is.
//!
//! Crash safety. The copy goes to `<dir>.copy`; only once it is complete
//! and durable (sled flush, fdatasync of its log, the `boot` sidecar copied,
//! a `complete` marker written and the folder fsynced) is the old folder
//! renamed to `<dir>.old` and the copy renamed to `<dir>`, then the old one
//! removed. [`resume`], called first at every open, finishes or discards
//! whatever a crash left: an incomplete copy is removed (the old database
//! is still in place), a complete copy with no `<dir>` left is renamed in,
//! and a `<dir>.old` beside a working `<dir>` is removed. A failed
//! conversion (a full disk, say: the copy needs room for a second database)
//! leaves the old database in place and in use; it is tried again at the
//! next start.

use std::path::{Path, PathBuf};

use super::commit::sync_dir;
use super::open::{BOOT_FILE, compressed_on_disk};

const COMPLETE: &str = "complete";

/// Why a conversion failed, with the step it was at.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error("{step}: {source}")]
    Io {
        step: &'static str,
        source: std::io::Error,
    },
    #[error("{step}: {source}")]
    Db {
        step: &'static str,
        source: sled::Error,
    },
    #[error("{step}: {source}")]
    Sync {
        step: &'static str,
        source: super::OutboxError,
    },
}

impl ConvertError {
    /// The old database is held by another process (sled's file lock): the
    /// open that follows reports that.
    pub fn in_use(&self) -> bool {
        matches!(self, ConvertError::Db { source, .. } if super::open::lock_held(source))
    }
}

fn io(step: &'static str) -> impl FnOnce(std::io::Error) -> ConvertError {
    move |source| ConvertError::Io { step, source }
}

fn db(step: &'static str) -> impl FnOnce(sled::Error) -> ConvertError {
    move |source| ConvertError::Db { step, source }
}

fn synced(step: &'static str) -> impl FnOnce(super::OutboxError) -> ConvertError {
    move |source| ConvertError::Sync { step, source }
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

fn parent(dir: &Path) -> PathBuf {
    match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Finishes or discards an upgrade that a crash interrupted.
pub fn resume(dir: &Path) -> std::io::Result<()> {
    let copy = sibling(dir, ".copy");
    let old = sibling(dir, ".old");
    if copy.exists() {
        if copy.join(COMPLETE).is_file() && !dir.join("db").is_file() {
            if dir.exists() {
                std::fs::remove_dir_all(dir)?;
            }
            std::fs::rename(&copy, dir)?;
            sync_dir(&parent(dir)).map_err(std::io::Error::other)?;
            tracing::info!(path = %dir.display(), "outbox: finished an interrupted conversion of its layout");
        } else {
            std::fs::remove_dir_all(&copy)?;
        }
    }
    if old.exists() && dir.join("db").is_file() {
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}

/// Copies the database in `dir` into one of the layout `compress` names
/// and swaps it in, when it is of the other one. Returns the records
/// copied; Ok(None) when there was nothing to do.
pub fn convert(
    dir: &Path,
    compress: bool,
    cache_capacity: u64,
) -> Result<Option<u64>, ConvertError> {
    if compressed_on_disk(dir).is_none_or(|c| c == compress) {
        return Ok(None);
    }
    let copy = sibling(dir, ".copy");
    let old_dir = sibling(dir, ".old");
    let n = copy_into(dir, &copy, cache_capacity, compress).inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&copy);
    })?;
    std::fs::rename(dir, &old_dir).map_err(io("move the old database aside"))?;
    std::fs::rename(&copy, dir).map_err(io("move the copy in"))?;
    sync_dir(&parent(dir)).map_err(synced("fsync the parent folder"))?;
    std::fs::remove_dir_all(&old_dir).map_err(io("remove the old database"))?;
    Ok(Some(n))
}

/// Copies the database in `dir` (opened as it was made) into `copy`, made
/// with `compress`; durable and marked complete when it returns.
fn copy_into(
    dir: &Path,
    copy: &Path,
    cache_capacity: u64,
    compress: bool,
) -> Result<u64, ConvertError> {
    let open = |path: &Path, compress: bool| {
        sled::Config::new()
            .path(path)
            .cache_capacity(cache_capacity)
            .flush_every_ms(None)
            .use_compression(compress)
            .compression_factor(super::open::COMPRESSION_LEVEL)
            .open()
    };
    if copy.exists() {
        std::fs::remove_dir_all(copy).map_err(io("remove an old copy"))?;
    }
    // A database closed a moment ago may still be locked by sled's threads.
    let was_compressed = compressed_on_disk(dir).unwrap_or(false);
    let old = super::open::waiting_for_lock(super::open::sled_locked, || open(dir, was_compressed))
        .map_err(db("open the old database"))?;
    let new = open(copy, compress).map_err(db("create the copy"))?;
    let mut records = 0u64;
    for name in old.tree_names() {
        let from = old.open_tree(&name).map_err(db("open a tree"))?;
        let to = new.open_tree(&name).map_err(db("create a tree"))?;
        let mut batch = sled::Batch::default();
        let mut in_batch = 0;
        for kv in from.iter() {
            let (k, v) = kv.map_err(db("read"))?;
            batch.insert(k, v);
            in_batch += 1;
            if name == b"records".as_slice() {
                records += 1;
            }
            if in_batch == 4096 {
                to.apply_batch(std::mem::take(&mut batch))
                    .map_err(db("write"))?;
                in_batch = 0;
            }
        }
        to.apply_batch(batch).map_err(db("write"))?;
    }
    new.flush().map_err(db("flush the copy"))?;
    // sled's flush does not reach the disk (see commit.rs): fdatasync its log.
    std::fs::File::open(copy.join("db"))
        .and_then(|f| f.sync_data())
        .map_err(io("fsync the copy"))?;
    drop(new);
    drop(old);
    let sidecar = dir.join(BOOT_FILE);
    if sidecar.is_file() {
        std::fs::copy(&sidecar, copy.join(BOOT_FILE)).map_err(io("copy the boot file"))?;
    }
    for f in [BOOT_FILE, "conf"] {
        if let Ok(h) = std::fs::File::open(copy.join(f)) {
            h.sync_all().map_err(io("fsync the copy's files"))?;
        }
    }
    let done = std::fs::File::create(copy.join(COMPLETE)).map_err(io("mark the copy complete"))?;
    done.sync_all().map_err(io("mark the copy complete"))?;
    sync_dir(copy).map_err(synced("fsync the copy's folder"))?;
    Ok(records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::open::{sled_locked, waiting_for_lock};
    use std::sync::atomic::{AtomicU32, Ordering};

    fn old_db(dir: &Path, n: u64) {
        let db = sled::Config::new()
            .path(dir)
            .use_compression(false)
            .open()
            .unwrap();
        let t = db.open_tree("records").unwrap();
        for i in 0..n {
            t.insert(i.to_be_bytes(), format!("record {i}").as_bytes())
                .unwrap();
        }
        db.open_tree("meta")
            .unwrap()
            .insert("boot", &3u64.to_be_bytes())
            .unwrap();
        db.flush().unwrap();
        std::fs::write(dir.join(BOOT_FILE), "3\n").unwrap();
    }

    #[test]
    fn an_uncompressed_database_is_copied_whole_and_swapped_in() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("outbox");
        old_db(&dir, 5000);
        assert_eq!(compressed_on_disk(&dir), Some(false));
        assert_eq!(convert(&dir, true, 8 << 20).unwrap(), Some(5000));
        assert_eq!(compressed_on_disk(&dir), Some(true));
        assert!(!sibling(&dir, ".copy").exists());
        assert!(!sibling(&dir, ".old").exists());
        assert_eq!(std::fs::read_to_string(dir.join(BOOT_FILE)).unwrap(), "3\n");
        let db = sled::Config::new()
            .path(&dir)
            .use_compression(true)
            .open()
            .unwrap();
        let t = db.open_tree("records").unwrap();
        assert_eq!(t.len(), 5000);
        assert_eq!(
            t.get(4321u64.to_be_bytes()).unwrap().unwrap(),
            b"record 4321".as_slice()
        );
        // Nothing more to do the second time.
        drop(t);
        drop(db);
        assert_eq!(convert(&dir, true, 8 << 20).unwrap(), None);
        // And back, when compression is turned off.
        assert_eq!(convert(&dir, false, 8 << 20).unwrap(), Some(5000));
        assert_eq!(compressed_on_disk(&dir), Some(false));
    }

    /// An outbox of the first layout (the same records, trees and sidecar,
    /// uncompressed): the daemon's open upgrades it and serves every record,
    /// dead letter and boot number as they were.
    #[test]
    fn an_outbox_of_the_first_layout_opens_with_every_record_in_order() {
        use crate::outbox::{Outbox, OutboxConfig};
        let tmp = tempfile::tempdir().unwrap();
        let made = tmp.path().join("made");
        let ob = Outbox::open(&made, OutboxConfig::default()).unwrap();
        let keys: Vec<_> = (0..300)
            .map(|i| {
                ob.append(&format!("s{}", i % 3), format!("record {i}").as_bytes())
                    .unwrap()
            })
            .collect();
        ob.dead_letter(keys[7], "refused by the fleet").unwrap();
        ob.ack(&keys[..5]).unwrap();
        ob.close().unwrap();
        // The same database as the first layout wrote it.
        let dir = tmp.path().join("outbox");
        copy_into(&made, &dir, 8 << 20, false).unwrap();
        std::fs::remove_file(dir.join(COMPLETE)).unwrap();
        assert_eq!(compressed_on_disk(&dir), Some(false));

        let ob = Outbox::open(&dir, OutboxConfig::default()).unwrap();
        assert_eq!(compressed_on_disk(&dir), Some(true));
        assert_eq!(ob.boot(), 2, "the boot counter carried over");
        let pending = ob.pending(None, 1000).unwrap();
        let want: Vec<_> = keys[5..]
            .iter()
            .filter(|k| **k != keys[7])
            .copied()
            .collect();
        assert_eq!(pending.iter().map(|e| e.key).collect::<Vec<_>>(), want);
        assert_eq!(pending[0].record, b"record 5");
        assert_eq!(pending[0].stream, "s2");
        let dead = ob.dead_letters(None, 10).unwrap();
        assert_eq!(dead.len(), 1);
        assert_eq!(dead[0].reason, "refused by the fleet");
        let st = ob.stats();
        assert_eq!((st.records, st.dead_letters), (294, 1));
        // New appends follow the old keys.
        let k = ob.append("s0", b"after the upgrade").unwrap();
        assert!(k > *keys.last().unwrap());
        ob.close().unwrap();
    }

    /// sled's lock still held by a database just closed (here: held, then
    /// let go after the first tries) delays the open the copy makes; it does
    /// not fail it. A lock that stays held makes the conversion "in use".
    #[test]
    fn a_lock_let_go_is_waited_for_and_one_kept_is_in_use() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("outbox");
        old_db(&dir, 10);
        let holder = sled::Config::new().path(&dir).open().unwrap();
        let tries = AtomicU32::new(0);
        let mut holder = Some(holder);
        let r = waiting_for_lock(sled_locked, || {
            if tries.fetch_add(1, Ordering::SeqCst) == 2 {
                drop(holder.take());
            }
            sled::Config::new().path(&dir).open()
        });
        assert!(r.is_ok(), "{:?}", r.err());
        assert!(tries.load(Ordering::SeqCst) >= 3);
        drop(r);
        let _kept = sled::Config::new().path(&dir).open().unwrap();
        let e = convert(&dir, true, 8 << 20).unwrap_err();
        assert!(e.in_use(), "{e}");
    }

    #[test]
    fn a_copy_interrupted_before_it_was_complete_is_discarded() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("outbox");
        old_db(&dir, 10);
        let copy = sibling(&dir, ".copy");
        std::fs::create_dir_all(&copy).unwrap();
        std::fs::write(copy.join("db"), b"half a copy").unwrap();
        resume(&dir).unwrap();
        assert!(!copy.exists());
        assert_eq!(
            compressed_on_disk(&dir),
            Some(false),
            "the old database stays"
        );
    }

    #[test]
    fn a_complete_copy_left_between_the_renames_is_moved_in() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("outbox");
        old_db(&dir, 10);
        let copy = sibling(&dir, ".copy");
        copy_into(&dir, &copy, 8 << 20, true).unwrap();
        // The crash: the old one moved aside, the copy not yet in.
        std::fs::rename(&dir, sibling(&dir, ".old")).unwrap();
        resume(&dir).unwrap();
        assert_eq!(compressed_on_disk(&dir), Some(true));
        assert!(!sibling(&dir, ".old").exists());
        assert!(!copy.exists());
    }
}
