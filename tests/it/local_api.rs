//! The local API against web pages and slow clients, with a real daemon and
//! a real browser (headless Chromium over WebDriver, see `console.rs`) as
//! the attacker: a page from another origin that posts a frame with
//! `no-cors`, a DNS-rebinding name that reads `/v1/status`, and slow request
//! bodies that take every connection slot.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{Daemon, http, sensors_over_http};
use crate::console::Browser;

/// A JSON frame the `sensors` pipeline takes (16 values).
const FRAME: &str = "[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

/// One request with the given extra header lines; returns (status, body).
fn request(addr: &str, method: &str, path: &str, headers: &str, body: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// A metric's value from /metrics (0 when absent).
fn metric(d: &Daemon, line_start: &str) -> f64 {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

fn sensors(d: &Daemon) -> Value {
    d.status()["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "sensors")
        .cloned()
        .expect("sensors pipeline")
}

const REFUSED_HOST: &str = "outpost_api_requests_refused_total{reason=\"host\"}";
const REFUSED_ORIGIN: &str = "outpost_api_requests_refused_total{reason=\"origin\"}";

/// The API answered any `Host:`, so a DNS-rebinding page (its own name
/// re-resolved to 127.0.0.1) could read `/v1/status` and `/v1/events`. Now
/// a Host that is not one of the API's names is answered 421 and counted;
/// the loopback forms, the listen address and `api.allowed_hosts` are served.
#[test]
fn requests_naming_another_host_are_refused() {
    let d = Daemon::start(&sensors_over_http("allowed_hosts = [\"gw-1.local\"]"));
    let port = d.api.rsplit(':').next().unwrap().to_string();
    for path in ["/v1/status", "/v1/events", "/metrics", "/"] {
        let (code, body) = request(&d.api, "GET", path, "Host: evil.example\r\n", "");
        assert_eq!(code, 421, "{path}: {body}");
        assert!(!body.contains("pipelines"), "{path}: {body}");
    }
    let (code, _) = request(
        &d.api,
        "GET",
        "/v1/status",
        &format!("Host: evil.example:{port}\r\n"),
        "",
    );
    assert_eq!(code, 421);
    for host in [
        format!("127.0.0.1:{port}"),
        "127.0.0.1".to_string(),
        format!("localhost:{port}"),
        format!("[::1]:{port}"),
        format!("gw-1.local:{port}"),
    ] {
        let (code, body) = request(
            &d.api,
            "GET",
            "/v1/status",
            &format!("Host: {host}\r\n"),
            "",
        );
        assert_eq!(code, 200, "{host}: {body}");
        assert!(body.contains("\"pipelines\""), "{host}: {body}");
    }
    // A client that sends no Host (HTTP/1.0 tools) is no browser: served.
    let (code, _) = request(&d.api, "GET", "/healthz", "", "");
    assert_eq!(code, 200);
    assert_eq!(metric(&d, REFUSED_HOST), 5.0);
}

/// A POST from another origin with a "simple" content type (no CORS
/// preflight) was stored like any other frame. Now a state change whose
/// `Origin` is not the API's own is refused (403, counted) and never
/// reaches the pipeline, unless it carries the bearer token; the same POST
/// without `Origin` (a sensor, curl) is stored as before.
#[test]
fn cross_origin_simple_post_is_refused_and_not_stored() {
    let dir = tempfile::tempdir().unwrap();
    let token = "local-api-test-token-0123456789";
    std::fs::write(dir.path().join("token"), token).unwrap();
    let mut d = Daemon::start_in(&sensors_over_http("token_file = \"{DIR}/token\""), dir);
    let host = format!("Host: {}\r\n", d.api);
    let path = "/v1/pipelines/sensors/infer?stream=";
    for (stream, ctype) in [
        ("plain", "text/plain"),
        ("form", "application/x-www-form-urlencoded"),
        ("multi", "multipart/form-data; boundary=x"),
    ] {
        let (code, body) = request(
            &d.api,
            "POST",
            &format!("{path}{stream}"),
            &format!("{host}Origin: http://evil.example\r\nContent-Type: {ctype}\r\n"),
            FRAME,
        );
        assert_eq!(code, 403, "{ctype}: {body}");
        assert!(body.contains("another origin"), "{body}");
    }
    // Another port of loopback is another origin too; so is "null".
    for origin in ["http://127.0.0.1:1", "null"] {
        let (code, _) = request(
            &d.api,
            "POST",
            &format!("{path}other"),
            &format!("{host}Origin: {origin}\r\nContent-Type: text/plain\r\n"),
            FRAME,
        );
        assert_eq!(code, 403, "{origin}");
    }
    // Pause is a state change as well (the token check comes after).
    let (code, _) = request(
        &d.api,
        "POST",
        "/v1/pipelines/sensors/pause",
        &format!("{host}Origin: http://evil.example\r\n"),
        "",
    );
    assert_eq!(code, 403);
    assert_eq!(metric(&d, REFUSED_ORIGIN), 6.0);
    let p = sensors(&d);
    assert_eq!(p["frames_in"], 0, "{p}");
    assert_eq!(p["records"], 0, "{p}");

    // The same POST without Origin: stored.
    let (code, body) = request(
        &d.api,
        "POST",
        &format!("{path}sensor"),
        &format!("{host}Content-Type: text/plain\r\n"),
        FRAME,
    );
    assert_eq!(code, 200, "{body}");
    // Same origin (what the console sends), and another origin with the token.
    let (code, body) = request(
        &d.api,
        "POST",
        &format!("{path}console"),
        &format!(
            "{host}Origin: http://{}\r\nContent-Type: text/plain\r\n",
            d.api
        ),
        FRAME,
    );
    assert_eq!(code, 200, "{body}");
    let (code, body) = request(
        &d.api,
        "POST",
        &format!("{path}tool"),
        &format!(
            "{host}Origin: http://evil.example\r\nAuthorization: Bearer {token}\r\nContent-Type: text/plain\r\n"
        ),
        FRAME,
    );
    assert_eq!(code, 200, "{body}");
    let records = d.records_until(Duration::from_secs(30), |r| r.len() >= 3);
    let mut streams: Vec<&str> = records
        .iter()
        .filter_map(|r| r["stream"].as_str())
        .collect();
    streams.sort_unstable();
    assert_eq!(streams, ["console", "sensor", "tool"]);
    assert_eq!(sensors(&d)["frames_in"], 3);
}

/// An HTTP server on another loopback port (another origin) that serves
/// `page` to every request; stops on drop.
struct PageServer {
    addr: String,
    stop: Arc<AtomicBool>,
}

impl PageServer {
    fn start(page: String) -> PageServer {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let Ok((mut s, _)) = l.accept() else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf) {
                        Ok(n) if n > 0 => req.extend_from_slice(&buf[..n]),
                        _ => break,
                    }
                }
                let _ = write!(
                    s,
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                    page.len()
                );
            }
        });
        PageServer { addr, stop }
    }
}

