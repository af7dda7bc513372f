//! Local outputs against real peers: a real `outpost run`, the embedded
//! broker and a real mosquitto, UDP and unix sockets on this machine read by
//! the test, records compared with the ones the outbox got.

use std::collections::BTreeSet;
use std::io::Read;
use std::net::UdpSocket;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;

/// A sensors-over-HTTP pipeline with the given `outputs = [...]` line.
fn config(head: &str, outputs: &str) -> String {
    format!(
        r#"
device = "gw-out"
data_dir = "{{DATA}}"
{head}
[api]
listen = "{{API}}"
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
source = {{ type = "http" }}
outputs = {outputs}
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#
    )
}

/// Posts one frame; returns the record the daemon made (and stored).
fn infer(d: &Daemon, stream: &str, k: usize) -> Value {
    let body = format!(
        "[{}]",
        (0..16)
            .map(|i| format!("{}", (i + k) as f32 / 7.0))
            .collect::<Vec<_>>()
            .join(",")
    );
    let (code, out) = http(
        "POST",
        &d.api,
        &format!("/v1/pipelines/sensors/infer?stream={stream}"),
        body.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&out));
    let v: Value = serde_json::from_slice(&out).unwrap();
    v["records"][0].clone()
}

/// The status of output `i` of the first pipeline.
fn output(d: &Daemon, i: usize) -> Value {
    d.status()["pipelines"][0]["outputs"][i].clone()
}

fn wait_until(what: &str, d: &Daemon, pred: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !pred() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{what}: {}\n{}",
            d.status()["pipelines"][0]["outputs"],
            d.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// (topic, payload) of each message received.
type Got = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// A rumqttc subscriber on its own thread collecting (topic, payload).
struct Sub {
    got: Got,
    stop: Arc<AtomicBool>,
}

impl Sub {
    fn start(port: u16, filter: &str) -> Sub {
        let got: Got = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let subscribed = Arc::new(AtomicBool::new(false));
        let (g, st, s, filter) = (
            got.clone(),
            stop.clone(),
            subscribed.clone(),
            filter.to_string(),
        );
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let mut o = rumqttc::MqttOptions::new(
                    format!("local-sub-{}", std::process::id()),
                    "127.0.0.1",
                    port,
                );
                o.set_keep_alive(Duration::from_secs(5));
                let (client, mut ev) = rumqttc::AsyncClient::new(o, 100);
                while !st.load(Ordering::SeqCst) {
                    match tokio::time::timeout(Duration::from_millis(100), ev.poll()).await {
                        Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::ConnAck(_)))) => {
                            let _ = client.try_subscribe(filter.clone(), rumqttc::QoS::AtMostOnce);
                        }
                        Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_)))) => {
                            s.store(true, Ordering::SeqCst)
                        }
                        Ok(Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p)))) => g
                            .lock()
                            .unwrap()
                            .push((p.topic.clone(), p.payload.to_vec())),
                        Ok(Ok(_)) | Err(_) => {}
                        Ok(Err(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            });
        });
        let t0 = Instant::now();
        while !subscribed.load(Ordering::SeqCst) {
            assert!(t0.elapsed() < Duration::from_secs(30), "no SUBACK");
            std::thread::sleep(Duration::from_millis(20));
        }
        Sub { got, stop }
    }

    /// Waits for `n` messages; returns (topic, JSON) of all so far.
    fn wait(&self, n: usize) -> Vec<(String, Value)> {
        let t0 = Instant::now();
        while self.got.lock().unwrap().len() < n && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.got
            .lock()
            .unwrap()
            .iter()
            .map(|(t, p)| (t.clone(), serde_json::from_slice(p).unwrap()))
            .collect()
    }
}

impl Drop for Sub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// mosquitto on a given port (killed on drop).
struct Broker(Child);

