//! Unix-domain stream socket: length-prefixed frames from capture processes
//! on the same device. Each connection is a stream (`conn-N`) unless named
//! framing names it per frame.
//!
//! Bounded, and no connection can hold up another:
//! - at most `max_connections` at once (one more is closed and counted
//!   `too_many_connections`);
//! - the frames being read hold at most `max_buffered_bytes` together. Half
//!   of it is split into one share per connection: a frame that fits its
//!   connection's share is read at once, whatever the others do. Larger
//!   frames reserve their whole length from the other half (the pool)
//!   before anything of them is read, so a frame either has all its room or
//!   none (no two frames can each wait for room the other holds); the
//!   largest frame is the pool's size. A frame's buffer grows only with the
//!   bytes that arrive;
//! - once a frame has begun (its first length byte), the rest of it must
//!   arrive within `frame_read_timeout`: a writer that stalls inside a frame
//!   is closed and counted (`frame_read_timeout`), and its room goes back.
//!   Between frames a connection may stay idle.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::AsyncReadExt;
use tokio::sync::Semaphore;

use super::framing::{FramingError, MAX_FRAME_BYTES, split_named};
use super::{Frame, Framing, Source, SourceCtx, SourceError};

pub struct UnixSource {
    pub path: PathBuf,
    pub framing: Framing,
    pub max_connections: usize,
    pub max_buffered_bytes: usize,
    pub frame_read_timeout: Duration,
}

/// How `max_buffered_bytes` is split: (each connection's share, the pool
/// the larger frames reserve from). Shares and pool together never exceed
/// the budget.
pub fn split_budget(max_buffered: usize, max_connections: usize) -> (usize, usize) {
    let share = max_buffered / 2 / max_connections.max(1);
    let pool = max_buffered - share * max_connections.max(1);
    (share, pool)
}

/// What the connections of one source share.
#[derive(Clone)]
struct Limits {
    framing: Framing,
    /// Bytes a frame may take without the pool.
    share: usize,
    /// Bytes of the larger frames being read (one permit a byte).
    pool: Arc<Semaphore>,
    /// The largest frame taken.
    largest: usize,
    read_timeout: Duration,
}

impl Source for UnixSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let setup = |detail: String| SourceError::Setup {
            pipeline: ctx.pipeline.clone(),
            kind: "unix",
            detail,
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| setup(format!("{}: {e}", dir.display())))?;
        }
        // A socket file left by a previous run would make bind fail; nothing else can own it
        // (a second daemon on the same data would have failed on the outbox lock first).
        if self.path.exists() {
            let _ = std::fs::remove_file(&self.path);
        }
        let std_l = std::os::unix::net::UnixListener::bind(&self.path)
            .map_err(|e| setup(format!("bind {}: {e}", self.path.display())))?;
        std_l
            .set_nonblocking(true)
            .map_err(|e| setup(e.to_string()))?;
        let listener =
            tokio::net::UnixListener::from_std(std_l).map_err(|e| setup(e.to_string()))?;
        tracing::info!(pipeline = %ctx.pipeline, path = %self.path.display(), "unix source listening");
        let (share, pool) = split_budget(self.max_buffered_bytes, self.max_connections);
        let limits = Limits {
            framing: self.framing,
            share,
            pool: Arc::new(Semaphore::new(pool)),
            largest: pool.min(MAX_FRAME_BYTES),
            read_timeout: self.frame_read_timeout,
        };
        let slots = Arc::new(Semaphore::new(self.max_connections));
        Ok(tokio::spawn(async move {
            let mut conn_no = 0u64;
            loop {
                let stream = tokio::select! {
                    r = listener.accept() => match r {
                        Ok((s, _)) => s,
                        Err(e) => {
                            tracing::warn!(pipeline = %ctx.pipeline, error = %e, "unix accept failed");
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    _ = ctx.stopped() => break,
                };
                conn_no += 1;
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    ctx.count_drop(
                        "too_many_connections",
                        &format!(
                            "conn-{conn_no}: {} connections are open; closed",
                            self.max_connections
                        ),
                    );
                    drop(stream);
                    continue;
                };
                let ctx = ctx.clone();
                let limits = limits.clone();
                tokio::spawn(async move {
                    connection(stream, format!("conn-{conn_no}"), limits, ctx).await;
                    drop(slot);
                });
            }
            let _ = std::fs::remove_file(&self.path);
        }))
    }
}

