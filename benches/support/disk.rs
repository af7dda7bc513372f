//! Shared by the outbox benches: the disk a folder takes.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Allocated blocks of every file under `dir`, in bytes (what `du` counts).
pub fn disk_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| match e.metadata() {
                    Ok(m) if m.is_dir() => disk_bytes(&e.path()),
                    Ok(m) => m.blocks() * 512,
                    Err(_) => 0,
                })
                .sum()
        })
        .unwrap_or(0)
}