impl Drop for PageServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// The attack in a real browser: a page from another origin posts a frame
/// to the http source with `mode: "no-cors"` and `Content-Type: text/plain`
/// (a request the browser sends without asking). It became a record; now
/// it is refused (counted) and nothing is stored.
#[test]
fn a_page_from_another_origin_in_a_real_browser_creates_no_record() {
    let mut d = Daemon::start(&sensors_over_http(""));
    let page = format!(
        r#"<!doctype html><title>start</title><script>
fetch("http://{api}/v1/pipelines/sensors/infer?stream=browser", {{
  method: "POST", mode: "no-cors",
  headers: {{"Content-Type": "text/plain"}},
  body: "{FRAME}"
}}).then(() => {{ document.title = "sent"; }}, e => {{ document.title = "error " + e; }});
</script>"#,
        api = d.api
    );
    let site = PageServer::start(page);
    let b = Browser::start();
    b.go(&format!("http://{}/", site.addr));
    let title = b.wait_for(
        "the page's fetch to finish",
        Duration::from_secs(30),
        "return document.title !== 'start' && document.title",
    );
    assert_eq!(title, "sent", "the page's fetch failed");
    // The answer came back (opaque to the page), so a stored frame would be
    // counted by now.
    let p = sensors(&d);
    assert_eq!(p["frames_in"], 0, "{p}");
    assert_eq!(p["records"], 0, "{p}");
    let records = d.records_until(Duration::from_millis(200), |r| !r.is_empty());
    assert!(records.is_empty(), "stored: {records:?}");
    // The browser's request reached the daemon and was refused there.
    assert_eq!(metric(&d, REFUSED_ORIGIN), 1.0, "{}", d.log());
    // A sensor (no Origin) is still served.
    let (code, _) = request(
        &d.api,
        "POST",
        "/v1/pipelines/sensors/infer?stream=sensor",
        &format!("Host: {}\r\n", d.api),
        FRAME,
    );
    assert_eq!(code, 200);
    assert_eq!(sensors(&d)["frames_in"], 1);
}

