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
/// fsync the folder (created when missing).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    fsync_dir(dir)
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
