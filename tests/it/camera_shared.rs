//! One camera, many pipelines; keyframe-only decoding. A real RTSP server
//! on loopback (`tests/rtsp_server.py`, which reports its RTSP clients)
//! streams H.264 made from real photographs to a real `outpost run`.

#[cfg(feature = "camera")]
pub(crate) mod with_gstreamer {
    use std::io::BufRead;
    use std::path::Path;
    use std::process::{Child, Command, Stdio};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use crate::common::*;

    /// One at a time: each streams live video through an encoder and decoders.
    static SERIAL: Mutex<()> = Mutex::new(());

    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The RTSP server process, with the client counts it printed; killed on drop.
    pub(crate) struct RtspServer {
        child: Child,
        pub(crate) port: u16,
        lines: Arc<Mutex<Vec<String>>>,
    }

    impl RtspServer {
        pub(crate) fn start(images: &[&str], args: &[&str]) -> RtspServer {
            let script = root().join("tests/rtsp_server.py");
            let images: Vec<_> = images
                .iter()
                .map(|i| model_dir().join("images").join(i))
                .collect();
            for i in &images {
                assert!(
                    i.exists(),
                    "{} missing: run models/fetch first",
                    i.display()
                );
            }
            let mut child = Command::new("/usr/bin/python3")
                .arg(&script)
                .args(&images)
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("/usr/bin/python3 (Debian python3) is needed for the RTSP server");
            let out = child.stdout.take().unwrap();
            let lines = Arc::new(Mutex::new(Vec::new()));
            let l = lines.clone();
            std::thread::spawn(move || {
                for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    l.lock().unwrap().push(line);
                }
            });
            let mut s = RtspServer {
                child,
                port: 0,
                lines,
            };
            let t0 = Instant::now();
            while s.port == 0 {
                s.port = s
                    .lines()
                    .iter()
                    .find_map(|l| l.strip_prefix("PORT ").and_then(|p| p.trim().parse().ok()))
                    .unwrap_or(0);
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "the RTSP server did not start (python3-gi, gir1.2-gst-rtsp-server-1.0 and \
                     gstreamer1.0-plugins-base/-good/-ugly are needed; .ci/run installs them)"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
            s
        }

        fn lines(&self) -> Vec<String> {
            self.lines.lock().unwrap().clone()
        }

        /// Every client count the server reported, in order.
        pub(crate) fn client_counts(&self) -> Vec<u64> {
            self.lines()
                .iter()
                .filter_map(|l| {
                    l.strip_prefix("CLIENTS ")
                        .and_then(|n| n.trim().parse().ok())
                })
                .collect()
        }