impl Broker {
    fn start(dir: &Path, port: u16) -> Broker {
        let conf = dir.join("mosquitto.conf");
        std::fs::write(
            &conf,
            format!("user root\nlistener {port} 127.0.0.1\nallow_anonymous true\n"),
        )
        .unwrap();
        let child = Command::new("/usr/sbin/mosquitto")
            .arg("-c")
            .arg(&conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("mosquitto (Debian package mosquitto) is needed");
        let t0 = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "mosquitto did not listen"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Broker(child)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn recv_datagram(s: &UdpSocket) -> Value {
    let mut buf = vec![0u8; 65536];
    let n = s.recv(&mut buf).expect("a datagram within the timeout");
    serde_json::from_slice(&buf[..n]).unwrap()
}

/// Reads one u32-LE-length-prefixed frame.
fn read_frame(s: &mut UnixStream) -> Vec<u8> {
    let mut head = [0u8; 4];
    s.read_exact(&mut head).expect("a frame within the timeout");
    let mut body = vec![0u8; u32::from_le_bytes(head) as usize];
    s.read_exact(&mut body).unwrap();
    body
}

fn ids<'a>(v: impl IntoIterator<Item = &'a Value>) -> BTreeSet<String> {
    v.into_iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect()
}

/// The value of a /metrics sample whose line holds every one of `parts`.
fn metric(d: &Daemon, parts: &[&str]) -> Option<f64> {
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    let text = String::from_utf8(body).unwrap();
    text.lines()
        .find(|l| parts.iter().all(|p| l.contains(p)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn records_reach_every_local_output_with_the_outbox_id() {
    let broker = free_port();
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let udp_port = udp.local_addr().unwrap().port();
    let mut d = Daemon::start(&config(
        &format!("[embedded_broker]\nlisten = \"127.0.0.1:{broker}\""),
        &format!(
            r#"[
  {{ type = "mqtt", topic = "site/{{pipeline}}/{{stream}}" }},
  {{ type = "udp", to = "127.0.0.1:{udp_port}" }},
  {{ type = "unix", path = "{{DIR}}/out.sock", payload = "cbor" }},
]"#
        ),
    ));
    let sub = Sub::start(broker, "site/#");
    wait_until("mqtt output connects", &d, || {
        output(&d, 0)["connected"] == true
    });
    let mut reader = UnixStream::connect(d.dir.path().join("out.sock")).unwrap();
    reader
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    wait_until("unix reader accepted", &d, || {
        output(&d, 2)["connected"] == true
    });

    let n = 5;
    let made: Vec<Value> = (0..n).map(|k| infer(&d, &format!("s{k}"), k)).collect();
    let want = ids(&made);
    assert_eq!(want.len(), n);

    // UDP: the same JSON record, one datagram each.
    let got_udp: Vec<Value> = (0..n).map(|_| recv_datagram(&udp)).collect();
    assert_eq!(got_udp, made, "udp records differ from the stored ones");
    // Unix: CBOR of the same record.
    let got_unix: Vec<Value> = (0..n)
        .map(|_| ciborium::from_reader(&read_frame(&mut reader)[..]).unwrap())
        .collect();
    assert_eq!(ids(&got_unix), want);
    assert_eq!(got_unix[0]["outputs"], made[0]["outputs"]);
    // MQTT: on the topic of its pipeline and stream.
    let got_mqtt = sub.wait(n);
    assert_eq!(ids(got_mqtt.iter().map(|(_, v)| v)), want);
    for (t, v) in &got_mqtt {
        assert_eq!(
            t,
            &format!("site/sensors/{}", v["stream"].as_str().unwrap())
        );
    }
    // The outbox has the same ids (printed as stored).
    let printed = d.records_until(Duration::from_secs(20), |r| r.len() >= n);
    assert_eq!(ids(printed), want);

    for (i, label) in [
        "mqtt:site/{pipeline}/{stream}".to_string(),
        format!("udp:127.0.0.1:{udp_port}"),
    ]
    .iter()
    .enumerate()
    {
        assert_eq!(output(&d, i)["sent"], n, "{}", output(&d, i));
        let sent = metric(
            &d,
            &["outpost_output_sent_total{", &format!("output=\"{label}\"")],
        );
        assert_eq!(sent, Some(n as f64), "{label}");
    }
    assert!(output(&d, 2)["drops"].as_object().unwrap().is_empty());
    assert_eq!(d.terminate().code(), Some(0));
}

#[test]
fn an_output_whose_peer_is_gone_drops_and_inference_goes_on_until_it_is_back() {
    let broker_port = free_port();
    let udp_port = {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap().port()
    };
    let d = Daemon::start(&config(
        &format!("[site_broker]\nhost = \"127.0.0.1\"\nport = {broker_port}"),
        &format!(
            r#"[
  {{ type = "mqtt", topic = "site/{{device}}/{{stream}}" }},
  {{ type = "udp", to = "127.0.0.1:{udp_port}" }},
  {{ type = "unix", path = "{{DIR}}/out.sock" }},
]"#
        ),
    ));
    // Nobody listens anywhere: every frame is still answered and stored.
    let n = 20;
    for k in 0..n {
        infer(&d, "pump-1", k);
    }
    let st = d.status()["pipelines"][0].clone();
    assert_eq!(st["records"], n, "{st}");
    assert_eq!(st["frames_done"], n, "{st}");
    let o = &st["outputs"];
    assert_eq!(o[0]["drops"]["disconnected"], n, "{o}");
    assert_eq!(o[2]["drops"]["no_reader"], n, "{o}");
    let udp_refused = o[1]["drops"]["refused"].as_u64().unwrap_or(0);
    assert!(udp_refused > 0, "refused datagrams are counted: {o}");
    assert_eq!(
        o[1]["sent"].as_u64().unwrap() + udp_refused,
        n as u64,
        "{o}"
    );
    assert_eq!(
        metric(
            &d,
            &["outpost_output_dropped_total{", "reason=\"no_reader\""]
        ),
        Some(n as f64)
    );

    // The peers come back; each output finds its own way to them.
    let _broker = Broker::start(d.dir.path(), broker_port);
    let udp = UdpSocket::bind(("127.0.0.1", udp_port)).unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut reader = UnixStream::connect(d.dir.path().join("out.sock")).unwrap();
    reader
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let sub = Sub::start(broker_port, "site/#");
    wait_until("outputs reconnect", &d, || {
        let o = d.status()["pipelines"][0]["outputs"].clone();
        o[0]["connected"] == true && o[2]["connected"] == true
    });
    let made: Vec<Value> = (0..3).map(|k| infer(&d, "pump-1", 100 + k)).collect();
    let got_udp: Vec<Value> = (0..3).map(|_| recv_datagram(&udp)).collect();
    assert_eq!(got_udp, made);
    let got_unix: Vec<Value> = (0..3)
        .map(|_| serde_json::from_slice(&read_frame(&mut reader)).unwrap())
        .collect();
    assert_eq!(got_unix, made);
    let got_mqtt = sub.wait(3);
    assert_eq!(ids(got_mqtt.iter().map(|(_, v)| v)), ids(&made));
    assert!(got_mqtt.iter().all(|(t, _)| t == "site/gw-out/pump-1"));
}
