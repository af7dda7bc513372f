//! The local console in a real browser: Debian's headless Chromium driven
//! over the W3C WebDriver protocol (chromedriver, spoken over plain HTTP on
//! loopback) against a running daemon with three pipelines fed over HTTP and
//! an uplink that cannot reach its fleet. Screenshots are kept under
//! `target/tmp/console/` (the path is printed).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{Value, json};

use crate::common::{Daemon, free_port, http, model_dir, model_file};

const TOKEN: &str = "console-test-token-0123456789";

/// One HTTP/1.1 exchange with chromedriver, which keeps the connection
/// open whatever the request says: the body is read by its Content-Length.
fn wd_exchange(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
) -> std::io::Result<(u16, Vec<u8>)> {
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 65536];
    let (split, len) = loop {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other("chromedriver closed the connection"));
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(split) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..split]).to_ascii_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| std::io::Error::other(format!("no content-length: {head}")))?;
            break (split, len);
        }
    };
    while buf.len() < split + 4 + len {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other("chromedriver closed the connection"));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let status = String::from_utf8_lossy(&buf[..split])
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((status, buf[split + 4..split + 4 + len].to_vec()))
}

/// One WebDriver request; returns the answer's `value`.
fn wd(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Value {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let (_, resp) = wd_exchange(addr, method, path, &body)
        .unwrap_or_else(|e| panic!("chromedriver {method} {path}: {e}"));
    let v: Value = serde_json::from_slice(&resp).unwrap_or_else(|e| {
        panic!(
            "chromedriver {method} {path}: bad JSON ({e}): {}",
            String::from_utf8_lossy(&resp)
        )
    });
    if let Some(err) = v["value"].get("error") {
        panic!(
            "WebDriver {method} {path} failed: {err}: {}",
            v["value"]["message"]
        );
    }
    v["value"].clone()
}

fn which(exe: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(exe))
            .find(|f| f.is_file())
    })
}

/// chromedriver with one headless Chromium session; both ended on drop.
pub(crate) struct Browser {
    driver: Child,
    addr: String,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub(crate) fn start() -> Browser {
        Self::start_with(&[])
    }

    /// With further Chromium switches (e.g. `--host-resolver-rules=...`).
    pub(crate) fn start_with(extra_args: &[&str]) -> Browser {
        let (Some(chromium), Some(chromedriver)) = (which("chromium"), which("chromedriver"))
        else {
            panic!(
                "the console tests need Debian's `chromium` and `chromium-driver` packages \
                 (apt-get install chromium chromium-driver; .ci/run installs them)"
            );
        };
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let profile = tempfile::tempdir().unwrap();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .arg(format!(
                "--log-path={}",
                profile.path().join("chromedriver.log").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn chromedriver");
        let mut b = Browser {
            driver,
            addr,
            session: String::new(),
            _profile: profile,
        };
        let t0 = Instant::now();
        loop {
            if let Ok((200, body)) = wd_exchange(&b.addr, "GET", "/status", "")
                && serde_json::from_slice::<Value>(&body)
                    .map(|v| v["value"]["ready"] == true)
                    .unwrap_or(false)
            {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "chromedriver not ready in 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let user_data = b._profile.path().join("chromium");
        let mut args = vec![
            json!("--headless"),
            json!("--no-sandbox"),
            json!("--disable-gpu"),
            json!("--disable-quic"),
            json!("--no-first-run"),
            json!("--disable-background-networking"),
            json!("--disable-component-update"),
            json!("--disable-sync"),
            json!("--disable-dev-shm-usage"),
            json!("--hide-scrollbars"),
            json!(format!("--user-data-dir={}", user_data.display())),
            json!("--window-size=1280,2200"),
        ];
        args.extend(extra_args.iter().map(|a| json!(a)));
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:loggingPrefs": {"browser": "ALL"},
            "goog:chromeOptions": {
                "binary": chromium.display().to_string(),
                "args": args,
            },
        }}});
        let v = wd(&b.addr, "POST", "/session", Some(&caps));
        b.session = v["sessionId"].as_str().expect("session id").to_string();
        b
    }

    fn cmd(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        wd(
            &self.addr,
            method,
            &format!("/session/{}{path}", self.session),
            body,
        )
    }

