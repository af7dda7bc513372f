//! The HTTP uplink: batched NDJSON POSTs (gzip), one request in flight.
//!
//! A batch is the oldest `batch_records` records. 2xx acknowledges it all;
//! timeouts, connection errors, 408, 429 and 5xx retry the same batch (same
//! `Idempotency-Key`) after a backoff or the server's `Retry-After`; any
//! other 4xx splits the batch in halves until the refused records stand
//! alone, and those go to the dead letters: a bad record costs about
//! 2·log2(batch) requests and never blocks the ones behind it.
//!
//! What to send, when, and what to ack is decided by the I/O-free
//! [`Session`] (`session.rs`); this file is its driver: the HTTP client,
//! the outbox calls, the timers and the stop, with the clocks and the
//! backoff's randomness handed in.

mod session;

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

pub use self::session::{Answer, Command, Next, Session, Settings, Unreachable};
use super::stats::UplinkStats;
use super::{HttpConfig, UplinkError, sleep_or_stop, tls};
use crate::clock::clocks::Clocks;
use crate::outbox::{Key, Outbox};

/// The longest `Retry-After` honoured; a longer one is cut to this.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(3600);
/// How long an idle uplink waits for an append before it looks again anyway.
const IDLE_POLL: Duration = Duration::from_secs(5);

/// What to do with a batch after a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Delivered: delete the records.
    Ack,
    /// Send the same batch again, after `after` when the server said so.
    Retry {
        after: Option<Duration>,
        reason: String,
    },
    /// The server refused it for good: bisect, dead-letter single records.
    Reject { reason: String },
}

/// Classifies a response: status, its `Retry-After` header, a body excerpt.
pub fn classify(status: u16, retry_after: Option<&str>, now: SystemTime, body: &str) -> Verdict {
    let excerpt: String = body.chars().take(300).collect();
    let reason = if excerpt.is_empty() {
        format!("HTTP {status}")
    } else {
        format!("HTTP {status}: {excerpt}")
    };
    match status {
        200..=299 => Verdict::Ack,
        408 | 429 | 500..=599 => Verdict::Retry {
            after: retry_after.and_then(|v| parse_retry_after(v, now)),
            reason,
        },
        400..=499 => Verdict::Reject { reason },
        // 1xx/3xx left over after reqwest's redirects: the endpoint is
        // misconfigured, not the records; keep them and retry.
        _ => Verdict::Retry {
            after: None,
            reason,
        },
    }
}

/// `Retry-After`: delta-seconds or an HTTP-date (RFC 9110 §10.2.3), at most
/// an hour; a date in the past is zero.
pub fn parse_retry_after(v: &str, now: SystemTime) -> Option<Duration> {
    let v = v.trim();
    let d = match v.parse::<u64>() {
        Ok(s) => Duration::from_secs(s),
        Err(_) => {
            let at = httpdate::parse_http_date(v).ok()?;
            at.duration_since(now).unwrap_or(Duration::ZERO)
        }
    };
    Some(d.min(MAX_RETRY_AFTER))
}

/// The fleet's time from a delivery's `Date` header (unix µs): a
/// reference for the clock (a clock far ahead of every reference is not
/// trusted), taken only over verified TLS and where the clock agrees.
pub fn fleet_time(date: Option<&str>) -> Option<i64> {
    let t = httpdate::parse_http_date(date?.trim()).ok()?;
    Some(crate::clock::system::unix_us(t))
}

/// Whether requests to `url` authenticate the server: https, whose
/// certificate is always verified (there is no switch to turn that off).
/// Only then is an answer's `Date` the fleet's word.
pub fn verifies_server(url: &str) -> bool {
    reqwest::Url::parse(url).is_ok_and(|u| u.scheme() == "https")
}

/// Stable for the same batch (also after a restart: outbox keys do not
/// change), different for any other set of records of any device.
pub fn idempotency_key(device: &str, keys: &[Key]) -> String {
    let mut h = Sha256::new();
    h.update((device.len() as u64).to_be_bytes());
    h.update(device.as_bytes());
    for k in keys {
        h.update(k.to_bytes());
    }
    hex::encode(h.finalize())
}

/// The request body: one record per line, gzip.
pub fn ndjson_gzip(
    records: impl IntoIterator<Item = impl AsRef<[u8]>>,
) -> std::io::Result<Vec<u8>> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    for r in records {
        gz.write_all(r.as_ref())?;
        gz.write_all(b"\n")?;
    }
    gz.finish()
}

