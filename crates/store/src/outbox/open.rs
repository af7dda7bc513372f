//! Opening: sled, the boot counter, the byte accounting scan, quarantine.

use std::any::Any;
use std::io::ErrorKind;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::commit::sync_dir;
use super::record::{KEY_LEN, Key};
use super::{OutboxConfig, OutboxError};

/// The sidecar file that mirrors the boot counter outside sled, so a
/// database that is quarantined still tells its successor where boots stood.
pub const BOOT_FILE: &str = "boot";
const BOOT_KEY: &[u8] = b"boot";

/// An opened, scanned database.
pub struct Loaded {
    pub db: sled::Db,
    pub records: sled::Tree,
    pub dead: sled::Tree,
    pub meta: sled::Tree,
    pub records_n: u64,
    pub records_bytes: u64,
    pub dead_n: u64,
    pub dead_bytes: u64,
    /// The highest boot seen in meta or in any key.
    pub last_boot: u64,
}

/// Why an open failed, sorted by what to do about it.
pub enum Failure {
    /// Another process holds sled's lock: never touch its files.
    InUse(sled::Error),
    /// The files do not hold a usable database: quarantine.
    Damaged(String),
    /// Anything else (permissions, disk full, ...): report, touch nothing.
    Other(sled::Error),
}

impl Failure {
    pub fn into_error(self, path: &Path) -> OutboxError {
        let path = path.to_path_buf();
        match self {
            Failure::InUse(source) => OutboxError::InUse { path, source },
            Failure::Damaged(reason) => OutboxError::Damaged { path, reason },
            Failure::Other(source) => OutboxError::Open { path, source },
        }
    }
}

/// Whether an open failed on sled's file lock (held by another process, or
/// by this one's background threads of a database closed a moment ago).
pub fn lock_held(e: &sled::Error) -> bool {
    // sled 0.34 reports a held flock as an `Other` I/O error with this text.
    matches!(e, sled::Error::Io(io)
        if io.kind() == ErrorKind::Other && io.to_string().contains("could not acquire lock"))
}

/// [`lock_held`] for the result of a sled open (the `locked` of
/// [`waiting_for_lock`]).
pub fn sled_locked<T>(r: &Result<T, sled::Error>) -> bool {
    matches!(r, Err(e) if lock_held(e))
}

/// Tries an open again while `locked` says sled's lock was held, for up to a
/// second: sled's background threads of a database closed a moment ago (in
/// this process or one that just exited) can hold it for a few milliseconds
/// more.
pub fn waiting_for_lock<R>(locked: impl Fn(&R) -> bool, mut open: impl FnMut() -> R) -> R {
    let mut attempt = open();
    for _ in 0..40 {
        if !locked(&attempt) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
        attempt = open();
    }
    attempt
}

fn classify(e: sled::Error) -> Failure {
    match &e {
        _ if lock_held(&e) => Failure::InUse(e),
        sled::Error::Io(io)
            if matches!(io.kind(), ErrorKind::InvalidData | ErrorKind::UnexpectedEof) =>
        {
            Failure::Damaged(e.to_string())
        }
        sled::Error::Io(_) => Failure::Other(e),
        sled::Error::Corruption { .. }
        | sled::Error::Unsupported(_)
        | sled::Error::ReportableBug(_)
        | sled::Error::CollectionNotFound(_) => Failure::Damaged(e.to_string()),
    }
}

fn panic_text(p: Box<dyn Any + Send>) -> String {
    match crate::panics::message(p.as_ref()) {
        Some(s) => format!("sled panicked: {s}"),
        None => "sled panicked".to_string(),
    }
}

/// Whether the database in `dir` was made with compression; None when there
/// is none yet (a new database is made compressed).
pub fn compressed_on_disk(dir: &Path) -> Option<bool> {
    let raw = std::fs::read(dir.join("conf")).ok()?;
    let text = String::from_utf8_lossy(&raw);
    text.lines()
        .find_map(|l| l.strip_prefix("use_compression:"))
        .map(|v| v.trim() == "true")
}

/// zstd's level for sled's log. sled compresses every log entry with a
/// fresh context, whose tables level 1 keeps smallest: the cheapest per
/// record, and records of one pipeline are alike enough that the higher
/// levels save little more (benches/outbox.rs, benches/outbox_wear.rs).
pub const COMPRESSION_LEVEL: i32 = 1;

/// Opens sled at `dir` and scans it. sled 0.34 can panic on some damaged
/// files instead of returning an error: that is caught and called damage.
pub fn load(dir: &Path, cfg: &OutboxConfig) -> Result<Loaded, Failure> {
    match catch_unwind(AssertUnwindSafe(|| load_inner(dir, cfg))) {
        Ok(r) => r,
        Err(p) => Err(Failure::Damaged(panic_text(p))),
    }
}

