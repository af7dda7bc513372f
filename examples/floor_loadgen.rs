//! The load generator and receivers of `perf/floor_latency`: compiled, with
//! blocking sockets on their own threads, so neither the generator nor the
//! PLC is what the tail measures.
//!
//! It is the PLC (a minimal Modbus TCP server that acknowledges writes of
//! multiple registers, FC 16), the UDP peer and the MQTT subscriber of one
//! pipeline's three local outputs, and the sender of its frames. Each frame
//! is a named UDP datagram (one length byte, the stream name, 16 f32 LE
//! values: the frame's global number, its stream, zeros); the pipeline's
//! model passes the values through, so every record carries its frame's
//! number: the UDP and MQTT outputs in the record's JSON
//! (`outputs.y.data[0]`), the Modbus output in registers 0-1 (a u32). Each
//! arrival is matched to its frame exactly, whatever the order.
//!
//! It binds its listeners, prints `{"ready": {"modbus": PORT, "udp": PORT}}`,
//! waits for a line on stdin (the daemon is up and its outputs connected),
//! sends `--warm-seconds` of frames not counted, then `--seconds` at `--rate`
//! frames/s per stream (`--streams` streams, offset by a fraction of the
//! period so they never arrive together), waits a second for stragglers and
//! prints one JSON line: for each output the frames seen, missing, and the
//! send -> arrival latency p50/p90/p99/max in µs. `--loopback` sends the
//! frames to its own UDP receiver instead (no daemon): the harness's floor.
//!
//! Usage: cargo build --release --example floor_loadgen

// A failed unwrap here is a failed run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, Read, Write};
use std::net::{TcpListener, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser, Debug)]
struct Args {
    /// Where frames go (the daemon's udp source).
    #[arg(long, default_value = "127.0.0.1:9400")]
    to: String,
    /// MQTT broker port of the mqtt output (0: no MQTT).
    #[arg(long, default_value_t = 0)]
    mqtt_port: u16,
    /// Topic filter of the mqtt output's records.
    #[arg(long, default_value = "local/+/floor")]
    sub: String,
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Frames/s per stream.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    #[arg(long, default_value_t = 2.0)]
    warm_seconds: f64,
    /// Frames to the own UDP receiver, no daemon.
    #[arg(long)]
    loopback: bool,
}

/// Arrival (ns since t0, 0 = not yet) per frame number, per output.
struct Table(Vec<AtomicU64>);

