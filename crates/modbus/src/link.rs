//! One client connection to a PLC (tokio-modbus on a TCP stream with
//! TCP_NODELAY): connect with backoff, one request at a time, each bounded
//! by the timeout. A failed or late request drops the connection (an answer
//! arriving late would be read as the next one's); the next call connects
//! again once the backoff allows.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;
use tokio_modbus::client::{Context, Reader as _, Writer as _};
use tokio_modbus::prelude::{Slave, SlaveContext as _};

use crate::config::Table;

/// The first retry delay; it doubles per failure up to [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_millis(100);
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Exponential backoff, free of I/O: the delay after `failures` failures.
pub fn backoff(failures: u32) -> Duration {
    MIN_BACKOFF
        .saturating_mul(1u32 << failures.min(16))
        .min(MAX_BACKOFF)
}

/// What a request does.
#[derive(Debug, Clone, Copy)]
pub enum Op<'a> {
    WriteRegisters(u16, &'a [u16]),
    WriteCoil(u16, bool),
    WriteCoils(u16, &'a [bool]),
    Read(Table, u16, u16),
}

/// A request's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Written,
    Words(Vec<u16>),
    Bits(Vec<bool>),
}

/// Why a request got no answer; the connection is gone either way and
/// retrying after the backoff may help.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{target}: waiting {wait:?} before connecting again")]
    Backoff { target: String, wait: Duration },
    #[error("{target}: cannot connect: {source}")]
    Connect {
        target: String,
        source: std::io::Error,
    },
    #[error("{target}: no answer within {timeout:?}")]
    Timeout { target: String, timeout: Duration },
    #[error("{target}: {source}")]
    Lost {
        target: String,
        source: tokio_modbus::Error,
    },
}

impl LinkError {
    pub fn reason(&self) -> &'static str {
        match self {
            LinkError::Backoff { .. } => "backoff",
            LinkError::Connect { .. } => "connect",
            LinkError::Timeout { .. } => "timeout",
            LinkError::Lost { .. } => "lost",
        }
    }
}

/// Counters of one connection (shared with status).
#[derive(Debug, Default)]
pub struct LinkStats {
    pub connected: AtomicBool,
    /// Connections made.
    pub connects: AtomicU64,
    /// Requests answered (exceptions included).
    pub requests: AtomicU64,
    /// Exception answers by code.
    pub exceptions: Mutex<BTreeMap<u8, u64>>,
    /// Requests and connects that failed, by reason (`connect`, `timeout`, `lost`).
    pub failures: Mutex<BTreeMap<&'static str, u64>>,
}

/// One connection in `/v1/status`.
#[derive(Debug, Clone, Serialize)]
pub struct LinkStatus {
    pub target: String,
    pub connected: bool,
    pub connects: u64,
    pub requests: u64,
    pub exceptions: BTreeMap<u8, u64>,
    pub failures: BTreeMap<&'static str, u64>,
}

impl LinkStats {
    pub fn status(&self, target: &str) -> LinkStatus {
        LinkStatus {
            target: target.to_string(),
            connected: self.connected.load(Ordering::Relaxed),
            connects: self.connects.load(Ordering::Relaxed),
            requests: self.requests.load(Ordering::Relaxed),
            exceptions: self.exceptions.lock().clone(),
            failures: self.failures.lock().clone(),
        }
    }
}

pub struct Link {
    pub target: String,
    timeout: Duration,
    ctx: Option<Context>,
    failures: u32,
    next_try: Instant,
    pub stats: std::sync::Arc<LinkStats>,
}

impl Link {
    pub fn new(target: &str, timeout: Duration) -> Link {
        Link {
            target: target.to_string(),
            timeout,
            ctx: None,
            failures: 0,
            next_try: Instant::now(),
            stats: Default::default(),
        }
    }

    pub fn connected(&self) -> bool {
        self.ctx.is_some()
    }

    /// When the next connect may be tried (now when connected).
    pub fn ready_at(&self) -> Instant {
        if self.ctx.is_some() {
            Instant::now()
        } else {
            self.next_try
        }
    }

