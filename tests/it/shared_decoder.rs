//! Cameras decoding keyframes only share one decoder; one of them is
//! hostile. Real RTSP servers on loopback (`tests/rtsp_server.py`), one per
//! camera, and a real `outpost run`: a camera whose keyframes come cut
//! short or as random bytes (its records carried the other cameras'
//! pictures), and a camera flooding the decoder with keyframes of noise
//! (the other cameras went without a frame for most of the flood).

#[cfg(feature = "camera")]
mod with_gstreamer {
    use std::time::{Duration, Instant};

    use crate::camera_shared::with_gstreamer::{
        RtspServer, config, pipeline_status, serial, wait_status,
    };
    use crate::common::*;

    /// `[[cameras]]` entries decoding keyframes only, one per server.
    fn cameras(names: &[&str], servers: &[RtspServer]) -> String {
        names
            .iter()
            .zip(servers)
            .map(|(n, s)| {
                format!(
                    "[[cameras]]\nname = \"{n}\"\nurl = \"{}\"\ndecode = \"keyframes\"\n\
                     stall_timeout = \"3s\"\n\n",
                    s.url("/cam")
                )
            })
            .collect()
    }

    /// One pipeline over all the cameras (at `fps` each, if given).
    fn site(names: &[&str], servers: &[RtspServer], fps: Option<f64>) -> String {
        let list: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
        let fps = fps.map(|f| format!(", fps = {f}")).unwrap_or_default();
        config(&format!(
            r#"
{}
[[pipelines]]
name = "site"
model = "classifier"
source = {{ type = "camera", cameras = [{}]{fps} }}
"#,
            cameras(names, servers),
            list.join(", ")
        ))
    }

