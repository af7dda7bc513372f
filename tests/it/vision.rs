//! Imagery results a person can check: OCR (PP-OCR det -> cls -> rec as
//! cascaded stages) on rendered text against the known strings and against
//! RapidOCR's own Python pipeline; MTCNN faces on real photographs against
//! the package's Python reference; annotated snapshots; the stage edge cases
//! (no boxes, capped boxes, a failing stage model).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::common::*;

const LABELS: &str = r#"
[[pipelines]]
name = "labels"
model = "ppocr_det"
source = { type = "http" }
[[pipelines.stages]]
model = "ppocr_cls"
[[pipelines.stages]]
model = "ppocr_rec"
"#;

const FACES: &str = r#"
[[pipelines]]
name = "faces"
model = "mtcnn_pnet"
source = { type = "http" }
[[pipelines.stages]]
model = "mtcnn_rnet"
[[pipelines.stages]]
model = "mtcnn_onet"
"#;

fn config(pipelines: &str) -> String {
    format!(
        "data_dir = \"{{DATA}}\"\nmodel_dir = \"{}\"\n[api]\nlisten = \"{{API}}\"\n{pipelines}",
        model_dir().display()
    )
}

fn vision_script(name: &str) -> PathBuf {
    root().join("tests/vision").join(name)
}

/// Runs a Python helper; fails the test with its stderr (a missing package
/// or font names itself there).
fn python(script: &str, args: &[&Path]) -> String {
    let o = run(Command::new("python3")
        .arg(vision_script(script))
        .args(args));
    assert!(o.status.success(), "{script} failed:\n{}", stderr(&o));
    stdout(&o)
}

/// The records of posting `body` to `pipeline`.
fn infer(d: &Daemon, pipeline: &str, body: &[u8]) -> Vec<Value> {
    let (code, resp) = http(
        "POST",
        &d.api,
        &format!("/v1/pipelines/{pipeline}/infer?stream=cam"),
        body,
    )
    .unwrap();
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&resp));
    let v: Value = serde_json::from_slice(&resp).unwrap();
    v["records"].as_array().cloned().unwrap_or_default()
}

