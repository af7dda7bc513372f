//! Hardening, third round: track ids across boots, a busy frame's events
//! and the uplink's packet size, and what an HTTP `200` promises. Real
//! daemons fed over HTTP with `boxes`, a model whose detections are its
//! input (tests/helpers/box_model.py), so each test decides every box.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::*;
use crate::uplink::{Fleet, Mosquitto};

/// Writes the `boxes` model (`n` rows a frame) into `dir/models`.
pub(crate) fn box_model(dir: &Path, n: usize) {
    let o = run(Command::new("python3")
        .arg(root().join("tests/helpers/box_model.py"))
        .arg(dir.join("models"))
        .arg(n.to_string()));
    assert!(o.status.success(), "box_model.py: {}", stderr(&o));
}

/// A frame of `n` rows: `boxes` first (score 0.9, class 0), then empty rows.
pub(crate) fn frame(n: usize, boxes: &[[f64; 4]]) -> Vec<u8> {
    let rows: Vec<Value> = (0..n)
        .map(|i| match boxes.get(i) {
            Some(b) => json!([b[0], b[1], b[2], b[3], 0.9, 0.0]),
            None => json!([0.0, 0.0, 0.0, 0.0, 0.0, 0.0]),
        })
        .collect();
    serde_json::to_vec(&rows).unwrap()
}

/// A daemon in `dir` whose models are the ones `box_model` wrote there.
pub(crate) fn start_boxes(cfg: &str, dir: tempfile::TempDir) -> Daemon {
    let models = dir.path().join("models").display().to_string();
    Daemon::start_full(cfg, dir, &[("OUTPOST_MODEL_DIR", models)], true)
}

/// POSTs a frame to the pipeline's http source; the answer's JSON.
pub(crate) fn post(d: &Daemon, pipeline: &str, stream: &str, body: &[u8]) -> Value {
    let path = format!("/v1/pipelines/{pipeline}/infer?stream={stream}");
    let (code, answer) = http("POST", &d.api, &path, body).expect("infer");
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&answer));
    serde_json::from_slice(&answer).unwrap()
}

pub(crate) fn tracking(extra: &str) -> String {
    format!(
        r#"data_dir = "{{DATA}}"
[device]
name = "gw"
[api]
listen = "{{API}}"
[[pipelines]]
name = "gate"
model = "boxes"
source = {{ type = "http" }}
[pipelines.track]
min_hits = 1
{extra}"#
    )
}

/// Every event of the printed records, with the id of its record.
fn printed_events(d: &Daemon) -> Vec<(String, Value)> {
    d.seen
        .iter()
        .flat_map(|r| {
            let id = r["id"].as_str().unwrap_or_default().to_string();
            r["outputs"]["events"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |e| (id.clone(), e))
        })
        .collect()
}

/// The boot in a record id `device/boot/seq`.
fn record_boot(id: &str) -> String {
    id.rsplit('/').nth(1).unwrap().to_string()
}

#[test]
fn track_ids_name_their_boot_and_never_repeat_across_restarts() {
    let dir = tempfile::tempdir().unwrap();
    box_model(dir.path(), 4);
    let cfg = tracking("");
    let mut dir = dir;
    let mut ids: Vec<String> = Vec::new();
    for boot in 1..=3 {
        let mut d = start_boxes(&cfg, dir);
        post(&d, "gate", "cam", &frame(4, &[[10.0, 10.0, 40.0, 40.0]]));
        let starts = |r: &[Value]| {
            r.iter().any(|r| {
                r["outputs"]["events"]
                    .as_array()
                    .is_some_and(|e| e.iter().any(|e| e["event"] == "track_start"))
            })
        };
        d.records_until(Duration::from_secs(20), starts);
        let started: Vec<(String, Value)> = printed_events(&d)
            .into_iter()
            .filter(|(_, e)| e["event"] == "track_start")
            .collect();
        assert_eq!(started.len(), 1, "boot {boot}: {:?}", d.seen);
        let (record, e) = &started[0];
        let track = e["track"].as_str().unwrap().to_string();
        // The record's boot (the outbox's, kept in the data dir) is in the
        // track's id: `{device}/{pipeline}/{stream}/{boot}-{n}`.
        let b = record_boot(record);
        assert_eq!(track, format!("gw/gate/cam/{b}-1"), "record {record}");
        assert!(
            !ids.contains(&track),
            "{track} again in boot {boot}: {ids:?}"
        );
        ids.push(track);
        dir = d.stop_keep_dir();
    }
}

