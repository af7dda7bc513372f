//! The daemon end to end: real `outpost run` processes, real models, real
//! sockets, a real MQTT broker (the embedded one), real speech.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use crate::common::*;

/// Speech from espeak-ng (22.05 kHz PCM16), with the span where it is loud.
pub(crate) fn speak(dir: &Path, name: &str, text: &str) -> (Vec<i16>, u32, (usize, usize)) {
    let wav = dir.join(format!("{name}.wav"));
    let st = std::process::Command::new("espeak-ng")
        .arg("-w")
        .arg(&wav)
        .arg(text)
        .status()
        .expect("espeak-ng (Debian package espeak-ng) is needed");
    assert!(st.success());
    let mut r = hound::WavReader::open(&wav).unwrap();
    let rate = r.spec().sample_rate;
    let s: Vec<i16> = r.samples::<i16>().map(|x| x.unwrap()).collect();
    let loud = |x: &i16| x.unsigned_abs() > 800;
    let first = s.iter().position(loud).unwrap();
    let last = s.len() - s.iter().rev().position(loud).unwrap();
    (s, rate, (first, last))
}

/// Low noise, like a quiet room through a cheap microphone.
pub(crate) fn noise(n: usize, seed: &mut u64) -> Vec<i16> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (((*seed >> 33) % 121) as i16) - 60
        })
        .collect()
}

#[test]
fn speech_over_mqtt_through_silero_vad_finds_the_segments() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, rate, ea) = speak(
        tmp.path(),
        "a",
        "the pump on line three is running hot, please check it",
    );
    let (b, _, eb) = speak(tmp.path(), "b", "all clear, the valve is closed again");
    let mut seed = 7;
    let sec = |s: f64| (s * rate as f64) as usize;
    let mut audio = noise(sec(1.2), &mut seed);
    let off_a = audio.len();
    audio.extend(&a);
    audio.extend(noise(sec(1.5), &mut seed));
    let off_b = audio.len();
    audio.extend(&b);
    audio.extend(noise(sec(1.5), &mut seed));
    let truth = [
        (
            (off_a + ea.0) as f64 / rate as f64,
            (off_a + ea.1) as f64 / rate as f64,
        ),
        (
            (off_b + eb.0) as f64 / rate as f64,
            (off_b + eb.1) as f64 / rate as f64,
        ),
    ];

    let broker = free_port();
    let mut d = Daemon::start(&format!(
        r#"
device = "gw-test"
data_dir = "{{DATA}}"
[api]
listen = "{{API}}"
[embedded_broker]
listen = "127.0.0.1:{broker}"
[[pipelines]]
name = "vad"
model = "silero_vad"
priority = "realtime"
when_full = "block"
source = {{ type = "mqtt", topics = ["site/+/audio"], qos = 1, stream = {{ topic_segment = 1 }} }}
[pipelines.preprocess]
type = "audio"
sample_rate = 16000
input_rate = {rate}
window = 576
hop = 512
"#
    ));

    // Publish 20 ms chunks of PCM16 as a microphone would (faster than real time).
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut o = rumqttc::MqttOptions::new("mic-1-publisher", "127.0.0.1", broker);
        o.set_keep_alive(Duration::from_secs(10));
        let (client, mut ev) = rumqttc::AsyncClient::new(o, 100);
        let poller = tokio::spawn(async move { while ev.poll().await.is_ok() {} });
        // Let the daemon's subscription be in place before the first chunk.
        tokio::time::sleep(Duration::from_millis(500)).await;
        for chunk in audio.chunks(sec(0.02)) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|s| s.to_le_bytes()).collect();
            client
                .publish("site/mic-1/audio", rumqttc::QoS::AtLeastOnce, false, bytes)
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_micros(1500)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        client.disconnect().await.ok();
        poller.abort();
    });

    let recs = d
        .records_until(Duration::from_secs(30), |r| {
            r.iter().filter(|x| x["outputs"]["event"] == "end").count() >= 2
        })
        .to_vec();
    let status = d.status();
    let ends: Vec<&serde_json::Value> = recs
        .iter()
        .filter(|r| r["outputs"]["event"] == "end")
        .collect();
    let starts = recs
        .iter()
        .filter(|r| r["outputs"]["event"] == "start")
        .count();
    let events: Vec<String> = recs.iter().map(|r| r["outputs"].to_string()).collect();
    assert_eq!(
        ends.len(),
        2,
        "speech segments: {events:#?}\ntruth: {truth:?}\nstatus: {status}"
    );
    assert_eq!(starts, 2, "{recs:#?}");
    for (e, (t0, t1)) in ends.iter().zip(truth) {
        let s = e["outputs"]["start"].as_f64().unwrap();
        let t = e["outputs"]["t"].as_f64().unwrap();
        assert!(
            (s - t0).abs() < 0.3,
            "segment start {s:.3} s, truth {t0:.3} s"
        );
        assert!(
            (t - t1).abs() < 0.45,
            "segment end {t:.3} s, truth {t1:.3} s"
        );
        assert_eq!(e["stream"], "mic-1");
        assert_eq!(e["pipeline"], "vad");
        assert_eq!(e["model"], "silero_vad@6.2.3");
        assert_eq!(e["ep"], "cpu");
        assert!(e["id"].as_str().unwrap().starts_with("gw-test/1/"));
    }
    // The quiet parts sent nothing: only the four events became records.
    assert_eq!(recs.len(), 4, "{recs:#?}");
    let p = &status["pipelines"][0];
    assert!(p["drops"].as_object().unwrap().is_empty(), "{p}");
    assert_eq!(d.terminate().code(), Some(0));
}

fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            (x as u8).wrapping_mul(seed),
            (y as u8).wrapping_add(seed),
            seed,
        ])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

fn jpeg(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x % 256) as u8, (y % 256) as u8, 128])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

#[test]
fn watched_directory_processes_each_file_once_and_moves_it() {
    let dir = tempfile::tempdir().unwrap();
    let inbox = dir.path().join("inbox");
    std::fs::create_dir_all(&inbox).unwrap();
    std::fs::write(inbox.join("scan-1.png"), png(320, 240, 3)).unwrap();
    std::fs::write(inbox.join("scan-2.jpg"), jpeg(640, 480)).unwrap();
    let mut broken = jpeg(640, 480);
    broken.truncate(300);
    std::fs::write(inbox.join("scan-3.jpg"), &broken).unwrap();
    std::fs::write(inbox.join("notes.txt"), b"not an image at all").unwrap();
    let config = r#"
device = "gw-test"
data_dir = "{DATA}"
[api]
listen = "{API}"
[[pipelines]]
name = "inspect"
model = "classifier"
source = { type = "watch", dir = "{DIR}/inbox", poll_interval = "100ms", extensions = ["png", "jpg"] }
"#;
    let mut d = Daemon::start_in(config, dir);
    let recs = d
        .records_until(Duration::from_secs(30), |r| r.len() >= 2)
        .to_vec();
    assert_eq!(recs.len(), 2, "{recs:#?}");
    let mut streams: Vec<&str> = recs.iter().map(|r| r["stream"].as_str().unwrap()).collect();
    streams.sort();
    assert_eq!(streams, ["scan-1.png", "scan-2.jpg"]);
    for r in &recs {
        let top = r["outputs"]["top"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        let s: f64 = top.iter().map(|t| t["score"].as_f64().unwrap()).sum();
        assert!(s > 0.0 && s <= 1.0 + 1e-6);
    }
    // Wait for the corrupt one to be moved too.
    let inbox = d.dir.path().join("inbox");
    let t0 = std::time::Instant::now();
    while !inbox.join("failed/scan-3.jpg").exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(inbox.join("done/scan-1.png").exists() && inbox.join("done/scan-2.jpg").exists());
    assert!(inbox.join("failed/scan-3.jpg").exists(), "{}", d.log());
    let reason = std::fs::read_to_string(inbox.join("failed/scan-3.jpg.reason.txt")).unwrap();
    assert!(!reason.trim().is_empty());
    assert!(
        inbox.join("notes.txt").exists(),
        "other extensions are left alone"
    );
    let drops = d.status()["pipelines"][0]["drops"].clone();
    assert_eq!(
        drops
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum::<u64>(),
        1,
        "{drops}"
    );

    // A restart neither reprocesses nor loses anything; a new file is taken.
    let dir = d.stop_keep_dir();
    std::fs::write(dir.path().join("inbox/scan-4.png"), png(64, 64, 9)).unwrap();
    let mut d = Daemon::start_in(config, dir);
    d.records_until(Duration::from_secs(60), |r| {
        r.iter().any(|x| x["stream"] == "scan-4.png")
    });
    // The scan that found scan-4.png also saw the old files: once the
    // pipeline is idle, this boot took in one frame only.
    let st = wait_idle(&d, 1);
    assert_eq!(st["pipelines"][0]["frames_in"], 1, "{st}");
    let recs2 = d
        .records_until(Duration::from_millis(10), |_| false)
        .to_vec();
    assert_eq!(recs2.len(), 1, "only the new file: {recs2:#?}");
    assert_eq!(recs2[0]["stream"], "scan-4.png");
    assert!(
        recs2[0]["id"].as_str().unwrap().starts_with("gw-test/2/"),
        "second boot"
    );
}

/// Sends length-prefixed frames to a unix socket.
fn send_unix(path: &Path, frames: impl Iterator<Item = Vec<u8>>) {
    let t0 = std::time::Instant::now();
    let mut s = loop {
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(s) => break s,
            Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("{}: {e}", path.display()),
        }
    };
    for f in frames {
        s.write_all(&outpost::source::framing::length_prefixed(&f))
            .unwrap();
    }
    s.flush().unwrap();
}