/// DNS rebinding in a real browser: Chromium resolves `rebind.example` to
/// 127.0.0.1 (what the attacker's DNS does once the page is loaded), so a
/// script on `http://rebind.example:PORT` is same-origin with the API. It
/// read `/v1/status`; now every answer to that name is a 421.
#[test]
fn a_rebound_name_in_a_real_browser_reads_nothing() {
    let d = Daemon::start(&sensors_over_http(""));
    let port = d.api.rsplit(':').next().unwrap().to_string();
    let b = Browser::start_with(&["--host-resolver-rules=MAP rebind.example 127.0.0.1"]);
    let origin = format!("http://rebind.example:{port}");
    b.go(&format!("{origin}/v1/status"));
    let shown = b.wait_for(
        "the page to load",
        Duration::from_secs(30),
        "return document.readyState === 'complete' && document.body && document.body.innerText",
    );
    let shown = shown.as_str().unwrap_or_default();
    assert!(!shown.contains("\"pipelines\""), "the page read: {shown}");
    assert!(shown.contains("not a name of this API"), "{shown}");
    // A script of that origin, same-origin with the API, reads nothing either.
    let read = b.js(
        "return Promise.all(['/v1/status', '/metrics', '/v1/pipelines/sensors/records'].map(\
           p => fetch(p).then(async r => r.status + ' ' + (await r.text()))))",
    );
    for answer in read.as_array().expect("three answers") {
        let a = answer.as_str().unwrap_or_default();
        assert!(a.starts_with("421 "), "{a}");
        assert!(!a.contains("outpost_"), "{a}");
    }
    // The loopback name is served in the same browser.
    b.go(&format!("http://127.0.0.1:{port}/v1/status"));
    b.wait_for(
        "the status page",
        Duration::from_secs(30),
        "return document.body && document.body.innerText.includes('\"pipelines\"')",
    );
    assert!(metric(&d, REFUSED_HOST) >= 4.0);
}

/// A connection that sends an http-source request header announcing a
/// large body, and a few bytes of it, then stops: it holds its connection
/// slot for `body_read_timeout`.
fn slow_body(api: &str) -> std::net::TcpStream {
    let mut s = std::net::TcpStream::connect(api).expect("connect");
    write!(
        s,
        "POST /v1/pipelines/sensors/infer HTTP/1.1\r\nHost: {api}\r\nContent-Length: 1000000\r\n\r\n[0.1,"
    )
    .unwrap();
    s
}

/// Whether the server answers and closes `s` within `limit` (an answer
/// then EOF, or a reset when it closed with the body unread).
fn answered_and_closed(s: &mut std::net::TcpStream, limit: Duration) -> (bool, String) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (true, String::from_utf8_lossy(&seen).into_owned()),
            Ok(n) => seen.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return (false, String::from_utf8_lossy(&seen).into_owned());
            }
            Err(_) => return (true, String::from_utf8_lossy(&seen).into_owned()),
        }
    }
}