#[test]
fn a_busy_frames_events_reach_the_fleet_in_parts_that_fit_the_packet_size() {
    // 256 objects entering 50 zones that all overlap, in one frame:
    // 256 track_start and 12,800 zone_enter events, about 2 MB of JSON,
    // against the uplink's default max_packet_bytes of 1 MiB.
    const OBJECTS: usize = 256;
    const ZONES: usize = 50;
    let dir = tempfile::tempdir().unwrap();
    box_model(dir.path(), OBJECTS);
    let broker = Mosquitto::start(&dir.path().join("broker"));
    let fleet = Fleet::start(broker.port, "fleet-busy-frame");
    let mut extra = String::new();
    for z in 0..ZONES {
        extra.push_str(&format!(
            "[[pipelines.zones]]\nname = \"zone{z}\"\ninertia = 1\npolygon = [[0, 0], [1000, 0], [1000, 1000], [0, 1000]]\n"
        ));
    }
    extra.push_str(&format!(
        "[uplink]\ntype = \"mqtt\"\nhost = \"127.0.0.1\"\nport = {}\nbackoff_min = \"100ms\"\nbackoff_max = \"1s\"\n",
        broker.port
    ));
    let d = start_boxes(&tracking(&extra), dir);
    let boxes: Vec<[f64; 4]> = (0..OBJECTS)
        .map(|i| {
            let (x, y) = ((i % 16) as f64 * 40.0, (i / 16) as f64 * 40.0);
            [x, y, x + 20.0, y + 20.0]
        })
        .collect();
    post(&d, "gate", "cam", &frame(OBJECTS, &boxes));
    let t0 = Instant::now();
    let (mut enters, mut starts, mut parts) = (0, 0, Vec::new());
    while t0.elapsed() < Duration::from_secs(60) {
        let got = fleet.records();
        enters = 0;
        starts = 0;
        parts.clear();
        for (_, r) in &got {
            let Some(events) = r["outputs"]["events"].as_array() else {
                continue;
            };
            enters += events.iter().filter(|e| e["event"] == "zone_enter").count();
            starts += events
                .iter()
                .filter(|e| e["event"] == "track_start")
                .count();
            parts.push(r["outputs"].clone());
        }
        if enters >= OBJECTS * ZONES {
            break;
        }
        // Dead-lettered records never arrive: stop waiting once the outbox
        // has nothing left to send.
        if d.status()["outbox"]["records"] == 0 && t0.elapsed() > Duration::from_secs(5) {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        (starts, enters),
        (OBJECTS, OBJECTS * ZONES),
        "the fleet got {} records; dead letters: {}\n{}",
        parts.len(),
        d.status()["outbox"],
        d.log()
    );
    // The parts name one frame and count themselves.
    let n = parts.len();
    assert!(n >= 2, "{n} records");
    let frame = parts[0]["frame"].clone();
    let mut seen: Vec<u64> = parts.iter().map(|p| p["part"].as_u64().unwrap()).collect();
    seen.sort_unstable();
    assert_eq!(seen, (1..=n as u64).collect::<Vec<_>>());
    assert!(
        parts
            .iter()
            .all(|p| p["frame"] == frame && p["parts"] == n as u64),
        "{frame}"
    );
}

#[test]
fn an_http_200_is_a_record_that_survives_sigkill() {
    // A group commit window of 2 s: a record answered before its commit
    // would be lost by the kill that follows at once.
    let cfg = format!(
        "{}[outbox]\nflush_interval = \"2s\"\nflush_records = 100000\n",
        sensors_over_http("")
    );
    let mut d = Daemon::start(&cfg);
    let body = serde_json::to_vec(&[0.25f32; 16]).unwrap();
    let mut answered = Vec::new();
    for _ in 0..4 {
        let v = post(&d, "sensors", "s", &body);
        assert_eq!(v["durable"], true, "{v}");
        for r in v["records"].as_array().unwrap() {
            answered.push(r["id"].as_str().unwrap().to_string());
        }
    }
    assert_eq!(answered.len(), 4);
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let o = run(outpost()
        .args(["outbox", "export", "--data-dir"])
        .arg(d.dir.path().join("data")));
    assert!(o.status.success(), "export: {}", stderr(&o));
    let kept: Vec<String> = stdout(&o)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["record"]["id"].as_str().map(str::to_string))
        .collect();
    let lost: Vec<&String> = answered.iter().filter(|id| !kept.contains(id)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} records answered 200 lost after SIGKILL: {lost:?}",
        lost.len(),
        answered.len()
    );
}