async fn connection(
    mut s: tokio::net::UnixStream,
    default_stream: String,
    limits: Limits,
    ctx: SourceCtx,
) {
    let framing = limits.framing;
    let timed_out = |what: &str| {
        ctx.count_drop(
            "frame_read_timeout",
            &format!(
                "{default_stream}: {what} did not arrive within {:?} (frame_read_timeout); closing the connection",
                limits.read_timeout
            ),
        );
    };
    loop {
        // Idle between frames is fine; the first length byte starts the clock.
        let mut head = [0u8; 4];
        let got = tokio::select! {
            r = s.read(&mut head) => match r {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            },
            _ = ctx.stopped() => return,
        };
        if got < head.len() {
            let rest = tokio::select! {
                r = tokio::time::timeout(limits.read_timeout, s.read_exact(&mut head[got..])) => r,
                _ = ctx.stopped() => return,
            };
            match rest {
                Err(_) => {
                    timed_out("a frame's length");
                    return;
                }
                // EOF or reset: the peer is gone.
                Ok(Err(_)) => return,
                Ok(Ok(_)) => {}
            }
        }
        let len = u32::from_le_bytes(head) as usize;
        if len > limits.largest {
            let e = FramingError::TooLarge(len);
            ctx.count_drop(
                e.reason(),
                &format!(
                    "{default_stream}: {e} (at most {} bytes with this max_buffered_bytes); closing the connection",
                    limits.largest
                ),
            );
            return;
        }
        // A frame over the share needs room in the pool first: all of it,
        // before anything is read (nothing is allocated ahead of the bytes).
        let _reserved = if len > limits.share {
            let permits = u32::try_from(len).unwrap_or(u32::MAX);
            let r = tokio::select! {
                r = limits.pool.clone().acquire_many_owned(permits) => r,
                _ = ctx.stopped() => return,
            };
            match r {
                Ok(p) => Some(p),
                Err(_) => return,
            }
        } else {
            None
        };
        let mut body = Vec::new();
        let mut frame_bytes = (&mut s).take(len as u64);
        let read = tokio::select! {
            r = tokio::time::timeout(limits.read_timeout, frame_bytes.read_to_end(&mut body)) => r,
            _ = ctx.stopped() => return,
        };
        match read {
            Err(_) => {
                timed_out(&format!(
                    "{} of a {len}-byte frame's bytes",
                    len - body.len()
                ));
                return;
            }
            Ok(r) if r.is_err() || body.len() != len => {
                ctx.count_drop(
                    "truncated_frame",
                    &format!("{default_stream}: connection closed inside a frame"),
                );
                return;
            }
            Ok(_) => {}
        }
        let frame = match framing {
            Framing::Raw => Frame::new(default_stream.as_str(), Bytes::from(body)),
            Framing::Named => match split_named(&body) {
                Ok((name, payload)) => Frame::new(
                    name.unwrap_or(&default_stream),
                    Bytes::copy_from_slice(payload),
                ),
                Err(e) => {
                    ctx.count_drop(e.reason(), &e.to_string());
                    continue;
                }
            },
        };
        if !ctx.submit(frame).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_splits_into_shares_and_a_pool_within_it() {
        // The defaults: 1 MiB a connection, 64 MiB for larger frames.
        assert_eq!(split_budget(128 << 20, 64), (1 << 20, 64 << 20));
        for (b, c) in [
            (1024, 1),
            (1024, 4096),
            (64 << 20, 4),
            (u32::MAX as usize, 7),
        ] {
            let (share, pool) = split_budget(b, c);
            assert!(share * c + pool <= b, "{b} {c}");
            assert!(pool >= b / 2, "{b} {c}");
        }
    }
}
