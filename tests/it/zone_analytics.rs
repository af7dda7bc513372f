//! Zone analytics end to end on a rendered scene with known ground truth
//! (tests/vision/render_zones.py: two faces on straight paths at known
//! pixel speeds, played by a real GStreamer `multifilesrc` at 10 fps into
//! the camera source, MTCNN faces, tracking): the occupancy a zone tells
//! frame by frame, speeds in a zone whose calibration maps the scene's
//! pixels to metres, `after`, and direction filters on a zone and lines.

use std::net::UdpSocket;
use std::process::Command;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::common::*;

const FRAMES: usize = 50;
const FPS: f64 = 10.0;
/// render_zones.py's paths, pixels a frame: A right and down, B right.
const A_STEP: (f64, f64) = (3.0, 1.0);
const B_STEP: (f64, f64) = (4.0, 0.0);
/// The yard (and the lane, the same rectangle) in pixels, and what the
/// calibration says a pixel is on the ground: 80 px across are 4 m, 180 px
/// down are 54 m.
const YARD: ([f64; 2], [f64; 2]) = ([160.0, 60.0], [240.0, 240.0]);
const M_PER_PX: (f64, f64) = (4.0 / 80.0, 54.0 / 180.0);

fn time(v: &Value) -> SystemTime {
    humantime::parse_rfc3339_weak(v.as_str().expect("a time")).expect("RFC 3339")
}

fn bottom_centre(b: &Value) -> (f64, f64) {
    let f = |i: usize| b[i].as_f64().unwrap();
    ((f(0) + f(2)) / 2.0, f(3))
}

/// A face's true speed on the ground in km/h.
fn kmh(step: (f64, f64)) -> f64 {
    (step.0 * M_PER_PX.0).hypot(step.1 * M_PER_PX.1) * FPS * 3.6
}

