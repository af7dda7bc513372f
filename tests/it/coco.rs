//! The COCO-80 detector (models/coco_det: the CenterNet of the npm package
//! @vladmandic/human, converted to ONNX by models/fetch) on real
//! photographs: the daemon's records against tests/vision/coco_ref.py, the
//! same converted model in Python onnxruntime with the daemon's pre- and
//! postprocessing written out in numpy (Pillow's bilinear stretch, score
//! threshold, class-wise NMS, boxes mapped back to the photograph).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::common::*;

const OBJECTS: &str = r#"
[[pipelines]]
name = "objects"
model = "coco_det"
source = { type = "http" }
"#;

/// Debian's `darknet` test photographs (scripts/deps) and scikit-image's
/// (models/fetch).
fn photos() -> Vec<PathBuf> {
    let mut v = Vec::new();
    for n in ["dog", "person", "kite", "horses", "giraffe"] {
        let p = PathBuf::from(format!("/usr/share/darknet/data/{n}.jpg"));
        assert!(
            p.exists(),
            "{} missing: install Debian's darknet (scripts/deps)",
            p.display()
        );
        v.push(p);
    }
    for n in [
        "astronaut.png",
        "camera.png",
        "chelsea.png",
        "coffee.png",
        "motorcycle_left.png",
        "rocket.jpg",
    ] {
        let p = model_dir().join("images").join(n);
        assert!(p.exists(), "{} missing: run models/fetch", p.display());
        v.push(p);
    }
    v
}

struct Det {
    bbox: [f64; 4],
    score: f64,
    label: String,
}

fn dets(list: &Value) -> Vec<Det> {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list of detections: {list}"))
        .iter()
        .map(|d| {
            let b: Vec<f64> = serde_json::from_value(d["box"].clone()).unwrap();
            Det {
                bbox: [b[0], b[1], b[2], b[3]],
                score: d["score"].as_f64().unwrap(),
                label: d["label"].as_str().unwrap().to_string(),
            }
        })
        .collect()
}

fn iou(a: &[f64; 4], b: &[f64; 4]) -> f64 {
    let iw = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let ih = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = iw * ih;
    let area = |r: &[f64; 4]| (r[2] - r[0]).max(0.0) * (r[3] - r[1]).max(0.0);
    let union = area(a) + area(b) - inter;
    if union <= 0.0 { 0.0 } else { inter / union }
}

/// How many of `of` have a box of the same label in `among` with IoU >= 0.9;
/// the unmatched ones, described; the lowest IoU of a match.
fn matched(of: &[Det], among: &[Det]) -> (usize, Vec<String>, f64) {
    let mut n = 0;
    let mut missing = Vec::new();
    let mut lowest: f64 = 1.0;
    for d in of {
        let best = among
            .iter()
            .filter(|o| o.label == d.label)
            .map(|o| iou(&o.bbox, &d.bbox))
            .fold(0.0, f64::max);
        if best >= 0.9 {
            n += 1;
            lowest = lowest.min(best);
        } else {
            missing.push(format!("{} {:.3} {:?}", d.label, d.score, d.bbox));
        }
    }
    (n, missing, lowest)
}

fn labels(d: &[Det]) -> Vec<&str> {
    d.iter().map(|d| d.label.as_str()).collect()
}

