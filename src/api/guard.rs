//! What keeps web pages out of the local API: a page in any browser on the
//! device (or on the operator's laptop, through the tunnel) can send
//! requests to it.
//!
//! - **Host.** A DNS-rebinding page (its name re-resolved to 127.0.0.1)
//!   is same-origin with itself, so the browser lets it read the answers;
//!   only the `Host` it sends (the attacker's name) tells it apart. A request
//!   is served only when its `Host` is an address of the API (a loopback
//!   address, `localhost`, the listen address; any IP literal when
//!   listening on every address, since an IP literal names no DNS record
//!   to rebind) or a name in `api.allowed_hosts`; the others get 421. The
//!   port is not compared: a tunnel forwards from another port, and a
//!   rebinding page is told apart by its name, not by the port.
//! - **Origin.** A page may send a "simple" cross-origin request without
//!   asking first (`fetch(..., {mode: "no-cors"})`, a form): a POST with
//!   `Content-Type` text/plain, application/x-www-form-urlencoded or
//!   multipart/form-data. It cannot read the answer, but the request would
//!   take effect (an http-source frame becomes a record). A request that
//!   changes state (any method but GET, HEAD and OPTIONS) with an `Origin`
//!   that is not the API's own, or, without one, with a `Sec-Fetch-Site`
//!   saying another site sent it, is refused (403) unless it carries the
//!   valid bearer token.
//!
//!   The content type is not what is checked: every browser sends `Origin`
//!   on a cross-origin POST, `no-cors` included, so the `Origin` check
//!   already covers the three simple types, while refusing those types
//!   would refuse sensors and scripts that send no `Origin` (`curl -d`
//!   sends application/x-www-form-urlencoded, many sensors text/plain).
//!   Any other type, or an `Authorization` header, makes the browser ask
//!   first (a CORS preflight), and the API never answers one with
//!   `Access-Control-Allow-*`, so such a request never leaves the browser.
//!
//! Clients that are not browsers (curl, sensors) send no `Origin` and name
//! the address they connect to: they are served as before. The console is
//! served by the API itself, so its requests are same-origin.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::DescriptorEncoder;

use crate::config::host::{HostName, parse_host};
use crate::telemetry::logging::RateLimitedLog;
use crate::telemetry::metrics::{MetricSource, counter};

/// How often a refusal of one kind is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Refused requests, for `/metrics`.
#[derive(Debug, Default)]
pub struct GuardStats {
    /// `Host` not a name of this API (421).
    pub host: AtomicU64,
    /// A state change sent by another origin (403).
    pub origin: AtomicU64,
}

impl MetricSource for GuardStats {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let row = |reason: &str, a: &AtomicU64| {
            (
                vec![("reason", reason.to_string())],
                a.load(Ordering::Relaxed),
            )
        };
        counter(
            enc,
            "outpost_api_requests_refused",
            "Requests refused by the local API: host (Host not one of its names, 421), origin (a state change from another origin, 403)",
            &[row("host", &self.host), row("origin", &self.origin)],
        )
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("Host `{0}` is not a name of this API (add it to api.allowed_hosts)")]
    Host(String),
    #[error("a state change from another origin ({0}) is refused")]
    Origin(String),
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Refusal::Host(_) => StatusCode::MISDIRECTED_REQUEST,
            Refusal::Origin(_) => StatusCode::FORBIDDEN,
        }
    }
}

/// Compares `Authorization: Bearer <token>` with `want` in constant time.
pub fn bearer_matches(headers: &HeaderMap, want: &str) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    let (a, b) = (given.as_bytes(), want.as_bytes());
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0)) as usize;
    }
    diff == 0
}

/// The checks, set up once at start (the `[api]` table is not reloaded).
#[derive(Debug)]
pub struct Guard {
    /// `api.allowed_hosts` and `localhost`.
    names: Vec<HostName>,
    /// The address the API is bound to.
    listen: SocketAddr,
    /// The bearer token, when one is set.
    token: Option<Arc<String>>,
    stats: Arc<GuardStats>,
    /// One line per kind of refusal per [`LOG_EVERY`].
    log: RateLimitedLog,
}