#[test]
fn zone_analytics_on_a_rendered_scene_match_its_ground_truth() {
    let scene = tempfile::tempdir().unwrap();
    let o = run(Command::new("python3")
        .arg(root().join("tests/vision/render_zones.py"))
        .arg(model_dir().join("images/astronaut.png"))
        .arg(scene.path())
        .arg(FRAMES.to_string()));
    assert!(o.status.success(), "render_zones.py: {}", stderr(&o));
    let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
    udp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let port = udp.local_addr().unwrap().port();
    let location = scene.path().join("f%03d.png");
    let ([x0, y0], [x1, y1]) = YARD;
    let cfg = format!(
        r#"data_dir = "{{DATA}}"
model_dir = "{models}"
[device]
name = "gw"
[api]
listen = "{{API}}"
[[pipelines]]
name = "zones"
model = "mtcnn_pnet"
source = {{ type = "camera", queue = 64, pipeline = "multifilesrc location={location} index=0 stop-index={last} caps=image/png,framerate=10/1 ! pngdec ! identity sync=true ! videoconvert ! appsink name=outpost" }}
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
polygon = [[{x0}, {y0}], [{x1}, {y0}], [{x1}, {y1}], [{x0}, {y1}]]
occupancy = true
after = "street"
[[pipelines.zones]]
name = "lane"
polygon = [[{x0}, {y0}], [{x1}, {y0}], [{x1}, {y1}], [{x0}, {y1}]]
distances = [4, 54, 4, 54]
speed_unit = "km/h"
speed_limit = 9.5
[[pipelines.zones]]
name = "street"
polygon = [[0, 140], [150, 140], [150, 240], [0, 240]]
direction = "out"
[[pipelines.lines]]
name = "gate"
points = [[100, 0], [100, 240]]
direction = "in"
[[pipelines.lines]]
name = "exit"
points = [[200, 0], [200, 240]]
direction = "out"
"#,
        models = model_dir().display(),
        location = location.display(),
        last = FRAMES - 1,
    );
    // `identity sync=true` plays the files at their 10 fps, as a camera
    // sends: the frames' capture times are then 100 ms apart, which speeds
    // are measured against (read at once, they would be microseconds).
    let mut d = Daemon::start(&cfg);
    // As in tracking.rs: once the files have played, they go, so the
    // camera's reconnects find nothing to play again.
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
    let stream = frames[0]["stream"].as_str().unwrap().to_string();

    // Where each face's box stands at frame 0 (A is the higher one): the
    // rendered path moves it from there by its step a frame.
    let mut first = [None, None];
    for b in frames[0]["outputs"]["boxes"].as_array().unwrap() {
        let p = bottom_centre(&b["box"]);
        first[usize::from(p.1 > 150.0)] = Some(p);
    }
    let (a0, b0) = (first[0].expect("face A"), first[1].expect("face B"));
    let at = |p0: (f64, f64), step: (f64, f64), f: usize| {
        (p0.0 + step.0 * f as f64, p0.1 + step.1 * f as f64)
    };
    let in_yard = |p: (f64, f64)| p.0 > x0 && p.0 < x1 && p.1 > y0 && p.1 < y1;
    let truth: Vec<u64> = (0..FRAMES)
        .map(|f| u64::from(in_yard(at(a0, A_STEP, f))) + u64::from(in_yard(at(b0, B_STEP, f))))
        .collect();
    let changes: Vec<usize> = (1..FRAMES).filter(|f| truth[*f] != truth[f - 1]).collect();
    // The scene is made for this: A in at ~11, B in at ~32, A out at ~37.
    assert_eq!(changes.len(), 3, "{truth:?}");

    // The counts now, after the last frame: B is in the yard.
    let st = d.status();
    let t = &st["pipelines"][0]["tracking"];
    assert_eq!(t["occupancy"][&stream]["yard"]["object"], 1, "{t}");
    let (_, m) = http("GET", &d.api, "/metrics", b"").unwrap();
    let m = String::from_utf8(m).unwrap();
    for line in [
        format!(
            r#"outpost_zone_occupancy{{pipeline="zones",stream="{stream}",zone="yard",label="object"}} 1.0"#
        ),
        r#"outpost_line_crossings_total{pipeline="zones",line="gate",direction="in",label="object"} 1"#
            .to_string(),
    ] {
        assert!(m.lines().any(|l| l == line), "{line} not in:\n{m}");
    }
    assert!(
        !m.contains(r#"line="exit""#),
        "exit counts only `out`, and both faces went in:\n{m}"
    );

    let st = d.terminate();
    assert!(st.success(), "{st}\n{}", d.log());
    let events: Vec<Value> = d
        .seen
        .iter()
        .filter(|r| r["pipeline"] == "zones")
        .flat_map(|r| {
            r["outputs"]["events"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    let frame_of = |e: &Value| {
        let t = time(&e["ts"]);
        let gap = |r: &Value| {
            let c = time(&r["captured"]);
            c.duration_since(t)
                .or_else(|_| t.duration_since(c))
                .unwrap()
        };
        (0..frames.len()).min_by_key(|i| gap(&frames[*i])).unwrap()
    };
    // Which track is which face: A is the one high in the picture.
    let track_of = |want_a: bool| {
        events
            .iter()
            .find(|e| e["event"] == "track_start" && (bottom_centre(&e["box"]).1 < 150.0) == want_a)
            .and_then(|e| e["track"].as_str())
            .unwrap_or_else(|| {
                panic!(
                    "no track_start of face {}: {events:#?}",
                    if want_a { "A" } else { "B" }
                )
            })
            .to_string()
    };
    let (a, b) = (track_of(true), track_of(false));
    let of = |kind: &str, track: &str, key: &str, value: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["event"] == kind && e["track"] == track && e[key] == value)
            .collect()
    };

    // Occupancy: every change told once, at its frame (the boxes stand
    // where the patches were drawn, to a pixel or so: a frame either way);
    // between changes the told count is the true one, frame by frame.
    let occ: Vec<(usize, u64)> = events
        .iter()
        .filter(|e| e["event"] == "zone_occupancy" && e["zone"] == "yard")
        .map(|e| {
            assert_eq!(e["label"], "object", "{e}");
            assert!(e.get("track").is_none(), "{e}");
            (frame_of(e), e["count"].as_u64().unwrap())
        })
        .collect();
    // The last one is the stream's end, emptying the yard.
    assert_eq!(occ.last().map(|o| o.1), Some(0), "{occ:?}");
    let told = &occ[..occ.len() - 1];
    assert_eq!(
        told.len(),
        changes.len(),
        "told {told:?}, truth changes at {changes:?}"
    );
    for ((f, n), c) in told.iter().zip(&changes) {
        assert!(
            f.abs_diff(*c) <= 1,
            "count {n} told at frame {f}, truth at {c}"
        );
        assert_eq!(*n, truth[*c], "{told:?} {truth:?}");
    }
    for f in 0..FRAMES {
        if changes.iter().any(|c| c.abs_diff(f) <= 1) {
            continue;
        }
        let now = told.iter().rev().find(|(g, _)| *g <= f).map_or(0, |o| o.1);
        assert_eq!(now, truth[f], "frame {f}: told {told:?}, truth {truth:?}");
    }

    // `after = "street"`: B came from the street and enters the yard; A
    // came down from above and passes unannounced (occupancy counted it).
    assert_eq!(of("zone_enter", &b, "zone", "yard").len(), 1, "{events:#?}");
    assert!(
        of("zone_enter", &a, "zone", "yard").is_empty(),
        "{events:#?}"
    );
    assert!(
        of("zone_leave", &a, "zone", "yard").is_empty(),
        "{events:#?}"
    );

    // Direction: the street tells only leaving; `gate` counts only `in`
    // (B), `exit` only `out` (nobody went that way).
    assert!(
        of("zone_enter", &b, "zone", "street").is_empty(),
        "{events:#?}"
    );
    assert_eq!(
        of("zone_leave", &b, "zone", "street").len(),
        1,
        "{events:#?}"
    );
    let crossings: Vec<(&str, &str, &str)> = events
        .iter()
        .filter(|e| e["event"] == "line_cross")
        .map(|e| {
            (
                e["track"].as_str().unwrap(),
                e["line"].as_str().unwrap(),
                e["direction"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(crossings, vec![(b.as_str(), "gate", "in")], "{events:#?}");

    // Speed in the calibrated lane, within 10 % of the rendered speed:
    // A 12.1 km/h (over the limit of 9.5, so speeding once), B 7.2 km/h.
    let near = |v: &Value, want: f64, what: &str| {
        let got = v.as_f64().unwrap_or_else(|| panic!("{what}: no speed"));
        eprintln!("{what}: {got:.2} km/h, rendered {want:.2}");
        assert!(
            (got - want).abs() <= 0.1 * want,
            "{what}: {got} km/h, rendered {want}"
        );
    };
    let (va, vb) = (kmh(A_STEP), kmh(B_STEP));
    for (track, want, name) in [(&a, va, "A"), (&b, vb, "B")] {
        let leave = of("zone_leave", track, "zone", "lane");
        assert_eq!(leave.len(), 1, "{name}: {events:#?}");
        assert_eq!(leave[0]["speed_unit"], "km/h", "{}", leave[0]);
        near(
            &leave[0]["speed"],
            want,
            &format!("{name} leaving the lane"),
        );
        let end = of("track_end", track, "reason", "restart");
        assert_eq!(end.len(), 1, "{name}: {events:#?}");
        near(&end[0]["max_speed"], want, &format!("{name} max_speed"));
        assert_eq!(end[0]["speed_unit"], "km/h", "{}", end[0]);
    }
    let speeding: Vec<&Value> = events.iter().filter(|e| e["event"] == "speeding").collect();
    assert_eq!(speeding.len(), 1, "{speeding:#?}");
    assert_eq!(speeding[0]["track"], a.as_str(), "{}", speeding[0]);
    assert_eq!(speeding[0]["zone"], "lane");
    assert_eq!(speeding[0]["speed_limit"], 9.5);
    near(&speeding[0]["speed"], va, "A speeding");
}

#[test]
fn check_names_every_zone_analytics_problem_with_its_path() {
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
name = "drive"
polygon = [[0, 0], [100, 0], [100, 100]]
distances = [4, 12, 4, 12]
after = "road"
[[pipelines.zones]]
name = "lot"
polygon = [[0, 0], [100, 0], [100, 100], [0, 100]]
speed_limit = 20
"#,
            model_dir().display()
        ),
    )
    .unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "3 problem(s)");
    let err = stderr(&o);
    for want in [
        "zones#1.after: no zone is named `road`",
        "zones#1.distances: a calibrated zone needs exactly 4 polygon points (its corners), not 3",
        "zones#2.speed_limit: needs `distances` (the zone's calibration)",
    ] {
        assert!(err.contains(want), "{want} not in:\n{err}");
    }
}