/// 517 slow request bodies made `/healthz` answer 503 for the whole
/// `body_read_timeout` (30 s): each held a connection slot. Now a few slots
/// of `max_connections` are kept for `/healthz`, `/readyz`, `/metrics` and
/// `/v1/status`:
/// with every other slot held by a slow body those still answer at once,
/// anything else beyond the cap still gets 503, and a slow body cannot hold
/// a kept slot.
#[test]
fn slow_bodies_leave_slots_for_health_checks() {
    let d = Daemon::start(&sensors_over_http(
        "max_connections = 16\nbody_read_timeout = \"30s\"",
    ));
    let max = metric(&d, "outpost_api_max_connections") as usize;
    assert_eq!(max, 16);
    let kept = metric(&d, "outpost_api_health_connections") as usize;
    // Every general slot: taken in the order they connect, before any
    // connection made after them.
    let mut slow: Vec<_> = (0..max - kept).map(|_| slow_body(&d.api)).collect();
    let t0 = Instant::now();
    for path in ["/healthz", "/readyz", "/metrics", "/v1/status"] {
        let (code, body) = request(&d.api, "GET", path, &format!("Host: {}\r\n", d.api), "");
        assert_eq!(code, 200, "{path} with the general slots full: {body}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "health checks took {:?}",
        t0.elapsed()
    );
    // Held: the slow bodies are still open, and the gauge counts them.
    assert!(metric(&d, "outpost_api_connections") >= (max - kept) as f64);
    // Anything else beyond the general slots: 503 at once.
    for path in ["/v1/pipelines/sensors/records", "/"] {
        let (code, _) = request(&d.api, "GET", path, &format!("Host: {}\r\n", d.api), "");
        assert_eq!(code, 503, "{path}");
    }
    // Slow bodies beyond the general slots are answered and let go at
    // once: none can hold a kept slot.
    for _ in 0..kept * 2 {
        let mut s = slow_body(&d.api);
        let (closed, seen) = answered_and_closed(&mut s, Duration::from_secs(10));
        assert!(closed, "a slow body held a kept slot: {seen}");
        assert!(
            seen.is_empty() || seen.starts_with("HTTP/1.1 503"),
            "{seen}"
        );
    }
    let (code, _) = request(
        &d.api,
        "GET",
        "/healthz",
        &format!("Host: {}\r\n", d.api),
        "",
    );
    assert_eq!(code, 200);
    assert!(metric(&d, "outpost_api_health_connections_accepted_total") >= 4.0);
    // The slow bodies still hold their slots (well within body_read_timeout).
    for s in slow.iter_mut() {
        let (closed, seen) = answered_and_closed(s, Duration::from_millis(10));
        assert!(!closed, "a slow body was let go early: {seen}");
    }
    drop(slow);
    // Once they close, the general slots serve everything again.
    let t0 = Instant::now();
    loop {
        let (code, _) = request(
            &d.api,
            "GET",
            "/v1/status",
            &format!("Host: {}\r\n", d.api),
            "",
        );
        if code == 200 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "still {code}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The daemon's threads (`Threads:` of /proc/PID/status).
fn threads(d: &Daemon) -> u64 {
    let st = std::fs::read_to_string(format!("/proc/{}/status", d.child.id())).unwrap();
    st.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads: in /proc/PID/status")
}

/// Issue 50, item 8: `check` takes an `outbox.flush_interval` up to 60 s,
/// but an http-source request waited a fixed 30 s for the commit of its
/// records: with a slower interval every POST was answered `503 records
/// not stored durably` although every record was stored, so a client that
/// sends again (as the 503 says) duplicates them all. And each waiting
/// request held one of tokio's 512 blocking threads (1,000 POSTs: 519
/// threads), while `/v1/status` answered 503 for the whole wait (every
/// connection slot held). Now the wait follows the interval, a waiting
/// request holds no thread, and the status still answers. Here 292
/// requests wait (every general slot of `max_connections = 300`).
#[test]
fn posts_waiting_for_a_slow_commit_get_200_hold_no_thread_and_leave_the_status_answering() {
    // Slower than the old fixed 30 s wait (the issue's 45 s); no early
    // commit by count.
    let cfg = format!(
        "{}\n[outbox]\nflush_interval = \"45s\"\nflush_records = 1000000\n",
        sensors_over_http("max_connections = 300")
    );
    let d = Daemon::start(&cfg);
    // Every general slot (the kept ones stay for the checks below).
    let kept = metric(&d, "outpost_api_health_connections") as usize;
    let waiting = metric(&d, "outpost_api_max_connections") as usize - kept;
    assert!(waiting >= 290, "{waiting}");
    let before = threads(&d);
    let mut posts: Vec<std::net::TcpStream> = (0..waiting)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&d.api).expect("connect");
            write!(
                s,
                "POST /v1/pipelines/sensors/infer HTTP/1.1\r\nHost: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{FRAME}",
                d.api,
                FRAME.len()
            )
            .unwrap();
            s
        })
        .collect();
    let t0 = Instant::now();
    // Every frame stored, its request waiting for the commit.
    loop {
        let stored = metric(&d, "outpost_records_total{pipeline=\"sensors\"}") as usize;
        if stored >= waiting {
            break;
        }
        // Before the commit (45 s after the first), so all still wait.
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "{stored} of {waiting} frames stored"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let during = threads(&d);
    let (code, body) = request(
        &d.api,
        "GET",
        "/v1/status",
        &format!("Host: {}\r\n", d.api),
        "",
    );
    eprintln!(
        "{waiting} requests waiting for the commit: threads {before} before, {during} during; \
         /v1/status {code}"
    );
    assert_eq!(code, 200, "/v1/status while requests wait: {body}");
    let st: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        st["outbox"]["records"].as_u64(),
        Some(waiting as u64),
        "{st:#}"
    );
    assert!(
        during < before + 64,
        "{waiting} waiting requests took {} threads ({before} before)",
        during - before.min(during)
    );
    // Every waiting request: 200, durable, after the commit (45 s).
    let (mut ok, mut other) = (0, Vec::new());
    for s in posts.iter_mut() {
        let (_, seen) = answered_and_closed(s, Duration::from_secs(120));
        let code: u16 = seen
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        match code {
            200 if seen.contains("\"durable\":true") => ok += 1,
            _ => other.push(seen),
        }
    }
    let took = t0.elapsed();
    eprintln!(
        "answers: {ok} 200 durable, {} other, after {took:?}",
        other.len()
    );
    assert!(
        other.is_empty(),
        "{} other answers, e.g. {}",
        other.len(),
        other[0]
    );
    assert_eq!(ok, waiting);
    assert_eq!(
        metric(&d, "outpost_records_total{pipeline=\"sensors\"}") as usize,
        waiting
    );
}