impl Guard {
    /// `allowed` entries are checked by the config's validation; one that
    /// does not parse is left out (it could match nothing).
    pub fn new(
        allowed: &[String],
        listen: SocketAddr,
        token: Option<Arc<String>>,
        stats: Arc<GuardStats>,
    ) -> Guard {
        let mut names = vec![HostName::Name("localhost".into())];
        names.extend(allowed.iter().filter_map(|a| parse_host(a)));
        Guard {
            names,
            listen,
            token,
            stats,
            log: RateLimitedLog::new(LOG_EVERY),
        }
    }

    fn host_allowed(&self, host: &HostName) -> bool {
        if self.names.contains(host) {
            return true;
        }
        match host {
            HostName::Ip(ip) => {
                let ip = ip.to_canonical();
                let listen = self.listen.ip().to_canonical();
                ip.is_loopback() || ip == listen || listen.is_unspecified()
            }
            HostName::Name(_) => false,
        }
    }

    /// Whether the request may be served; pure, so it is tested without sockets.
    pub fn check(&self, method: &Method, headers: &HeaderMap) -> Result<(), Refusal> {
        // HTTP/1.1 requires Host; a client that sends none (HTTP/1.0
        // tools) is no browser, and a browser always sends one.
        let host = headers.get(header::HOST).map(|h| {
            let text = String::from_utf8_lossy(h.as_bytes()).into_owned();
            (parse_host(&text), text)
        });
        if let Some((parsed, text)) = &host
            && !parsed.as_ref().is_some_and(|h| self.host_allowed(h))
        {
            return Err(Refusal::Host(text.chars().take(200).collect()));
        }
        if matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) {
            return Ok(());
        }
        if self
            .token
            .as_ref()
            .is_some_and(|t| bearer_matches(headers, t))
        {
            return Ok(());
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = String::from_utf8_lossy(origin.as_bytes());
            // Same origin: the page came from this very authority (the
            // `Host`, already checked above), over http (or https through
            // a TLS proxy in front).
            let authority = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"));
            let same = match (authority, &host) {
                (Some(a), Some((_, h))) => a.eq_ignore_ascii_case(h.trim()),
                _ => false,
            };
            if !same {
                return Err(Refusal::Origin(origin.chars().take(200).collect()));
            }
            return Ok(());
        }
        // No Origin: Fetch Metadata, where the browser sends it, still says
        // who sent the request ("none": the user typed or bookmarked it).
        if let Some(site) = headers.get("sec-fetch-site")
            && !matches!(site.as_bytes(), b"same-origin" | b"none")
        {
            return Err(Refusal::Origin(format!(
                "Sec-Fetch-Site: {}",
                String::from_utf8_lossy(site.as_bytes())
            )));
        }
        Ok(())
    }

    fn refused(&self, why: &Refusal) {
        let (kind, counter) = match why {
            Refusal::Host(_) => ("host", &self.stats.host),
            Refusal::Origin(_) => ("origin", &self.stats.origin),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.log.allow(kind) {
            tracing::warn!(reason = %why, suppressed, "API: request refused");
        }
    }
}