fn boxes(rec: &Value) -> Vec<Value> {
    rec["outputs"]["boxes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn squash(s: &str) -> Vec<char> {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

fn levenshtein(a: &[char], b: &[char]) -> usize {
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

#[test]
fn ocr_reads_rendered_text_within_five_percent_and_as_rapidocr_does() {
    let pages = tempfile::tempdir().unwrap();
    python("render_text.py", &[pages.path()]);
    let truth: BTreeMap<String, Vec<String>> =
        serde_json::from_slice(&std::fs::read(pages.path().join("truth.json")).unwrap()).unwrap();
    let files: Vec<PathBuf> = truth
        .keys()
        .map(|n| pages.path().join(format!("{n}.png")))
        .collect();
    let refs: Vec<&Path> = files.iter().map(PathBuf::as_path).collect();
    let rapid: BTreeMap<String, Vec<String>> =
        serde_json::from_str(&python("rapidocr_ref.py", &refs)).unwrap();

    let d = Daemon::start(&config(LABELS));
    let (mut edits, mut chars, mut rapid_edits, mut same) = (0, 0, 0, 0);
    let mut table = String::new();
    for (name, lines) in &truth {
        let path = pages.path().join(format!("{name}.png"));
        let recs = infer(&d, "labels", &std::fs::read(&path).unwrap());
        assert_eq!(recs.len(), 1, "{recs:?}");
        let ours: Vec<String> = boxes(&recs[0])
            .iter()
            .map(|b| b["text"].as_str().unwrap_or("").to_string())
            .collect();
        let want = squash(&lines.join(""));
        let got = squash(&ours.join(""));
        let theirs = squash(&rapid[&path.display().to_string()].join(""));
        let e = levenshtein(&got, &want);
        let re = levenshtein(&theirs, &want);
        edits += e;
        rapid_edits += re;
        chars += want.len();
        same += usize::from(got == theirs);
        table += &format!(
            "{name:<8} edits {e:>2} (rapidocr {re:>2})  outpost {ours:?}  rapidocr {:?}\n",
            rapid[&path.display().to_string()]
        );
    }
    let cer = edits as f64 / chars as f64;
    let rapid_cer = rapid_edits as f64 / chars as f64;
    eprintln!(
        "{table}character error rate (whitespace ignored): outpost {:.2} %, rapidocr {:.2} %; \
         {same}/{} pages read identically",
        cer * 100.0,
        rapid_cer * 100.0,
        truth.len()
    );
    assert!(cer <= 0.05, "CER {cer:.4} > 5 %:\n{table}");
    // The same models on the same pages: outpost may differ where its boxes
    // differ (axis-aligned, one box per line), but must not read worse.
    assert!(
        cer <= rapid_cer + 0.01,
        "outpost {cer:.4} vs rapidocr {rapid_cer:.4}:\n{table}"
    );
}

/// The reference's box convention: x = max(0, int(x1)), w = int(x2 - x).
fn xywh(b: &Value) -> [i64; 4] {
    let f = |i: usize| b["box"][i].as_f64().unwrap();
    let (x, y) = ((f(0) as i64).max(0), (f(1) as i64).max(0));
    [x, y, (f(2) - x as f64) as i64, (f(3) - y as f64) as i64]
}

#[test]
fn faces_match_the_python_reference_and_photos_without_faces_give_none() {
    let images: Vec<PathBuf> = [
        "astronaut.png",
        "camera.png",
        "chelsea.png",
        "coffee.png",
        "motorcycle_left.png",
        "rocket.jpg",
    ]
    .iter()
    .map(|n| model_dir().join("images").join(n))
    .collect();
    let refs: Vec<&Path> = images.iter().map(PathBuf::as_path).collect();
    let reference: BTreeMap<String, Vec<Value>> =
        serde_json::from_str(&python("mtcnn_ref.py", &refs)).unwrap();
    // The photographs: one face each in astronaut and camera, none elsewhere.
    let counts: Vec<usize> = images
        .iter()
        .map(|p| reference[&p.display().to_string()].len())
        .collect();
    assert_eq!(counts, [1, 1, 0, 0, 0, 0], "{reference:?}");

    let d = Daemon::start(&config(FACES));
    for p in &images {
        let want = &reference[&p.display().to_string()];
        let recs = infer(&d, "faces", &std::fs::read(p).unwrap());
        let got = recs.first().map(boxes).unwrap_or_default();
        assert_eq!(
            got.len(),
            want.len(),
            "{}: {got:?} vs {want:?}",
            p.display()
        );
        for (g, w) in got.iter().zip(want) {
            let (gb, wb) = (xywh(g), &w["box"]);
            for k in 0..4 {
                let wv = wb[k].as_i64().unwrap();
                assert!(
                    (gb[k] - wv).abs() <= 2,
                    "{}: box {gb:?} vs {wb}",
                    p.display()
                );
            }
            let (gs, ws) = (
                g["score"].as_f64().unwrap(),
                w["confidence"].as_f64().unwrap(),
            );
            assert!(
                (gs - ws).abs() <= 0.01,
                "{}: score {gs} vs {ws}",
                p.display()
            );
            let marks = g["landmarks"].as_array().unwrap();
            assert_eq!(marks.len(), 5);
            for (m, key) in
                marks
                    .iter()
                    .zip(["left_eye", "right_eye", "nose", "mouth_left", "mouth_right"])
            {
                for k in 0..2 {
                    let (a, b) = (
                        m[k].as_f64().unwrap(),
                        w["keypoints"][key][k].as_f64().unwrap(),
                    );
                    assert!(
                        (a - b).abs() <= 2.0,
                        "{}: {key} {m} vs {}",
                        p.display(),
                        w["keypoints"][key]
                    );
                }
            }
        }
    }
}

#[test]
fn snapshot_draws_the_boxes_of_the_latest_record() {
    let d = Daemon::start(&config(FACES));
    // Before any frame: 404 with a JSON error.
    let (code, body) = http("GET", &d.api, "/v1/pipelines/faces/snapshot.jpg", b"").unwrap();
    assert_eq!(code, 404);
    let e: Value = serde_json::from_slice(&body).unwrap();
    assert!(
        e["error"].as_str().unwrap().contains("no image frame yet"),
        "{e}"
    );

    let photo = std::fs::read(model_dir().join("images/astronaut.png")).unwrap();
    let recs = infer(&d, "faces", &photo);
    let faces = boxes(&recs[0]);
    assert_eq!(faces.len(), 1);
    let (code, jpeg) = http("GET", &d.api, "/v1/pipelines/faces/snapshot.jpg", b"").unwrap();
    assert_eq!(code, 200);
    let img = image::load_from_memory_with_format(&jpeg, image::ImageFormat::Jpeg)
        .expect("a valid JPEG")
        .into_rgb8();
    assert_eq!(img.dimensions(), (512, 512));
    let green = |x: f64, y: f64| {
        let p = img.get_pixel(x.round() as u32, y.round() as u32).0;
        p[1] > 180 && p[0] < 110 && p[2] < 110
    };
    let b: Vec<f64> = (0..4)
        .map(|k| faces[0]["box"][k].as_f64().unwrap())
        .collect();
    let (cx, cy) = ((b[0] + b[2]) / 2.0, (b[1] + b[3]) / 2.0);
    // The outline runs along each edge of the recorded box, and only there.
    for (x, y) in [(cx, b[1]), (cx, b[3]), (b[0], cy), (b[2], cy)] {
        assert!(
            green(x, y),
            "no outline at ({x}, {y}): {:?}",
            img.get_pixel(x as u32, y as u32)
        );
    }
    assert!(!green(cx, cy) && !green(b[0] - 8.0, cy) && !green(cx, b[3] + 8.0));
    // The box's label (its score) in white on a black strip just above it.
    let strip: Vec<[u8; 3]> = ((b[1] as u32 - 11)..(b[1] as u32 - 3))
        .flat_map(|y| (b[0] as u32..b[0] as u32 + 32).map(move |x| (x, y)))
        .map(|(x, y)| img.get_pixel(x, y).0)
        .collect();
    let white = strip.iter().filter(|p| p.iter().all(|c| *c > 190)).count();
    let black = strip.iter().filter(|p| p.iter().all(|c| *c < 60)).count();
    assert!(
        white >= 12 && black >= 40,
        "label strip above the box: {white} white, {black} black of {}",
        strip.len()
    );
    // The original photograph has no such green there.
    let orig = image::load_from_memory(&photo).unwrap().into_rgb8();
    let p = orig.get_pixel(cx as u32, b[1].round() as u32).0;
    assert!(!(p[1] > 180 && p[0] < 110 && p[2] < 110));
    let (code, _) = http("GET", &d.api, "/v1/pipelines/nope/snapshot.jpg", b"").unwrap();
    assert_eq!(code, 404);
}

/// A page of many separate words: more boxes than the stage takes.
fn word_grid(cols: u32, rows: u32) -> Vec<u8> {
    let pages = tempfile::tempdir().unwrap();
    let out = pages.path().join("grid.png");
    let script = format!(
        "from PIL import Image, ImageDraw\n\
         img = Image.new('RGB', ({w}, {h}), (236, 233, 226))\n\
         g = ImageDraw.Draw(img)\n\
         for r in range({rows}):\n\
         \x20   for c in range({cols}):\n\
         \x20       g.text((10 + c * 90, 10 + r * 40), 'ab%d' % ((r * {cols} + c) % 10), fill=(20, 20, 30), font_size=22)\n\
         img.save('{out}')\n",
        w = cols * 90 + 20,
        h = rows * 40 + 20,
        out = out.display()
    );
    let o = run(Command::new("python3").args(["-c", &script]));
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::read(out).unwrap()
}

#[test]
fn stages_handle_no_boxes_capped_boxes_and_a_failing_model() {
    // Stage 1 takes at most 20 boxes; the `broken` pipeline's second stage
    // feeds a 224x224 classifier 100x100 crops, which the model refuses.
    let pipelines = format!(
        "{LABELS}max_boxes = 20\n\
         [[pipelines]]\nname = \"broken\"\nmodel = \"ppocr_det\"\nsource = {{ type = \"http\" }}\n\
         [[pipelines.stages]]\nmodel = \"ppocr_cls\"\n\
         [[pipelines.stages]]\nmodel = \"classifier\"\n\
         [pipelines.stages.preprocess]\ntype = \"image\"\nwidth = 100\nheight = 100\n"
    );
    let d = Daemon::start(&config(&pipelines));

    // Zero boxes: a blank page gives a record without boxes, no error.
    let blank = {
        let img = image::RgbImage::from_pixel(320, 200, image::Rgb([236, 233, 226]));
        let mut out = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png)
            .unwrap();
        out
    };
    let recs = infer(&d, "labels", &blank);
    assert!(boxes(&recs[0]).is_empty() && recs[0]["outputs"].get("stage_error").is_none());

    // Many boxes: the first stage takes 20, the rest are counted and left out.
    let grid = word_grid(8, 12);
    let recs = infer(&d, "labels", &grid);
    let out = &recs[0]["outputs"];
    let capped = out["capped"].as_u64().unwrap_or(0);
    assert!(capped >= 40, "{out}");
    assert_eq!(boxes(&recs[0]).len(), 20, "{out}");
    assert!(
        boxes(&recs[0])
            .iter()
            .all(|b| b["text"].as_str().is_some_and(|t| t.starts_with("ab"))),
        "{out}"
    );

    // A failing stage: the record keeps the earlier stages' results and says
    // what failed; the pipeline serves the next frame; errors are counted.
    let page = std::fs::read({
        let dir = d.dir.path().join("pages");
        python("render_text.py", &[&dir]);
        dir.join("report.png")
    })
    .unwrap();
    for _ in 0..2 {
        let recs = infer(&d, "broken", &page);
        let out = &recs[0]["outputs"];
        let err = out["stage_error"].as_str().unwrap_or_default();
        assert!(err.contains("classifier"), "{out}");
        assert!(
            boxes(&recs[0]).iter().all(|b| b.get("angle").is_some()),
            "{out}"
        );
    }
    let st = d.status();
    let broken = st["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "broken")
        .unwrap();
    assert_eq!(broken["stages"][1]["errors"], 2, "{broken}");
    assert_eq!(broken["stages"][0]["errors"], 0, "{broken}");
    let labels = &st["pipelines"][0];
    assert!(
        labels["stages"][1]["boxes_capped"].as_u64().unwrap() >= 40,
        "{labels}"
    );
    assert!(
        labels["stages"][1]["latency"]["count"].as_u64().unwrap() >= 1,
        "{labels}"
    );
    // Each stage's own inference runs: the crops they held, failed runs too.
    let rec = &labels["stages"][1];
    let runs = rec["batches"].as_u64().unwrap();
    assert!(runs >= 3, "20 crops in batches of 8: {rec}");
    assert_eq!(rec["batch_items"], rec["crops"], "{rec}");
    assert_eq!(rec["inference_latency"]["count"], runs, "{rec}");
    assert!(rec["inference_us_total"].as_u64().unwrap() > 0, "{rec}");
    let refused = &broken["stages"][1];
    assert!(refused["batches"].as_u64().unwrap() >= 2, "{refused}");
    assert_eq!(refused["crops"], 0, "{refused}");
    // And in /metrics.
    let (_, m) = http("GET", &d.api, "/metrics", b"").unwrap();
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains("outpost_stage_errors_total{pipeline=\"broken\",stage=\"classifier@1.0.0\"} 2"),
        "{m}"
    );
    assert!(m.contains(
        "outpost_stage_latency_seconds_count{pipeline=\"labels\",stage=\"ppocr_rec@1.4.4\"}"
    ));
    assert!(m.contains(&format!(
        "outpost_stage_batches_total{{pipeline=\"labels\",stage=\"ppocr_rec@1.4.4\"}} {runs}"
    )));
    for family in [
        "outpost_stage_batch_size_count",
        "outpost_stage_inference_latency_seconds_count",
    ] {
        assert!(
            m.contains(&format!(
                "{family}{{pipeline=\"labels\",stage=\"ppocr_rec@1.4.4\"}} {runs}"
            )),
            "{family}: {m}"
        );
    }
}

/// `astronaut.png` scaled to `w` x `h`, as JPEG: a large frame with a
/// person in it.
fn big_photo(w: u32, h: u32) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("big.jpg");
    let script = format!(
        "from PIL import Image\n\
         Image.open('{src}').convert('RGB').resize(({w}, {h})).save('{out}', quality=80)\n",
        src = model_dir().join("images/astronaut.png").display(),
        out = out.display()
    );
    let o = run(Command::new("python3").args(["-c", &script]));
    assert!(o.status.success(), "{}", stderr(&o));
    std::fs::read(out).unwrap()
}

/// A GET; returns (status, header lines, body).
fn get(addr: &str, path: &str) -> (u16, String, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120)))
        .unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).unwrap();
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&buf[..split]).to_ascii_lowercase();
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap();
    (code, head, buf[split + 4..].to_vec())
}

