//! UDP: one frame per datagram. With `framing = "raw"` the stream is the
//! sender's address; with `named` the datagram names it.

use std::net::SocketAddr;

use bytes::Bytes;

use super::framing::split_named;
use super::{Frame, Framing, Source, SourceCtx, SourceError};

pub struct UdpSource {
    pub listen: SocketAddr,
    pub framing: Framing,
}

/// Datagrams can be up to 64 KiB.
const MAX_DATAGRAM: usize = 65_536;

impl Source for UdpSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        let setup = |detail: String| SourceError::Setup {
            pipeline: ctx.pipeline.clone(),
            kind: "udp",
            detail,
        };
        let std_sock = std::net::UdpSocket::bind(self.listen)
            .map_err(|e| setup(format!("bind {}: {e}", self.listen)))?;
        std_sock
            .set_nonblocking(true)
            .map_err(|e| setup(e.to_string()))?;
        let sock = tokio::net::UdpSocket::from_std(std_sock).map_err(|e| setup(e.to_string()))?;
        tracing::info!(pipeline = %ctx.pipeline, listen = %self.listen, "udp source listening");
        Ok(tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_DATAGRAM];
            loop {
                let (n, peer) = tokio::select! {
                    r = sock.recv_from(&mut buf) => match r {
                        Ok(x) => x,
                        Err(e) => {
                            tracing::warn!(pipeline = %ctx.pipeline, error = %e, "udp receive failed");
                            continue;
                        }
                    },
                    _ = ctx.stopped() => return,
                };
                let body = &buf[..n];
                let frame = match self.framing {
                    Framing::Raw => Frame::new(peer.to_string(), Bytes::copy_from_slice(body)),
                    Framing::Named => match split_named(body) {
                        Ok((name, payload)) => {
                            let stream =
                                name.map(str::to_string).unwrap_or_else(|| peer.to_string());
                            Frame::new(stream, Bytes::copy_from_slice(payload))
                        }
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
        }))
    }
}