fn wait_idle(d: &Daemon, pipelines: usize) -> serde_json::Value {
    let t0 = std::time::Instant::now();
    let mut last = String::new();
    loop {
        let st = d.status();
        let done = (0..pipelines).all(|i| {
            let p = &st["pipelines"][i];
            let drops: u64 = p["drops"]
                .as_object()
                .unwrap()
                .values()
                .map(|v| v.as_u64().unwrap())
                .sum();
            p["queue_depth"] == 0
                && p["frames_in"].as_u64().unwrap() == p["frames_done"].as_u64().unwrap() + drops
        });
        // The outbox part ages every second; only the pipelines must settle.
        let now = st["pipelines"].to_string();
        if done && now == last {
            return st;
        }
        last = now;
        assert!(t0.elapsed() < Duration::from_secs(60), "not idle: {st}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn flooded_realtime_pipeline_counts_drops_exactly_and_batch_still_progresses() {
    let config = r#"
device = "gw-test"
data_dir = "{DATA}"
[api]
listen = "{API}"
token_file = "{DIR}/token"
[scheduler]
workers = 1
[[pipelines]]
name = "camera"
model = "classifier"
priority = "realtime"
queue = 4
when_full = "drop_oldest"
source = { type = "unix", path = "{DIR}/camera.sock" }
[[pipelines]]
name = "sensors"
model = "sensor_mlp"
priority = "batch"
queue = 1000
when_full = "block"
source = { type = "unix", path = "{DIR}/sensors.sock" }
[pipelines.preprocess]
type = "sensor"
format = "json"
length = 16
"#;
    let dir = tempfile::tempdir().unwrap();
    let token = "flooded-realtime-token-0123456789";
    std::fs::write(dir.path().join("token"), token).unwrap();
    let d = Daemon::start_in(config, dir);
    let cam = d.dir.path().join("camera.sock");
    let sens = d.dir.path().join("sensors.sock");
    let image = png(224, 224, 5);
    let n_cam = 300;
    let n_sens = 40;
    // The overflow is made, not hoped for: the first 150 frames arrive while
    // the camera pipeline is paused (a queue of 4 keeps the newest 4, so 146
    // drops at least); the other 150 flood it after the resume, while the
    // sensor frames arrive.
    let paused = "/v1/pipelines/camera/pause";
    assert_eq!(post_with_token(&d.api, paused, token), 200);
    send_unix(&cam, (0..n_cam / 2).map(|_| image.clone()));
    let t0 = std::time::Instant::now();
    while d.status()["pipelines"][0]["frames_in"] != n_cam / 2 {
        assert!(t0.elapsed() < Duration::from_secs(60), "{}", d.status());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        post_with_token(&d.api, "/v1/pipelines/camera/resume", token),
        200
    );
    let cam_thread =
        std::thread::spawn(move || send_unix(&cam, (0..n_cam / 2).map(|_| image.clone())));
    send_unix(
        &sens,
        (0..n_sens).map(|i| {
            format!(
                "[{}]",
                (0..16)
                    .map(|k| format!("{}", (i + k) as f32 / 10.0))
                    .collect::<Vec<_>>()
                    .join(",")
            )
            .into_bytes()
        }),
    );
    cam_thread.join().unwrap();
    let st = wait_idle(&d, 2);
    let cam = &st["pipelines"][0];
    let sens = &st["pipelines"][1];
    let dropped = cam["drops"]["queue_full_drop_oldest"].as_u64().unwrap_or(0);
    assert_eq!(cam["frames_in"], n_cam, "{cam}");
    assert!(
        dropped >= n_cam as u64 / 2 - 4,
        "150 frames into a paused queue of 4: {cam}"
    );
    assert_eq!(
        cam["frames_done"].as_u64().unwrap() + dropped,
        n_cam as u64,
        "{cam}"
    );
    assert_eq!(cam["records"], cam["frames_done"], "{cam}");
    assert_eq!(
        cam["drops"].as_object().unwrap().len(),
        1,
        "only queue drops: {cam}"
    );
    // The batch pipeline got its turns during the flood and lost nothing.
    assert_eq!(sens["frames_in"], n_sens, "{sens}");
    assert_eq!(sens["records"], n_sens, "{sens}");
    assert!(sens["drops"].as_object().unwrap().is_empty(), "{sens}");
}

#[test]
fn malformed_frames_are_counted_and_the_pipeline_keeps_serving() {
    let d = Daemon::start(&sensors_over_http(""));
    let good = format!("[{}]", vec!["0.5"; 16].join(","));
    let (code, body) = http(
        "POST",
        &d.api,
        "/v1/pipelines/sensors/infer?stream=s1",
        good.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["records"][0]["stream"], "s1");
    assert_eq!(
        v["records"][0]["outputs"]["top"].as_array().unwrap().len(),
        4
    );
    for bad in [&b"[1,2,3]"[..], b"{not json", b"", &[0xff, 0xfe, 0x00][..]] {
        let (code, _) = http("POST", &d.api, "/v1/pipelines/sensors/infer", bad).unwrap();
        assert_eq!(code, 422, "bad payload {:?}", String::from_utf8_lossy(bad));
    }
    let (code, _) = http("POST", &d.api, "/v1/pipelines/nope/infer", b"[]").unwrap();
    assert_eq!(code, 404);
    let (code, _) = http(
        "POST",
        &d.api,
        "/v1/pipelines/sensors/infer",
        good.as_bytes(),
    )
    .unwrap();
    assert_eq!(code, 200, "still serving");
    let st = d.status();
    let p = &st["pipelines"][0];
    assert_eq!(p["records"], 2);
    let drops: u64 = p["drops"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(drops, 4, "{p}");
}