/// kB of a `/proc/PID/status` line (`VmRSS:`, `VmHWM:`).
fn proc_kb(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Issue 50, item 3: `snapshot.jpg` decoded and drew the whole frame for
/// every request, with no bound on how many at once: 8 clients x 3
/// requests on a 7936x7936 camera took the daemon from 529 MB to 2.43 GB,
/// answers up to 21 s. Now each frame is drawn once (the requests for it
/// share the JPEG), at most 1920 pixels on its long side, at most two at
/// once in the daemon; a request that would draw a third is answered 503
/// with `Retry-After` at once, and counted. Three pipelines each keep a
/// 4000x1000 frame (wide, so that a debug build draws it in seconds);
/// six clients ask for them at once, three times each.
#[test]
fn snapshots_of_large_frames_are_drawn_once_small_and_refused_past_the_bound() {
    const W: u32 = 4000;
    const H: u32 = 1000;
    const PIPES: usize = 3;
    const CLIENTS: usize = 6;
    let pipelines: String = (0..PIPES)
        .map(|i| {
            format!("[[pipelines]]\nname = \"big{i}\"\nmodel = \"coco_det\"\nsource = {{ type = \"http\" }}\n")
        })
        .collect();
    let d = Daemon::start(&config(&pipelines));
    let photo = big_photo(W, H);
    for i in 0..PIPES {
        infer(&d, &format!("big{i}"), &photo);
    }
    let pid = d.child.id();
    let rss = proc_kb(pid, "VmRSS:");
    // Peak RSS from here on.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
    let start = std::sync::Barrier::new(CLIENTS);
    let t0 = std::time::Instant::now();
    let answers: Vec<(usize, u16, String, Vec<u8>, std::time::Duration)> =
        std::thread::scope(|s| {
            let clients: Vec<_> = (0..CLIENTS)
                .map(|c| {
                    let (api, start) = (&d.api, &start);
                    s.spawn(move || {
                        start.wait();
                        (0..3)
                            .map(|_| {
                                let t = std::time::Instant::now();
                                let p = c % PIPES;
                                let (code, head, body) =
                                    get(api, &format!("/v1/pipelines/big{p}/snapshot.jpg"));
                                (p, code, head, body, t.elapsed())
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            clients
                .into_iter()
                .flat_map(|c| c.join().unwrap())
                .collect()
        });
    let took = t0.elapsed();
    let peak = proc_kb(pid, "VmHWM:");
    let slowest = answers.iter().map(|a| a.4).max().unwrap();
    let ok: Vec<_> = answers.iter().filter(|a| a.1 == 200).collect();
    let refused: Vec<_> = answers.iter().filter(|a| a.1 == 503).collect();
    let sizes: Vec<(u32, u32)> = ok
        .iter()
        .map(|a| {
            let img = image::load_from_memory(&a.3).unwrap();
            (img.width(), img.height())
        })
        .collect();
    eprintln!(
        "{CLIENTS} clients x 3 snapshots of {PIPES} {W}x{H} frames: RSS {} MB before, \
         peak {} MB; {} answered 200 (sizes {:?}), {} answered 503, the slowest in {slowest:?}, \
         all in {took:?}",
        rss / 1024,
        peak / 1024,
        ok.len(),
        sizes.iter().collect::<std::collections::BTreeSet<_>>(),
        refused.len()
    );
    assert!(
        sizes.iter().all(|&(w, h)| w.max(h) <= 1920),
        "snapshots larger than 1920 px: {sizes:?}"
    );
    assert!(
        !refused.is_empty(),
        "no request refused while two frames were being drawn"
    );
    assert_eq!(ok.len() + refused.len(), answers.len());
    for a in &refused {
        assert!(a.2.contains("\r\nretry-after: 1"), "{}", a.2);
        let e: Value = serde_json::from_slice(&a.3).unwrap();
        assert!(e["error"].as_str().unwrap().contains("busy"), "{e}");
    }
    // Two drawings at once at most, each of the small picture (the frame
    // itself is decoded whole, as the pipeline decoded it).
    assert!(
        peak.saturating_sub(rss) < 256 * 1024,
        "peak RSS {} MB over {} MB before",
        peak / 1024,
        rss / 1024
    );
    // One client at a time: every frame is drawn (once), and a frame
    // already drawn is answered from its drawing.
    for p in 0..PIPES {
        for _ in 0..2 {
            let (code, _, body) = get(&d.api, &format!("/v1/pipelines/big{p}/snapshot.jpg"));
            assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
            let img = image::load_from_memory(&body).unwrap();
            assert_eq!((img.width(), img.height()), (1920, 480));
        }
    }
    let (_, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    let text = String::from_utf8_lossy(&body);
    let sum = |family: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(&format!("{family}{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(sum("outpost_snapshot_renders_total"), PIPES as f64);
    assert_eq!(
        sum("outpost_snapshot_renders_refused_total"),
        refused.len() as f64
    );
}
