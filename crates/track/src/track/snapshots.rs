//! The best crop of each track as a JPEG file, all of them within a byte
//! budget: `<data_dir>/tracks/<pipeline>/<name>.jpg`, served at
//! `/v1/pipelines/{name}/tracks/{id}/snapshot.jpg`.
//!
//! Invariants:
//! - what the files take on disk (their allocated blocks, not their
//!   lengths: a 3 kB JPEG takes a 4 KiB block) adds up to at most `budget`
//!   bytes: a new or replaced snapshot evicts the least recently written
//!   others first (one larger than the whole budget is refused);
//! - a file is written whole (write to a temporary name, fsync, rename), so
//!   a crash leaves the old snapshot or the new one, never half of one; a
//!   write that fails (a full or read-only disk) leaves no temporary and is
//!   counted ([`SnapshotStore::failed`]);
//! - the index is rebuilt from the folder at open, so the budget holds
//!   across restarts.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};

pub struct SnapshotStore {
    dir: PathBuf,
    budget: u64,
    index: Mutex<Index>,
    /// Writes that failed since the store was opened.
    failed: AtomicU64,
}

#[derive(Default)]
struct Index {
    /// name -> (bytes on disk, write order)
    files: HashMap<String, (u64, u64)>,
    total: u64,
    seq: u64,
}

/// The file name (without `.jpg`) of a track's snapshot: the id with
/// anything but `[A-Za-z0-9_-]` as `_`, and a short hash of the id so two
/// ids that read the same that way do not share a file.
pub fn snapshot_name(track_id: &str) -> String {
    let safe: String = track_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(96)
        .collect();
    let h = Sha256::digest(track_id.as_bytes());
    format!("{safe}-{}", hex::encode(&h[..4]))
}

impl SnapshotStore {
    /// Opens (creating) `dir`, indexes what it holds, oldest first by
    /// modification time, and trims it to `budget`.
    pub fn open(dir: &Path, budget: u64) -> io::Result<SnapshotStore> {
        std::fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            let p = e.path();
            let Some(name) = p
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jpg"))
            else {
                // Leftover temporary files of an interrupted write.
                if p.extension().is_some_and(|x| x == "tmp") {
                    let _ = std::fs::remove_file(&p);
                }
                continue;
            };
            let m = e.metadata()?;
            found.push((
                m.modified().ok(),
                name.to_string(),
                crate::fsio::disk_bytes(&m),
            ));
        }
        found.sort();
        let store = SnapshotStore {
            dir: dir.to_path_buf(),
            budget,
            index: Mutex::new(Index::default()),
            failed: AtomicU64::new(0),
        };
        {
            let mut ix = store.lock();
            for (_, name, len) in found {
                ix.seq += 1;
                let seq = ix.seq;
                ix.files.insert(name, (len, seq));
                ix.total += len;
            }
            store.trim(&mut ix, None);
        }
        Ok(store)
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Index> {
        self.index.lock()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.jpg"))
    }

    /// Evicts the least recently written files (but `keep`) until within budget.
    fn trim(&self, ix: &mut Index, keep: Option<&str>) {
        while ix.total > self.budget {
            let Some(oldest) = ix
                .files
                .iter()
                .filter(|(n, _)| Some(n.as_str()) != keep)
                .min_by_key(|(_, (_, seq))| *seq)
                .map(|(n, _)| n.clone())
            else {
                break;
            };
            if let Some((len, _)) = ix.files.remove(&oldest) {
                ix.total -= len;
            }
            let _ = std::fs::remove_file(self.path(&oldest));
        }
    }

