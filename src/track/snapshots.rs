//! The best crop of each track as a JPEG file, all of them within a byte
//! budget: `<data_dir>/tracks/<pipeline>/<name>.jpg`, served at
//! `/v1/pipelines/{name}/tracks/{id}/snapshot.jpg`.
//!
//! Invariants:
//! - the files' sizes add up to at most `budget` bytes: a new or replaced
//!   snapshot evicts the least recently written others first (one larger
//!   than the whole budget is refused);
//! - a file is written whole (write to a temporary name, fsync, rename), so
//!   a crash leaves the old snapshot or the new one, never half of one;
//! - the index is rebuilt from the folder at open, so the budget holds
//!   across restarts.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};

pub struct SnapshotStore {
    dir: PathBuf,
    budget: u64,
    index: Mutex<Index>,
}

#[derive(Default)]
struct Index {
    /// name -> (bytes, write order)
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
            found.push((m.modified().ok(), name.to_string(), m.len()));
        }
        found.sort();
        let store = SnapshotStore {
            dir: dir.to_path_buf(),
            budget,
            index: Mutex::new(Index::default()),
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
    /// is larger than the budget.
    pub fn put(&self, name: &str, jpeg: &[u8]) -> io::Result<bool> {
        let len = jpeg.len() as u64;
        if len > self.budget {
            return Ok(false);
        }
        crate::fsio::write_atomic(&self.path(name), jpeg)?;
        let mut ix = self.lock();
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

    /// Bytes held, and the number of snapshots.
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
        let s = SnapshotStore::open(dir.path(), 250).unwrap();
        assert!(s.put("a", &[1; 100]).unwrap());
        assert!(s.put("b", &[2; 100]).unwrap());
        // Replacing a's snapshot makes it the newest; c then evicts b.
        assert!(s.put("a", &[3; 80]).unwrap());
        assert!(s.put("c", &[4; 100]).unwrap());
        assert_eq!(s.usage(), (180, 2));
        assert!(s.get("b").is_none());
        assert_eq!(s.get("a").unwrap(), vec![3; 80]);
        assert!(!s.put("huge", &[0; 251]).unwrap());
        drop(s);
        std::fs::write(dir.path().join("x.jpg.tmp"), b"half").unwrap();
        let s = SnapshotStore::open(dir.path(), 150).unwrap();
        assert_eq!(s.usage().1, 1, "reopened under a smaller budget");
        assert!(!dir.path().join("x.jpg.tmp").exists());
    }
}