    fn failed(&mut self, reason: &'static str) {
        self.ctx = None;
        self.stats.connected.store(false, Ordering::Relaxed);
        *self.stats.failures.lock().entry(reason).or_default() += 1;
        self.next_try = Instant::now() + backoff(self.failures);
        self.failures = self.failures.saturating_add(1);
    }

    /// Connects unless connected. Returns true for a new connection.
    pub async fn connect(&mut self) -> Result<bool, LinkError> {
        if self.ctx.is_some() {
            return Ok(false);
        }
        let now = Instant::now();
        if now < self.next_try {
            return Err(LinkError::Backoff {
                target: self.target.clone(),
                wait: self.next_try - now,
            });
        }
        let attempt = async {
            let addr = tokio::net::lookup_host(&self.target)
                .await?
                .next()
                .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))?;
            let s = tokio::net::TcpStream::connect(addr).await?;
            // One small request per write: latency, not packet count.
            s.set_nodelay(true)?;
            Ok::<_, std::io::Error>(s)
        };
        let stream = match tokio::time::timeout(self.timeout, attempt).await {
            Ok(Ok(s)) => s,
            Ok(Err(source)) => {
                self.failed("connect");
                return Err(LinkError::Connect {
                    target: self.target.clone(),
                    source,
                });
            }
            Err(_) => {
                self.failed("connect");
                return Err(LinkError::Connect {
                    target: self.target.clone(),
                    source: std::io::ErrorKind::TimedOut.into(),
                });
            }
        };
        self.ctx = Some(tokio_modbus::client::tcp::attach_slave(stream, Slave(1)));
        self.failures = 0;
        self.stats.connected.store(true, Ordering::Relaxed);
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// One request to `unit` (connecting first if needed): the answer, or
    /// the PLC's exception code.
    pub async fn call(&mut self, unit: u8, op: Op<'_>) -> Result<Result<Reply, u8>, LinkError> {
        self.connect().await?;
        let Some(ctx) = self.ctx.as_mut() else {
            return Err(LinkError::Connect {
                target: self.target.clone(),
                source: std::io::ErrorKind::NotConnected.into(),
            });
        };
        ctx.set_slave(Slave(unit));
        let req = async {
            match op {
                Op::WriteRegisters(a, w) => ctx
                    .write_multiple_registers(a, w)
                    .await
                    .map(|r| r.map(|()| Reply::Written)),
                Op::WriteCoil(a, on) => ctx
                    .write_single_coil(a, on)
                    .await
                    .map(|r| r.map(|()| Reply::Written)),
                Op::WriteCoils(a, b) => ctx
                    .write_multiple_coils(a, b)
                    .await
                    .map(|r| r.map(|()| Reply::Written)),
                Op::Read(Table::Holding, a, n) => ctx
                    .read_holding_registers(a, n)
                    .await
                    .map(|r| r.map(Reply::Words)),
                Op::Read(Table::Input, a, n) => ctx
                    .read_input_registers(a, n)
                    .await
                    .map(|r| r.map(Reply::Words)),
                Op::Read(Table::Coils, a, n) => {
                    ctx.read_coils(a, n).await.map(|r| r.map(Reply::Bits))
                }
                Op::Read(Table::Discrete, a, n) => ctx
                    .read_discrete_inputs(a, n)
                    .await
                    .map(|r| r.map(Reply::Bits)),
            }
        };
        match tokio::time::timeout(self.timeout, req).await {
            Ok(Ok(Ok(reply))) => {
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                Ok(Ok(reply))
            }
            Ok(Ok(Err(exception))) => {
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                let code = u8::from(exception);
                *self.stats.exceptions.lock().entry(code).or_default() += 1;
                Ok(Err(code))
            }
            Ok(Err(source)) => {
                self.failed("lost");
                Err(LinkError::Lost {
                    target: self.target.clone(),
                    source,
                })
            }
            Err(_) => {
                self.failed("timeout");
                Err(LinkError::Timeout {
                    target: self.target.clone(),
                    timeout: self.timeout,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_ceiling() {
        assert_eq!(backoff(0), Duration::from_millis(100));
        assert_eq!(backoff(1), Duration::from_millis(200));
        assert_eq!(backoff(5), Duration::from_millis(3200));
        assert_eq!(backoff(6), MAX_BACKOFF);
        assert_eq!(backoff(u32::MAX), MAX_BACKOFF);
    }
}