fn load_inner(dir: &Path, cfg: &OutboxConfig) -> Result<Loaded, Failure> {
    let db = sled::Config::new()
        .path(dir)
        .cache_capacity(cfg.cache_capacity)
        // The group commit flushes; sled's own 500 ms flusher would only add I/O.
        .flush_every_ms(None)
        // As the database was made (sled refuses the other setting); a new
        // one as configured (see upgrade.rs).
        .use_compression(compressed_on_disk(dir).unwrap_or(cfg.compress))
        .compression_factor(COMPRESSION_LEVEL)
        .open()
        .map_err(classify)?;
    let records = db.open_tree("records").map_err(classify)?;
    let dead = db.open_tree("dead_letters").map_err(classify)?;
    let meta = db.open_tree("meta").map_err(classify)?;
    let (records_n, records_bytes, last_r) = scan(&records)?;
    let (dead_n, dead_bytes, last_d) = scan(&dead)?;
    let meta_boot = match meta.get(BOOT_KEY).map_err(classify)? {
        None => 0,
        Some(v) => {
            let b: [u8; 8] = v.as_ref().try_into().map_err(|_| {
                Failure::Damaged(format!("meta boot value has {} bytes, not 8", v.len()))
            })?;
            u64::from_be_bytes(b)
        }
    };
    let last_boot = meta_boot.max(last_r).max(last_d);
    Ok(Loaded {
        db,
        records,
        dead,
        meta,
        records_n,
        records_bytes,
        dead_n,
        dead_bytes,
        last_boot,
    })
}

/// Counts entries and bytes (the accounting is not stored: a scan at open
/// cannot disagree with the data) and returns the highest key's boot.
fn scan(t: &sled::Tree) -> Result<(u64, u64, u64), Failure> {
    let (mut n, mut bytes) = (0u64, 0u64);
    for kv in t.iter() {
        let (k, v) = kv.map_err(classify)?;
        n += 1;
        bytes += (k.len() + v.len()) as u64;
    }
    let last = match t.last().map_err(classify)? {
        Some((k, _)) => Key::from_bytes(&k).map_or(0, Key::boot),
        None => 0,
    };
    Ok((n, bytes, last))
}

/// Persists this open's boot number before any append can use it: in sled
/// (flushed and fsynced by the caller) and in the sidecar file.
pub fn store_boot(meta: &sled::Tree, boot: u64) -> Result<(), OutboxError> {
    meta.insert(BOOT_KEY, &boot.to_be_bytes())
        .map_err(OutboxError::db("store boot"))?;
    Ok(())
}

/// The sidecar's boot; a missing or unreadable sidecar reads as 0 (sled's
/// copy and the keys then decide).
pub fn read_boot_file(dir: &Path) -> u64 {
    let p = dir.join(BOOT_FILE);
    match std::fs::read_to_string(&p) {
        Ok(s) => s.trim().parse().unwrap_or_else(|e| {
            tracing::warn!(path = %p.display(), error = %e, "unreadable outbox boot file ignored");
            0
        }),
        Err(_) => 0,
    }
}

/// Writes the sidecar atomically: temp file, fsync, rename, fsync the directory.
pub fn write_boot_file(dir: &Path, boot: u64) -> Result<(), OutboxError> {
    let p = dir.join(BOOT_FILE);
    let tmp = dir.join(format!("{BOOT_FILE}.tmp"));
    let io = |op, path: &Path| {
        let path = path.to_path_buf();
        move |source| OutboxError::Io { op, path, source }
    };
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp).map_err(io("create", &tmp))?;
        writeln!(f, "{boot}").map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
    }
    std::fs::rename(&tmp, &p).map_err(io("rename", &p))?;
    sync_dir(dir)
}

/// Moves a damaged database to `<dir>/../quarantine/outbox-<unix-ts>` (with
/// a `-N` suffix if that exists). Never deletes: an operator may recover it.
pub fn quarantine(dir: &Path) -> Result<PathBuf, OutboxError> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let qdir = parent.join("quarantine");
    std::fs::create_dir_all(&qdir).map_err(|source| OutboxError::Quarantine {
        path: dir.to_path_buf(),
        to: qdir.clone(),
        source,
    })?;
    let ts = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut to = qdir.join(format!("outbox-{ts}"));
    let mut n = 1;
    while to.exists() {
        to = qdir.join(format!("outbox-{ts}-{n}"));
        n += 1;
    }
    std::fs::rename(dir, &to).map_err(|source| OutboxError::Quarantine {
        path: dir.to_path_buf(),
        to: to.clone(),
        source,
    })?;
    sync_dir(&qdir)?;
    sync_dir(&parent)?;
    Ok(to)
}

/// Key length check for values read back (keys are written only by us).
pub fn key_of(k: &[u8]) -> Result<Key, OutboxError> {
    Key::from_bytes(k).ok_or_else(|| OutboxError::Corrupt {
        key: hex::encode(k),
        reason: format!("key has {} bytes, not {KEY_LEN}", k.len()),
    })
}
