//! Sparkplug B under pressure, with real processes: a flood of new stream
//! names against the byte cap, a flood of node commands against the log,
//! and a broker (NATS's MQTT gateway) that refuses Sparkplug's topics.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;
use crate::ota::{metric, wait_log};
use crate::uplink::Mosquitto;

/// A child process killed when the test ends, however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A Python subscriber of `script` (tests/fleet/) on `spBv1.0/#`, and its
/// output lines once it said it subscribed; `stdin`: piped (it publishes
/// what it reads).
fn subscriber(script: &str, port: u16, stdin: bool) -> (KillOnDrop, Receiver<String>) {
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(root().join("tests/fleet").join(script))
        .arg(port.to_string())
        .arg("spBv1.0/#")
        .stdout(std::process::Stdio::piped());
    if stdin {
        cmd.stdin(std::process::Stdio::piped());
    }
    let mut sub = KillOnDrop(cmd.spawn().expect("python3"));
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let out = sub.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    assert_eq!(
        first, "SUBSCRIBED",
        "the Sparkplug subscriber did not start (python3 with protobuf and paho-mqtt from models/requirements.txt is needed)"
    );
    (sub, rx)
}

/// A daemon whose `sensors` pipeline reads named UDP frames (JSON vectors
/// of 16 for sensor_mlp) and whose uplink speaks Sparkplug B to `port`.
fn udp_sparkplug(device: &str, udp: u16, port: u16, uplink_extra: &str) -> String {
    format!(
        r#"
device = "{device}"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
when_full = "block"
source = {{ type = "udp", listen = "127.0.0.1:{udp}", framing = "named" }}
[pipelines.preprocess]
type = "sensor"
length = 16
format = "json"
[pipelines.postprocess]
type = "softmax_topk"
output = "probs"
k = 2
[uplink]
type = "mqtt"
host = "127.0.0.1"
port = {port}
payload = "sparkplug_b"
sparkplug_group = "plant"
{uplink_extra}
"#
    )
}

/// One named frame (`[k][name][payload]`) for stream `name`.
fn frame(name: &str, i: usize) -> Vec<u8> {
    let v: Vec<f32> = (0..16).map(|j| ((i + j) % 7) as f32 / 3.0).collect();
    outpost::source::framing::named(name, &serde_json::to_vec(&v).unwrap())
}

/// One frame for each of `n` new stream names, sent over UDP in rounds of
/// 100; each round waits (bounded) until its records were printed, so the
/// kernel's receive buffer never overflows and every name becomes a record.
fn flood(d: &mut Daemon, udp: u16, n: usize) {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for round in 0..n.div_ceil(100) {
        let hi = ((round + 1) * 100).min(n);
        for i in round * 100..hi {
            s.send_to(&frame(&format!("flood-{i:05}"), i), ("127.0.0.1", udp))
                .unwrap();
        }
        d.records_until(Duration::from_secs(10), |r| r.len() >= hi);
    }
}

