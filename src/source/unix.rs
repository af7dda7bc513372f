//! Unix-domain stream socket: length-prefixed frames from capture processes
//! on the same device. Each connection is a stream (`conn-N`) unless named
//! framing names it per frame.

use std::path::PathBuf;

use bytes::Bytes;
use tokio::io::AsyncReadExt;

use super::framing::{FramingError, MAX_FRAME_BYTES, split_named};
use super::{Frame, Framing, Source, SourceCtx, SourceError};

pub struct UnixSource {
    pub path: PathBuf,
    pub framing: Framing,
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
        let framing = self.framing;
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
                let ctx = ctx.clone();
                tokio::spawn(connection(stream, format!("conn-{conn_no}"), framing, ctx));
            }
            let _ = std::fs::remove_file(&self.path);
        }))
    }
}

async fn connection(
    mut s: tokio::net::UnixStream,
    default_stream: String,
    framing: Framing,
    ctx: SourceCtx,
) {
    loop {
        let len = tokio::select! {
            r = s.read_u32_le() => match r {
                Ok(n) => n as usize,
                // EOF or reset: the peer is gone.
                Err(_) => return,
            },
            _ = ctx.stopped() => return,
        };
        if len > MAX_FRAME_BYTES {
            let e = FramingError::TooLarge(len);
            ctx.count_drop(
                e.reason(),
                &format!("{default_stream}: {e}; closing the connection"),
            );
            return;
        }
        let mut body = vec![0u8; len];
        if s.read_exact(&mut body).await.is_err() {
            ctx.count_drop(
                "truncated_frame",
                &format!("{default_stream}: connection closed inside a frame"),
            );
            return;
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
