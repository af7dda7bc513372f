//! The console and the snapshots of a pipeline over several cameras: one
//! view per camera, side by side, each with its own snapshot
//! (`snapshot.jpg?stream=NAME`), zones, lines and tracks. A real RTSP
//! server on loopback (`tests/rtsp_server.py`), a real `outpost run` and
//! a real headless browser.

#[cfg(feature = "camera")]
mod with_gstreamer {
    use std::time::Duration;

    use serde_json::Value;

    use crate::camera_shared::with_gstreamer::{RtspServer, cameras, config, serial, wait_status};
    use crate::common::*;
    use crate::console::{Browser, errors};

    const NAMES: [&str; 2] = ["gate", "yard"];

    /// Two cameras (one RTSP session each on the server's `/cam`), one
    /// tracking pipeline over both, a zone on each and a line on `gate`.
    fn site(server: &RtspServer) -> String {
        let cameras = cameras(server, &NAMES, &[]);
        config(&format!(
            r#"
{cameras}
[[pipelines]]
name = "site"
model = "det_batch"
max_batch = 4
source = {{ type = "camera", cameras = "*", fps = 2 }}
[pipelines.track]
min_hits = 1
[[pipelines.zones]]
name = "gate_area"
camera = "gate"
polygon = [[0, 0], [160, 0], [160, 240], [0, 240]]
[[pipelines.zones]]
name = "yard_area"
camera = "yard"
polygon = [[160, 0], [320, 0], [320, 240], [160, 240]]
[[pipelines.lines]]
name = "gate_line"
camera = "gate"
points = [[100, 0], [100, 240]]
"#
        ))
    }

    fn start() -> (RtspServer, Daemon) {
        let args = ["--width", "320", "--height", "240", "--fps", "10"];
        let server = RtspServer::start(&["astronaut.png"], &args);
        let d = Daemon::start(&site(&server));
        // Every camera has frames done (so each has a frame kept).
        wait_status(
            &d,
            "site",
            Duration::from_secs(90),
            "frames done on every camera",
            |p| {
                p["cameras"].as_array().is_some_and(|c| {
                    c.len() == NAMES.len()
                        && c.iter()
                            .all(|c| c["frames_done"].as_u64().unwrap_or(0) >= 1)
                })
            },
        );
        (server, d)
    }

    /// `GET snapshot.jpg?stream=NAME`: each camera's own frame as JPEG, an
    /// unknown camera 404 with a message naming it; without `stream` the
    /// newest frame of any camera, as before.
    #[test]
    fn each_camera_has_its_snapshot_and_an_unknown_one_is_404() {
        let _one_at_a_time = serial();
        let (_server, d) = start();
        for path in [
            "/v1/pipelines/site/snapshot.jpg?stream=gate",
            "/v1/pipelines/site/snapshot.jpg?stream=yard",
            "/v1/pipelines/site/snapshot.jpg",
        ] {
            let (code, body) = http("GET", &d.api, path, b"").unwrap();
            assert_eq!(code, 200, "{path}: {}", String::from_utf8_lossy(&body));
            assert!(body.starts_with(&[0xFF, 0xD8]), "{path}: not a JPEG");
            let img = image::load_from_memory(&body).unwrap();
            assert_eq!((img.width(), img.height()), (320, 240), "{path}");
        }
        let (code, body) = http(
            "GET",
            &d.api,
            "/v1/pipelines/site/snapshot.jpg?stream=dock",
            b"",
        )
        .unwrap();
        assert_eq!(code, 404);
        let v: Value = serde_json::from_slice(&body).unwrap();
        let msg = v["error"].as_str().unwrap_or_default();
        assert!(
            msg.contains("`site`") && msg.contains("camera `dock`"),
            "{v}"
        );
        assert!(!d.log().contains("panicked"), "{}", d.log());
    }