    pub(crate) fn go(&self, url: &str) {
        self.cmd("POST", "/url", Some(&json!({"url": url})));
    }

    pub(crate) fn js(&self, script: &str) -> Value {
        self.cmd(
            "POST",
            "/execute/sync",
            Some(&json!({"script": script, "args": []})),
        )
    }

    /// Runs `script` until it returns something truthy; returns that.
    pub(crate) fn wait_for(&self, what: &str, timeout: Duration, script: &str) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.js(script);
            let truthy = match &v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                _ => true,
            };
            if truthy {
                return v;
            }
            assert!(
                t0.elapsed() < timeout,
                "timed out waiting for {what}; page: {}",
                self.js("return document.body.innerText")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn element(&self, css: &str) -> String {
        let v = self.cmd(
            "POST",
            "/element",
            Some(&json!({"using": "css selector", "value": css})),
        );
        v.as_object()
            .and_then(|o| o.values().next())
            .and_then(|x| x.as_str())
            .expect("element id")
            .to_string()
    }

    fn click(&self, css: &str) {
        let id = self.element(css);
        self.cmd("POST", &format!("/element/{id}/click"), Some(&json!({})));
    }

    fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.cmd(
            "POST",
            &format!("/element/{id}/value"),
            Some(&json!({"text": text})),
        );
    }

    pub(crate) fn window(&self, w: u32, h: u32) {
        self.cmd(
            "POST",
            "/window/rect",
            Some(&json!({"width": w, "height": h})),
        );
    }

    pub(crate) fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.cmd("GET", "/screenshot", None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(b64.as_str().expect("screenshot base64"))
            .expect("screenshot decodes");
        assert!(png.starts_with(b"\x89PNG"), "not a PNG");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console");
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, png).unwrap();
        println!("console screenshot: {}", p.display());
        p
    }

    /// The browser's console entries since the last call.
    pub(crate) fn console_log(&self) -> Vec<Value> {
        self.cmd("POST", "/se/log", Some(&json!({"type": "browser"})))
            .as_array()
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = std::panic::catch_unwind(|| {
                wd(
                    &self.addr,
                    "DELETE",
                    &format!("/session/{}", self.session),
                    None,
                )
            });
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn post(d: &Daemon, pipeline: &str, stream: &str, body: &[u8]) {
    let (code, resp) = http(
        "POST",
        &d.api,
        &format!("/v1/pipelines/{pipeline}/infer?stream={stream}"),
        body,
    )
    .expect("infer");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&resp));
}

fn sensor_frame(i: usize) -> Vec<u8> {
    let v: Vec<f32> = (0..16)
        .map(|k| ((i * 16 + k) as f32 * 0.37).sin())
        .collect();
    serde_json::to_vec(&v).unwrap()
}

fn pipeline<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no pipeline {name} in {status}"))
}

/// What the page shows of one pipeline, read from its card.
const CARD_FIGURES: &str = r#"
const out = {};
for (const c of document.querySelectorAll('[data-pipeline]')) {
  const f = n => c.querySelector('[data-field="' + n + '"]').textContent;
  out[c.dataset.pipeline] = {
    frames_in: f('frames_in'), frames_done: f('frames_done'), records: f('records'),
    model: f('model'), source: f('source'), state: f('state'), drops: f('drops'),
    p99: f('p99'), fps_in: f('fps_in'),
  };
}
out.outbox = document.querySelector('#outbox [data-field="records"]').textContent;
out.uplink = document.querySelector('#uplink [data-field="state"]').textContent;
return out;
"#;

/// Console errors other than the snapshot endpoint answering 404 (the
/// console shows a placeholder then, by design).
pub(crate) fn errors(entries: &[Value]) -> Vec<Value> {
    entries
        .iter()
        .filter(|e| e["level"] == "SEVERE")
        .filter(|e| {
            let m = e["message"].as_str().unwrap_or("");
            !(m.contains("/snapshot.jpg") && m.contains("404"))
        })
        .cloned()
        .collect()
}

