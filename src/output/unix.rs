//! Unix output: outpost listens on a stream socket; every connected reader
//! gets each record as a u32 little-endian length followed by the record.
//!
//! Frames are written from the inference thread with non-blocking writes. A
//! frame that only partly fits is kept and finished before anything later
//! goes to that reader (so a reader always sees whole frames); records that
//! arrive meanwhile drop for that reader as `slow`. A reader that hung up is
//! forgotten at the next write (`gone`). With no reader, records drop as
//! `no_reader`.
//!
//! Readers are capped: at most `max_readers` at once (readers that hung up
//! are pruned first), and none when taking its descriptor would leave fewer
//! than `api.reserved_fds` free for storage; one more is closed at once and
//! counted by reason (`max_readers`, `descriptors`).

use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{OutputStats, Sent};
use crate::telemetry::logging::RateLimitedLog;

/// How many readers one output serves, and the descriptors it may take.
#[derive(Debug, Clone)]
pub struct ReaderLimits {
    pub max_readers: usize,
    /// Descriptors kept free for storage (`api.reserved_fds`).
    pub reserved_fds: u64,
    /// The descriptors all unix outputs' readers share (one permit each);
    /// the API's connection cap was lowered by as many.
    pub budget: Arc<Semaphore>,
}

/// Whether the process holds few enough descriptors (the reader just
/// accepted among them) to keep `reserved` of its limit free. Unknown
/// counts as no: a reader is worth less than storage.
fn fds_to_spare(reserved: u64) -> bool {
    use rustix::process::{Resource, getrlimit};
    let Some(soft) = getrlimit(Resource::Nofile).current else {
        return true;
    };
    match std::fs::read_dir("/proc/self/fd") {
        // The listing's own descriptor counts too: one on the safe side.
        Ok(d) => (d.count() as u64).saturating_add(reserved) <= soft,
        Err(_) => false,
    }
}

struct Reader {
    stream: UnixStream,
    /// The unwritten rest of a frame.
    pending: Vec<u8>,
    /// The reader's descriptor out of the shared budget (back when it goes).
    _fd: OwnedSemaphorePermit,
}

/// What one write attempt to a reader did.
enum Wrote {
    All,
    /// Part of it; the rest is pending.
    Part,
    /// Nothing (the socket buffer is full).
    Nothing,
    Gone,
}

impl Reader {
    /// Whether the reader hung up: a read that finds the end of the stream.
    /// Readers have nothing to say, so whatever one sent is discarded.
    fn hung_up(&self) -> bool {
        let mut b = [0u8; 512];
        match (&self.stream).read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => e.kind() != ErrorKind::WouldBlock && e.kind() != ErrorKind::Interrupted,
        }
    }

    /// Writes as much of `buf` as the socket takes now.
    fn write_some(&mut self, buf: &[u8]) -> (usize, bool) {
        let mut done = 0;
        while done < buf.len() {
            match self.stream.write(&buf[done..]) {
                Ok(0) => return (done, false),
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => return (done, true),
                Err(_) => return (done, false),
            }
        }
        (done, true)
    }

    /// Finishes a pending frame; true when nothing is pending any more.
    fn flush_pending(&mut self) -> Result<bool, ()> {
        if self.pending.is_empty() {
            return Ok(true);
        }
        let pending = std::mem::take(&mut self.pending);
        let (n, alive) = self.write_some(&pending);
        if !alive {
            return Err(());
        }
        self.pending = pending[n..].to_vec();
        Ok(self.pending.is_empty())
    }

    fn write_frame(&mut self, head: &[u8; 4], payload: &[u8]) -> Wrote {
        match self.flush_pending() {
            Err(()) => return Wrote::Gone,
            Ok(false) => return Wrote::Nothing,
            Ok(true) => {}
        }
        let mut frame = Vec::with_capacity(4 + payload.len());
        frame.extend_from_slice(head);
        frame.extend_from_slice(payload);
        let (n, alive) = self.write_some(&frame);
        if !alive {
            return Wrote::Gone;
        }
        if n == frame.len() {
            Wrote::All
        } else if n == 0 {
            Wrote::Nothing
        } else {
            self.pending = frame[n..].to_vec();
            Wrote::Part
        }
    }
}