    /// Each camera's view: its name, figures, snapshot, zones and tracks.
    const CAMERA_VIEWS: &str = r#"
const c = document.querySelector('[data-pipeline="site"]');
if (!c) return null;
const figs = Array.from(c.querySelectorAll('figure.camera'));
const text = (f, n) => f.querySelector('[data-field="' + n + '"]').textContent;
const out = figs.map(f => {
  const img = f.querySelector('img[data-field="snapshot"]');
  const svg = f.querySelector('svg.overlay');
  const r = f.getBoundingClientRect();
  return {
    camera: f.dataset.camera,
    caption: f.querySelector('figcaption').textContent,
    frames_in: text(f, 'cam_frames_in'),
    fps: text(f, 'cam_fps'),
    age: text(f, 'cam_frame_age_p99'),
    drops: text(f, 'cam_drops'),
    error: text(f, 'cam_last_error'),
    tracks_open: text(f, 'cam_tracks_open'),
    kind: img.dataset.kind,
    src: img.getAttribute('src'),
    viewBox: svg.getAttribute('viewBox'),
    zones: Array.from(svg.querySelectorAll('polygon.zone')).map(z => z.dataset.name),
    lines: Array.from(svg.querySelectorAll('line.line')).map(l => l.dataset.name),
    tracks: Array.from(svg.querySelectorAll('rect.track')).map(t => t.dataset.track),
    left: r.left, top: r.top,
  };
});
const ready = out.length === 2 && out.every(v => v.kind === 'snapshot' && v.zones.length
  && v.tracks.length && Number(v.frames_in) > 0 && v.fps !== '–');
return ready ? out : null;
"#;

    /// A pipeline over two cameras in a real browser: one view per camera,
    /// side by side, each with the snapshot of its own stream, only its
    /// camera's zones and lines, only its camera's tracks, and its figures.
    #[test]
    fn console_shows_each_camera_side_by_side_with_its_zones_and_tracks() {
        let _one_at_a_time = serial();
        let (_server, d) = start();
        let b = Browser::start();
        b.window(1280, 900);
        b.go(&format!("http://{}/", d.api));
        let v = b.wait_for(
            "a view per camera with its snapshot, zones and tracks",
            Duration::from_secs(120),
            CAMERA_VIEWS,
        );
        let views = v.as_array().unwrap();
        let names: Vec<&str> = views
            .iter()
            .map(|x| x["camera"].as_str().unwrap())
            .collect();
        assert_eq!(names, NAMES, "{v:#}");
        for x in views {
            let cam = x["camera"].as_str().unwrap();
            // The image's source is the probe's absolute URL.
            let src = x["src"].as_str().unwrap();
            let path = src
                .strip_prefix(&format!("http://{}", d.api))
                .unwrap_or(src);
            assert!(
                path.starts_with("/v1/pipelines/site/snapshot.jpg?")
                    && path.contains(&format!("stream={cam}&")),
                "{cam}: {src}"
            );
            let (zones, lines) = match cam {
                "gate" => (vec!["gate_area"], vec!["gate_line"]),
                _ => (vec!["yard_area"], vec![]),
            };
            assert_eq!(x["zones"], serde_json::json!(zones), "{cam}: {x:#}");
            assert_eq!(x["lines"], serde_json::json!(lines), "{cam}: {x:#}");
            assert_eq!(x["viewBox"], "0 0 320 240", "{cam}: {x:#}");
            for t in x["tracks"].as_array().unwrap() {
                let t = t.as_str().unwrap();
                assert!(t.contains(&format!("/site/{cam}/")), "{cam}: track {t}");
            }
            let caption = x["caption"].as_str().unwrap();
            assert!(caption.starts_with(cam), "{caption}");
            for label in [
                "fps",
                "frames in",
                "frame age p99",
                "drops",
                "last error",
                "open tracks",
            ] {
                assert!(caption.contains(label), "{cam}: {caption}");
            }
            assert_ne!(x["age"], "–", "{x:#}");
            assert_ne!(x["tracks_open"], "–", "{x:#}");
        }
        // Side by side: one row, the second to the right of the first.
        assert_eq!(views[0]["top"], views[1]["top"], "{v:#}");
        assert!(
            views[1]["left"].as_f64() > views[0]["left"].as_f64(),
            "{v:#}"
        );
        b.screenshot("console-cameras.png");
        let errs = errors(&b.console_log());
        assert!(errs.is_empty(), "console errors: {errs:#?}");
    }
}