/// A tmpfs mounted for the test's life (the test runs as root, as `.ci/run` does).
#[cfg(feature = "camera")]
struct Tmpfs(std::path::PathBuf);

#[cfg(feature = "camera")]
impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[cfg(feature = "camera")]
#[test]
fn snapshots_on_a_full_disk_are_counted_and_leave_no_temporary_files() {
    use std::io::Write;
    // The tracking test's scene (two faces, MTCNN with its stages, so the
    // pipeline decodes frames and keeps best crops), its snapshots folder
    // on a tmpfs that is full before the daemon starts.
    let scene = tempfile::tempdir().unwrap();
    crate::tracking::render(scene.path());
    let dir = tempfile::tempdir().unwrap();
    let tracks = dir.path().join("data/tracks");
    std::fs::create_dir_all(&tracks).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&tracks)
        .status()
        .expect("run mount");
    assert!(st.success(), "mounting a tmpfs needs root");
    let _tmpfs = Tmpfs(tracks.clone());
    std::fs::create_dir_all(tracks.join("gate")).unwrap();
    let mut f = std::fs::File::create(tracks.join("filler")).unwrap();
    while f.write(&[0u8; 4096]).is_ok_and(|n| n > 0) {}
    drop(f);
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
source = {{ type = "camera", queue = 64, pipeline = "multifilesrc location={location} index=0 stop-index={last} loop=true caps=image/png,framerate=10/1 ! pngdec ! videoconvert ! appsink name=outpost" }}
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"
[pipelines.track]
min_hits = 3
max_age = "200ms"
"#,
        models = model_dir().display(),
        location = location.display(),
        last = crate::tracking::FRAMES - 1,
    );
    let d = Daemon::start(&cfg.replace("{DATA}", &dir.path().join("data").display().to_string()));
    let failed = |d: &Daemon| -> f64 {
        let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
        String::from_utf8_lossy(&body)
            .lines()
            .find(|l| l.starts_with("outpost_track_snapshots_failed_total{"))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
            .unwrap_or(0.0)
    };
    let t0 = Instant::now();
    while failed(&d) < 3.0 && t0.elapsed() < Duration::from_secs(180) {
        std::thread::sleep(Duration::from_millis(200));
    }
    let warnings = d.log().matches("track snapshot not kept").count();
    // Rate-limited: at most one warning every 5 s, however many fail.
    let bound = 1 + (t0.elapsed().as_secs() / 5) as usize;
    let tmp: Vec<_> = std::fs::read_dir(tracks.join("gate"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let status = d.status();
    eprintln!(
        "full disk: failed {} in {:?}, {warnings} warnings, left in the folder: {tmp:?}",
        failed(&d),
        t0.elapsed()
    );
    assert!(
        failed(&d) >= 3.0,
        "no failed snapshot counted:\n{}",
        d.log()
    );
    assert!(tmp.is_empty(), "files left behind: {tmp:?}");
    assert!(
        warnings <= bound,
        "{warnings} warnings in {:?}:\n{}",
        t0.elapsed(),
        d.log()
    );
    // `/v1/status` counts them too, in the pipeline's tracking counts.
    let text = status.to_string();
    let in_status = text.split("\"snapshots_failed\":").nth(1).and_then(|r| {
        r.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse::<u64>()
            .ok()
    });
    assert!(in_status.is_some_and(|n| n >= 3), "{text}");
}