pub struct UnixSink {
    readers: Arc<Mutex<Vec<Reader>>>,
    stats: Arc<OutputStats>,
}

/// Removes a stale socket file (a previous run's); refuses to remove anything else.
fn clear_stale(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path),
        Ok(_) => Err(std::io::Error::new(
            ErrorKind::AlreadyExists,
            "exists and is not a socket",
        )),
        Err(_) => Ok(()),
    }
}

impl UnixSink {
    /// Binds the socket and starts accepting readers until `shutdown`.
    pub fn listen(
        path: &Path,
        limits: ReaderLimits,
        stats: Arc<OutputStats>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> std::io::Result<(UnixSink, tokio::task::JoinHandle<()>)> {
        if let Some(dir) = path.parent()
            && !dir.as_os_str().is_empty()
        {
            std::fs::create_dir_all(dir)?;
        }
        clear_stale(path)?;
        let listener = tokio::net::UnixListener::bind(path)?;
        let readers: Arc<Mutex<Vec<Reader>>> = Arc::default();
        let sink = UnixSink {
            readers: readers.clone(),
            stats: stats.clone(),
        };
        let path: PathBuf = path.to_path_buf();
        let log = RateLimitedLog::new(Duration::from_secs(30));
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = listener.accept() => match r {
                        Ok((s, _)) => match s.into_std() {
                            // tokio's streams are non-blocking already.
                            Ok(stream) => {
                                let fd = match admit(&readers, &limits) {
                                    Ok(fd) => fd,
                                    Err(reason) => {
                                    // Dropped here: closed at once.
                                    drop(stream);
                                    stats.refuse_reader(reason);
                                    if let Some(suppressed) = log.allow(reason) {
                                        tracing::warn!(
                                            path = %path.display(),
                                            reason,
                                            max_readers = limits.max_readers,
                                            reserved_fds = limits.reserved_fds,
                                            suppressed,
                                            "unix output: reader refused and closed"
                                        );
                                    }
                                    continue;
                                    }
                                };
                                let mut g = readers.lock();
                                g.push(Reader { stream, pending: Vec::new(), _fd: fd });
                                stats.readers.store(g.len() as u64, Ordering::Relaxed);
                                tracing::info!(path = %path.display(), readers = g.len(), "unix output: reader connected");
                            }
                            Err(e) => tracing::warn!(path = %path.display(), error = %e, "unix output: reader refused"),
                        },
                        Err(e) => {
                            tracing::warn!(path = %path.display(), error = %e, "unix output: accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                        }
                    },
                    _ = shutdown.cancelled() => break,
                }
            }
            drop(listener);
            let _ = std::fs::remove_file(&path);
        });
        Ok((sink, task))
    }

    pub(super) fn send(&self, payload: &[u8]) -> Sent {
        let Ok(len) = u32::try_from(payload.len()) else {
            return Sent::Dropped("too_large");
        };
        let head = len.to_le_bytes();
        let mut g = self.readers.lock();
        let mut outcome = if g.is_empty() {
            Sent::Dropped("no_reader")
        } else {
            Sent::Ok
        };
        g.retain_mut(|r| match r.write_frame(&head, payload) {
            Wrote::All | Wrote::Part => true,
            Wrote::Nothing => {
                outcome = Sent::Dropped("slow");
                true
            }
            Wrote::Gone => {
                outcome = Sent::Dropped("gone");
                false
            }
        });
        self.stats.readers.store(g.len() as u64, Ordering::Relaxed);
        outcome
    }

    /// Readers connected now.
    pub fn readers(&self) -> usize {
        self.readers.lock().len()
    }
}

