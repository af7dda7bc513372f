//! Motion-gated detection through a real daemon: two real RTSP cameras
//! (tests/rtsp_server.py) in one detector pipeline, one showing a still
//! photograph with fresh sensor noise in every frame, one whose picture
//! scrolls. The still camera's frames do not run the detector (their
//! records carry its first detections), the moving one's all do; the
//! status and the metrics count both, per pipeline and per camera.

#[cfg(feature = "camera")]
mod with_gstreamer {
    use std::time::Duration;

    use crate::camera_shared::with_gstreamer::{RtspServer, config, serial, wait_status};
    use crate::common::*;

    fn camera(name: &str, server: &RtspServer) -> String {
        format!(
            "[[cameras]]\nname = \"{name}\"\nurl = \"{}\"\nstall_timeout = \"3s\"\n",
            server.url("/cam")
        )
    }

    fn metric(text: &str, name: &str, labels: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(labels))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn a_still_camera_skips_the_detector_and_a_moving_one_runs_it() {
        let _one_at_a_time = serial();
        let args = ["--width", "320", "--height", "240", "--fps", "10"];
        let still = RtspServer::start(&["astronaut.png"], &[&args[..], &["--noise"]].concat());
        let moving = RtspServer::start(&["astronaut.png"], &[&args[..], &["--pan", "8"]].concat());
        let body = format!(
            r#"
{}{}
[[pipelines]]
name = "site"
model = "det_batch"
source = {{ type = "camera", cameras = "*", fps = 4 }}
"#,
            camera("still", &still),
            camera("moving", &moving)
        );
        let mut d = Daemon::start(&config(&body));
        let p = wait_status(
            &d,
            "site",
            Duration::from_secs(120),
            "frames of both cameras through the gate",
            |p| {
                p["cameras"].as_array().is_some_and(|c| {
                    c.iter().all(|c| {
                        c["motion"]["frames_still"].as_u64().unwrap_or(0)
                            + c["motion"]["detector_runs"].as_u64().unwrap_or(0)
                            >= 8
                    })
                })
            },
        );
        let cam = |name: &str| {
            p["cameras"]
                .as_array()
                .unwrap()
                .iter()
                .find(|c| c["name"] == name)
                .unwrap_or_else(|| panic!("no camera {name}: {p:#}"))["motion"]
                .clone()
        };
        let (s, m) = (cam("still"), cam("moving"));
        // The still camera's first frame ran (no background yet; the
        // encoder's first pictures may still settle once); noise alone
        // never moves.
        let s_runs = s["detector_runs"].as_u64().unwrap();
        assert!((1..=2).contains(&s_runs), "{p:#}");
        assert!(s["frames_still"].as_u64().unwrap() >= 6, "{p:#}");
        // Every frame of the scrolling camera ran.
        assert_eq!(m["frames_still"], 0, "{p:#}");
        assert!(m["detector_runs"].as_u64().unwrap() >= 8, "{p:#}");
        assert_eq!(
            (s["regions"].as_u64(), m["regions"].as_u64()),
            (Some(0), Some(0))
        );
        // The pipeline's counts are its cameras' (the status reads the
        // cameras first; one frame at a time may be counted in between).
        for key in ["frames_still", "detector_runs"] {
            let sum = s[key].as_u64().unwrap() + m[key].as_u64().unwrap();
            let total = p["motion"][key].as_u64().unwrap();
            assert!((sum..=sum + 1).contains(&total), "{key}: {p:#}");
        }
        // Inference ran once per detector run (a frame counted by the gate
        // may not have reached the model yet), never on a still frame.
        let runs = p["motion"]["detector_runs"].as_u64().unwrap();
        let items = p["items"].as_u64().unwrap();
        assert!(items <= runs && items + 1 >= runs, "{p:#}");

        // A still frame's record is the camera's latest detections again.
        d.records_until(Duration::from_secs(60), |r| {
            r.iter()
                .any(|x| x["stream"] == "still" && x["outputs"]["motion"] == "still")
        });
        let still_recs: Vec<&serde_json::Value> =
            d.seen.iter().filter(|x| x["stream"] == "still").collect();
        let first = still_recs
            .iter()
            .find(|x| x["outputs"]["motion"].is_null())
            .expect("the still camera's first frame ran the detector");
        let carried = still_recs
            .iter()
            .find(|x| x["outputs"]["motion"] == "still")
            .unwrap();
        assert_eq!(
            carried["outputs"]["detections"], first["outputs"]["detections"],
            "{carried}"
        );
        assert!(
            d.seen
                .iter()
                .filter(|x| x["stream"] == "moving")
                .all(|x| x["outputs"]["motion"].is_null()),
            "a moving camera's frame was carried"
        );

        let (_, text) = http("GET", &d.api, "/metrics", b"").unwrap();
        let text = String::from_utf8_lossy(&text);
        let still_total = metric(
            &text,
            "outpost_motion_frames_still_total",
            "pipeline=\"site\"",
        )
        .unwrap_or_else(|| panic!("{text}"));
        assert!(still_total >= 7.0, "{text}");
        let cam_runs = metric(
            &text,
            "outpost_pipeline_camera_motion_detector_runs_total",
            "camera=\"moving\"",
        )
        .unwrap_or_else(|| panic!("{text}"));
        assert!(cam_runs >= 8.0, "{text}");
        let still_runs = metric(
            &text,
            "outpost_pipeline_camera_motion_detector_runs_total",
            "camera=\"still\"",
        )
        .unwrap_or_else(|| panic!("{text}"));
        assert!((1.0..=2.0).contains(&still_runs), "{text}");
    }

    /// `enabled = false`: every frame of the same still camera runs the
    /// detector, and no motion counts are shown.
    #[test]
    fn a_camera_pipeline_without_the_gate_runs_every_frame() {
        let _one_at_a_time = serial();
        let args = [
            "--width", "320", "--height", "240", "--fps", "10", "--noise",
        ];
        let still = RtspServer::start(&["astronaut.png"], &args);
        let body = format!(
            r#"
{}
[[pipelines]]
name = "always"
model = "det_batch"
source = {{ type = "camera", camera = "still", fps = 4 }}
[pipelines.motion]
enabled = false
"#,
            camera("still", &still)
        );
        let d = Daemon::start(&config(&body));
        let p = wait_status(&d, "always", Duration::from_secs(120), "frames done", |p| {
            p["frames_done"].as_u64().unwrap_or(0) >= 5
        });
        assert!(p["motion"].is_null(), "{p:#}");
        // Every frame done ran the model (one may be between the two counts).
        let (items, done) = (
            p["items"].as_u64().unwrap(),
            p["frames_done"].as_u64().unwrap(),
        );
        assert!(items == done || items == done + 1, "{p:#}");
    }
}
