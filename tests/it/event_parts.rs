//! A frame's events at a small packet size: every event reaches the fleet
//! (an event too large for a packet is shortened, a frame's events are
//! split in parts that all arrive), a UDP output gets a busy frame's events
//! in datagrams, and `check` refuses a packet size no event could fit.
//! Real daemons fed over HTTP with the `boxes` model (its detections are
//! its input), a real mosquitto and a subscriber.

use std::collections::{BTreeMap, BTreeSet};
use std::net::UdpSocket;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::*;
use crate::round_three::{box_model, frame, post, start_boxes, tracking};
use crate::uplink::{Fleet, Mosquitto};

/// `n` zones over the whole picture, with names as long as a site's
/// ("loading-bay-07-north-gate-...", 48 bytes): an object in all of them
/// ends with a `track_end` naming every one.
fn zones(n: usize, inertia: u32) -> String {
    (0..n)
        .map(|z| {
            format!(
                "[[pipelines.zones]]\nname = \"loading-bay-{z:02}-north-gate-{}\"\ninertia = {inertia}\npolygon = [[0, 0], [2000, 0], [2000, 2000], [0, 2000]]\n",
                "x".repeat(19)
            )
        })
        .collect()
}

/// `n` boxes on a grid, apart.
fn grid(n: usize) -> Vec<[f64; 4]> {
    (0..n)
        .map(|i| {
            let (x, y) = ((i % 8) as f64 * 60.0, (i / 8) as f64 * 60.0);
            [x, y, x + 30.0, y + 30.0]
        })
        .collect()
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|e| e["event"] == kind).count()
}