/// The middleware in front of every route.
pub async fn guard(State(g): State<Arc<Guard>>, req: Request, next: Next) -> Response {
    match g.check(req.method(), req.headers()) {
        Ok(()) => next.run(req).await,
        Err(why) => {
            g.refused(&why);
            let status = why.status();
            (
                status,
                // Connection: close, so a refused page keeps no connection.
                [(header::CONNECTION, "close")],
                axum::Json(serde_json::json!({"error": why.to_string()})),
            )
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(listen: &str, allowed: &[&str], token: Option<&str>) -> Guard {
        Guard::new(
            &allowed.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            listen.parse().unwrap(),
            token.map(|t| Arc::new(t.to_string())),
            Arc::default(),
        )
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn host_forms_of_the_api_are_served_others_refused() {
        let g = guard("127.0.0.1:8780", &["gw-1.local"], None);
        for ok in [
            "127.0.0.1:8780",
            "127.0.0.1",
            "localhost:8780",
            "LOCALHOST",
            "localhost.:9000",
            "[::1]:8780",
            "[::1]",
            "gw-1.local",
            "gw-1.local:8780",
            "127.0.0.2:8780",
        ] {
            assert_eq!(
                g.check(&Method::GET, &headers(&[("host", ok)])),
                Ok(()),
                "{ok}"
            );
        }
        for bad in [
            "evil.example",
            "evil.example:8780",
            "10.0.0.5:8780",
            "gw-2.local",
            "localhost.evil.example",
            "",
            "127.0.0.1:80:80",
            "[::1]x",
            "a b",
        ] {
            assert!(
                matches!(
                    g.check(&Method::GET, &headers(&[("host", bad)])),
                    Err(Refusal::Host(_))
                ),
                "{bad}"
            );
        }
        // No Host at all (HTTP/1.0 tools): served.
        assert_eq!(g.check(&Method::GET, &HeaderMap::new()), Ok(()));
    }

    #[test]
    fn listen_address_and_any_ip_when_listening_on_all() {
        let g = guard("192.168.1.20:8780", &[], None);
        let h = |v| headers(&[("host", v)]);
        assert_eq!(g.check(&Method::GET, &h("192.168.1.20:8780")), Ok(()));
        assert!(g.check(&Method::GET, &h("192.168.1.21:8780")).is_err());
        let all = guard("0.0.0.0:8780", &[], None);
        assert_eq!(all.check(&Method::GET, &h("192.168.1.21:8780")), Ok(()));
        assert_eq!(all.check(&Method::GET, &h("[fe80::1]:8780")), Ok(()));
        assert!(all.check(&Method::GET, &h("gw-1.local")).is_err());
        let v6 = guard("[::]:8780", &[], None);
        assert_eq!(v6.check(&Method::GET, &h("10.1.2.3")), Ok(()));
    }

    #[test]
    fn cross_origin_state_changes_are_refused_unless_the_token_is_given() {
        let g = guard("127.0.0.1:8780", &[], Some("0123456789abcdef"));
        let host = ("host", "127.0.0.1:8780");
        // A sensor or curl: no Origin.
        assert_eq!(g.check(&Method::POST, &headers(&[host])), Ok(()));
        // The console: same origin.
        assert_eq!(
            g.check(
                &Method::POST,
                &headers(&[host, ("origin", "http://127.0.0.1:8780")])
            ),
            Ok(())
        );
        for origin in [
            "http://evil.example",
            "http://127.0.0.1:9999",
            "null",
            "http://localhost:8780",
        ] {
            assert!(
                matches!(
                    g.check(&Method::POST, &headers(&[host, ("origin", origin)])),
                    Err(Refusal::Origin(_))
                ),
                "{origin}"
            );
            // Reads are the browser's to keep from the page (same-origin policy).
            assert_eq!(
                g.check(&Method::GET, &headers(&[host, ("origin", origin)])),
                Ok(())
            );
        }
        let evil = ("origin", "http://evil.example");
        assert_eq!(
            g.check(
                &Method::POST,
                &headers(&[host, evil, ("authorization", "Bearer 0123456789abcdef")])
            ),
            Ok(())
        );
        assert!(
            g.check(
                &Method::DELETE,
                &headers(&[host, evil, ("authorization", "Bearer wrong")])
            )
            .is_err()
        );
        // Fetch Metadata without Origin.
        assert!(
            g.check(
                &Method::PUT,
                &headers(&[host, ("sec-fetch-site", "cross-site")])
            )
            .is_err()
        );
        assert_eq!(
            g.check(
                &Method::POST,
                &headers(&[host, ("sec-fetch-site", "same-origin")])
            ),
            Ok(())
        );
        // Without a token set, a cross-origin state change is always refused.
        let none = guard("127.0.0.1:8780", &[], None);
        assert!(
            none.check(
                &Method::POST,
                &headers(&[host, evil, ("authorization", "Bearer x")])
            )
            .is_err()
        );
    }

    #[test]
    fn bearer_compare() {
        let h = headers(&[("authorization", "Bearer 0123456789abcdef")]);
        assert!(bearer_matches(&h, "0123456789abcdef"));
        assert!(!bearer_matches(&h, "0123456789abcdeF"));
        assert!(!bearer_matches(&HeaderMap::new(), "0123456789abcdef"));
    }
}
