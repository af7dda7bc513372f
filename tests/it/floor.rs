//! The floor over Modbus TCP with real peers (pymodbus, tests/floor/peer.py):
//! outpost writing records into a PLC, a PLC gone and back, a PLC answering
//! exceptions, outpost's server read by a SCADA client, clients outside
//! `allow`, fuzzed frames at the server, and the Modbus source feeding
//! `sensor_mlp`. Every wait is on an event (a write the PLC reports, a
//! metric, a status field, a record).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{Daemon, free_port, http, outpost, root, run, stderr, stdout};

/// A JSON frame the sensor_mlp pipelines take (16 values).
const FRAME: &str = "[0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0,1.1,1.2,1.3,1.4,1.5,1.6]";

const LIMIT: Duration = Duration::from_secs(30);

fn peer() -> Command {
    let mut c = Command::new("python3");
    c.arg(root().join("tests/floor/peer.py"));
    c
}

/// A pymodbus PLC on a loopback port; killed on drop.
struct Plc {
    child: Child,
    port: u16,
    writes: mpsc::Receiver<Value>,
    pub seen: Vec<Value>,
}

impl Plc {
    fn start(port: u16, args: &[&str]) -> Plc {
        let mut child = peer()
            .args(["plc", "--port", &port.to_string()])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("python3 tests/floor/peer.py (pip install -r tests/floor/requirements.txt)");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send(v);
                }
            }
        });
        match rx.recv_timeout(LIMIT) {
            Ok(v) if v == "ready" => {}
            other => panic!("the PLC did not start: {other:?}"),
        }
        Plc {
            child,
            port,
            writes: rx,
            seen: Vec::new(),
        }
    }

    /// Waits for a write the PLC reports that satisfies `pred`.
    fn write_where(&mut self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        if let Some(w) = self.seen.iter().find(|w| pred(w)) {
            return w.clone();
        }
        while t0.elapsed() < LIMIT {
            if let Ok(w) = self.writes.recv_timeout(Duration::from_millis(100)) {
                self.seen.push(w.clone());
                if pred(&w) {
                    return w;
                }
            }
        }
        panic!(
            "{what}: not written within {LIMIT:?}; writes seen: {:?}",
            self.seen
        );
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Plc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// One read from outpost's server with a pymodbus client bound to `source`.
fn read(port: u16, source: &str, fc: u8, address: u16, count: u16) -> Value {
    let o = peer()
        .args(["read", "--port", &port.to_string(), "--source", source])
        .args(["--fc", &fc.to_string(), "--address", &address.to_string()])
        .args(["--count", &count.to_string()])
        .output()
        .unwrap();
    serde_json::from_slice(&o.stdout).unwrap_or_else(|_| {
        panic!(
            "peer read: {}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

fn wait_for(d: &Daemon, what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(
            t0.elapsed() < LIMIT,
            "{what}: not within {LIMIT:?}\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The sum of a metric's series whose line starts with `prefix`.
fn metric(d: &Daemon, prefix: &str) -> f64 {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    String::from_utf8_lossy(&body)
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// POSTs a frame to a pipeline's http source; its one record's outputs.
fn infer(d: &Daemon, pipeline: &str, frame: &str) -> Value {
    let (code, body) = http(
        "POST",
        &d.api,
        &format!("/v1/pipelines/{pipeline}/infer"),
        frame.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let v: Value = serde_json::from_slice(&body).unwrap();
    v["records"][0]["outputs"].clone()
}

fn f32_words(v: f64) -> [u64; 2] {
    let b = (v as f32).to_bits();
    [u64::from(b >> 16), u64::from(b & 0xFFFF)]
}

/// The `sensors` pipeline (http) with `outputs` in its table.
fn sensors(outputs: &str, extra: &str) -> String {
    format!(
        r#"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
{outputs}
{extra}
"#
    )
}

fn modbus_output(port: u16, write: &str) -> String {
    format!(
        r#"[[pipelines.outputs]]
type = "modbus"
target = "127.0.0.1:{port}"
unit = 1
write = "{write}"
timeout = "500ms"
registers = [ {{ field = "/top/0/index", address = 100, kind = "u16" }},
              {{ field = "/top/0/score", address = 101, kind = "f32" }},
              {{ field = "/top/0/score", address = 103, kind = "u16", scale = 1000 }},
              {{ field = "/top/0/index", address = 7, kind = "bool" }} ]
"#
    )
}

fn output_status(d: &Daemon) -> Value {
    d.status()["pipelines"][0]["outputs"][0].clone()
}

#[test]
fn modbus_output_writes_the_records_values_into_a_plc() {
    let mut plc = Plc::start(free_port(), &[]);
    let d = Daemon::start(&sensors(&modbus_output(plc.port, "record"), ""));
    let out = infer(&d, "sensors", FRAME);
    let (index, score) = (
        out["top"][0]["index"].as_u64().unwrap(),
        out["top"][0]["score"].as_f64().unwrap(),
    );
    // The three adjacent registers in one write-multiple-registers.
    let [hi, lo] = f32_words(score);
    let per_mille = (score * 1000.0).round() as u64;
    plc.write_where("index, score, score per mille at 100-103", |w| {
        w["table"] == "hr"
            && w["address"] == 100
            && w["values"] == json!([index, hi, lo, per_mille])
    });
    plc.write_where("the coil at 7", |w| {
        w["table"] == "co" && w["address"] == 7 && w["values"] == json!([u64::from(index != 0)])
    });
    wait_for(&d, "the output's status counting both requests", || {
        output_status(&d)["modbus"]["requests"].as_u64() == Some(2)
    });
    let st = output_status(&d);
    assert_eq!(st["type"], "modbus");
    assert_eq!(st["connected"], true);
    assert_eq!(st["modbus"]["written"], 5, "{st}");
    assert!(metric(&d, "outpost_modbus_output_requests_total{") >= 2.0);
    // A write-multiple-registers per record, not one request per field.
    assert_eq!(
        plc.seen.iter().filter(|w| w["table"] == "hr").count(),
        1,
        "{:?}",
        plc.seen
    );
}

#[test]
fn a_plc_that_disappears_and_comes_back_gets_the_newest_values_and_records_keep_flowing() {
    let port = free_port();
    let mut plc = Plc::start(port, &[]);
    let d = Daemon::start(&sensors(&modbus_output(port, "change"), ""));
    infer(&d, "sensors", FRAME);
    plc.write_where("the first record's values", |w| w["address"] == 100);
    plc.kill();
    // The PLC is gone: every frame still gets its record, and the records
    // reach the outbox; the output only keeps the newest values.
    let records_before = d.status()["pipelines"][0]["records"].as_u64().unwrap();
    let mut last = Value::Null;
    for i in 0..50 {
        let frame: Vec<f64> = (0..16).map(|k| ((i * 7 + k) % 13) as f64 / 3.0).collect();
        last = infer(&d, "sensors", &serde_json::to_string(&frame).unwrap());
    }
    wait_for(&d, "the output seeing its PLC gone", || {
        output_status(&d)["connected"] == false
    });
    let st = d.status();
    assert_eq!(
        st["pipelines"][0]["records"].as_u64().unwrap(),
        records_before + 50,
        "records kept flowing to the outbox"
    );
    assert!(st["outbox"]["appended_total"].as_u64().unwrap() >= records_before + 50);
    // Back on the same port: the newest record's values arrive.
    let mut plc = Plc::start(port, &[]);
    let index = last["top"][0]["index"].as_u64().unwrap();
    let [hi, lo] = f32_words(last["top"][0]["score"].as_f64().unwrap());
    plc.write_where("the newest record's values after the PLC came back", |w| {
        w["table"] == "hr"
            && w["address"] == 100
            && w["values"].as_array().map(|v| &v[..3])
                == Some(&[json!(index), json!(hi), json!(lo)][..])
    });
    wait_for(&d, "the output connected again", || {
        output_status(&d)["connected"] == true
    });
    let m = &output_status(&d)["modbus"];
    assert!(m["link"]["connects"].as_u64().unwrap() >= 2, "{m}");
}

#[test]
fn a_plc_answering_exceptions_is_counted_by_code() {
    // The PLC holds registers 0-49 only: 100-103 are refused (02), the coil at 7 is not.
    let mut plc = Plc::start(free_port(), &["--registers", "50"]);
    let d = Daemon::start(&sensors(&modbus_output(plc.port, "record"), ""));
    infer(&d, "sensors", FRAME);
    plc.write_where("the coil the PLC has", |w| {
        w["table"] == "co" && w["address"] == 7
    });
    wait_for(&d, "exception 02 counted", || {
        metric(&d, "outpost_modbus_output_exceptions_total{") >= 1.0
    });
    let st = output_status(&d);
    assert_eq!(st["modbus"]["exceptions"], json!({"2": 1}), "{st}");
    assert_eq!(st["modbus"]["requests"], 1, "{st}");
    assert!(
        metric(
            &d,
            "outpost_modbus_output_exceptions_total{pipeline=\"sensors\",output=\"modbus:127.0.0.1"
        ) >= 1.0
    );
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    assert!(
        String::from_utf8_lossy(&body).contains("code=\"02\""),
        "exceptions are labelled by code"
    );
    // The connection stayed up through the exception.
    assert_eq!(st["connected"], true);
}

fn server(allow: &str, extra: &str) -> String {
    format!(
        r#"
[modbus_server]
listen = "127.0.0.1:0"
allow = [{allow}]
{extra}
[[modbus_server.registers]]
pipeline = "sensors"
field = "/top/0/index"
address = 0
kind = "u16"
[[modbus_server.registers]]
pipeline = "sensors"
field = "/top/0/score"
address = 1
kind = "f32"
[[modbus_server.registers]]
pipeline = "sensors"
field = "/top/0/index"
address = 0
kind = "bool"
"#
    )
}

fn server_port(d: &Daemon) -> u16 {
    let listen = d.status()["modbus"]["server"]["listen"].clone();
    let listen = listen
        .as_str()
        .unwrap_or_else(|| panic!("no modbus server in status"));
    listen.rsplit(':').next().unwrap().parse().unwrap()
}

#[test]
fn outposts_server_is_read_by_a_pymodbus_client() {
    let d = Daemon::start(&sensors("", &server("\"127.0.0.1\"", "")));
    let port = server_port(&d);
    // Before any record: mapped, but no value yet.
    assert_eq!(read(port, "127.0.0.1", 3, 0, 3), json!({"exception": 4}));
    assert_eq!(
        read(port, "127.0.0.1", 3, 0, 4),
        json!({"exception": 2}),
        "register 3 is not mapped"
    );
    let out = infer(&d, "sensors", FRAME);
    let index = out["top"][0]["index"].as_u64().unwrap();
    let [hi, lo] = f32_words(out["top"][0]["score"].as_f64().unwrap());
    assert_eq!(
        read(port, "127.0.0.1", 3, 0, 3),
        json!({"values": [index, hi, lo]})
    );
    assert_eq!(
        read(port, "127.0.0.1", 4, 1, 2),
        json!({"values": [hi, lo]})
    );
    assert_eq!(
        read(port, "127.0.0.1", 1, 0, 1),
        json!({"values": [u64::from(index != 0)]})
    );
    let s = &d.status()["modbus"]["server"];
    assert_eq!(s["requests"], 3, "{s}");
    assert!(metric(&d, "outpost_modbus_server_requests_total{") >= 3.0);
}

#[test]
fn a_client_outside_allow_is_refused_and_counted() {
    let d = Daemon::start(&sensors("", &server("\"127.0.0.1\"", "")));
    infer(&d, "sensors", FRAME);
    let port = server_port(&d);
    let refused = read(port, "127.0.0.2", 3, 0, 1);
    assert!(
        refused.get("error").is_some(),
        "127.0.0.2 must be refused: {refused}"
    );
    wait_for(&d, "the refusal counted", || {
        metric(&d, "outpost_modbus_server_refused_total{listen=") >= 1.0
    });
    assert_eq!(
        d.status()["modbus"]["server"]["refused"],
        json!({"not_allowed": 1})
    );
    assert!(read(port, "127.0.0.1", 3, 0, 1).get("values").is_some());
}

/// A request's bytes: MBAP with `protocol` and the PDU.
fn adu(protocol: u16, pdu: &[u8]) -> Vec<u8> {
    let mut v = vec![0, 1];
    v.extend_from_slice(&protocol.to_be_bytes());
    v.extend_from_slice(&((pdu.len() + 1) as u16).to_be_bytes());
    v.push(1);
    v.extend_from_slice(pdu);
    v
}

/// Sends `bytes` on a new connection; what came back before the server
/// closed it (or 2 s passed).
fn exchange(port: u16, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

#[test]
fn fuzzed_frames_never_stop_the_modbus_server() {
    let d = Daemon::start(&sensors(
        "",
        &server(
            "\"127.0.0.1\"",
            "max_connections = 8\nidle_timeout = \"1s\"",
        ),
    ));
    infer(&d, "sensors", FRAME);
    let port = server_port(&d);
    // Random bytes (the same every run).
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    for _ in 0..200 {
        let n = (x % 400) as usize;
        let bytes: Vec<u8> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        exchange(port, &bytes);
    }
    // A wrong protocol id: the connection is closed, nothing answered.
    assert!(exchange(port, &adu(7, &[3, 0, 0, 0, 1])).is_empty());
    // Huge counts are answered with exception 03; the connection serves on.
    let mut two = adu(0, &[3, 0, 0, 0xFF, 0xFF]);
    two.extend_from_slice(&adu(0, &[1, 0, 0, 0xFF, 0xFF]));
    two.extend_from_slice(&adu(0, &[3, 0, 0, 0, 1]));
    let back = exchange(port, &two);
    assert_eq!(&back[7..9], [0x83, 3]);
    assert_eq!(&back[16..18], [0x81, 3]);
    assert_eq!(&back[25..27], [3, 2], "the read after them is answered");
    // Writes and unknown functions: exception 01.
    assert_eq!(&exchange(port, &adu(0, &[6, 0, 0, 0, 1]))[7..], [0x86, 1]);
    assert_eq!(
        &exchange(port, &adu(0, &[0x2B, 0x0E, 1, 0]))[7..],
        [0xAB, 1]
    );
    // A length field of 0xFFFF: closed.
    let mut huge = adu(0, &[3, 0, 0, 0, 1]);
    huge[4] = 0xFF;
    huge[5] = 0xFF;
    assert!(exchange(port, &huge).is_empty());
    // Many idle connections: 8 are held (then closed after idle_timeout),
    // the others closed at once.
    let idle: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    wait_for(&d, "92 idle connections refused", || {
        metric(&d, "outpost_modbus_server_refused_total{listen=\"127.0.0.1") >= 92.0
    });
    wait_for(&d, "the held ones closed after idle_timeout", || {
        d.status()["modbus"]["server"]["connections"] == 0
    });
    drop(idle);
    let s = d.status()["modbus"]["server"].clone();
    for reason in [
        "protocol_id",
        "bad_length",
        "bad_quantity",
        "illegal_function",
    ] {
        assert!(
            s["malformed"][reason].as_u64().unwrap_or(0) >= 1,
            "{reason}: {s}"
        );
    }
    assert_eq!(
        s["refused"]["too_many_connections"].as_u64(),
        Some(92),
        "{s}"
    );
    assert!(s["idle_closed"].as_u64().unwrap() >= 8, "{s}");
    // Still serving, to a real client.
    assert!(read(port, "127.0.0.1", 3, 0, 3).get("values").is_some());
    assert!(d.status()["ready"] == true);
}

#[test]
fn the_modbus_source_feeds_sensor_mlp_from_a_plc() {
    let values: Vec<u16> = (0..16).map(|i| i * 100 + 7).collect();
    let csv: Vec<String> = values.iter().map(|v| v.to_string()).collect();
    let plc = Plc::start(free_port(), &["--values", &csv.join(",")]);
    let cfg = format!(
        r#"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "polled"
model = "sensor_mlp"
source = {{ type = "modbus", target = "127.0.0.1:{p}", unit = 1, address = 200, count = 16, kind = "u16", interval = "50ms", scale = 100, stream = "plc-1" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
[[pipelines]]
name = "beyond"
model = "sensor_mlp"
source = {{ type = "modbus", target = "127.0.0.1:{p}", address = 290, count = 16, interval = "50ms" }}
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "http" }}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#,
        p = plc.port
    );
    let mut d = Daemon::start(&cfg);
    let recs = d
        .records_until(LIMIT, |r| {
            r.iter().filter(|r| r["pipeline"] == "polled").count() >= 3
        })
        .to_vec();
    let polled: Vec<&Value> = recs.iter().filter(|r| r["pipeline"] == "polled").collect();
    assert!(polled.len() >= 3, "{}", d.log());
    assert_eq!(polled[0]["stream"], "plc-1");
    assert!(polled[0]["captured"].is_string(), "stamped at the read");
    // The same values through the http source give the same outputs.
    let scaled: Vec<f64> = values.iter().map(|v| f64::from(*v) / 100.0).collect();
    let same = infer(&d, "sensors", &serde_json::to_string(&scaled).unwrap());
    assert_eq!(polled[0]["outputs"], same);
    // Registers 290-305 are past the PLC's 300: exception 02, counted as drops.
    wait_for(&d, "the failed reads counted as drops", || {
        let st = d.status();
        let p = st["pipelines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "beyond")
            .cloned()
            .unwrap();
        p["drops"]["modbus_exception_02"].as_u64().unwrap_or(0) >= 2
    });
    let st = d.status();
    let links = st["modbus"]["sources"].as_array().unwrap();
    assert_eq!(
        links.len(),
        1,
        "two sources on one PLC share one connection: {links:?}"
    );
    assert_eq!(links[0]["connects"], 1);
    assert!(links[0]["exceptions"]["2"].as_u64().unwrap() >= 2);
    assert!(metric(&d, "outpost_modbus_source_requests_total{") >= 3.0);
}

#[test]
fn check_names_each_bad_modbus_key_with_its_line_and_map_prints_the_registers() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        r#"[[pipelines]]
name = "line3"
model = "sensor_mlp"
source = { type = "http" }
[[pipelines.outputs]]
type = "modbus"
target = "10.0.0.5"
registers = [ { field = "/top/0/index", address = 100, kind = "u16" },
              { field = "/top/0/score", address = 100, kind = "f32" } ]

[[pipelines]]
name = "polled"
model = "sensor_mlp"
source = { type = "modbus", target = "10.0.0.5:502", address = 200, count = 3, kind = "f32", interval = "200ms" }

[modbus_server]
listen = "127.0.0.1:1502"
allow = ["plc"]
[[modbus_server.registers]]
pipeline = "line4"
field = "/top/0/index"
address = 0
kind = "u16"
"#,
    )
    .unwrap();
    let o = run(outpost().arg("check").arg("--config").arg(&bad));
    assert!(!o.status.success());
    let text = format!("{}{}", stdout(&o), stderr(&o));
    for needle in [
        "line 7: pipeline \"line3\" (line 1), outputs#1.target: `10.0.0.5` is not host:port",
        "line 9: pipeline \"line3\" (line 1), outputs#1.registers#2.address: register 100 is already taken by entry 1 (field /top/0/index)",
        "line 14: pipeline \"polled\" (line 11), source.count: 3 registers",
        "line 18: modbus_server.allow: `plc` is not an address",
        "line 20: modbus_server.registers#1.pipeline: `line4` is not a pipeline",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
    }
    // The issue's config, as given, maps and checks.
    let good = dir.path().join("good.toml");
    std::fs::write(
        &good,
        std::fs::read_to_string(&bad)
            .unwrap()
            .replace("target = \"10.0.0.5\"", "target = \"10.0.0.5:502\"")
            .replace(
                "address = 100, kind = \"f32\"",
                "address = 101, kind = \"f32\"",
            )
            .replace("count = 3", "count = 4")
            .replace("[\"plc\"]", "[\"10.0.0.5\"]")
            .replace("line4", "line3"),
    )
    .unwrap();
    let o = run(outpost().arg("check").arg("--config").arg(&good));
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    let o = run(outpost().arg("--config").arg(&good).args(["modbus", "map"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let map = stdout(&o);
    let lines: Vec<&str> = map.lines().collect();
    assert!(lines[0].starts_with("ROLE"), "{map}");
    let has = |parts: &[&str]| lines.iter().any(|l| parts.iter().all(|p| l.contains(p)));
    assert!(
        has(&["server", "holding", "0", "u16", "/top/0/index", "line3"]),
        "{map}"
    );
    assert!(
        has(&[
            "output",
            "10.0.0.5:502",
            "101-102",
            "f32",
            "/top/0/score",
            "line3"
        ]),
        "{map}"
    );
    assert!(
        has(&["source", "holding", "200-203", "f32", "polled"]),
        "{map}"
    );
}