/// Whether one more reader may stay: under `max_readers` (after forgetting
/// readers that hung up), with a descriptor from the readers' budget, and
/// with `reserved_fds` still free in the process (other sockets count
/// too). The descriptor count is read outside the readers' lock (the
/// inference thread takes it for every record).
fn admit(
    readers: &Mutex<Vec<Reader>>,
    limits: &ReaderLimits,
) -> Result<OwnedSemaphorePermit, &'static str> {
    {
        let mut g = readers.lock();
        if g.len() >= limits.max_readers {
            g.retain(|r| !r.hung_up());
        }
        if g.len() >= limits.max_readers {
            return Err("max_readers");
        }
    }
    let fd = limits
        .budget
        .clone()
        .try_acquire_owned()
        .map_err(|_| "descriptors")?;
    if !fds_to_spare(limits.reserved_fds) {
        return Err("descriptors");
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn readers_get_whole_frames_and_a_gone_reader_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.sock");
        let stop = tokio_util::sync::CancellationToken::new();
        let limits = ReaderLimits {
            max_readers: 8,
            reserved_fds: 0,
            budget: Arc::new(Semaphore::new(8)),
        };
        let (sink, _task) = UnixSink::listen(&path, limits, Arc::default(), stop).unwrap();
        assert!(matches!(sink.send(b"x"), Sent::Dropped("no_reader")));
        let mut a = UnixStream::connect(&path).unwrap();
        let t0 = std::time::Instant::now();
        while sink.readers() == 0 {
            assert!(t0.elapsed().as_secs() < 10);
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(matches!(sink.send(b"hello"), Sent::Ok));
        let mut buf = [0u8; 9];
        a.read_exact(&mut buf).unwrap();
        assert_eq!(&buf[..4], &5u32.to_le_bytes());
        assert_eq!(&buf[4..], b"hello");
        drop(a);
        // The first write after a hang-up may still succeed (into the dead
        // socket's buffer); a later one sees the reader gone.
        let mut gone = false;
        for _ in 0..10 {
            if matches!(sink.send(b"again"), Sent::Dropped("gone")) {
                gone = true;
                break;
            }
        }
        assert!(gone && sink.readers() == 0);
    }

    /// At the cap one more reader is closed and counted; a reader that hung
    /// up is forgotten first, so its place is free again without a record.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn readers_beyond_max_readers_are_closed_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.sock");
        let stats: Arc<OutputStats> = Arc::default();
        let limits = ReaderLimits {
            max_readers: 2,
            reserved_fds: 0,
            budget: Arc::new(Semaphore::new(16)),
        };
        let stop = tokio_util::sync::CancellationToken::new();
        let (sink, _task) = UnixSink::listen(&path, limits, stats.clone(), stop).unwrap();
        let wait = |cond: &dyn Fn() -> bool| {
            let t0 = std::time::Instant::now();
            while !cond() {
                assert!(t0.elapsed().as_secs() < 10);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        let a = UnixStream::connect(&path).unwrap();
        let _b = UnixStream::connect(&path).unwrap();
        wait(&|| sink.readers() == 2);
        let mut c = UnixStream::connect(&path).unwrap();
        wait(&|| stats.readers_refused().get("max_readers") == Some(&1));
        let mut buf = [0u8; 1];
        assert_eq!(c.read(&mut buf).unwrap(), 0, "a refused reader is closed");
        drop(a);
        let _d = UnixStream::connect(&path).unwrap();
        wait(&|| stats.readers.load(Ordering::Relaxed) == 2 && sink.readers() == 2);
        assert_eq!(stats.readers_refused().get("max_readers"), Some(&1));
        // An empty descriptor budget refuses as `descriptors`.
        let path2 = dir.path().join("out2.sock");
        let stats2: Arc<OutputStats> = Arc::default();
        let none = ReaderLimits {
            max_readers: 8,
            reserved_fds: 0,
            budget: Arc::new(Semaphore::new(0)),
        };
        let stop2 = tokio_util::sync::CancellationToken::new();
        let (_sink2, _task2) = UnixSink::listen(&path2, none, stats2.clone(), stop2).unwrap();
        let _e = UnixStream::connect(&path2).unwrap();
        wait(&|| stats2.readers_refused().get("descriptors") == Some(&1));
    }
}