#[test]
fn console_in_a_real_browser() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("token"), TOKEN).unwrap();
    // An uplink to a port nothing listens on: the console shows it backing off.
    let dead = free_port();
    let config = format!(
        r#"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
token_file = "{{DIR}}/token"
[uplink]
type = "http"
url = "http://127.0.0.1:{dead}/ingest"
backoff_max = "1s"
[[pipelines]]
name = "pumps"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
[[pipelines]]
name = "fans"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
[[pipelines]]
name = "yard"
model = "classifier"
source = {{ type = "http" }}
"#
    );
    let d = Daemon::start_in(&config, dir);
    for i in 0..30 {
        post(&d, "pumps", "pump-1", &sensor_frame(i));
    }
    for i in 0..12 {
        post(&d, "fans", "fan-2", &sensor_frame(i));
    }
    for img in ["astronaut.png", "coffee.png"] {
        let bytes = std::fs::read(model_file("images", img)).unwrap();
        post(&d, "yard", "gate", &bytes);
    }

    let b = Browser::start();
    b.go(&format!("http://{}/", d.api));
    b.wait_for(
        "three pipeline cards and a tick",
        Duration::from_secs(60),
        "return document.querySelectorAll('[data-pipeline]').length === 3 \
         && Number(document.body.dataset.ticks || 0) >= 1 \
         && document.getElementById('conn').textContent === 'live'",
    );

    // Each pipeline's figures are those of /v1/status (nothing flows now,
    // so they settle; the page updates once a second).
    let t0 = Instant::now();
    loop {
        let status = d.status();
        let page = b.js(CARD_FIGURES);
        let mut diffs = Vec::new();
        for name in ["pumps", "fans", "yard"] {
            let s = pipeline(&status, name);
            let c = &page[name];
            for k in ["frames_in", "frames_done", "records"] {
                if c[k].as_str() != Some(&s[k].to_string()) {
                    diffs.push(format!("{name}.{k}: page {} status {}", c[k], s[k]));
                }
            }
            if !c["model"]
                .as_str()
                .unwrap()
                .contains(s["model"].as_str().unwrap())
            {
                diffs.push(format!(
                    "{name}.model: page {} status {}",
                    c["model"], s["model"]
                ));
            }
            if !c["source"].as_str().unwrap().starts_with("http") {
                diffs.push(format!("{name}.source: {}", c["source"]));
            }
            if c["state"] != "running" {
                diffs.push(format!("{name}.state: {}", c["state"]));
            }
        }
        if page["outbox"].as_str() != Some(&status["outbox"]["records"].to_string()) {
            diffs.push(format!(
                "outbox: page {} status {}",
                page["outbox"], status["outbox"]["records"]
            ));
        }
        if diffs.is_empty() {
            assert_eq!(pipeline(&status, "pumps")["frames_done"], 30);
            assert_eq!(pipeline(&status, "yard")["records"], 2);
            assert_eq!(page["uplink"], "backing off", "{page}");
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "page and /v1/status differ: {diffs:#?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The latest records are listed.
    let recs = b.js(
        "return document.querySelectorAll('[data-pipeline=\"yard\"] [data-field=\"records_list\"] li code').length",
    );
    assert_eq!(recs, 2, "the yard card lists its two records");
    let (code, body) = http("GET", &d.api, "/v1/pipelines/yard/records", b"").unwrap();
    assert_eq!(code, 200);
    let listed: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    assert_eq!(listed[0]["stream"], "gate");
    assert_eq!(
        http("GET", &d.api, "/v1/pipelines/nope/records", b"")
            .unwrap()
            .0,
        404
    );

    // The image pipeline shows its latest frame, or a placeholder until the
    // snapshot endpoint has one; either way an image that loaded.
    let kind = b.wait_for(
        "the snapshot or its placeholder",
        Duration::from_secs(30),
        "const i = document.querySelector('[data-pipeline=\"yard\"] img[data-field=\"snapshot\"]'); \
         return i && i.complete && i.naturalWidth > 0 ? i.dataset.kind : null",
    );
    assert!(
        kind == "snapshot" || kind == "placeholder",
        "snapshot kind {kind}"
    );
    assert!(
        b.js("return document.querySelectorAll('[data-pipeline=\"pumps\"] img').length") == 0,
        "a sensor pipeline has no snapshot"
    );

    // The plots move while frames flow.
    let plot = "const s = document.querySelector('[data-pipeline=\"pumps\"] svg[data-plot=\"fps\"]'); \
                return [Number(s.dataset.n), s.querySelector('path.k1').getAttribute('d')]";
    let before = b.js(plot);
    let flowing = Arc::new(AtomicBool::new(true));
    let feeder = {
        let (api, flowing) = (d.api.clone(), flowing.clone());
        std::thread::spawn(move || {
            let mut i = 0;
            while flowing.load(Ordering::Relaxed) {
                let _ = http(
                    "POST",
                    &api,
                    "/v1/pipelines/pumps/infer?stream=pump-1",
                    &sensor_frame(i),
                );
                i += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    b.wait_for(
        "the frames/s plot and figure to follow the frames",
        Duration::from_secs(60),
        &format!(
            "const s = document.querySelector('[data-pipeline=\"pumps\"] svg[data-plot=\"fps\"]'); \
             const p99 = document.querySelector('[data-pipeline=\"pumps\"] svg[data-plot=\"p99\"]'); \
             const fps = parseFloat(document.querySelector('[data-pipeline=\"pumps\"] [data-field=\"fps_in\"]').textContent); \
             return Number(s.dataset.n) >= {} + 3 && s.querySelector('path.k1').getAttribute('d') !== {} \
               && fps > 0 && Number(s.dataset.max) > 0 && Number(p99.dataset.max) > 0",
            before[0],
            before[1]
        ),
    );
    b.screenshot("console.png");
    flowing.store(false, Ordering::Relaxed);
    feeder.join().unwrap();

    // Phone-sized: nothing wider than the screen.
    b.window(390, 844);
    b.wait_for(
        "the page to fit a phone's width",
        Duration::from_secs(10),
        "return window.innerWidth <= 400 && document.documentElement.scrollWidth <= window.innerWidth",
    );
    b.screenshot("console-phone.png");
    b.window(1280, 2200);

    let errs = errors(&b.console_log());
    assert!(errs.is_empty(), "console errors: {errs:#?}");

    // Read-only without the token: no controls, and the API refuses.
    let shown = b.js(
        "const t = document.querySelector('[data-pipeline=\"pumps\"] [data-field=\"toggle\"]'); \
         return getComputedStyle(t).display",
    );
    assert_eq!(shown, "none", "pause offered without a token");
    let bare = b.cmd(
        "POST",
        "/execute/async",
        Some(&json!({"script": "const done = arguments[arguments.length - 1]; \
            fetch('/v1/pipelines/pumps/pause', {method: 'POST'}).then(r => done(r.status), e => done(String(e)));",
            "args": []})),
    );
    assert_eq!(bare, 401);
    // A wrong token: the button is there, the API refuses, nothing changes.
    b.type_into("#token", "not-the-token-at-all");
    b.click("#unlock");
    b.click("[data-pipeline=\"pumps\"] [data-field=\"toggle\"]");
    let msg = b.wait_for(
        "the refusal",
        Duration::from_secs(20),
        "const r = document.getElementById('action-result').textContent; return r.includes('refused') ? r : null",
    );
    assert!(msg.as_str().unwrap().contains("401"), "{msg}");
    assert_eq!(pipeline(&d.status(), "pumps")["paused"], false);
    // The right token: pause, then resume, seen in /v1/status and on the page.
    b.click("#lock");
    b.type_into("#token", TOKEN);
    b.click("#unlock");
    b.click("[data-pipeline=\"pumps\"] [data-field=\"toggle\"]");
    b.wait_for(
        "pause done",
        Duration::from_secs(20),
        "return document.getElementById('action-result').textContent.includes('done')",
    );
    assert_eq!(pipeline(&d.status(), "pumps")["paused"], true);
    assert_eq!(pipeline(&d.status(), "fans")["paused"], false);
    b.wait_for(
        "the card to say paused",
        Duration::from_secs(20),
        "const c = document.querySelector('[data-pipeline=\"pumps\"]'); \
         return c.querySelector('[data-field=\"state\"]').textContent === 'paused' \
           && c.querySelector('[data-field=\"toggle\"]').textContent === 'Resume'",
    );
    b.click("[data-pipeline=\"pumps\"] [data-field=\"toggle\"]");
    let t0 = Instant::now();
    while pipeline(&d.status(), "pumps")["paused"] != false {
        assert!(t0.elapsed() < Duration::from_secs(20), "resume not applied");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn event_stream_refuses_past_its_bound_and_ends_on_stop() {
    // Raw SSE clients: the first event is the history, then ticks follow;
    // SIGTERM ends the streams so the daemon stops promptly.
    let mut d = Daemon::start(&crate::common::sensors_over_http(""));
    let mut s = std::net::TcpStream::connect(&d.api).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET /v1/events HTTP/1.1\r\nHost: {}\r\nAccept: text/event-stream\r\n\r\n",
        d.api
    )
    .unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let t0 = Instant::now();
    while !(seen.contains("event: history") && seen.contains("event: tick")) {
        let n = s.read(&mut buf).expect("event stream read");
        assert!(n > 0, "stream closed early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
        assert!(t0.elapsed() < Duration::from_secs(30), "{seen}");
    }
    assert!(seen.contains("text/event-stream"), "{seen}");
    // At most 64 streams at once: the 65th is refused, not queued.
    let mut more = Vec::new();
    for _ in 1..outpost::api::live::MAX_CLIENTS {
        let mut c = std::net::TcpStream::connect(&d.api).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(c, "GET /v1/events HTTP/1.1\r\nHost: {}\r\n\r\n", d.api).unwrap();
        let n = c.read(&mut buf).unwrap();
        assert!(
            String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&buf[..n])
        );
        more.push(c);
    }
    let (code, _) = http("GET", &d.api, "/v1/events", b"").unwrap();
    assert_eq!(code, 503);
    drop(more);
    let st = d.terminate();
    assert!(st.success(), "{st}: {}", d.log());
    // The stream ended with the daemon.
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
}

/// What the tracking pipeline's card shows: the overlay's shapes and the
/// events list, once each has something.
#[cfg(feature = "camera")]
const TRACKING_VIEW: &str = r#"
const c = document.querySelector('[data-pipeline="gate"]');
const svg = c && c.querySelector('svg.overlay');
if (!svg) return null;
const all = (sel, f) => Array.from(svg.querySelectorAll(sel)).map(f);
const out = {
  viewBox: svg.getAttribute('viewBox'),
  zones: all('polygon.zone', z => [z.dataset.name, z.getAttribute('points')]),
  lines: all('line.line', l => [l.dataset.name,
    ['x1', 'y1', 'x2', 'y2'].map(k => Number(l.getAttribute(k)))]),
  in_sides: all('path.in-side', p => p.dataset.name),
  in_labels: all('text.in-label', t => [t.textContent, Number(t.getAttribute('x'))]),
  tracks: all('rect.track', r => [r.dataset.track,
    ['x', 'y', 'width', 'height'].map(k => Number(r.getAttribute(k)))]),
  track_labels: all('text.track-label', t => [t.dataset.track, t.textContent]),
  events: Array.from(c.querySelectorAll('ol.events li[data-event]')).map(li =>
    [li.dataset.event, li.dataset.track, li.textContent, Date.parse(li.dataset.ts)]),
  snapshot: c.querySelector('img[data-field="snapshot"]').dataset.kind,
};
const ready = out.zones.length && out.lines.length && out.tracks.length
  && out.events.some(e => e[0] === 'track_start');
return ready ? out : null;
"#;

// Its scene comes from a camera source (a hand-written GStreamer pipeline).
#[cfg(feature = "camera")]
#[test]
fn console_draws_zones_lines_live_tracks_and_events_of_a_tracking_pipeline() {
    // The rendered scene of tracking.rs (two faces crossing the line, one
    // into the yard), played by a real GStreamer pipeline, again at each
    // end of the files, so tracks keep coming while the browser looks.
    let scene = tempfile::tempdir().unwrap();
    crate::tracking::render(scene.path());
    let location = scene.path().join("f%03d.png");
    let cfg = format!(
        r#"data_dir = "{{DATA}}"
model_dir = "{models}"
[device]
name = "gw"
[api]
listen = "{{API}}"
[[pipelines]]
name = "gate"
model = "mtcnn_pnet"
source = {{ type = "camera", queue = 64, pipeline = "multifilesrc location={location} index=0 stop-index={last} caps=image/png,framerate=10/1 ! pngdec ! videoconvert ! appsink name=outpost" }}
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"
[pipelines.track]
min_hits = 3
max_age = "10s"
[[pipelines.zones]]
name = "yard"
polygon = [[0, 150], [320, 150], [320, 240], [0, 240]]
[[pipelines.lines]]
name = "gate"
points = [[160, 0], [160, 240]]
"#,
        models = model_dir().display(),
        location = location.display(),
        last = crate::tracking::FRAMES - 1,
    );
    let d = Daemon::start(&cfg);
    let b = Browser::start();
    b.go(&format!("http://{}/", d.api));
    let v = b.wait_for(
        "the overlay's zone, line and tracks, and a track_start listed",
        Duration::from_secs(120),
        TRACKING_VIEW,
    );

    // The status carries what is drawn, in source-frame pixels.
    let st = d.status();
    let t = &pipeline(&st, "gate")["tracking"];
    assert_eq!(
        t["geometry"]["zones"],
        json!([{"name": "yard", "polygon": [[0.0, 150.0], [320.0, 150.0], [320.0, 240.0], [0.0, 240.0]]}]),
        "{t}"
    );
    assert_eq!(
        t["geometry"]["lines"],
        json!([{"name": "gate", "points": [[160.0, 0.0], [160.0, 240.0]]}]),
        "{t}"
    );
    assert_eq!(t["frame_size"], json!([320, 240]), "{t}");

    // The overlay: the frame's pixels as its viewBox, the zone and the line
    // where the config puts them, the line's "in" side to its right.
    assert_eq!(v["viewBox"], "0 0 320 240", "{v}");
    assert_eq!(
        v["zones"],
        json!([["yard", "0,150 320,150 320,240 0,240"]]),
        "{v}"
    );
    assert_eq!(v["lines"], json!([["gate", [160, 0, 160, 240]]]), "{v}");
    assert_eq!(v["in_sides"], json!(["gate"]), "{v}");
    let in_label = &v["in_labels"][0];
    assert_eq!(in_label[0], "in", "{v}");
    assert!(
        in_label[1].as_f64().unwrap() > 160.0,
        "in is right of the line: {v}"
    );

    // Live tracks: boxes inside the frame, each named by its track id
    // (`{device}/{pipeline}/{stream}/{boot}-{n}`) and labelled with its number
    // and label.
    let tracks = v["tracks"].as_array().unwrap();
    assert!(!tracks.is_empty() && tracks.len() <= 2, "{v}");
    for tr in tracks {
        let id = tr[0].as_str().unwrap();
        let parts: Vec<&str> = id.split('/').collect();
        assert!(
            parts.len() == 4
                && parts[..2] == ["gw", "gate"]
                && parts[3]
                    .split_once('-')
                    .is_some_and(|(b, n)| b.parse::<u64>().is_ok() && n.parse::<u64>().is_ok()),
            "track id {id}"
        );
        let g: Vec<f64> = tr[1]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert!(
            g[0] >= -1.0
                && g[1] >= -1.0
                && g[2] > 5.0
                && g[3] > 5.0
                && g[0] + g[2] <= 321.0
                && g[1] + g[3] <= 241.0,
            "box of {id} off the frame: {g:?}"
        );
        let label = v["track_labels"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l[0] == id)
            .unwrap_or_else(|| panic!("no label for {id}: {v}"));
        assert_eq!(label[1], format!("#{} object", parts[3]), "{v}");
    }

    // The events list: newest first, at most 20, each with its kind, track
    // and label; the track_start of a track of this pipeline among them.
    let events = v["events"].as_array().unwrap();
    assert!(events.len() <= 20, "{v}");
    let times: Vec<f64> = events.iter().map(|e| e[3].as_f64().unwrap()).collect();
    assert!(
        times.windows(2).all(|w| w[0] >= w[1]),
        "not newest first: {v}"
    );
    let start = events
        .iter()
        .find(|e| e[0] == "track_start")
        .unwrap_or_else(|| panic!("{v}"));
    let id = start[1].as_str().unwrap();
    assert!(id.starts_with("gw/gate/"), "{v}");
    let text = start[2].as_str().unwrap();
    assert!(
        text.contains("track_start")
            && text.contains("object")
            && text.contains(id.rsplit('/').next().unwrap()),
        "{text}"
    );
    b.screenshot("console-tracking.png");
    let errs = errors(&b.console_log());
    assert!(errs.is_empty(), "console errors: {errs:#?}");
}
