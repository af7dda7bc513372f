//! Unix output: outpost listens on a stream socket; every connected reader
//! gets each record as a u32 little-endian length followed by the record.
//!
//! Frames are written from the inference thread with non-blocking writes. A
//! frame that only partly fits is kept and finished before anything later
//! goes to that reader (so a reader always sees whole frames); records that
//! arrive meanwhile drop for that reader as `slow`. A reader that hung up is
//! forgotten at the next write (`gone`). With no reader, records drop as
//! `no_reader`.

use std::io::{ErrorKind, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::Sent;

struct Reader {
    stream: UnixStream,
    /// The unwritten rest of a frame.
    pending: Vec<u8>,
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
        };
        let path: PathBuf = path.to_path_buf();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    r = listener.accept() => match r {
                        Ok((s, _)) => match s.into_std() {
                            // tokio's streams are non-blocking already.
                            Ok(stream) => {
                                let mut g = readers.lock().unwrap_or_else(|p| p.into_inner());
                                g.push(Reader { stream, pending: Vec::new() });
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
        let mut g = self.readers.lock().unwrap_or_else(|p| p.into_inner());
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
        outcome
    }

    /// Readers connected now.
    pub fn readers(&self) -> usize {
        self.readers.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[tokio::test]
    async fn readers_get_whole_frames_and_a_gone_reader_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.sock");
        let stop = tokio_util::sync::CancellationToken::new();
        let (sink, _task) = UnixSink::listen(&path, stop).unwrap();
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
}
