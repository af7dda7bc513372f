//! Many cameras, one pipeline: each camera a stream with its own zones,
//! served in turn, the ready ones batched into one inference; and many of
//! them dead. A real RTSP server on loopback (`tests/rtsp_server.py`) and a
//! real `outpost run`.

#[cfg(feature = "camera")]
mod with_gstreamer {
    use std::time::Duration;

    use crate::camera_shared::with_gstreamer::{
        RtspServer, cameras, config, pipeline_status, serial, wait_status,
    };
    use crate::common::*;

    const NAMES: [&str; 4] = ["gate", "yard", "dock", "pier"];

    fn events(recs: &[serde_json::Value]) -> Vec<(String, serde_json::Value)> {
        recs.iter()
            .flat_map(|r| {
                let stream = r["stream"].as_str().unwrap_or_default().to_string();
                r["outputs"]["events"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .map(move |e| (stream.clone(), e))
            })
            .collect()
    }

    fn zone_streams(ev: &[(String, serde_json::Value)], zone: &str) -> Vec<String> {
        ev.iter()
            .filter(|(_, e)| e["event"] == "zone_enter" && e["zone"] == zone)
            .map(|(s, _)| s.clone())
            .collect()
    }

    fn started(ev: &[(String, serde_json::Value)], stream: &str) -> usize {
        ev.iter()
            .filter(|(s, e)| s == stream && e["event"] == "track_start")
            .count()
    }

    /// The tracking pipeline over the four cameras, zones on two of them.
    fn site(server: &RtspServer, names: &[&str]) -> String {
        site_with(server, names, &[])
    }

    /// ... with cameras of their own rates.
    fn site_with(server: &RtspServer, names: &[&str], fps: &[(&str, f64)]) -> String {
        config(&format!(
            r#"
{}
[[pipelines]]
name = "site"
model = "det_batch"
max_batch = 8
source = {{ type = "camera", cameras = "*", fps = 2 }}
[pipelines.track]
min_hits = 1
[[pipelines.zones]]
name = "gate_area"
camera = "gate"
polygon = [[0, 0], [320, 0], [320, 240], [0, 240]]
inertia = 1
[[pipelines.zones]]
name = "yard_area"
camera = "yard"
polygon = [[0, 0], [320, 0], [320, 240], [0, 240]]
inertia = 1
"#,
            cameras(server, names, fps)
        ))
    }

    /// Four RTSP cameras in one pipeline, zones on two: each camera's events
    /// carry its name, a zone of one camera never sees another's objects
    /// (the same picture is on all four), one RTSP session per camera, and
    /// the status and the metrics show each camera.
    #[test]
    fn four_cameras_in_one_pipeline_keep_their_zones_and_tracks_apart() {
        let _one_at_a_time = serial();
        let args = ["--width", "320", "--height", "240", "--fps", "10"];
        let server = RtspServer::start(&["astronaut.png"], &args);
        let mut d = Daemon::start(&site(&server, &NAMES));
        d.records_until(Duration::from_secs(90), |r| {
            let ev = events(r);
            NAMES.iter().all(|n| started(&ev, n) >= 1)
                && !zone_streams(&ev, "gate_area").is_empty()
                && !zone_streams(&ev, "yard_area").is_empty()
        });
        let ev = events(&d.seen);
        for n in NAMES {
            assert!(started(&ev, n) >= 1, "no track on {n}: {ev:?}\n{}", d.log());
        }
        // Events are records of their camera's stream, and only that
        // camera's zone sees its objects.
        let gate = zone_streams(&ev, "gate_area");
        let yard = zone_streams(&ev, "yard_area");
        assert!(
            !gate.is_empty() && gate.iter().all(|s| s == "gate"),
            "{gate:?}"
        );
        assert!(
            !yard.is_empty() && yard.iter().all(|s| s == "yard"),
            "{yard:?}"
        );
        for (s, e) in &ev {
            assert!(NAMES.contains(&s.as_str()), "event of stream {s}: {e}");
            if let Some(track) = e["track"].as_str() {
                assert!(track.contains(&format!("/site/{s}/")), "{s}: {e}");
            }
        }
        // One RTSP session per camera.
        let clients = server.client_counts();
        assert_eq!(clients.iter().max(), Some(&4), "{clients:?}");
        // Each camera in the status, with its frames, rate and open tracks.
        let p = wait_status(
            &d,
            "site",
            Duration::from_secs(30),
            "every camera done",
            |p| {
                p["cameras"].as_array().is_some_and(|c| {
                    c.len() == 4
                        && c.iter().all(|c| {
                            c["frames_done"].as_u64().unwrap_or(0) >= 3 && c["fps"].is_number()
                        })
                })
            },
        );
        let cams = p["cameras"].as_array().unwrap();
        let names: Vec<&str> = cams.iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!(names, NAMES, "{p:#}");
        for c in cams {
            assert!(c["tracks_open"].as_u64().unwrap() >= 1, "{c:#}");
            assert!(c["frame_age"]["count"].as_u64().unwrap() >= 3, "{c:#}");
            assert_eq!(c["camera"]["name"], c["name"], "{c:#}");
        }
        let zones = p["tracking"]["geometry"]["zones"].as_array().unwrap();
        assert_eq!(zones[0]["camera"], "gate", "{zones:?}");
        let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
        let text = String::from_utf8_lossy(&body);
        for n in NAMES {
            for family in [
                "outpost_pipeline_camera_frames_done_total",
                "outpost_pipeline_camera_fps",
                "outpost_pipeline_camera_tracks_open",
            ] {
                let row = format!("{family}{{pipeline=\"site\",camera=\"{n}\"}}");
                assert!(text.contains(&row), "no {row}:\n{text}");
            }
        }
        assert!(!d.log().contains("panicked"), "{}", d.log());
    }

    /// A camera at 30 fps beside three at 1 fps, on a model slower than all
    /// of them together (the classifier, one frame a run: with this test
    /// build's preprocessing, tens of ms a frame, under 33 frames a second):
    /// the fast camera loses frames (its latest wins), each slow one still
    /// gets at least 90 % of its frames through.
    #[test]
    fn a_fast_camera_never_starves_three_slow_ones() {
        let _one_at_a_time = serial();
        let args = ["--width", "320", "--height", "240", "--fps", "30"];
        let server = RtspServer::start(&["astronaut.png", "chelsea.png"], &args);
        let slow = [("yard", 1.0), ("dock", 1.0), ("pier", 1.0)];
        let mut d = Daemon::start(&config(&format!(
            r#"
{}
[[pipelines]]
name = "site"
model = "classifier"
source = {{ type = "camera", cameras = ["gate", "yard", "dock", "pier"] }}
"#,
            cameras(&server, &NAMES, &slow)
        )));
        let p = wait_status(
            &d,
            "site",
            Duration::from_secs(120),
            "ten slow frames",
            |p| {
                p["cameras"].as_array().is_some_and(|c| {
                    c.iter()
                        .skip(1)
                        .all(|c| c["frames_in"].as_u64().unwrap_or(0) >= 10)
                })
            },
        );
        // The model is the bottleneck: the fast camera's frames pile up and
        // only its latest is kept.
        let cams = p["cameras"].as_array().unwrap();
        let fast = &cams[0];
        assert!(
            fast["drops"]["stale"].as_u64().unwrap_or(0) > 10,
            "the model kept up with 30 fps: {fast:#}"
        );
        // Frames still in a lane when the status was read are neither done
        // nor dropped: one at most per camera.
        for c in &cams[1..] {
            let (offered, done) = (
                c["frames_in"].as_u64().unwrap() as f64,
                c["frames_done"].as_u64().unwrap() as f64,
            );
            assert!(
                done + 1.0 >= 0.9 * offered,
                "{}: {done} of {offered} frames\n{p:#}",
                c["name"]
            );
        }
        d.records_until(Duration::ZERO, |_| true);
        assert!(!d.log().contains("panicked"), "{}", d.log());
    }

    /// A token for the API's state changes (pause, resume), in a file of
    /// its own that lives as long as the returned folder.
    fn d_token() -> (String, std::path::PathBuf, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        let token = "many-cameras-token-0123456789abcdef".to_string();
        std::fs::write(&path, &token).unwrap();
        (token, path, dir)
    }

    fn detections(r: &serde_json::Value) -> Vec<(String, Vec<f64>)> {
        r["outputs"]["detections"]
            .as_array()
            .unwrap_or_else(|| panic!("no detections: {r}"))
            .iter()
            .map(|d| {
                (
                    d["label"].as_str().unwrap_or_default().to_string(),
                    d["box"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|v| v.as_f64().unwrap())
                        .collect(),
                )
            })
            .collect()
    }

    /// With the dynamic-batch detector, the frames of four cameras waiting
    /// together (the pipeline held paused until each has one) run as one
    /// inference of four, and each camera's result is the one it gets
    /// running alone (a pipeline of its own with batches of one).
    #[test]
    fn ready_cameras_run_as_one_batch_with_the_results_of_running_alone() {
        let _one_at_a_time = serial();
        let args = ["--width", "320", "--height", "240", "--fps", "5"];
        let server = RtspServer::start(&["astronaut.png"], &args);
        let mut body = format!(
            r#"
{}
[[pipelines]]
name = "site"
model = "det_batch"
max_batch = 8
source = {{ type = "camera", cameras = "*", fps = 1 }}
# Every frame runs the detector: the batches are what is tested.
[pipelines.motion]
enabled = false
"#,
            cameras(&server, &NAMES, &[])
        );
        for n in NAMES {
            body.push_str(&format!(
                "[[pipelines]]\nname = \"alone-{n}\"\nmodel = \"det_batch\"\nsource = {{ type = \"camera\", camera = \"{n}\", fps = 1 }}\n[pipelines.motion]\nenabled = false\n"
            ));
        }
        let token = d_token();
        let mut d = Daemon::start(&config(&body).replace(
            "[api]\n",
            &format!("[api]\ntoken_file = \"{}\"\n", token.1.display()),
        ));
        let post = |path: &str| {
            let code = post_with_token(&d.api, path, &token.0);
            assert_eq!(code, 200, "{path}");
        };
        post("/v1/pipelines/site/pause");
        let held = wait_status(
            &d,
            "site",
            Duration::from_secs(60),
            "a frame of each",
            |p| p["queue_depth"].as_u64() == Some(4),
        );
        let (b0, i0) = (
            held["batches"].as_u64().unwrap(),
            held["batch_items"].as_u64().unwrap(),
        );
        post("/v1/pipelines/site/resume");
        let after = wait_status(
            &d,
            "site",
            Duration::from_secs(30),
            "the held frames",
            |p| p["batch_items"].as_u64().unwrap_or(0) >= i0 + 4,
        );
        // The four held frames went in one run (later frames, one camera
        // at a time at 1 fps each, may have followed).
        let (b, i) = (
            after["batches"].as_u64().unwrap() - b0,
            after["batch_items"].as_u64().unwrap() - i0,
        );
        assert!(
            b < i,
            "{b} runs for {i} items: the held frames were not batched"
        );
        let (_, m) = http("GET", &d.api, "/metrics", b"").unwrap();
        let m = String::from_utf8_lossy(&m);
        assert!(
            m.lines().any(|l| l.starts_with("outpost_batch_size_bucket")
                && l.contains("pipeline=\"site\"")
                && l.contains("le=\"4")
                && !l.ends_with(" 0")),
            "{m}"
        );
        // Each camera's detections equal those of its pipeline of one.
        d.records_until(Duration::from_secs(60), |r| {
            NAMES.iter().all(|n| {
                r.iter()
                    .any(|x| x["pipeline"] == "site" && x["stream"] == *n)
                    && r.iter().any(|x| x["pipeline"] == format!("alone-{n}"))
            })
        });
        for n in NAMES {
            let batched = d
                .seen
                .iter()
                .find(|x| x["pipeline"] == "site" && x["stream"] == n)
                .unwrap_or_else(|| panic!("no record of {n}"));
            let alone = d
                .seen
                .iter()
                .find(|x| x["pipeline"] == format!("alone-{n}"))
                .unwrap_or_else(|| panic!("no record of alone-{n}"));
            let (a, b) = (detections(batched), detections(alone));
            assert_eq!(a.len(), b.len(), "{n}: {a:?} vs {b:?}");
            assert!(!a.is_empty(), "{n}: no detections");
            for ((la, ba), (lb, bb)) in a.iter().zip(&b) {
                assert_eq!(la, lb, "{n}");
                for (x, y) in ba.iter().zip(bb) {
                    // Frames a moment apart: the detector's small
                    // dependence on the picture moves a box by well under
                    // a pixel.
                    assert!((x - y).abs() < 1.0, "{n}: {ba:?} vs {bb:?}");
                }
            }
        }
    }

    /// Writes the site's config over `names` and reloads it (SIGHUP).
    fn reload(d: &Daemon, text: String) {
        let text = text
            .replace("{API}", "127.0.0.1:0")
            .replace("{DATA}", &d.dir.path().join("data").display().to_string());
        std::fs::write(d.dir.path().join("outpost.toml"), text).unwrap();
        let _ = std::process::Command::new("kill")
            .arg("-HUP")
            .arg(d.child.id().to_string())
            .status();
    }

    /// No track of `names` ended, and each still has the tracks it had
    /// (`before`): none started since.
    fn same_tracks(ev: &[(String, serde_json::Value)], names: &[&str], before: &[usize]) {
        for (n, b) in names.iter().zip(before) {
            assert_eq!(
                started(ev, n),
                *b,
                "{n}: new tracks after the reload\n{ev:?}"
            );
            assert!(
                !ev.iter().any(|(s, e)| s == n && e["event"] == "track_end"),
                "{n}: a track ended across the reload"
            );
        }
    }

    /// A reload that adds a fifth camera leaves the first four as they
    /// were: their RTSP sessions and decoders run on (the server sees no
    /// session close), the objects keep their track ids (no new track
    /// starts on them), and the fifth camera gets tracks of its own. A
    /// reload that removes one closes that camera's session only, and the
    /// others keep their sessions and tracks again; one whose definition
    /// changes is opened anew.
    #[test]
    fn a_reload_adding_a_camera_keeps_the_other_cameras_track_ids() {
        let _one_at_a_time = serial();
        let args = ["--width", "320", "--height", "240", "--fps", "10"];
        let server = RtspServer::start(&["astronaut.png"], &args);
        let mut d = Daemon::start(&site(&server, &NAMES));
        d.records_until(Duration::from_secs(90), |r| {
            let ev = events(r);
            NAMES.iter().all(|n| started(&ev, n) >= 4)
        });
        let before: Vec<usize> = NAMES.iter().map(|n| started(&events(&d.seen), n)).collect();
        assert!(before.iter().all(|n| *n >= 4), "{before:?}\n{}", d.log());
        let mut five = NAMES.to_vec();
        five.push("quay");
        reload(&d, site(&server, &five));
        d.records_until(Duration::from_secs(90), |r| {
            started(&events(r), "quay") >= 4
        });
        assert!(started(&events(&d.seen), "quay") >= 4, "{}", d.log());
        // Frames of the first four went on after the reload ...
        let p = wait_status(&d, "site", Duration::from_secs(60), "five cameras", |p| {
            p["cameras"].as_array().is_some_and(|c| {
                c.len() == 5
                    && c.iter()
                        .all(|c| c["frames_done"].as_u64().unwrap_or(0) >= 3)
            })
        });
        for c in p["cameras"].as_array().unwrap() {
            assert_eq!(c["camera"]["state"], "streaming", "{c:#}");
        }
        d.records_until(Duration::ZERO, |_| true);
        // ... on the same tracks: no track ended or started on them ...
        same_tracks(&events(&d.seen), &NAMES, &before);
        // ... through the same sessions: one opened for the fifth, none closed.
        let clients = server.client_counts();
        assert_eq!(clients, [1, 2, 3, 4, 5], "{clients:?}\n{}", d.log());
        assert_eq!(
            d.log().matches("camera kept across the reload").count(),
            4,
            "{}",
            d.log()
        );
        let p = pipeline_status(&d, "site");
        for c in p["cameras"].as_array().unwrap() {
            assert!(c["tracks_open"].as_u64().unwrap() >= 1, "{c:#}");
        }

        // Removing `pier`: its session closes, the other four run on.
        let kept = ["gate", "yard", "dock", "quay"];
        let ev = events(&d.seen);
        let before: Vec<usize> = kept.iter().map(|n| started(&ev, n)).collect();
        reload(&d, site(&server, &kept));
        let clients = server.wait_clients(Duration::from_secs(60), |c| c.len() > 5);
        assert_eq!(clients, [1, 2, 3, 4, 5, 4], "{}", d.log());
        let p = wait_status(&d, "site", Duration::from_secs(60), "four cameras", |p| {
            p["cameras"].as_array().is_some_and(|c| {
                c.len() == 4
                    && c.iter()
                        .all(|c| c["frames_done"].as_u64().unwrap_or(0) >= 3)
            })
        });
        let names: Vec<&str> = p["cameras"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, kept, "{p:#}");
        d.records_until(Duration::ZERO, |_| true);
        let ev = events(&d.seen);
        same_tracks(&ev, &kept, &before);
        assert_eq!(server.client_counts(), [1, 2, 3, 4, 5, 4], "{}", d.log());

        // A camera whose definition changes (its own rate) is opened anew;
        // the others run on.
        reload(&d, site_with(&server, &kept, &[("gate", 2.0)]));
        let clients = server.wait_clients(Duration::from_secs(60), |c| c.len() > 7);
        assert_eq!(clients, [1, 2, 3, 4, 5, 4, 3, 4], "{}", d.log());
        wait_status(
            &d,
            "site",
            Duration::from_secs(60),
            "gate streams again",
            |p| {
                p["cameras"][0]["frames_done"].as_u64().unwrap_or(0) >= 3
                    && p["cameras"][0]["camera"]["state"] == "streaming"
            },
        );
        assert_eq!(
            d.log().matches("camera kept across the reload").count(),
            4 + 4 + 3,
            "{}",
            d.log()
        );

        // A new rate on the pipeline asks nothing new of an RTSP camera:
        // all four run on through the same sessions.
        let slower = site_with(&server, &kept, &[("gate", 2.0)])
            .replace(r#"cameras = "*", fps = 2"#, r#"cameras = "*", fps = 1"#);
        reload(&d, slower);
        let t0 = std::time::Instant::now();
        while d.log().matches("camera kept across the reload").count() < 15 {
            assert!(t0.elapsed() < Duration::from_secs(60), "{}", d.log());
            std::thread::sleep(Duration::from_millis(50));
        }
        wait_status(
            &d,
            "site",
            Duration::from_secs(60),
            "four cameras again",
            |p| {
                p["cameras"].as_array().is_some_and(|c| {
                    c.len() == 4
                        && c.iter()
                            .all(|c| c["frames_done"].as_u64().unwrap_or(0) >= 2)
                })
            },
        );
        assert_eq!(
            server.client_counts(),
            [1, 2, 3, 4, 5, 4, 3, 4],
            "{}",
            d.log()
        );
    }

    /// Lines of the log that say `what` of the camera `name`.
    fn lines_of(log: &str, what: &str, name: &str) -> usize {
        let field = format!("name={name} ");
        log.lines()
            .filter(|l| l.contains(what) && l.contains(&field))
            .count()
    }

    /// 47 dead cameras beside one good one wrote 510-700 WARN lines a
    /// minute at the default log level (160-220 MiB a day): a line for every reconnect
    /// of every camera. A camera that stays down now logs its first failure
    /// and then lines at growing intervals (the first a minute later); its
    /// status counts every reconnect, and its recovery is logged.
    #[test]
    fn dead_cameras_log_their_first_failure_not_every_reconnect() {
        let _one_at_a_time = serial();
        let dead: Vec<RefusedPort> = (0..3).map(|_| RefusedPort::new()).collect();
        let late = RefusedPort::new();
        let mut entries: String = dead
            .iter()
            .enumerate()
            .map(|(i, p)| {
                format!(
                    "[[cameras]]\nname = \"dead{i}\"\nurl = \"rtsp://127.0.0.1:{}/cam\"\n\n",
                    p.port
                )
            })
            .collect();
        entries.push_str(&format!(
            "[[cameras]]\nname = \"late\"\nurl = \"rtsp://127.0.0.1:{}/cam\"\nstall_timeout = \"3s\"\n",
            late.port
        ));
        let d = Daemon::start(&config(&format!(
            r#"
{entries}
[[pipelines]]
name = "site"
model = "classifier"
source = {{ type = "camera", cameras = "*" }}
"#
        )));
        // Every camera has failed and reconnected several times...
        let reconnects = |st: &serde_json::Value, name: &str| {
            st["cameras"]
                .as_array()
                .and_then(|c| c.iter().find(|c| c["name"] == name))
                .and_then(|c| c["reconnects"].as_u64())
                .unwrap_or(0)
        };
        let names = ["dead0", "dead1", "dead2", "late"];
        let t0 = std::time::Instant::now();
        loop {
            let st = d.status();
            if names.iter().all(|n| reconnects(&st, n) >= 4) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "cameras did not reconnect: {st:#}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // ...and each said so once.
        let log = d.log();
        for n in names {
            assert_eq!(
                lines_of(&log, "camera down; reconnecting", n),
                1,
                "{n}:\n{log}"
            );
        }
        assert!(log.contains("Connection refused"), "{log}");
        // The late camera comes up: its recovery is logged with the
        // failures it ended.
        let late_port = late.port.to_string();
        drop(late);
        let _server = RtspServer::start(
            &["astronaut.png"],
            &[
                "--width", "320", "--height", "240", "--fps", "10", "--port", &late_port,
            ],
        );
        let t0 = std::time::Instant::now();
        while lines_of(&d.log(), "camera streaming again", "late") == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "no recovery logged:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = d.log();
        let line = log
            .lines()
            .find(|l| l.contains("camera streaming again"))
            .unwrap();
        let failed: u64 = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("failed_attempts="))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{line}"));
        assert!(failed >= 4, "{line}");
        for n in ["dead0", "dead1", "dead2"] {
            assert_eq!(lines_of(&log, "camera down", n), 1, "{n}:\n{log}");
        }
    }
}