    /// Stores (or replaces) the snapshot `name`; `Ok(false)` when it alone
    /// is larger than the budget. A failed write is counted.
    pub fn put(&self, name: &str, jpeg: &[u8]) -> io::Result<bool> {
        if jpeg.len() as u64 > self.budget {
            return Ok(false);
        }
        let path = self.path(name);
        let written = crate::fsio::write_atomic(&path, jpeg).and_then(|()| path.metadata());
        let len = match written {
            Ok(m) => crate::fsio::disk_bytes(&m),
            Err(e) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
                return Err(e);
            }
        };
        let mut ix = self.lock();
        if len > self.budget {
            // Its blocks alone are over the budget: it goes again.
            if let Some((old, _)) = ix.files.remove(name) {
                ix.total -= old;
            }
            let _ = std::fs::remove_file(&path);
            return Ok(false);
        }
        ix.seq += 1;
        let seq = ix.seq;
        if let Some((old, _)) = ix.files.insert(name.to_string(), (len, seq)) {
            ix.total -= old;
        }
        ix.total += len;
        self.trim(&mut ix, Some(name));
        Ok(true)
    }

    pub fn get(&self, name: &str) -> Option<Vec<u8>> {
        if !self.lock().files.contains_key(name) {
            return None;
        }
        std::fs::read(self.path(name)).ok()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.lock().files.contains_key(name)
    }

    /// Writes that failed (a full or read-only disk) since the store opened.
    pub fn failed(&self) -> u64 {
        self.failed.load(Ordering::Relaxed)
    }

    /// Bytes held on disk, and the number of snapshots.
    pub fn usage(&self) -> (u64, usize) {
        let ix = self.lock();
        (ix.total, ix.files.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_safe_and_distinct() {
        let a = snapshot_name("gw/gate/cam/1");
        let b = snapshot_name("gw_gate_cam_1");
        assert!(a.starts_with("gw_gate_cam_1-"), "{a}");
        assert_ne!(a, b);
        assert!(!snapshot_name("../../etc/passwd").contains('/'));
    }

    #[test]
    fn the_budget_holds_oldest_first_and_across_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let block = {
            let p = dir.path().join("probe");
            std::fs::write(&p, [0u8; 100]).unwrap();
            std::fs::File::open(&p).unwrap().sync_all().unwrap();
            let b = crate::fsio::disk_bytes(&p.metadata().unwrap());
            std::fs::remove_file(&p).unwrap();
            b
        };
        // Room for two small files' blocks, not three.
        let s = SnapshotStore::open(dir.path(), 2 * block + block / 2).unwrap();
        assert!(s.put("a", &[1; 100]).unwrap());
        assert!(s.put("b", &[2; 100]).unwrap());
        // Replacing a's snapshot makes it the newest; c then evicts b.
        assert!(s.put("a", &[3; 80]).unwrap());
        assert!(s.put("c", &[4; 100]).unwrap());
        assert_eq!(s.usage(), (2 * block, 2));
        assert!(s.get("b").is_none());
        assert_eq!(s.get("a").unwrap(), vec![3; 80]);
        assert!(!s.put("huge", &vec![0; 3 * block as usize]).unwrap());
        drop(s);
        std::fs::write(dir.path().join("x.jpg.tmp"), b"half").unwrap();
        let s = SnapshotStore::open(dir.path(), block + block / 2).unwrap();
        assert_eq!(s.usage().1, 1, "reopened under a smaller budget");
        assert!(!dir.path().join("x.jpg.tmp").exists());
    }

    #[test]
    fn small_files_count_their_blocks_not_their_length() {
        // The case: 200 kB of budget, snapshots of a few hundred
        // bytes each; by length 316 of them fitted and took 1,288 KiB.
        let dir = tempfile::tempdir().unwrap();
        let s = SnapshotStore::open(dir.path(), 200_000).unwrap();
        for i in 0..400 {
            assert!(s.put(&format!("t{i}"), &[7; 600]).unwrap());
        }
        let on_disk: u64 = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| crate::fsio::disk_bytes(&e.unwrap().metadata().unwrap()))
            .sum();
        assert!(on_disk <= 200_000, "{on_disk} bytes on disk");
        assert_eq!(s.usage().0, on_disk);
    }

    #[test]
    fn a_failed_write_is_counted_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let s = SnapshotStore::open(dir.path(), 1 << 20).unwrap();
        // A folder where the snapshot would go: the rename fails.
        std::fs::create_dir_all(dir.path().join("busy.jpg/inner")).unwrap();
        assert!(s.put("busy", b"jpeg").is_err());
        assert_eq!(s.failed(), 1);
        assert!(!dir.path().join("busy.tmp").exists());
        assert_eq!(s.usage(), (0, 0));
    }
}