/// A flood of new stream names (one UDP frame each) into a pipeline with a
/// Sparkplug B uplink under a byte cap. What reaches the broker is counted
/// by an independent subscriber: the payload bytes over a 10 s window stay
/// within the cap (times the window, plus the bucket's one second and the
/// messages of one record: a DBIRTH of at most `max_packet_bytes` and its
/// DDATA); no DBIRTH is larger than
/// `max_packet_bytes` (the birth ceiling); there is one connection (one
/// NBIRTH, no disconnect); every DDATA's metrics were declared by the
/// latest DBIRTH before it; and the metric set was kept bounded by
/// evicting the least recently seen streams (counted).
#[test]
fn sparkplug_births_of_a_stream_name_flood_stay_within_the_byte_cap() {
    const STREAMS: usize = 3000;
    const CAP: f64 = 10_000.0;
    const CEILING: usize = 32 * 1024;
    const WINDOW: f64 = 10.0;
    let work = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start(&work.path().join("mosquitto"));
    let (_sub, rx) = subscriber("sparkplug_sizes.py", broker.port, false);
    let udp = free_port();
    let cfg = udp_sparkplug(
        "gw-flood",
        udp,
        broker.port,
        &format!("max_bytes_per_s = {CAP}\nmax_packet_bytes = {CEILING}\n"),
    );
    let mut d = Daemon::start(&cfg);
    flood(&mut d, udp, STREAMS);
    let printed = d.seen.len();
    // What the subscriber saw until the window after the NBIRTH is over.
    let mut msgs: Vec<Value> = Vec::new();
    let t0 = Instant::now();
    loop {
        let start = msgs
            .iter()
            .find(|m| m["topic"] == "spBv1.0/plant/NBIRTH/gw-flood")
            .map(|m| m["t"].as_f64().unwrap());
        if let (Some(s), Some(last)) = (start, msgs.last())
            && last["t"].as_f64().unwrap() > s + WINDOW
        {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{} messages in 60 s",
            msgs.len()
        );
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            msgs.push(serde_json::from_str(&l).unwrap());
        }
    }
    let start = msgs
        .iter()
        .find(|m| m["topic"] == "spBv1.0/plant/NBIRTH/gw-flood")
        .map(|m| m["t"].as_f64().unwrap())
        .unwrap();
    let window: Vec<&Value> = msgs
        .iter()
        .filter(|m| {
            let t = m["t"].as_f64().unwrap();
            t >= start && t <= start + WINDOW
        })
        .collect();
    let kind = |m: &Value| {
        m["topic"]
            .as_str()
            .unwrap()
            .split('/')
            .nth(2)
            .unwrap()
            .to_string()
    };
    let bytes = |k: &str| -> u64 {
        window
            .iter()
            .filter(|m| k.is_empty() || kind(m) == k)
            .map(|m| m["bytes"].as_u64().unwrap())
            .sum()
    };
    let count = |k: &str| window.iter().filter(|m| kind(m) == k).count();
    let largest_birth = msgs
        .iter()
        .filter(|m| kind(m) == "DBIRTH")
        .map(|m| m["bytes"].as_u64().unwrap())
        .max()
        .unwrap_or(0);
    let total = bytes("");
    // The bucket holds one second; the messages of one record (a DBIRTH
    // of at most CEILING and a small DDATA) may overdraw it once.
    let allowed = CAP * WINDOW + CAP + CEILING as f64 + 1024.0;
    eprintln!(
        "flood: {STREAMS} names, {printed} records; in {WINDOW} s after the NBIRTH: {total} bytes \
         ({:.0} B/s; cap {CAP}), {} DBIRTHs ({} bytes, largest {largest_birth}), {} DDEATHs, \
         {} DDATA ({} bytes), {} NBIRTHs; disconnects {}, evicted metrics {}",
        total as f64 / WINDOW,
        count("DBIRTH"),
        bytes("DBIRTH"),
        count("DDEATH"),
        count("DDATA"),
        bytes("DDATA"),
        msgs.iter().filter(|m| kind(m) == "NBIRTH").count(),
        metric(&d, "outpost_uplink_disconnects_total"),
        metric(&d, "outpost_uplink_sparkplug_metrics_evicted_total"),
    );
    assert!(
        total as f64 <= allowed,
        "{total} bytes in {WINDOW} s, above {allowed} (cap {CAP} B/s)"
    );
    assert!(
        largest_birth as usize <= CEILING,
        "a DBIRTH of {largest_birth} bytes, above max_packet_bytes ({CEILING})"
    );
    assert_eq!(
        metric(&d, "outpost_uplink_disconnects_total"),
        0.0,
        "{}",
        d.log()
    );
    assert_eq!(
        msgs.iter().filter(|m| kind(m) == "NBIRTH").count(),
        1,
        "one connection, one NBIRTH"
    );
    assert!(
        count("DDATA") >= 50,
        "only {} DDATA in the window",
        count("DDATA")
    );
    // Sparkplug: a DDATA carries only metrics its device's latest DBIRTH declared.
    let mut declared: HashSet<String> = HashSet::new();
    for m in &msgs {
        assert!(m.get("undecodable").is_none(), "{m}");
        let names = || {
            m["names"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
        };
        match kind(m).as_str() {
            "DBIRTH" => declared = names().collect(),
            "DDEATH" => declared.clear(),
            "DDATA" => {
                for n in names() {
                    assert!(
                        declared.contains(&n),
                        "{n} was not declared by the last DBIRTH"
                    );
                }
            }
            _ => {}
        }
    }
    // The set stayed bounded: least recently seen streams were evicted.
    assert!(metric(&d, "outpost_uplink_sparkplug_metrics_evicted_total") > 0.0);
}

