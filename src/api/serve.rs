//! The API's accept loop: axum's router on hyper, with what `axum::serve`
//! does not offer: a cap on connections served at once (one more is
//! answered 503 and closed, counted, logged at a limited rate), a
//! header-read timeout (which also closes idle connections), and a cap
//! lowered at start so connections never take the descriptors storage
//! needs.
//!
//! A few of the cap's slots ([`health_slots`]) are kept for `/healthz`,
//! `/readyz`, `/metrics` and `/v1/status`: slow request bodies (each may
//! take `body_read_timeout`), event streams or http-source requests
//! waiting for their commit can hold every general slot, and the checks
//! that decide whether to restart the daemon, and the status that says
//! why it is busy, must still be answered. A connection accepted while the general slots are full takes a
//! kept slot: it is served one request (no keep-alive), with a short
//! header timeout; a GET or HEAD of those three paths is answered, anything
//! else 503 at once, without reading its body. So no body can hold a kept
//! slot, and one is free again as soon as its single answer is written.
//!
//! Invariant: at most `max_connections` accepted connections are open
//! (general and kept slots together), plus the one being turned away; so
//! with the cap below the descriptor limit minus `reserved_fds`, the
//! outbox, watch folders and the uplink always find a descriptor.

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

/// Most slots of the cap kept for the health paths.
pub const HEALTH_SLOTS: usize = 8;
/// What a kept slot's connection gets to send its request header: health
/// checkers send theirs at once, and a slot held by a silent client is one
/// a checker cannot have.
const HEALTH_HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// The paths kept slots serve.
const HEALTH_PATHS: [&str; 4] = ["/healthz", "/readyz", "/metrics", "/v1/status"];

/// Slots of a cap of `cap` kept for the health paths: [`HEALTH_SLOTS`],
/// and never more than half of the cap (a cap of 1 keeps none).
pub fn health_slots(cap: usize) -> usize {
    HEALTH_SLOTS.min(cap / 2)
}

/// Whether a kept slot serves this request.
fn health_request<B>(req: &axum::http::Request<B>) -> bool {
    matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    ) && HEALTH_PATHS.contains(&req.uri().path())
}

/// The 503 a kept slot gives any other request.
fn busy_response() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        [
            (axum::http::header::RETRY_AFTER, "1"),
            (axum::http::header::CONNECTION, "close"),
        ],
        "too many connections\r\n",
    )
        .into_response()
}

/// Connection figures for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnStats {
    pub open: AtomicU64,
    pub accepted: AtomicU64,
    /// Turned away at the cap (also: a request other than a health check
    /// on a kept slot).
    pub refused: AtomicU64,
    /// accept() failed (e.g. no descriptor left).
    pub accept_errors: AtomicU64,
    /// The cap in force (after lowering it to the descriptor limit).
    pub max: AtomicU64,
    /// Slots of the cap kept for `/healthz`, `/readyz`, `/metrics` and `/v1/status`.
    pub health_slots: AtomicU64,
    /// Connections served on a kept slot.
    pub health_accepted: AtomicU64,
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
        gauge(
            enc,
            "outpost_api_health_connections",
            "Connections of max_connections kept for /healthz, /readyz, /metrics and /v1/status",
            &[(none.clone(), g(&self.health_slots) as f64)],
        )?;
        counter(
            enc,
            "outpost_api_connections_accepted",
            "Connections accepted by the local API",
            &[(none.clone(), g(&self.accepted))],
        )?;
        counter(
            enc,
            "outpost_api_health_connections_accepted",
            "Connections accepted on a slot kept for the health paths (the others were full)",
            &[(none.clone(), g(&self.health_accepted))],
        )?;
        counter(
            enc,
            "outpost_api_connections_refused",
            "Connections turned away (503) at max_connections, and requests other than health checks on a kept slot",
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
    let kept = health_slots(cap);
    stats.health_slots.store(kept as u64, Ordering::Relaxed);
    let slots = Arc::new(Semaphore::new(cap - kept));
    let health = Arc::new(Semaphore::new(kept));
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
        let (permit, health_only) = match slots.clone().try_acquire_owned() {
            Ok(p) => (p, false),
            Err(_) => match health.clone().try_acquire_owned() {
                Ok(p) => (p, true),
                Err(_) => {
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
                        let _ =
                            tokio::time::timeout(Duration::from_secs(1), s.write_all(BUSY)).await;
                    });
                    continue;
                }
            },
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        if health_only {
            stats.health_accepted.fetch_add(1, Ordering::Relaxed);
        }
        stats.open.fetch_add(1, Ordering::Relaxed);
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let stats_c = stats.clone();
        let stopping = stop.clone().cancelled_owned();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new());
            if health_only {
                builder
                    .header_read_timeout(header_timeout.min(HEALTH_HEADER_TIMEOUT))
                    .keep_alive(false);
            } else {
                builder.header_read_timeout(header_timeout);
            }
            let refused = stats_c.clone();
            let service = hyper::service::service_fn(move |req| {
                let service = service.clone();
                let refused = refused.clone();
                async move {
                    if health_only && !health_request(&req) {
                        refused.refused.fetch_add(1, Ordering::Relaxed);
                        return Ok(busy_response());
                    }
                    hyper::service::Service::call(&service, req).await
                }
            });
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
    let _ = tokio::time::timeout(DRAIN + Duration::from_secs(1), async {
        let _ = slots.acquire_many((cap - kept) as u32).await;
        let _ = health.acquire_many(kept as u32).await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_slots_are_a_few_and_never_more_than_half() {
        assert_eq!(health_slots(512), HEALTH_SLOTS);
        assert_eq!(health_slots(10), 5);
        assert_eq!(health_slots(1), 0);
    }

    #[test]
    fn kept_slots_serve_only_health_reads() {
        let req = |m: &str, p: &str| {
            axum::http::Request::builder()
                .method(m)
                .uri(p)
                .body(())
                .unwrap()
        };
        assert!(health_request(&req("GET", "/healthz")));
        assert!(health_request(&req("HEAD", "/readyz")));
        assert!(health_request(&req("GET", "/metrics?x=1")));
        assert!(!health_request(&req("POST", "/healthz")));
        assert!(health_request(&req("GET", "/v1/status")));
        assert!(!health_request(&req("GET", "/v1/status/x")));
        assert!(!health_request(&req("POST", "/v1/pipelines/a/infer")));
    }
}