struct Ctx {
    cfg: HttpConfig,
    outbox: Outbox,
    stats: Arc<UplinkStats>,
    client: reqwest::Client,
    headers: reqwest::header::HeaderMap,
    clocks: Arc<dyn Clocks>,
}

/// Starts the uplink: `time` for its timers and its backoff's draws.
pub(super) fn spawn(
    cfg: HttpConfig,
    outbox: Outbox,
    device: &str,
    stats: Arc<UplinkStats>,
    time: super::Time,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, UplinkError> {
    let super::Time { clocks, jitter } = time;
    let mut b = reqwest::Client::builder()
        .timeout(cfg.timeout)
        .connect_timeout(cfg.timeout)
        .no_proxy();
    // reqwest built without a default crypto provider panics unless it is
    // handed a TLS config, also for plain http: give it one that trusts
    // nothing when TLS is not used.
    let https = verifies_server(&cfg.url);
    let tc = if https {
        tls::client_config(cfg.ca.as_deref(), cfg.cert.as_deref(), cfg.key.as_deref())?
    } else {
        tls::trust_nothing()?
    };
    b = b.tls_backend_preconfigured(tc);
    let client = b
        .build()
        .map_err(|e| UplinkError::Setup(format!("HTTP client: {e}")))?;
    let mut headers = reqwest::header::HeaderMap::new();
    for (k, v) in &cfg.headers {
        let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
            .map_err(|e| UplinkError::Setup(format!("header `{k}`: {e}")))?;
        let mut value = reqwest::header::HeaderValue::from_str(v)
            .map_err(|e| UplinkError::Setup(format!("header `{k}`: {e}")))?;
        value.set_sensitive(true);
        headers.insert(name, value);
    }
    let set = Settings {
        device: device.to_string(),
        batch_records: cfg.batch_records,
        backoff_min: cfg.backoff_min,
        backoff_max: cfg.backoff_max,
        max_bytes_per_s: cfg.max_bytes_per_s,
        // https always verifies the server (there is no switch to turn
        // that off): only then is its `Date` the fleet's word.
        date_is_evidence: https,
    };
    let session = Session::new(set, stats.clone(), jitter, clocks.monotonic());
    let ctx = Ctx {
        cfg,
        outbox,
        stats,
        client,
        headers,
        clocks,
    };
    Ok(tokio::spawn(run(ctx, session, shutdown)))
}

impl Ctx {
    async fn post(&self, body: Vec<u8>, key: &str) -> Result<Answer, Unreachable> {
        use reqwest::header::{CONTENT_ENCODING, CONTENT_TYPE, DATE, RETRY_AFTER};
        let resp = self
            .client
            .post(&self.cfg.url)
            .headers(self.headers.clone())
            .header(CONTENT_TYPE, "application/x-ndjson")
            .header(CONTENT_ENCODING, "gzip")
            .header("Idempotency-Key", key)
            .body(body)
            .send()
            .await
            .map_err(|e| Unreachable::Send(error_chain(e)))?;
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get(RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let date = resp
            .headers()
            .get(DATE)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        // Read the body also on success, so the connection can be reused.
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| Unreachable::Body(error_chain(e)))?;
        let body = if (200..300).contains(&status) {
            String::new()
        } else {
            String::from_utf8_lossy(&bytes[..bytes.len().min(1024)]).into_owned()
        };
        Ok(Answer {
            status,
            retry_after,
            date,
            body,
        })
    }
}

/// reqwest's Display hides the cause ("error sending request"): add it.
fn error_chain(e: reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    if e.is_timeout() {
        s.push_str(" (timeout)");
    }
    s
}

/// Carries out what the session asks, one command at a time.
async fn run(ctx: Ctx, mut session: Session, shutdown: CancellationToken) {
    let notify = ctx.outbox.notified();
    loop {
        if shutdown.is_cancelled() {
            break;
        }
        let now = ctx.clocks.monotonic();
        match session.next(now) {
            Next::Do(Command::Read { limit }) => {
                let page = ctx.outbox.pending(None, limit);
                session.page(ctx.clocks.monotonic(), page);
            }
            Next::Do(Command::Post { batch, key }) => {
                let body = match ndjson_gzip(
                    batch
                        .iter()
                        .map(|e| crate::clock::for_sending(e.record.as_slice())),
                ) {
                    Ok(b) => b,
                    Err(e) => {
                        // Writing to memory does not fail; if it ever does, retry.
                        session.not_posted(ctx.clocks.monotonic(), format!("gzip: {e}"));
                        continue;
                    }
                };
                session.posting(ctx.clocks.monotonic(), body.len());
                let answer = tokio::select! {
                    a = ctx.post(body, &key) => a,
                    // The batch stays in the outbox and goes again next start.
                    _ = shutdown.cancelled() => break,
                };
                let confirmed =
                    session.answered(ctx.clocks.monotonic(), ctx.clocks.realtime(), answer);
                if let Some(t) = confirmed {
                    crate::clock::confirm(t);
                }
            }
            Next::Do(Command::Ack(keys)) => {
                let r = ctx.outbox.ack(&keys);
                session.ack_done(ctx.clocks.monotonic(), r);
            }
            Next::Do(Command::DeadLetter { key, reason }) => {
                let r = ctx.outbox.dead_letter(key, &reason);
                session.dead_letter_done(ctx.clocks.monotonic(), r);
            }
            Next::Wait(Some(d)) => {
                if sleep_or_stop(d, &shutdown).await {
                    break;
                }
            }
            Next::Wait(None) => {
                tokio::select! {
                    _ = notify.notified() => {}
                    _ = tokio::time::sleep(IDLE_POLL) => {}
                    _ = shutdown.cancelled() => break,
                }
                session.appended();
            }
        }
    }
    ctx.stats.set_connected(false);
    tracing::info!("uplink: stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn only_https_authenticates_the_fleet() {
        assert!(verifies_server("https://fleet.example/ingest"));
        assert!(verifies_server("HTTPS://fleet.example/ingest"));
        assert!(!verifies_server("http://fleet.example/ingest"));
        assert!(!verifies_server("http://127.0.0.1:8080/https:"));
        assert!(!verifies_server("not a url"));
    }

    #[test]
    fn retry_classification() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(classify(200, None, now, ""), Verdict::Ack);
        assert_eq!(classify(204, Some("5"), now, ""), Verdict::Ack);
        for s in [408, 429, 500, 502, 503, 504] {
            assert!(
                matches!(
                    classify(s, None, now, ""),
                    Verdict::Retry { after: None, .. }
                ),
                "{s}"
            );
        }
        assert_eq!(
            classify(429, Some("1"), now, "slow down"),
            Verdict::Retry {
                after: Some(Duration::from_secs(1)),
                reason: "HTTP 429: slow down".into()
            }
        );
        for s in [400, 401, 403, 404, 409, 413, 422] {
            assert!(
                matches!(classify(s, None, now, "bad"), Verdict::Reject { .. }),
                "{s}"
            );
        }
        // A body is cut in the reason.
        let Verdict::Reject { reason } = classify(400, None, now, &"x".repeat(5000)) else {
            panic!()
        };
        assert!(reason.len() < 320);
        assert!(matches!(
            classify(302, None, now, ""),
            Verdict::Retry { .. }
        ));
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        assert_eq!(parse_retry_after(" 7 ", now), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("999999", now), Some(MAX_RETRY_AFTER));
        let at = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(parse_retry_after(&at, now), Some(Duration::from_secs(30)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
    }

    #[test]
    fn idempotency_key_is_stable_per_batch() {
        let a = [Key(1, 0), Key(1, 1)];
        let k = idempotency_key("gw1", &a);
        assert_eq!(k.len(), 64);
        assert_eq!(k, idempotency_key("gw1", &a));
        assert_ne!(k, idempotency_key("gw1", &a[..1]));
        assert_ne!(k, idempotency_key("gw2", &a));
        assert_ne!(k, idempotency_key("gw1", &[Key(1, 1), Key(1, 0)]));
        // The device name's length is hashed: no ambiguity at the seam.
        assert_ne!(
            idempotency_key("a", &[Key(0, 0)]),
            idempotency_key("a\0\0\0\0\0\0\0\0", &[])
        );
    }

    #[test]
    fn body_is_gzipped_ndjson() {
        let recs: [&[u8]; 2] = [br#"{"id":"a"}"#, br#"{"id":"b"}"#];
        let gz = ndjson_gzip(recs).unwrap();
        let mut text = String::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "{\"id\":\"a\"}\n{\"id\":\"b\"}\n");
    }
}