/// 1,000 Sparkplug node commands (half rebirths, half a command the node
/// does not take) give a handful of log lines, not 2,000; every command is
/// counted, and the rebirths asked for while one was pending were folded
/// into it.
#[test]
fn sparkplug_ncmd_flood_logs_a_few_lines_and_counts_every_command() {
    const N: usize = 1000;
    let work = tempfile::tempdir().unwrap();
    let broker = Mosquitto::start(&work.path().join("mosquitto"));
    let (mut sub, rx) = subscriber("sparkplug_sub.py", broker.port, true);
    let mut host = sub.0.stdin.take().unwrap();
    let cfg = sensors_over_http("").replace("data_dir", "device = \"gw-ncmd\"\ndata_dir")
        + &format!(
            "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {}\npayload = \"sparkplug_b\"\nsparkplug_group = \"plant\"\n",
            broker.port
        );
    let d = Daemon::start(&cfg);
    wait_log(
        &d,
        "subscribed to Sparkplug node commands",
        Duration::from_secs(30),
    );
    let ncmd = "spBv1.0/plant/NCMD/gw-ncmd";
    for i in 0..N {
        if i % 2 == 0 {
            writeln!(host, "rebirth {ncmd}").unwrap();
        } else {
            writeln!(host, "metric {ncmd} Node Control/Reboot").unwrap();
        }
    }
    host.flush().unwrap();
    // The broker acknowledged all of them to the host...
    let mut published = 0;
    let t0 = Instant::now();
    while published < N {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{published} of {N} published"
        );
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200))
            && l == "PUBLISHED"
        {
            published += 1;
        }
    }
    // ... and the node took them all in, and did the rebirth.
    let t0 = Instant::now();
    while metric(&d, "outpost_uplink_sparkplug_commands_ignored_total") < (N / 2) as f64
        || metric(&d, "outpost_uplink_sparkplug_rebirths_total") < 1.0
    {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", d.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = d.log();
    let lines = log
        .lines()
        .filter(|l| l.contains("Sparkplug node command ignored") || l.contains("Sparkplug rebirth"))
        .count();
    eprintln!("ncmd flood: {N} commands, {lines} log lines about them");
    assert!(lines <= 6, "{lines} log lines for {N} commands:\n{log}");
    assert_eq!(
        metric(&d, "outpost_uplink_sparkplug_commands_total"),
        N as f64
    );
    assert_eq!(
        metric(&d, "outpost_uplink_sparkplug_commands_ignored_total"),
        (N / 2) as f64
    );
    // Rebirths asked for while one was pending were folded into it.
    let rebirths = metric(&d, "outpost_uplink_sparkplug_rebirths_total");
    assert!(rebirths < (N / 2) as f64, "{rebirths} rebirths");
}

/// A real nats-server with JetStream and its MQTT gateway on loopback.
struct Nats {
    _child: KillOnDrop,
    mqtt: u16,
}

impl Nats {
    fn start(dir: &Path) -> Nats {
        std::fs::create_dir_all(dir).unwrap();
        let mqtt = free_port();
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "server_name: outpost_test\nlisten: 127.0.0.1:{}\n\
                 jetstream {{ store_dir: \"{}/js\" }}\nmqtt {{ listen: 127.0.0.1:{mqtt} }}\n",
                free_port(),
                dir.display()
            ),
        )
        .unwrap();
        let log: PathBuf = dir.join("nats.log");
        let child = std::process::Command::new("nats-server")
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("nats-server (Debian package nats-server) is needed for the NATS tests");
        let n = Nats {
            _child: KillOnDrop(child),
            mqtt,
        };
        let t0 = Instant::now();
        while !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("Listening for MQTT clients")
            || std::net::TcpStream::connect(("127.0.0.1", mqtt)).is_err()
        {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "nats-server did not listen:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        n
    }
}

/// NATS 2.9's MQTT gateway refuses topics with a `.`, so Sparkplug B's
/// `spBv1.0/...` cannot pass: it closes the connection. The daemon's log
/// says which topic the broker refused (the NDEATH will of the CONNECT),
/// not only that the connection was closed.
#[test]
fn sparkplug_through_nats_logs_the_refused_topic() {
    let work = tempfile::tempdir().unwrap();
    let nats = Nats::start(&work.path().join("nats"));
    let cfg = sensors_over_http("").replace("data_dir", "device = \"gw-nats\"\ndata_dir")
        + &format!(
            "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {}\npayload = \"sparkplug_b\"\nsparkplug_group = \"plant\"\nbackoff_max = \"1s\"\n",
            nats.mqtt
        );
    let d = Daemon::start(&cfg);
    let log = wait_log(&d, "refused_topic=spBv1.0/plant/", Duration::from_secs(30));
    let line = log
        .lines()
        .find(|l| l.contains("refused_topic=spBv1.0/plant/"))
        .unwrap();
    assert!(line.contains("spBv1.0/plant/NDEATH/gw-nats"), "{line}");
    // The status says so too.
    let status = d.status();
    let err = status["uplink"]["last_error"].to_string();
    assert!(err.contains("spBv1.0/plant/NDEATH/gw-nats"), "{status:#}");
}