impl Table {
    fn new(n: usize) -> Arc<Table> {
        Arc::new(Table((0..n).map(|_| AtomicU64::new(0)).collect()))
    }
    fn mark(&self, seq: usize, t: u64) {
        if let Some(a) = self.0.get(seq) {
            let _ = a.compare_exchange(0, t.max(1), Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

fn ns(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

/// The frame number in a record's JSON (`outputs.y.data[0]`).
fn seq_of_record(body: &[u8]) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    v["outputs"]["y"]["data"][0].as_f64().map(|f| f as usize)
}

/// A minimal Modbus TCP server: acknowledges FC 16 and marks the frame
/// number written into registers 0-1.
fn plc(listener: TcpListener, t0: Instant, table: Arc<Table>) {
    for conn in listener.incoming() {
        let Ok(mut s) = conn else { continue };
        let _ = s.set_nodelay(true);
        let table = table.clone();
        std::thread::spawn(move || {
            let mut hdr = [0u8; 7];
            let mut pdu = [0u8; 256];
            loop {
                if s.read_exact(&mut hdr).is_err() {
                    return;
                }
                let len = usize::from(u16::from_be_bytes([hdr[4], hdr[5]]));
                if !(2..=254).contains(&len) || s.read_exact(&mut pdu[..len - 1]).is_err() {
                    return;
                }
                let at = ns(t0);
                let f = pdu[0];
                let mut out = Vec::with_capacity(12);
                out.extend_from_slice(&hdr[..4]);
                if f == 16 && len >= 12 {
                    let addr = u16::from_be_bytes([pdu[1], pdu[2]]);
                    if addr == 0 {
                        let hi = u32::from(u16::from_be_bytes([pdu[6], pdu[7]]));
                        let lo = u32::from(u16::from_be_bytes([pdu[8], pdu[9]]));
                        table.mark(((hi << 16) | lo) as usize, at);
                    }
                    out.extend_from_slice(&[0, 6, hdr[6], 16]);
                    out.extend_from_slice(&pdu[1..5]);
                } else {
                    out.extend_from_slice(&[0, 3, hdr[6], f | 0x80, 1]);
                }
                if s.write_all(&out).is_err() {
                    return;
                }
            }
        });
    }
}

fn udp_receiver(sock: UdpSocket, t0: Instant, table: Arc<Table>, loopback: bool) {
    let mut buf = vec![0u8; 65_536];
    loop {
        let Ok(n) = sock.recv(&mut buf) else { return };
        let at = ns(t0);
        let seq = if loopback {
            // The frame itself: length byte, name, then f32 values.
            let skip = 1 + usize::from(buf[0]);
            buf.get(skip..skip + 4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        } else {
            seq_of_record(&buf[..n])
        };
        if let Some(s) = seq {
            table.mark(s, at);
        }
    }
}

fn mqtt_receiver(port: u16, sub: String, t0: Instant, table: Arc<Table>, up: Arc<AtomicU64>) {
    let mut opts = rumqttc::MqttOptions::new("floor-loadgen", "127.0.0.1", port);
    opts.set_max_packet_size(1 << 20, 1 << 20);
    let (client, mut conn) = rumqttc::Client::new(opts, 64);
    let mut net = rumqttc::NetworkOptions::new();
    net.set_tcp_nodelay(true);
    conn.eventloop.set_network_options(net);
    client.subscribe(sub, rumqttc::QoS::AtMostOnce).unwrap();
    for ev in conn.iter() {
        match ev {
            Ok(rumqttc::Event::Incoming(rumqttc::Packet::Publish(p))) => {
                let at = ns(t0);
                if let Some(s) = seq_of_record(&p.payload) {
                    table.mark(s, at);
                }
            }
            Ok(rumqttc::Event::Incoming(rumqttc::Packet::SubAck(_))) => {
                up.store(1, Ordering::SeqCst);
            }
            Ok(_) => {}
            Err(e) => {
                eprintln!("floor_loadgen: mqtt: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn summary(sent: &[u64], got: &Table, from: usize, to: usize) -> serde_json::Value {
    let mut lat: Vec<u64> = (from..to)
        .filter_map(|i| {
            let a = got.0[i].load(Ordering::Relaxed);
            (a != 0 && sent[i] != 0).then(|| a.saturating_sub(sent[i]))
        })
        .collect();
    lat.sort_unstable();
    let n = lat.len();
    let q = |p: f64| -> f64 {
        if n == 0 {
            return 0.0;
        }
        let i = ((p * n as f64).ceil() as usize).clamp(1, n) - 1;
        (lat[i] as f64 / 1000.0 * 10.0).round() / 10.0
    };
    serde_json::json!({
        "frames": to - from,
        "seen": n,
        "missing": (to - from) - n,
        "p50_us": q(0.50),
        "p90_us": q(0.90),
        "p99_us": q(0.99),
        "max_us": q(1.0),
    })
}

fn main() {
    let args = Args::parse();
    let period = Duration::from_secs_f64(1.0 / args.rate);
    let warm = (args.warm_seconds * args.rate) as usize * args.streams;
    let measured = (args.seconds * args.rate) as usize * args.streams;
    let total = warm + measured;
    let t0 = Instant::now();
    let (mb_t, udp_t, mqtt_t) = (Table::new(total), Table::new(total), Table::new(total));

    let mb = TcpListener::bind("127.0.0.1:0").unwrap();
    let mb_port = mb.local_addr().unwrap().port();
    {
        let t = mb_t.clone();
        std::thread::spawn(move || plc(mb, t0, t));
    }
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    let udp_addr = udp.local_addr().unwrap();
    {
        let t = udp_t.clone();
        let lb = args.loopback;
        std::thread::spawn(move || udp_receiver(udp, t0, t, lb));
    }
    let mqtt_up = Arc::new(AtomicU64::new(0));
    if args.mqtt_port != 0 {
        let (t, up, sub, port) = (
            mqtt_t.clone(),
            mqtt_up.clone(),
            args.sub.clone(),
            args.mqtt_port,
        );
        std::thread::spawn(move || mqtt_receiver(port, sub, t0, t, up));
        let until = Instant::now() + Duration::from_secs(10);
        while mqtt_up.load(Ordering::SeqCst) == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    println!(
        "{}",
        serde_json::json!({"ready": {"modbus": mb_port, "udp": udp_addr.port()}})
    );
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);

    let to = if args.loopback {
        udp_addr.to_string()
    } else {
        args.to.clone()
    };
    let out = UdpSocket::bind("127.0.0.1:0").unwrap();
    out.connect(&to).unwrap();
    let mut sent = vec![0u64; total];
    let names: Vec<String> = (0..args.streams).map(|s| format!("s{s}")).collect();
    let start = Instant::now() + Duration::from_millis(50);
    let offset = period / args.streams as u32;
    let mut seq = 0usize;
    let mut k = 0u32;
    let mut frame = Vec::with_capacity(80);
    while seq < total {
        for (s, name) in names.iter().enumerate() {
            if seq >= total {
                break;
            }
            let due = start + period * k + offset * s as u32;
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            frame.clear();
            frame.push(name.len() as u8);
            frame.extend_from_slice(name.as_bytes());
            let mut v = [0f32; 16];
            v[0] = seq as f32;
            v[1] = s as f32;
            for x in v {
                frame.extend_from_slice(&x.to_le_bytes());
            }
            sent[seq] = ns(t0);
            let _ = out.send(&frame);
            seq += 1;
        }
        k += 1;
    }
    std::thread::sleep(Duration::from_secs(1));
    let mut res = serde_json::Map::new();
    if args.loopback {
        res.insert("loopback_udp".into(), summary(&sent, &udp_t, warm, total));
    } else {
        res.insert("udp".into(), summary(&sent, &udp_t, warm, total));
        res.insert("modbus".into(), summary(&sent, &mb_t, warm, total));
        if args.mqtt_port != 0 {
            res.insert("mqtt".into(), summary(&sent, &mqtt_t, warm, total));
        }
    }
    println!("{}", serde_json::Value::Object(res));
}
