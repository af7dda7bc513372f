//! Crash-safe file helpers shared by the outbox, OTA and the watch source.
//!
//! A leaf room: it imports nothing from the crate, so every room may use it.
//! The rules these helpers follow (Linux, ext4/xfs):
//!
//! - data is durable once its file is fsynced; a *name* (a new file, a
//!   rename) is durable once the folder holding it is fsynced;
//! - a file is replaced atomically by writing a temporary beside it,
//!   fsyncing it, renaming it over the old one, then fsyncing the folder:
//!   after a crash a reader sees the old bytes or the new ones, never a mix.

use std::io::Write;
use std::path::{Path, PathBuf};

/// fsyncs a folder, so the names in it (new files, renames) are durable.
pub fn fsync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

/// Replaces `path` atomically with `bytes`: `<path>.tmp`, fsync, rename,
/// fsync the folder (created when missing). When a step before the rename
/// fails (a full disk), the temporary is removed: a failed write leaves
/// nothing behind, or every failure would cost the disk another inode.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let written = write_synced(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        // The write's own error is the one worth telling; a temporary that
        // cannot be removed either (read-only disk) was never created.
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    fsync_dir(dir)
}

/// `bytes` into a new file at `path`, fsynced.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

/// What a file takes on disk: its allocated blocks (`st_blocks` counts
/// 512-byte units), not its length. A 3 kB file takes a whole 4 KiB block.
pub fn disk_bytes(m: &std::fs::Metadata) -> u64 {
    use std::os::unix::fs::MetadataExt;
    m.blocks().saturating_mul(512)
}

/// Moves `file` into `dir` (created when missing) under its own name, or
/// `<name>.1`, `<name>.2`, ... when that is taken: never overwrites an
/// earlier file. Returns where it went.
pub fn move_into(file: &Path, dir: &Path) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let name = file.file_name().unwrap_or_default();
    let mut to = dir.join(name);
    let mut n = 1;
    while to.exists() {
        to = dir.join(format!("{}.{n}", name.to_string_lossy()));
        n += 1;
    }
    std::fs::rename(file, &to)?;
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_atomic_replaces_and_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/state.json");
        write_atomic(&p, b"one").unwrap();
        write_atomic(&p, b"two").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        let names: Vec<_> = std::fs::read_dir(d.path().join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
    }

    #[test]
    fn a_failed_write_leaves_no_temporary() {
        let d = tempfile::tempdir().unwrap();
        // The rename fails: a folder (not empty) stands where the file would go.
        let p = d.path().join("taken");
        std::fs::create_dir_all(p.join("inner")).unwrap();
        assert!(write_atomic(&p, b"bytes").is_err());
        let names: Vec<_> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["taken"]);
    }

    #[test]
    fn disk_bytes_are_whole_blocks() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("small");
        std::fs::write(&p, [1u8; 3000]).unwrap();
        std::fs::File::open(&p).unwrap().sync_all().unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert!(disk_bytes(&m) >= 3000, "{}", disk_bytes(&m));
        assert_eq!(disk_bytes(&m) % 512, 0);
    }

    #[test]
    fn move_into_never_overwrites() {
        let d = tempfile::tempdir().unwrap();
        let done = d.path().join("done");
        for body in ["a", "b", "c"] {
            let f = d.path().join("x.csv");
            std::fs::write(&f, body).unwrap();
            move_into(&f, &done).unwrap();
        }
        assert_eq!(std::fs::read(done.join("x.csv")).unwrap(), b"a");
        assert_eq!(std::fs::read(done.join("x.csv.1")).unwrap(), b"b");
        assert_eq!(std::fs::read(done.join("x.csv.2")).unwrap(), b"c");
        fsync_dir(&done).unwrap();
    }
}