#[test]
fn a_frames_events_all_reach_the_fleet_at_a_1_kib_packet_size() {
    // 30 objects in 30 zones: 30 track_start, 900 zone_enter, then 900
    // zone_leave and 30 track_end, each naming the 30 zones (~2 kB alone).
    const OBJECTS: usize = 30;
    const ZONES: usize = 30;
    const PACKET: usize = 1024;
    let dir = tempfile::tempdir().unwrap();
    box_model(dir.path(), OBJECTS);
    let broker = Mosquitto::start(&dir.path().join("broker"));
    let fleet = Fleet::start(broker.port, "fleet-event-parts");
    let extra = format!(
        "max_age = \"300ms\"\n{}[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {}\nmax_packet_bytes = {PACKET}\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\n",
        zones(ZONES, 1),
        broker.port
    );
    let cfg = tracking(&extra);
    // `check` takes it: every event fits a 1 KiB packet once shortened.
    let file = dir.path().join("check.toml");
    let data = dir.path().join("data").display().to_string();
    std::fs::write(
        &file,
        cfg.replace("{DATA}", &data).replace("{API}", "127.0.0.1:0"),
    )
    .unwrap();
    let o = run(outpost()
        .arg("check")
        .arg(&file)
        .env("OUTPOST_MODEL_DIR", dir.path().join("models")));
    assert!(o.status.success(), "check: {}{}", stdout(&o), stderr(&o));

    let d = start_boxes(&cfg, dir);
    post(&d, "gate", "cam", &frame(OBJECTS, &grid(OBJECTS)));
    // The objects leave: empty frames until their tracks end (max_age),
    // as the fleet sees it.
    let want = 2 * OBJECTS + 2 * OBJECTS * ZONES;
    let t0 = Instant::now();
    let mut records: Vec<Value> = Vec::new();
    let mut posted_empty = 0;
    while t0.elapsed() < Duration::from_secs(60) {
        records = fleet.records().into_iter().map(|(_, r)| r).collect();
        let events: Vec<Value> = records
            .iter()
            .flat_map(|r| {
                r["outputs"]["events"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .collect();
        if events.len() >= want {
            break;
        }
        if count(&events, "track_end") < OBJECTS {
            post(&d, "gate", "cam", &frame(OBJECTS, &[]));
            posted_empty += 1;
        } else if d.status()["outbox"]["records"] == 0 && t0.elapsed() > Duration::from_secs(5) {
            // Dead-lettered records never arrive: stop once nothing is left.
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let events: Vec<Value> = records
        .iter()
        .flat_map(|r| {
            r["outputs"]["events"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    let got = (
        count(&events, "track_start"),
        count(&events, "zone_enter"),
        count(&events, "zone_leave"),
        count(&events, "track_end"),
    );
    let status = d.status();
    eprintln!(
        "{} of {want} events in {} records (start, enter, leave, end = {got:?}); {posted_empty} empty frames; outbox {}",
        events.len(),
        records.len(),
        status["outbox"]
    );
    // The split frames: every part of each arrived.
    let mut frames: BTreeMap<String, (u64, BTreeSet<u64>)> = BTreeMap::new();
    for r in &records {
        let o = &r["outputs"];
        if let Some(f) = o["frame"].as_str() {
            let e = frames
                .entry(f.to_string())
                .or_insert((o["parts"].as_u64().unwrap(), BTreeSet::new()));
            e.1.insert(o["part"].as_u64().unwrap());
        }
    }
    let incomplete: Vec<String> = frames
        .iter()
        .filter(|(_, (n, seen))| *seen != (1..=*n).collect::<BTreeSet<u64>>())
        .map(|(f, (n, seen))| {
            let missing: Vec<u64> = (1..=*n).filter(|p| !seen.contains(p)).collect();
            format!("{f}: {} of {n} parts, missing {missing:?}", seen.len())
        })
        .collect();
    eprintln!(
        "{} split frames, {} incomplete: {incomplete:?}",
        frames.len(),
        incomplete.len()
    );
    assert_eq!(
        status["outbox"]["dead_letters"],
        0,
        "dead letters: {}\n{}",
        status["outbox"],
        d.log()
    );
    assert_eq!(
        got,
        (OBJECTS, OBJECTS * ZONES, OBJECTS * ZONES, OBJECTS),
        "{}",
        d.log()
    );
    assert!(frames.len() >= 2, "{frames:?}");
    assert!(incomplete.is_empty(), "{incomplete:?}");
    // The ends that named too many zones for a packet say so, and how many.
    for e in events.iter().filter(|e| e["event"] == "track_end") {
        assert_eq!(e["truncated"], true, "{e}");
        assert_eq!(e["zones_count"], ZONES as u64, "{e}");
        let named = e["zones"].as_array().unwrap();
        assert!(!named.is_empty() && named.len() < ZONES, "{e}");
    }
}

#[test]
fn a_busy_frames_events_reach_a_udp_output_in_datagrams() {
    // 64 objects in 10 zones: 704 events, ~100 kB, one record for the
    // default 1 MiB packet, and more than a UDP datagram holds (65,507).
    const OBJECTS: usize = 64;
    const ZONES: usize = 10;
    let dir = tempfile::tempdir().unwrap();
    box_model(dir.path(), OBJECTS);
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let port = udp.local_addr().unwrap().port();
    let cfg = tracking(&zones(ZONES, 1)).replace(
        "source = { type = \"http\" }",
        &format!(
            "source = {{ type = \"http\" }}\noutputs = [{{ type = \"udp\", to = \"127.0.0.1:{port}\" }}]"
        ),
    );
    let d = start_boxes(&cfg, dir);
    let boxes: Vec<[f64; 4]> = (0..OBJECTS)
        .map(|i| {
            let (x, y) = ((i % 8) as f64 * 40.0, (i / 8) as f64 * 40.0);
            [x, y, x + 20.0, y + 20.0]
        })
        .collect();
    post(&d, "gate", "cam", &frame(OBJECTS, &boxes));
    let mut buf = vec![0u8; 65536];
    let (mut enters, mut starts, mut records) = (0, 0, 0);
    while enters < OBJECTS * ZONES {
        let Ok(n) = udp.recv(&mut buf) else {
            break;
        };
        let r: Value = serde_json::from_slice(&buf[..n]).unwrap();
        if let Some(events) = r["outputs"]["events"].as_array() {
            records += 1;
            enters += count(events, "zone_enter");
            starts += count(events, "track_start");
        }
    }
    let outputs = &d.status()["pipelines"][0]["outputs"];
    eprintln!(
        "udp: {starts} track_start, {enters} zone_enter in {records} records; outputs {outputs}"
    );
    assert_eq!(
        (starts, enters),
        (OBJECTS, OBJECTS * ZONES),
        "outputs: {outputs}\n{}",
        d.log()
    );
    assert!(records >= 2, "{records} records");
}

#[test]
fn check_refuses_a_packet_size_too_small_for_any_event() {
    // Names of 64 bytes: even shortened as far as it goes, a track_end's
    // record (device twice, the pipeline, a track id and the envelope)
    // needs more than 1 KiB.
    let long = |c: char| c.to_string().repeat(64);
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("outpost.toml");
    let write = |packet: usize| {
        std::fs::write(
            &cfg,
            format!(
                r#"model_dir = "{models}"
[device]
name = "{device}"
[[pipelines]]
name = "{pipeline}"
model = "mtcnn_pnet"
source = {{ type = "http" }}
[pipelines.track]
[[pipelines.zones]]
name = "{zone}"
polygon = [[0, 0], [100, 0], [100, 100], [0, 100]]
[uplink]
type = "mqtt"
host = "127.0.0.1"
max_packet_bytes = {packet}
"#,
                models = model_dir().display(),
                device = long('d'),
                pipeline = long('p'),
                zone = long('z'),
            ),
        )
        .unwrap();
    };
    write(1024);
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "1 problem(s)");
    let err = stderr(&o);
    let line = err
        .lines()
        .find(|l| l.contains("largest tracking event"))
        .unwrap_or_else(|| panic!("no such problem in:\n{err}"));
    eprintln!("{line}");
    let need: usize = line
        .split("needs a record of ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no figure in: {line}"));
    assert!(need > 1024, "{line}");
    assert!(line.contains("uplink.max_packet_bytes is 1024"), "{line}");
    // Its own figure is enough.
    write(need);
    let o = run(outpost().arg("check").arg(&cfg));
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
}
