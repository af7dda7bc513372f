//! `outpost models import FILE.onnx`: every model the project fetches or
//! builds, imported from its bare .onnx file into a fresh model folder,
//! gives the records its hand-written manifest gives (the same photograph
//! through both, in one real daemon), or, for the stage and audio models,
//! the same pre- and postprocessing; a graph it cannot recognise is refused
//! with its reason and exit code 2.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::common::*;

/// The detectors `models/build` makes name three classes.
const DET_CLASSES: &str = "person\ncar\ntruck\n";

fn copy_dir(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-r")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(st.success());
}

/// The model's .onnx file in its folder (the manifest's `file`).
fn onnx_of(model: &str) -> std::path::PathBuf {
    let text = std::fs::read_to_string(model_dir().join(model).join("manifest.toml"))
        .unwrap_or_else(|e| panic!("{model}: {e}: run models/fetch && models/build"));
    let m: toml::Table = toml::from_str(&text).unwrap();
    model_dir().join(model).join(m["file"].as_str().unwrap())
}

/// Imports `model`'s file as `<model>_imported` into `dir`.
fn import(dir: &Path, model: &str, labels: Option<&Path>) -> String {
    let mut c = outpost();
    c.arg("--model-dir").arg(dir).args(["models", "import"]);
    c.arg(onnx_of(model))
        .args(["--name", &format!("{model}_imported")]);
    if let Some(l) = labels {
        c.arg("--labels").arg(l);
    }
    let o = run(&mut c);
    assert!(o.status.success(), "import {model}: {}", stderr(&o));
    stdout(&o)
}

fn inspect(dir: &Path, model: &str) -> Value {
    let o = run(outpost()
        .arg("--model-dir")
        .arg(dir)
        .args(["models", "inspect", model, "--json"]));
    assert!(o.status.success(), "inspect {model}: {}", stderr(&o));
    json(&o)
}

#[test]
fn imported_models_give_the_records_of_their_hand_written_manifests() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("models");
    std::fs::create_dir_all(&dir).unwrap();
    let labels = tmp.path().join("det_classes.txt");
    std::fs::write(&labels, DET_CLASSES).unwrap();
    // (model, --labels, photograph)
    let astronaut = model_dir().join("images/astronaut.png");
    let dog = std::path::PathBuf::from("/usr/share/darknet/data/dog.jpg");
    // The COCO names are not in its graph: the labels file, as a user gives it.
    let coco_labels = model_dir().join("coco_det/labels.txt");
    let cases: Vec<(&str, Option<&Path>, &Path)> = vec![
        ("det_yolov8", None, &astronaut),
        ("det_yolov5", None, &astronaut),
        ("det_yolox", Some(&labels), &astronaut),
        ("det_ssd", Some(&labels), &astronaut),
        ("det_detr", Some(&labels), &astronaut),
        ("det_rtdetr", Some(&labels), &astronaut),
        ("classifier", None, &astronaut),
        ("coco_det", Some(&coco_labels), &dog),
        ("ppocr_det", None, &astronaut),
        ("ppocr_cls", None, &astronaut),
        ("ppocr_rec", None, &astronaut),
        ("mtcnn_pnet", None, &astronaut),
    ];
    let mut config = format!(
        "data_dir = \"{{DATA}}\"\nmodel_dir = \"{}\"\n[api]\nlisten = \"{{API}}\"\n",
        dir.display()
    );
    for (model, l, _) in &cases {
        copy_dir(&model_dir().join(model), &dir.join(model));
        let said = import(&dir, model, *l);
        assert!(said.contains(&format!("{model}_imported@1.0.0")), "{said}");
        for m in [model.to_string(), format!("{model}_imported")] {
            config.push_str(&format!(
                "[[pipelines]]\nname = \"{m}\"\nmodel = \"{m}\"\nsource = {{ type = \"http\" }}\n"
            ));
        }
    }
    // The daemon's model directory is the one with both folders of each model.
    let d = Daemon::start_full(
        &config,
        tempfile::tempdir().unwrap(),
        &[("OUTPOST_MODEL_DIR", dir.display().to_string())],
        true,
    );
    for (model, _, photo) in &cases {
        let body = std::fs::read(photo).unwrap();
        let outputs = |m: &str| -> Value {
            let (code, resp) = http(
                "POST",
                &d.api,
                &format!("/v1/pipelines/{m}/infer?stream=s"),
                &body,
            )
            .unwrap();
            assert_eq!(
                code,
                200,
                "{m}: {}\n{}",
                String::from_utf8_lossy(&resp),
                d.log()
            );
            let v: Value = serde_json::from_slice(&resp).unwrap();
            v["records"][0]["outputs"].clone()
        };
        let hand = outputs(model);
        let mut imported = outputs(&format!("{model}_imported"));
        if *model == "coco_det" {
            // The import's score threshold is 0.25, the hand-written
            // manifest's 0.3: the same boxes above 0.3.
            let kept: Vec<Value> = imported["detections"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["score"].as_f64().unwrap() >= 0.3)
                .cloned()
                .collect();
            assert!(
                kept.len() >= 3,
                "dog.jpg: a dog, a bicycle, a car: {imported}"
            );
            imported["detections"] = Value::Array(kept);
        }
        assert_eq!(hand, imported, "{model}: records differ");
    }
}

#[test]
fn imported_stage_and_audio_models_get_their_hand_written_processing() {
    let tmp = tempfile::tempdir().unwrap();
    for model in ["mtcnn_rnet", "mtcnn_onet", "silero_vad"] {
        let said = import(tmp.path(), model, None);
        assert!(said.contains("wrote"), "{said}");
        let hand = inspect(&model_dir(), model);
        let imported = inspect(tmp.path(), &format!("{model}_imported"));
        for key in ["preprocess", "postprocess", "state"] {
            assert_eq!(hand[key], imported[key], "{model}: {key}");
        }
        let fills = |v: &Value| -> Vec<Value> {
            v["inputs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["name"].clone())
                .collect()
        };
        assert_eq!(fills(&hand), fills(&imported), "{model}: inputs");
    }
}

#[test]
fn a_graph_import_cannot_recognise_is_refused_with_its_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let o = run(outpost()
        .arg("--model-dir")
        .arg(tmp.path())
        .args(["models", "import"])
        .arg(onnx_of("sensor_mlp")));
    assert_fails(&o, 2, "no single image input");
    assert!(
        std::fs::read_dir(tmp.path()).unwrap().next().is_none(),
        "a refused import wrote a folder"
    );
    // A file that is not a model at all.
    let junk = tmp.path().join("junk.onnx");
    std::fs::write(&junk, b"not a model").unwrap();
    let o = run(outpost()
        .arg("--model-dir")
        .arg(tmp.path())
        .args(["models", "import"])
        .arg(&junk));
    assert_fails(&o, 2, "not an ONNX model");
}