#[test]
fn coco_detector_boxes_match_python_onnxruntime_on_photographs() {
    model_file("coco_det", "centernet.onnx");
    let photos = photos();
    let o = run(Command::new("python3")
        .arg(root().join("tests/vision/coco_ref.py"))
        .args(photos.iter().map(PathBuf::as_path)));
    assert!(o.status.success(), "coco_ref.py failed:\n{}", stderr(&o));
    let reference: Value = serde_json::from_str(&stdout(&o)).unwrap();

    let d = Daemon::start(&format!(
        "data_dir = \"{{DATA}}\"\nmodel_dir = \"{}\"\n[api]\nlisten = \"{{API}}\"\n{OBJECTS}",
        model_dir().display()
    ));
    let mut ours = BTreeMap::new();
    let mut theirs = BTreeMap::new();
    for p in &photos {
        let (code, resp) = http(
            "POST",
            &d.api,
            "/v1/pipelines/objects/infer?stream=cam",
            &std::fs::read(p).unwrap(),
        )
        .unwrap();
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&resp));
        let v: Value = serde_json::from_slice(&resp).unwrap();
        let recs = v["records"].as_array().cloned().unwrap_or_default();
        assert_eq!(recs.len(), 1, "{}: {recs:?}", p.display());
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        ours.insert(name.clone(), dets(&recs[0]["outputs"]["detections"]));
        theirs.insert(name.clone(), dets(&reference["images"][&name]));
    }

    // Real objects are found, by both.
    let has = |m: &BTreeMap<String, Vec<Det>>, photo: &str, label: &str, n: usize| {
        let count = m[photo].iter().filter(|d| d.label == label).count();
        assert!(
            count >= n,
            "{photo}: {count} {label} (want {n}+): {:?}",
            labels(&m[photo])
        );
    };
    for m in [&ours, &theirs] {
        for label in ["dog", "bicycle", "car"] {
            has(m, "dog.jpg", label, 1);
        }
        has(m, "person.jpg", "person", 1);
        has(m, "kite.jpg", "person", 5);
        has(m, "kite.jpg", "kite", 3);
        has(m, "horses.jpg", "horse", 2);
        has(m, "giraffe.jpg", "giraffe", 1);
        has(m, "astronaut.png", "person", 1);
    }

    let (mut ref_total, mut ref_hit, mut our_total, mut our_hit) = (0, 0, 0, 0);
    let mut lowest: f64 = 1.0;
    let mut report = Vec::new();
    for (name, want) in &theirs {
        let got = &ours[name];
        let (a, miss_a, low_a) = matched(want, got);
        let (b, miss_b, low_b) = matched(got, want);
        lowest = lowest.min(low_a).min(low_b);
        ref_total += want.len();
        ref_hit += a;
        our_total += got.len();
        our_hit += b;
        for m in miss_a {
            report.push(format!("{name}: reference box without a match: {m}"));
        }
        for m in miss_b {
            report.push(format!("{name}: daemon box without a match: {m}"));
        }
    }
    assert!(ref_total >= 30, "too few reference boxes ({ref_total})");
    let rate = |hit: usize, total: usize| hit as f64 / total.max(1) as f64;
    eprintln!(
        "coco_det: {ref_hit}/{ref_total} reference boxes and {our_hit}/{our_total} daemon \
         boxes matched (same label, IoU >= 0.9; lowest IoU of a match {lowest:.4}){}",
        report
            .iter()
            .map(|r| format!("\n  {r}"))
            .collect::<String>()
    );
    assert!(
        rate(ref_hit, ref_total) >= 0.99 && rate(our_hit, our_total) >= 0.99,
        "{ref_hit}/{ref_total} reference and {our_hit}/{our_total} daemon boxes matched:\n  {}",
        report.join("\n  ")
    );
}

#[test]
fn coco_reference_output_is_the_one_models_fetch_wrote() {
    // The committed reference (models/coco_det/reference.json, written by
    // models/fetch on scikit-image's photographs) is what the reference
    // script gives now: the model, labels and postprocessing are unchanged.
    model_file("coco_det", "centernet.onnx");
    let dir = model_dir().join("coco_det");
    let want: Value =
        serde_json::from_slice(&std::fs::read(dir.join("reference.json")).unwrap()).unwrap();
    let names: Vec<&String> = want["images"].as_object().unwrap().keys().collect();
    assert!(names.len() >= 6, "{names:?}");
    let paths: Vec<PathBuf> = names
        .iter()
        .map(|n| model_dir().join("images").join(n))
        .collect();
    let o = run(Command::new("python3")
        .arg(root().join("tests/vision/coco_ref.py"))
        .args(paths.iter().map(PathBuf::as_path)));
    assert!(o.status.success(), "coco_ref.py failed:\n{}", stderr(&o));
    let got: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(got["model"], want["model"], "the model file changed");
    for n in names {
        let (g, w) = (dets(&got["images"][n]), dets(&want["images"][n]));
        assert_eq!(labels(&g), labels(&w), "{n}");
        for (a, b) in g.iter().zip(&w) {
            assert!(
                iou(&a.bbox, &b.bbox) >= 0.99,
                "{n}: {:?} vs {:?}",
                a.bbox,
                b.bbox
            );
        }
    }
}
