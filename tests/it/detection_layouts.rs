//! The `detections` postprocess on each exported detector layout (YOLOv8 /
//! YOLO11, YOLOv5, YOLOX, SSD, DETR, RT-DETR): a small model of the layout
//! (models/build) run by `outpost infer`, its outputs decoded with the
//! model manifest's postprocessing, held against models/build's numpy
//! reference decoder on the same model (`ref/detections.json`), letterbox
//! undone and labels from the manifest's class names.

use ndarray::{ArrayD, IxDyn};
use outpost::backend::Tensor;
use outpost::model::manifest::Manifest;
use outpost::preprocess::{ImageTransform, ItemMeta};

use crate::common::*;

fn check_layout(model: &str) {
    let dir = model_dir().join(model);
    let manifest = Manifest::load(&dir.join("manifest.toml")).unwrap();
    let post_cfg = manifest.postprocess.clone().expect("a postprocess");
    assert!(post_cfg.validate().is_empty(), "{:?}", post_cfg.validate());
    let input = dir.join("ref/in/images.npy");
    let v = json(&run(outpost()
        .args([
            "infer", "--model", model, "--json", "--ep", "cpu", "--input",
        ])
        .arg(format!("images={}", input.display()))));
    let mut outputs = Vec::new();
    for (name, o) in v["outputs"].as_object().unwrap() {
        let shape: Vec<usize> = serde_json::from_value(o["shape"].clone()).unwrap();
        let data: Vec<f32> = o["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect();
        outputs.push((
            name.clone(),
            Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), data).unwrap()),
        ));
    }
    let want: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("ref/detections.json")).unwrap()).unwrap();
    let tr = &want["transform"];
    let f = |k: &str| tr[k].as_f64().unwrap() as f32;
    let meta = ItemMeta {
        image: Some(ImageTransform {
            orig_width: tr["orig_width"].as_u64().unwrap() as u32,
            orig_height: tr["orig_height"].as_u64().unwrap() as u32,
            scale_x: f("scale_x"),
            scale_y: f("scale_y"),
            pad_x: f("pad_x"),
            pad_y: f("pad_y"),
        }),
        ..ItemMeta::default()
    };
    let mut post = post_cfg.build(&dir).unwrap();
    let got = post.process("s", &meta, &outputs).unwrap().unwrap();
    let got = got["detections"].as_array().unwrap();
    let want = want["detections"].as_array().unwrap();
    assert!(
        want.len() >= 4,
        "{model}: the reference finds {} detections, the test would prove little",
        want.len()
    );
    assert_eq!(got.len(), want.len(), "{model}: {got:#?}\nwant {want:#?}");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g["label"], w["label"], "{model}: {g} vs {w}");
        assert_eq!(g["class"], w["class"], "{model}: {g} vs {w}");
        let ds = (g["score"].as_f64().unwrap() - w["score"].as_f64().unwrap()).abs();
        assert!(ds < 1e-4, "{model}: score {g} vs {w}");
        for k in 0..4 {
            let d = (g["box"][k].as_f64().unwrap() - w["box"][k].as_f64().unwrap()).abs();
            assert!(d < 0.02, "{model}: box {g} vs {w}");
        }
    }
}

#[test]
fn yolov8_layout_matches_the_reference_decoder() {
    check_layout("det_yolov8");
}

#[test]
fn yolov5_layout_matches_the_reference_decoder() {
    check_layout("det_yolov5");
}

#[test]
fn yolox_layout_matches_the_reference_decoder() {
    check_layout("det_yolox");
}

#[test]
fn ssd_layout_matches_the_reference_decoder() {
    check_layout("det_ssd");
}

#[test]
fn detr_layout_matches_the_reference_decoder() {
    check_layout("det_detr");
}

#[test]
fn rtdetr_layout_matches_the_reference_decoder() {
    check_layout("det_rtdetr");
}