    /// A camera of the pipeline's status.
    fn camera<'a>(p: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
        p["cameras"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["name"] == name))
            .unwrap_or_else(|| panic!("no camera {name}: {p:#}"))
    }

    fn count(v: &serde_json::Value) -> u64 {
        v.as_u64().unwrap_or(0)
    }

    /// The latest frame of a camera with a record, as the API shows it.
    fn snapshot(d: &Daemon, stream: &str) -> Option<Vec<u8>> {
        let path = format!("/v1/pipelines/site/snapshot.jpg?stream={stream}");
        match http("GET", &d.api, &path, b"") {
            Ok((200, jpeg)) => Some(jpeg),
            _ => None,
        }
    }

    /// The share of a JPEG's pixels in strong colour (one channel 80 over
    /// another): none in a grey photograph, nearly all in a solid colour.
    fn coloured(jpeg: &[u8]) -> f64 {
        let img = image::load_from_memory_with_format(jpeg, image::ImageFormat::Jpeg)
            .expect("a valid JPEG")
            .into_rgb8();
        let strong = img
            .pixels()
            .filter(|p| {
                let (hi, lo) = (p.0.iter().max().unwrap(), p.0.iter().min().unwrap());
                hi - lo > 80
            })
            .count();
        strong as f64 / (img.width() * img.height()) as f64
    }

    /// The records the outbox kept of camera events.
    fn camera_events(dir: &std::path::Path) -> Vec<serde_json::Value> {
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

    /// Three cameras showing solid red, green and blue and a fourth showing
    /// a grey photograph share one keyframe decoder. From its sixth second
    /// on, every keyframe of the grey camera is cut short or random bytes,
    /// in turn. Before, the decoder filled the part of the picture those
    /// keyframes lacked from the picture it had last made, another
    /// camera's: the grey camera's records showed red, green and blue,
    /// while it stayed `streaming` with no error. Now none of its pictures
    /// is another camera's; its broken keyframes are `corrupt_keyframe`
    /// drops, its status says why, three in a row take it down (a
    /// `camera_down` record saying so) and it reconnects; the other three
    /// lose nothing.
    #[test]
    fn a_cameras_broken_keyframes_never_show_another_cameras_picture() {
        let _one_at_a_time = serial();
        let dir = tempfile::tempdir().unwrap();
        let args = [
            "--width",
            "320",
            "--height",
            "240",
            "--fps",
            "10",
            "--key-int",
            "10",
        ];
        let names = ["red", "green", "blue", "grey"];
        let mut servers = Vec::new();
        for (name, rgb) in [
            ("red", [230, 30, 30]),
            ("green", [30, 200, 30]),
            ("blue", [30, 30, 230]),
        ] {
            let path = dir.path().join(format!("{name}.png"));
            image::RgbImage::from_pixel(320, 240, image::Rgb(rgb))
                .save(&path)
                .unwrap();
            servers.push(RtspServer::start(&[path.to_str().unwrap()], &args));
        }
        let mut hostile = args.to_vec();
        hostile.extend(["--corrupt-keyframes", "mixed", "--corrupt-after", "6"]);
        servers.push(RtspServer::start(&["camera.png"], &hostile));
        let mut d = Daemon::start(&site(&names, &servers, None));
        wait_status(
            &d,
            "site",
            Duration::from_secs(90),
            "records of every camera",
            |p| {
                names
                    .iter()
                    .all(|n| count(&camera(p, n)["frames_done"]) >= 2)
            },
        );
        let own = snapshot(&d, "grey").expect("a snapshot of the grey camera");
        assert!(coloured(&own) < 0.02, "{}", coloured(&own));
        let before = pipeline_status(&d, "site");

        // Through the attack, every picture of the grey camera with a
        // record (its snapshot, polled ten times a frame).
        let t0 = Instant::now();
        let (mut seen, mut foreign) = (0, Vec::new());
        let p = loop {
            if let Some(jpeg) = snapshot(&d, "grey") {
                seen += 1;
                let c = coloured(&jpeg);
                if c > 0.05 {
                    foreign.push(format!("{:.0} %", c * 100.0));
                }
            }
            let p = pipeline_status(&d, "site");
            let grey = camera(&p, "grey");
            if count(&grey["drops"]["corrupt_keyframe"]) >= 6
                && count(&grey["camera"]["reconnects"]) >= 1
            {
                break p;
            }
            if t0.elapsed() > Duration::from_secs(60) {
                break p;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let records: usize = d
            .records_until(Duration::ZERO, |_| true)
            .iter()
            .filter(|r| r["stream"] == "grey")
            .count();
        assert!(
            foreign.is_empty(),
            "{} of {seen} snapshots of the grey camera were coloured (another camera's \
             picture: {foreign:?}); it made {records} records in all\n{p:#}",
            foreign.len()
        );
        let grey = camera(&p, "grey");
        assert!(
            count(&grey["drops"]["corrupt_keyframe"]) >= 6,
            "its broken keyframes were not counted: {grey:#}"
        );
        assert!(count(&grey["camera"]["reconnects"]) >= 1, "{grey:#}");
        assert!(
            grey["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("did not decode completely")),
            "{grey:#}"
        );
        for n in &names[..3] {
            let (was, c) = (camera(&before, n), camera(&p, n));
            assert_eq!(count(&c["drops"]["corrupt_keyframe"]), 0, "{c:#}");
            assert_eq!(count(&c["camera"]["reconnects"]), 0, "{c:#}");
            assert!(
                count(&c["frames_done"]) > count(&was["frames_done"]),
                "{n} made no record during the attack: {c:#}"
            );
        }
        assert_eq!(
            d.log().matches("shared keyframe decoder started").count(),
            1,
            "the four cameras share one decoder:\n{}",
            d.log()
        );
        assert!(!d.log().contains("panicked"), "{}", d.log());
        let dir = d.stop_keep_dir();
        let down = camera_events(dir.path())
            .into_iter()
            .filter(|e| e["event"] == "camera_down" && e["camera_name"] == "grey")
            .collect::<Vec<_>>();
        assert!(
            down.iter().any(|e| e["error"]
                .as_str()
                .is_some_and(|e| e.contains("keyframes in a row did not decode completely"))),
            "{down:#?}"
        );
    }

    /// The longest time, in seconds, between two changes of `frames_in`.
    struct Gaps {
        last: u64,
        at: Instant,
        longest: f64,
    }

    impl Gaps {
        fn see(&mut self, frames: u64) {
            let now = Instant::now();
            self.longest = self.longest.max(now.duration_since(self.at).as_secs_f64());
            if frames != self.last {
                self.last = frames;
                self.at = now;
            }
        }
    }

    /// Three cameras with a keyframe a second and a fourth sending nothing
    /// but keyframes of noise, far more a second than the shared decoder
    /// decodes, all of one kind of stream. Before, the flood filled the
    /// line of keyframes the cameras shared and the three went without a
    /// frame for most of it, down again and again. Now each camera has its
    /// own line, taken in turn: the three get their keyframes, never wait
    /// the stall limit for one, and the flood loses its own
    /// (`decoder_behind`).
    #[test]
    fn a_keyframe_flood_from_one_camera_never_starves_the_others() {
        let _one_at_a_time = serial();
        // One kind of stream: one level for all (x264 declares a higher
        // one for the flood's bitrate).
        let size = [
            "--width", "640", "--height", "480", "--fps", "10", "--level", "4.1",
        ];
        let names = ["gate", "yard", "dock", "flood"];
        let mut servers = Vec::new();
        for image in ["astronaut.png", "chelsea.png", "coffee.png"] {
            let mut args = size.to_vec();
            args.extend(["--key-int", "10"]);
            servers.push(RtspServer::start(&[image], &args));
        }
        let mut flood = size.to_vec();
        flood.extend(["--bitrate", "30000", "--flood", "50"]);
        servers.push(RtspServer::start(&["camera.png"], &flood));
        let d = Daemon::start(&site(&names, &servers, Some(2.0)));
        // The flood is on and the decoder cannot keep up with it.
        let p = wait_status(
            &d,
            "site",
            Duration::from_secs(90),
            "every camera streaming, the flood losing keyframes",
            |p| {
                names[..3]
                    .iter()
                    .all(|n| count(&camera(p, n)["camera"]["frames_in"]) >= 2)
                    && count(&camera(p, "flood")["drops"]["decoder_behind"]) >= 20
            },
        );
        let start = Instant::now();
        let first = p.clone();
        let mut gaps: Vec<Gaps> = names[..3]
            .iter()
            .map(|n| Gaps {
                last: count(&camera(&p, n)["camera"]["frames_in"]),
                at: start,
                longest: 0.0,
            })
            .collect();
        let mut p = p;
        while start.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(100));
            p = pipeline_status(&d, "site");
            for (g, n) in gaps.iter_mut().zip(names) {
                g.see(count(&camera(&p, n)["camera"]["frames_in"]));
            }
        }
        let longest: Vec<String> = gaps
            .iter()
            .zip(names)
            .map(|(g, n)| format!("{n} {:.1} s", g.longest))
            .collect();
        eprintln!("longest wait for a frame during the flood: {longest:?}");
        for (g, n) in gaps.iter().zip(names) {
            let c = camera(&p, n);
            assert!(
                g.longest <= 3.0,
                "{n} waited {:.1} s for a frame (the others: {longest:?}): {c:#}",
                g.longest
            );
            assert_eq!(count(&c["camera"]["reconnects"]), 0, "{c:#}");
            let (was, now) = (
                count(&camera(&first, n)["camera"]["frames_in"]),
                count(&c["camera"]["frames_in"]),
            );
            assert!(
                now - was >= 15,
                "{n} decoded {} of its 20 keyframes: {c:#}",
                now - was
            );
            // What a camera loses is its own: the flood nearly everything,
            // the others at most a keyframe of a burst (the machine
            // holding up their RTSP client now and then).
            let (lost, flooded) = (
                count(&c["drops"]["decoder_behind"]),
                count(&camera(&p, "flood")["drops"]["decoder_behind"])
                    - count(&camera(&first, "flood")["drops"]["decoder_behind"]),
            );
            assert!(
                lost * 50 < flooded,
                "{n} lost {lost} keyframes waiting, the flood {flooded}: {c:#}"
            );
        }
        assert_eq!(
            d.log().matches("shared keyframe decoder started").count(),
            1,
            "the four cameras share one decoder:\n{}",
            d.log()
        );
        assert!(!d.log().contains("panicked"), "{}", d.log());
    }
}