        /// Waits until the client counts reported so far satisfy `pred`.
        pub(crate) fn wait_clients(
            &self,
            timeout: Duration,
            pred: impl Fn(&[u64]) -> bool,
        ) -> Vec<u64> {
            let t0 = Instant::now();
            loop {
                let c = self.client_counts();
                if pred(&c) || t0.elapsed() > timeout {
                    return c;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        pub(crate) fn url(&self, path: &str) -> String {
            format!("rtsp://127.0.0.1:{}{path}", self.port)
        }

        fn kill(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    impl Drop for RtspServer {
        fn drop(&mut self) {
            self.kill();
        }
    }

    /// `[[cameras]]` entries for `names`, all reading the server's `/cam`
    /// (one shared encoder there, one RTSP session per camera here);
    /// `fps`: each entry's own rate, where given.
    pub(crate) fn cameras(server: &RtspServer, names: &[&str], fps: &[(&str, f64)]) -> String {
        names
            .iter()
            .map(|n| {
                let own = fps
                    .iter()
                    .find(|(c, _)| c == n)
                    .map(|(_, f)| format!("fps = {f}\n"))
                    .unwrap_or_default();
                format!(
                    "[[cameras]]\nname = \"{n}\"\nurl = \"{}\"\nstall_timeout = \"3s\"\n{own}\n",
                    server.url("/cam")
                )
            })
            .collect()
    }

    pub(crate) fn config(body: &str) -> String {
        format!(
            r#"
device = "gw-cam"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[scheduler]
workers = 1
{body}
"#
        )
    }

    pub(crate) fn pipeline_status(d: &Daemon, name: &str) -> serde_json::Value {
        let st = d.status();
        st["pipelines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no pipeline {name}: {st}"))
            .clone()
    }

    /// Polls the status until `pred` holds for the named pipeline.
    pub(crate) fn wait_status(
        d: &Daemon,
        name: &str,
        timeout: Duration,
        what: &str,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let t0 = Instant::now();
        loop {
            let p = pipeline_status(d, name);
            if pred(&p) {
                return p;
            }
            assert!(
                t0.elapsed() < timeout,
                "{what}: not within {timeout:?}; status {p:#}\nlog:\n{}",
                d.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn count(recs: &[serde_json::Value], pipeline: &str) -> usize {
        recs.iter().filter(|r| r["pipeline"] == pipeline).count()
    }

    fn camera_events(dir: &Path) -> Vec<serde_json::Value> {
        let out = run(outpost().args([
            "outbox",
            "export",
            "--data-dir",
            dir.join("data").to_str().unwrap(),
        ]));
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|r| r["record"]["event"].is_string())
            .map(|r| r["record"].clone())
            .collect()
    }

    /// Frames the pipeline took from its camera: decoded minus subsampled.
    fn admitted(p: &serde_json::Value) -> f64 {
        let c = &p["camera"];
        (c["frames_in"].as_u64().unwrap() - c["subsampled"].as_u64().unwrap()) as f64
    }

    /// A classifier and a face detector on one `[[cameras]]` entry: one RTSP
    /// session, records from both at their own rates, and after the camera
    /// goes away and comes back both resume, with one camera_down /
    /// camera_up pair for the camera.
    #[test]
    fn two_pipelines_on_one_camera_share_its_rtsp_session_and_keep_their_own_fps() {
        let _one_at_a_time = serial();
        let args = ["--width", "320", "--height", "240", "--fps", "10"];
        let mut server = RtspServer::start(&["astronaut.png", "chelsea.png"], &args);
        let port = server.port.to_string();
        let mut d = Daemon::start(&config(&format!(
            r#"
[[cameras]]
name = "gate"
url = "{}"
stall_timeout = "2s"

[[pipelines]]
name = "objects"
model = "classifier"
source = {{ type = "camera", camera = "gate", fps = 4 }}

[[pipelines]]
name = "faces"
model = "mtcnn_pnet"
source = {{ type = "camera", camera = "gate", fps = 1, queue = 1 }}
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"
"#,
            server.url("/cam")
        )));
        d.records_until(Duration::from_secs(90), |r| {
            count(r, "objects") >= 12 && count(r, "faces") >= 3
        });
        assert!(
            count(&d.seen, "objects") >= 12 && count(&d.seen, "faces") >= 3,
            "records: objects {}, faces {}\n{}",
            count(&d.seen, "objects"),
            count(&d.seen, "faces"),
            d.log()
        );
        // One RTSP session for both pipelines.
        let clients = server.client_counts();
        assert_eq!(clients.iter().max(), Some(&1), "{clients:?}");
        assert_eq!(clients.last(), Some(&1), "{clients:?}");
        // Each pipeline's fps gate took its own share of the one decode:
        // 4 of 10 frames a second, and 1 of 10 (over 6 s of frames at least).
        wait_status(&d, "faces", Duration::from_secs(30), "60 frames", |p| {
            p["camera"]["frames_in"].as_u64().unwrap_or(0) >= 60
        });
        let objects = pipeline_status(&d, "objects");
        let faces = pipeline_status(&d, "faces");
        let decoded = objects["camera"]["frames_in"].as_f64().unwrap();
        let (o, f) = (admitted(&objects) / decoded, admitted(&faces) / decoded);
        assert!((0.3..=0.5).contains(&o), "objects took {o} of the frames");
        assert!((0.06..=0.15).contains(&f), "faces took {f} of the frames");
        for p in [&objects, &faces] {
            let c = &p["camera"];
            assert_eq!(c["name"], "gate", "{p:#}");
            assert_eq!(
                c["pipelines"],
                serde_json::json!(["objects", "faces"]),
                "{p:#}"
            );
            assert_eq!(c["state"], "streaming", "{p:#}");
        }
        let st = d.status();
        let cams = st["cameras"].as_array().expect("cameras in the status");
        assert_eq!(cams.len(), 1, "{st:#}");
        assert_eq!(cams[0]["name"], "gate");
        // The records come at those rates too (a record per frame taken).
        let recs = d.seen.clone();
        let (no, nf) = (count(&recs, "objects"), count(&recs, "faces"));
        assert!(no >= 2 * nf, "objects {no}, faces {nf}");

        // The camera goes away; both pipelines wait for it ...
        server.kill();
        for name in ["objects", "faces"] {
            wait_status(&d, name, Duration::from_secs(30), "reconnecting", |p| {
                p["camera"]["state"] == "reconnecting"
            });
        }
        wait_status(&d, "objects", Duration::from_secs(30), "retries", |p| {
            p["camera"]["reconnects"].as_u64().unwrap_or(0) >= 2
        });
        // ... and both resume when it is back. (The records made before
        // the outage are taken in first, so they do not count as resumed.)
        d.records_until(Duration::ZERO, |_| true);
        let before = (count(&d.seen, "objects"), count(&d.seen, "faces"));
        let mut args_again = args.to_vec();
        args_again.extend(["--port", &port]);
        let server = RtspServer::start(&["astronaut.png", "chelsea.png"], &args_again);
        d.records_until(Duration::from_secs(60), |r| {
            count(r, "objects") >= before.0 + 4 && count(r, "faces") >= before.1 + 2
        });
        assert!(
            count(&d.seen, "objects") >= before.0 + 4 && count(&d.seen, "faces") >= before.1 + 2,
            "records did not resume: {before:?} -> ({}, {})\n{}",
            count(&d.seen, "objects"),
            count(&d.seen, "faces"),
            d.log()
        );
        let clients = server.client_counts();
        assert_eq!(clients.iter().max(), Some(&1), "{clients:?}");
        for name in ["objects", "faces"] {
            let p = wait_status(&d, name, Duration::from_secs(30), "streaming", |p| {
                p["camera"]["state"] == "streaming"
            });
            assert!(p["camera"]["reconnects"].as_u64().unwrap() >= 1, "{p:#}");
        }
        assert!(!d.log().contains("panicked"), "{}", d.log());

        // One status record per transition of the camera, not per pipeline.
        let dir = d.stop_keep_dir();
        let events = camera_events(dir.path());
        let kinds: Vec<&str> = events
            .iter()
            .map(|e| e["event"].as_str().unwrap())
            .collect();
        assert_eq!(
            kinds,
            ["camera_up", "camera_down", "camera_up"],
            "{events:#?}"
        );
        for e in &events {
            assert_eq!(e["camera_name"], "gate", "{e}");
            assert_eq!(
                e["pipelines"],
                serde_json::json!(["objects", "faces"]),
                "{e}"
            );
        }
    }

    /// Mean luma of a JPEG snapshot (BT.601 weights).
    fn brightness(jpeg: &[u8]) -> f64 {
        let img = image::load_from_memory_with_format(jpeg, image::ImageFormat::Jpeg)
            .expect("a valid JPEG")
            .into_rgb8();
        let n = (img.width() * img.height()) as f64;
        img.pixels()
            .map(|p| 0.299 * p[0] as f64 + 0.587 * p[1] as f64 + 0.114 * p[2] as f64)
            .sum::<f64>()
            / n
    }

    /// The brightness of the frames a pipeline made records of while `for_`
    /// lasts: its snapshot (the latest frame with a record) polled at least
    /// twice a frame (at 1 fps), so no frame it took goes unseen. (Keyframes
    /// of one photograph may decode to the same bytes: polls are not told apart.)
    fn snapshots(d: &Daemon, pipeline: &str, for_: Duration) -> Vec<f64> {
        let mut seen = Vec::new();
        let t0 = Instant::now();
        while t0.elapsed() < for_ {
            let path = format!("/v1/pipelines/{pipeline}/snapshot.jpg");
            if let Ok((200, jpeg)) = http("GET", &d.api, &path, b"") {
                seen.push(brightness(&jpeg));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(
            seen.len() as f64 >= 2.0 * for_.as_secs_f64(),
            "snapshots too slow to see every frame: {seen:?}"
        );
        seen
    }

    /// A 30 fps stream with a keyframe every 30 frames, read at 1 fps: with
    /// `decode = "keyframes"` (and with `auto`, once it has seen the
    /// keyframe rate) only keyframes reach the decoder, every record's
    /// frame is a keyframe, and none is lost to it (a record a second).
    #[test]
    fn keyframe_only_decoding_at_one_fps_makes_every_record_from_a_keyframe() {
        let _one_at_a_time = serial();
        // Keyframes show the astronaut; every other frame is black.
        let server = RtspServer::start(
            &["astronaut.png"],
            &[
                "--width",
                "320",
                "--height",
                "240",
                "--fps",
                "30",
                "--key-int",
                "30",
                "--mark-keyframes",
            ],
        );
        let mut d = Daemon::start(&config(&format!(
            r#"
[[cameras]]
name = "gate"
url = "{url}"
decode = "keyframes"

[[cameras]]
name = "yard"
url = "{url}"

[[pipelines]]
name = "plates"
model = "classifier"
source = {{ type = "camera", camera = "gate", fps = 1 }}

[[pipelines]]
name = "counts"
model = "classifier"
source = {{ type = "camera", camera = "yard", fps = 1 }}
"#,
            url = server.url("/cam")
        )));
        d.records_until(Duration::from_secs(60), |r| count(r, "plates") >= 2);
        // Every frame `plates` made a record of is a keyframe (a photograph,
        // not black).
        let lit = snapshots(&d, "plates", Duration::from_secs(8));
        assert!(
            lit.iter().all(|b| *b > 60.0),
            "a delta frame was decoded: {lit:?}"
        );
        d.records_until(Duration::from_secs(30), |r| count(r, "plates") >= 12);
        // Both cameras' keyframes (`yard` once `auto` has seen the rate) go
        // through one decoder they share.
        assert_eq!(
            d.log().matches("shared keyframe decoder started").count(),
            1,
            "{}",
            d.log()
        );
        let plates: Vec<serde_json::Value> = d
            .seen
            .iter()
            .filter(|r| r["pipeline"] == "plates")
            .cloned()
            .collect();
        assert!(plates.len() >= 12, "{}", d.log());
        // Records come on the keyframes' one-second grid: every gap is a
        // whole number of seconds. A loaded machine can lose a frame before
        // the mode sees it (the server's live encoder falls behind, the
        // queue replaces a frame), so one gap of two seconds is allowed;
        // that the decoder got every keyframe is checked on its own
        // counters below.
        let captured: Vec<std::time::SystemTime> = plates
            .iter()
            .map(|r| humantime::parse_rfc3339(r["captured"].as_str().expect("captured")).unwrap())
            .collect();
        let mut long = 0;
        for w in captured.windows(2) {
            let gap = w[1].duration_since(w[0]).unwrap_or_default().as_secs_f64();
            let whole = gap.round();
            assert!(
                whole >= 1.0 && (gap - whole).abs() < 0.3,
                "records {gap:.3} s apart: {captured:?}"
            );
            if whole > 1.0 {
                long += 1;
            }
        }
        assert!(long <= 1, "{long} keyframes without a record: {captured:?}");
        // The same photograph in every record: the same scores. The first
        // record may be of the encoder's first keyframe, which its rate
        // control codes coarser (nothing to go on yet): the others are
        // compared with the last.
        let top = |r: &serde_json::Value| r["outputs"]["top"][0]["index"].clone();
        let last = plates.last().unwrap();
        assert!(
            plates[1..].iter().all(|r| top(r) == top(last)),
            "{plates:#?}"
        );
        let p = pipeline_status(&d, "plates");
        let c = &p["camera"];
        assert_eq!(
            (c["decode"].as_str(), c["decode_mode"].as_str()),
            (Some("keyframes"), Some("keyframes")),
            "{p:#}"
        );
        let encoded = c["encoded_frames"].as_u64().unwrap();
        let decoder = c["decoder_frames_in"].as_u64().unwrap();
        let skipped = c["delta_frames_skipped"].as_u64().unwrap();
        // The decoder got the keyframes: one in 30.
        assert!(encoded >= 300, "{p:#}");
        assert_eq!(decoder + skipped, encoded, "{p:#}");
        let keyframes = encoded as f64 / 30.0;
        assert!(
            (decoder as f64) >= keyframes - 2.0 && (decoder as f64) <= keyframes + 2.0,
            "decoder input {decoder} for {encoded} frames: {p:#}"
        );
        let interval = c["keyframe_interval_ms"]
            .as_f64()
            .expect("keyframe interval");
        assert!((900.0..1100.0).contains(&interval), "{p:#}");

        // `auto` sees one keyframe a second, and 1 fps needs no more.
        let p = wait_status(
            &d,
            "counts",
            Duration::from_secs(20),
            "auto keyframes",
            |p| p["camera"]["decode_mode"] == "keyframes",
        );
        let c = &p["camera"];
        assert_eq!(c["decode"], "auto", "{p:#}");
        assert!(c["delta_frames_skipped"].as_u64().unwrap() > 0, "{p:#}");
        // A frame decoded before the choice may still be on its way to a
        // record: two records later, frames come from keyframes only.
        let records = count(d.records_until(Duration::ZERO, |_| true), "counts");
        d.records_until(Duration::from_secs(10), |r| {
            count(r, "counts") >= records + 2
        });
        let lit = snapshots(&d, "counts", Duration::from_secs(4));
        assert!(
            lit.iter().all(|b| *b > 60.0),
            "a delta frame was decoded after auto chose keyframes: {lit:?}"
        );
        assert!(d.terminate().success());
    }

    /// A camera whose keyframes stop while its delta frames keep coming
    /// (decoding keyframes only): once `frames_in` froze for twice the
    /// keyframe interval the camera is down with a reason that says so, a
    /// `camera_down` record is stored, the pipeline is rebuilt, and the
    /// rebuilt one decodes every frame. Before, the skipped delta frames
    /// kept the stall timer from ever firing and the camera stayed
    /// `streaming`, blind.
    #[test]
    fn a_camera_whose_keyframes_stop_goes_down_instead_of_streaming_blind() {
        let _one_at_a_time = serial();
        let server = RtspServer::start(
            &["astronaut.png"],
            &[
                "--width",
                "320",
                "--height",
                "240",
                "--fps",
                "10",
                "--key-int",
                "10",
                "--keyframes-for",
                "5",
            ],
        );
        let d = Daemon::start(&config(&format!(
            r#"
[[cameras]]
name = "gate"
url = "{url}"
decode = "keyframes"
stall_timeout = "2s"

[[pipelines]]
name = "plates"
model = "classifier"
source = {{ type = "camera", camera = "gate", fps = 1 }}
"#,
            url = server.url("/cam")
        )));
        wait_status(&d, "plates", Duration::from_secs(60), "streaming", |p| {
            p["camera"]["state"] == "streaming" && p["camera"]["frames_in"].as_u64() >= Some(1)
        });
        let p = wait_status(
            &d,
            "plates",
            Duration::from_secs(60),
            "down for want of keyframes",
            |p| {
                p["camera"]["reconnects"].as_u64() >= Some(1)
                    && p["camera"]["last_error"]
                        .as_str()
                        .is_some_and(|e| e.contains("no keyframe"))
            },
        );
        let c = &p["camera"];
        assert!(c["delta_frames_skipped"].as_u64() > Some(0), "{p:#}");
        // The rebuilt pipeline decodes every frame the camera sends.
        wait_status(&d, "plates", Duration::from_secs(60), "every frame", |p| {
            p["camera"]["decode_mode"] == "all"
                && p["camera"]["decoder_frames_in"].as_u64() > c["decoder_frames_in"].as_u64()
        });
        let dir = d.stop_keep_dir();
        let events = camera_events(dir.path());
        let down = events
            .iter()
            .find(|e| e["event"] == "camera_down")
            .unwrap_or_else(|| panic!("no camera_down: {events:#?}"));
        assert!(
            down["error"]
                .as_str()
                .is_some_and(|e| e.contains("no keyframe")),
            "{down:#}"
        );
    }
}
