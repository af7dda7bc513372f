//! The API's accept loop: axum's router on hyper, with what `axum::serve`
//! does not offer: a cap on connections served at once (one more is
//! answered 503 and closed, counted, logged at a limited rate), a
//! header-read timeout (which also closes idle connections), and a cap
//! lowered at start so connections never take the descriptors storage
//! needs.
//!
//! Invariant: at most `max_connections` accepted connections are open, plus
//! the one being turned away; so with the cap below the descriptor limit
//! minus `reserved_fds`, the outbox, watch folders and the uplink always
//! find a descriptor.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use prometheus_client::encoding::DescriptorEncoder;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::config::ApiConfig;
use crate::telemetry::metrics::{MetricSource, counter, gauge};

/// How long open connections get to finish at shutdown.
const DRAIN: Duration = Duration::from_secs(5);
/// How often a repeated accept problem is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\nContent-Length: 22\r\nConnection: close\r\n\r\ntoo many connections\r\n";

/// Connection figures for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub open: AtomicU64,
    pub accepted: AtomicU64,
    /// Turned away at the cap.
    pub refused: AtomicU64,
    /// accept() failed (e.g. no descriptor left).
    pub accept_errors: AtomicU64,
    /// The cap in force (after lowering it to the descriptor limit).
    pub max: AtomicU64,
}

impl MetricSource for ConnStats {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let none = Vec::new();
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        gauge(
            enc,
            "outpost_api_connections",
            "Open connections to the local API",
            &[(none.clone(), g(&self.open) as f64)],
        )?;
        gauge(
            enc,
            "outpost_api_max_connections",
            "Connections the local API serves at once",
            &[(none.clone(), g(&self.max) as f64)],
        )?;
        counter(
            enc,
            "outpost_api_connections_accepted",
            "Connections accepted by the local API",
            &[(none.clone(), g(&self.accepted))],
        )?;
        counter(
            enc,
            "outpost_api_connections_refused",
            "Connections turned away (503) at max_connections",
            &[(none.clone(), g(&self.refused))],
        )?;
        counter(
            enc,
            "outpost_api_accept_errors",
            "Failed accepts (no descriptor left, ...)",
            &[(none, g(&self.accept_errors))],
        )
    }
}

/// The descriptor limit: the soft limit raised to the hard one (systemd's
/// `LimitNOFILE` sets both), then the connection cap that leaves
/// `reserved` descriptors free. Returns (cap, soft limit).
pub fn connection_cap(cfg: &ApiConfig) -> (usize, Option<u64>) {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut lim = getrlimit(Resource::Nofile);
    if let (Some(cur), Some(max)) = (lim.current, lim.maximum)
        && cur < max
    {
        lim.current = Some(max);
        if setrlimit(Resource::Nofile, lim).is_err() {
            lim.current = Some(cur);
        }
    }
    let Some(soft) = lim.current else {
        // Unlimited.
        return (cfg.max_connections, None);
    };
    // Descriptors the process holds already (runtime, models, sockets).
    let held = std::fs::read_dir("/proc/self/fd").map_or(32, |d| d.count() as u64);
    let room = soft.saturating_sub(cfg.reserved_fds + held);
    let cap = cfg
        .max_connections
        .min(usize::try_from(room).unwrap_or(usize::MAX));
    (cap.max(1), Some(soft))
}

/// A limiter for log lines about one repeated condition.
struct Every {
    last: Option<Instant>,
    suppressed: u64,
}

impl Every {
    /// Some(suppressed since the last line) when a line is due.
    fn due(&mut self) -> Option<u64> {
        if self.last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(Instant::now());
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// Serves `app` on `listener` until `stop` is cancelled, then gives open
/// connections [`DRAIN`] to finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    cfg: &ApiConfig,
    cap: usize,
    stats: Arc<ConnStats>,
    stop: CancellationToken,
) {
    stats.max.store(cap as u64, Ordering::Relaxed);
    let slots = Arc::new(Semaphore::new(cap));
    let mut busy_log = Every {
        last: None,
        suppressed: 0,
    };
    let mut error_log = Every {
        last: None,
        suppressed: 0,
    };
    let header_timeout = cfg.header_read_timeout;
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stop.cancelled() => break,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(e) => {
                stats.accept_errors.fetch_add(1, Ordering::Relaxed);
                if let Some(suppressed) = error_log.due() {
                    tracing::error!(error = %e, suppressed, "API: accept failed");
                }
                // EMFILE and the like do not pass by retrying at once.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            if let Some(suppressed) = busy_log.due() {
                tracing::warn!(
                    max_connections = cap,
                    suppressed,
                    "API: connection refused (503): max_connections are open"
                );
            }
            tokio::spawn(async move {
                let mut s = stream;
                let _ = tokio::time::timeout(Duration::from_secs(1), s.write_all(BUSY)).await;
            });
            continue;
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        stats.open.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let stats_c = stats.clone();
        let stopping = stop.clone().cancelled_owned();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let finished = tokio::select! {
                _ = conn.as_mut() => true,
                _ = stopping => false,
            };
            if !finished {
                conn.as_mut().graceful_shutdown();
                let _ = tokio::time::timeout(DRAIN, conn.as_mut()).await;
            }
            stats_c.open.fetch_sub(1, Ordering::Relaxed);
            drop(permit);
        });
    }
    // Wait for the connections to finish (each drains within DRAIN).
    let _ = tokio::time::timeout(
        DRAIN + Duration::from_secs(1),
        slots.acquire_many(cap as u32),
    )
    .await;
}
