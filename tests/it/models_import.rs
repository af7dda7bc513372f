//! `outpost models import FILE.onnx`: every model the project fetches or
//! builds, imported from its bare .onnx file into a fresh model folder,
//! gives the records its hand-written manifest gives (the same photograph
//! through both, in one real daemon), or, for the stage and audio models,
//! the same pre- and postprocessing; a graph it cannot recognise is refused
//! with its reason and exit code 2. Hostile files (tests/helpers/hostile_model.py):
//! a declared size no one can allocate is refused before anything is
//! allocated (exit 4) and leaves nothing behind, and neither `check`,
//! `models list`, `run` nor a reload of a running daemon is brought down by
//! such a model folder; class names that would shift labels.txt, or that do
//! not match the model's classes, are refused; a detector with auxiliary
//! outputs is read through the one its layout fits.

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

/// Runs tests/helpers/hostile_model.py with `args`.
fn hostile(args: &[&str]) {
    let o = run(Command::new("python3")
        .arg(root().join("tests/helpers/hostile_model.py"))
        .args(args));
    assert!(
        o.status.success(),
        "hostile_model.py {args:?}: {}",
        stderr(&o)
    );
}

/// `outpost models import FILE ARGS` into the model directory `dir`.
fn import_file(dir: &Path, file: &Path, args: &[&str]) -> std::process::Output {
    run(outpost()
        .arg("--model-dir")
        .arg(dir)
        .args(["models", "import"])
        .arg(file)
        .args(args))
}

/// Every entry of a folder, hidden ones too.
fn entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_model_declaring_a_huge_state_is_refused_before_its_warm_up_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    let file = tmp.path().join("vad.onnx");
    let file_s = file.display().to_string();
    // silero's form, its state [2, D, 128]: 2^40 aborted the warm-up's
    // allocation, 2^62 overflowed (exit 101), 2 GiB went through.
    for (dims, said) in [
        (["2", "1099511627776", "128"], "1125899906842624 bytes"),
        (
            ["2", "4611686018427387904", "2"],
            "more bytes than 64 bits can count",
        ),
        (["2", "4194304", "64"], "2147483648 bytes"),
    ] {
        hostile(&["vad", &file_s, dims[0], dims[1], dims[2]]);
        let o = import_file(&models, &file, &[]);
        assert_fails(&o, 4, said);
        assert!(
            stderr(&o).contains("input `state` f32"),
            "{dims:?}: {}",
            stderr(&o)
        );
        assert!(
            entries(&models).is_empty(),
            "{dims:?}: a refused import left {:?}",
            entries(&models)
        );
    }
    // The same form with a state of a sane size imports.
    hostile(&["vad", &file_s, "2", "1", "128"]);
    let o = import_file(&models, &file, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(entries(&models), ["vad"], "only the model's folder");
}

/// A model folder whose state declares [2, 2^40, 128], as an import that
/// never checked the sizes left it, and a config naming it.
fn hostile_folder(tmp: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let models = tmp.join("models");
    let folder = models.join("hostile");
    hostile(&[
        "vad",
        &folder.join("hostile.onnx").display().to_string(),
        "2",
        "1099511627776",
        "128",
        &folder.display().to_string(),
    ]);
    let cfg = tmp.join("outpost.toml");
    std::fs::write(
        &cfg,
        format!(
            "data_dir = \"{}\"\nmodel_dir = \"{}\"\n[api]\nlisten = \"127.0.0.1:0\"\n\
             [[pipelines]]\nname = \"voice\"\nmodel = \"hostile\"\nsource = {{ type = \"http\" }}\n",
            tmp.join("data").display(),
            models.display()
        ),
    )
    .unwrap();
    (models, cfg)
}

#[test]
fn check_list_and_run_report_a_model_folder_declaring_a_huge_state_instead_of_aborting() {
    let tmp = tempfile::tempdir().unwrap();
    let (models, cfg) = hostile_folder(tmp.path());
    let limit = "over the 268435456 bytes (256 MiB)";
    // `check` said ok (exit 0), and `run` of the same config aborted.
    let o = run(outpost()
        .arg("--model-dir")
        .arg(&models)
        .arg("check")
        .arg(&cfg));
    assert_fails(&o, 2, limit);
    assert!(stderr(&o).contains("model `hostile`: "), "{}", stderr(&o));
    // `models list` aborted: now the model is listed as refused.
    let o = run(outpost()
        .arg("--model-dir")
        .arg(&models)
        .args(["models", "list"]));
    assert_fails(&o, 1, "no model in");
    assert!(
        stdout(&o).contains("refused: ") && stdout(&o).contains(limit),
        "{}",
        stdout(&o)
    );
    let o = run(outpost()
        .arg("--model-dir")
        .arg(&models)
        .args(["models", "list", "--json"]));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["errors"][0].as_str().unwrap().contains(limit), "{v}");
    // `run`: the model is refused with its reason, no abort.
    let o = run(outpost()
        .arg("--model-dir")
        .arg(&models)
        .arg("--config")
        .arg(&cfg)
        .arg("run"));
    assert!(
        o.status.code().is_some(),
        "killed by a signal: {}",
        stderr(&o)
    );
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains(limit), "{}", stderr(&o));
}

/// The value of a metric row in OpenMetrics text.
fn metric(text: &str, row: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(row)?.strip_prefix(' ')?.parse().ok())
}

#[test]
fn a_reload_to_a_config_naming_a_model_declaring_a_huge_state_keeps_the_old_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let (models, _) = hostile_folder(tmp.path());
    let o = run(Command::new("python3")
        .arg(root().join("tests/helpers/box_model.py"))
        .arg(&models)
        .arg("1"));
    assert!(o.status.success(), "box_model.py: {}", stderr(&o));
    let good = "data_dir = \"{DATA}\"\n[api]\nlisten = \"{API}\"\n\
                [[pipelines]]\nname = \"gate\"\nmodel = \"boxes\"\nsource = { type = \"http\" }\n";
    let mut d = Daemon::start_full(
        good,
        tempfile::tempdir().unwrap(),
        &[("OUTPOST_MODEL_DIR", models.display().to_string())],
        true,
    );
    let frame = b"[[1, 2, 30, 40, 0.9, 0]]";
    let post = |d: &Daemon| {
        http("POST", &d.api, "/v1/pipelines/gate/infer?stream=s", frame)
            .unwrap()
            .0
    };
    assert_eq!(post(&d), 200);
    // A second pipeline naming the hostile model; then SIGHUP, which
    // aborted the daemon in the warm-up's allocation.
    let cfg = d.dir.path().join("outpost.toml");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str(
        "[[pipelines]]\nname = \"voice\"\nmodel = \"hostile\"\nsource = { type = \"http\" }\n",
    );
    std::fs::write(&cfg, text).unwrap();
    let _ = Command::new("kill")
        .arg("-HUP")
        .arg(d.child.id().to_string())
        .status();
    let t0 = std::time::Instant::now();
    while !d.log().contains("reload failed") {
        if let Ok(Some(st)) = d.child.try_wait() {
            panic!("the daemon died on the reload ({st}):\n{}", d.log());
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "no refusal logged:\n{}",
            d.log()
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        d.log().contains("over the 268435456 bytes"),
        "the reason is logged:\n{}",
        d.log()
    );
    // The old generation serves on: its one pipeline, its records.
    assert_eq!(post(&d), 200);
    let st = d.status();
    let names: Vec<&str> = st["pipelines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["gate"], "{st}");
    let (code, body) = http("GET", &d.api, "/metrics", b"").unwrap();
    assert_eq!(code, 200);
    let text = String::from_utf8_lossy(&body);
    assert_eq!(
        metric(&text, "outpost_reloads_total{result=\"refused\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "outpost_reloads_total{result=\"applied\"}"),
        Some(0.0)
    );
    assert_eq!(metric(&text, "outpost_models_refused_total"), Some(1.0));
    let recs = d.records_until(std::time::Duration::from_secs(5), |r| r.len() >= 2);
    assert!(recs.iter().all(|r| r["model"] == "boxes@1.0.0"), "{recs:?}");
    assert_eq!(d.terminate().code(), Some(0));
}

#[test]
fn class_names_holding_a_line_break_are_refused_not_shifted_by_one() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let file = tmp.path().join("pets.onnx");
    let file_s = file.display().to_string();
    // A newline as such, and as Python's repr writes it (backslash, n).
    for names in [
        "{0: 'cat\ndog', 1: 'bird', 2: 'fish'}",
        "{0: 'cat\\ndog', 1: 'bird', 2: 'fish'}",
    ] {
        hostile(&["classifier", &file_s, "3", names]);
        let o = import_file(&models, &file, &[]);
        assert_fails(
            &o,
            2,
            "class 0's name \"cat\\ndog\" holds a control character",
        );
        assert!(entries(&models).is_empty(), "{:?}", entries(&models));
    }
    // A label of `--labels` with another control character.
    hostile(&["classifier", &file_s, "3", "{}"]);
    let labels = tmp.path().join("labels.txt");
    std::fs::write(&labels, "cat\nbi\x1b[2Krd\nfish\n").unwrap();
    let o = import_file(&models, &file, &["--labels", &labels.display().to_string()]);
    assert_fails(&o, 2, "--labels: class 1's name");
    // Quotes and escapes Python writes are read as the names they are.
    hostile(&[
        "classifier",
        &file_s,
        "3",
        r#"{0: "o'clock", 1: 'caf\xe9', 2: 'a\\b'}"#,
    ]);
    let o = import_file(&models, &file, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(models.join("pets/labels.txt")).unwrap(),
        "o'clock\ncafé\na\\b\n"
    );
}

#[test]
fn a_label_count_unlike_the_model_s_classes_is_refused_with_both_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let file = tmp.path().join("ten.onnx");
    let file_s = file.display().to_string();
    hostile(&["classifier", &file_s, "10", "{}"]);
    let labels = tmp.path().join("labels.txt");
    let million: String = (0..1_000_000).map(|i| format!("class{i}\n")).collect();
    std::fs::write(&labels, million).unwrap();
    let o = import_file(&models, &file, &["--labels", &labels.display().to_string()]);
    assert_fails(
        &o,
        2,
        "--labels has 1000000 class names, the model has 10 classes",
    );
    // The metadata's names are held to the same count.
    hostile(&["classifier", &file_s, "10", "{0: 'a', 1: 'b', 2: 'c'}"]);
    let o = import_file(&models, &file, &[]);
    assert_fails(&o, 2, "has 3 class names, the model has 10 classes");
    assert!(entries(&models).is_empty(), "{:?}", entries(&models));
}

#[test]
fn labels_that_are_not_text_are_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    let file = tmp.path().join("three.onnx");
    hostile(&["classifier", &file.display().to_string(), "3", "{}"]);
    let junk = tmp.path().join("junk.bin");
    std::fs::write(
        &junk,
        [0x7f, b'E', b'L', b'F', 0xff, 0xfe, 0, 0, 0x80, 0x81],
    )
    .unwrap();
    let o = import_file(&models, &file, &["--labels", &junk.display().to_string()]);
    assert_fails(&o, 2, "not UTF-8 text (byte 4)");
    let o = import_file(&models, &file, &["--labels", "/nonexistent/labels.txt"]);
    assert_fails(&o, 2, "cannot read");
    assert!(entries(&models).is_empty(), "{:?}", entries(&models));
}

#[test]
fn a_detector_with_auxiliary_outputs_is_read_through_the_output_its_layout_fits() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("models");
    std::fs::create_dir_all(&dir).unwrap();
    // coco_det is a CenterNet converted with tf2onnx; its file keeps
    // `detections` only. With `wh` and `heatmap` beside it, as the
    // converter gives them:
    let file = tmp.path().join("centernet.onnx");
    hostile(&[
        "aux",
        &onnx_of("coco_det").display().to_string(),
        &file.display().to_string(),
    ]);
    let labels = model_dir().join("coco_det/labels.txt");
    let labels_s = labels.display().to_string();
    let o = import_file(&dir, &file, &["--labels", &labels_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    let said = stdout(&o);
    for line in [
        "output `detections` [1, 100, 6]: at most 100 finished detections",
        "output `wh` [1, 128, 128, 4]: 4-D",
        "output `heatmap` [1, 128, 128, 80]: 4-D",
    ] {
        assert!(said.contains(line), "`{line}` not in:\n{said}");
    }
    assert_eq!(said.matches("left out").count(), 2, "{said}");
    let imported = inspect(&dir, "centernet");
    assert_eq!(imported["postprocess"]["output"], "detections");
    assert_eq!(imported["postprocess"]["layout"], "rows");
    // `--output` naming an output no layout fits says why.
    let o = import_file(
        &dir,
        &file,
        &[
            "--labels", &labels_s, "--output", "heatmap", "--name", "other",
        ],
    );
    assert_fails(
        &o,
        2,
        "--output `heatmap`: output `heatmap` [1, 128, 128, 80]: 4-D",
    );
    // The same boxes as the hand-written manifest's, on a photograph.
    copy_dir(&model_dir().join("coco_det"), &dir.join("coco_det"));
    let mut config = "data_dir = \"{DATA}\"\n[api]\nlisten = \"{API}\"\n".to_string();
    for m in ["coco_det", "centernet"] {
        config.push_str(&format!(
            "[[pipelines]]\nname = \"{m}\"\nmodel = \"{m}\"\nsource = {{ type = \"http\" }}\n"
        ));
    }
    let d = Daemon::start_full(
        &config,
        tempfile::tempdir().unwrap(),
        &[("OUTPOST_MODEL_DIR", dir.display().to_string())],
        true,
    );
    let body = std::fs::read("/usr/share/darknet/data/dog.jpg").unwrap();
    let detections = |m: &str| -> Vec<Value> {
        let (code, resp) = http(
            "POST",
            &d.api,
            &format!("/v1/pipelines/{m}/infer?stream=s"),
            &body,
        )
        .unwrap();
        assert_eq!(code, 200, "{m}: {}", String::from_utf8_lossy(&resp));
        let v: Value = serde_json::from_slice(&resp).unwrap();
        v["records"][0]["outputs"]["detections"]
            .as_array()
            .unwrap()
            .iter()
            // The import's threshold is 0.25, the hand-written one's 0.3.
            .filter(|d| d["score"].as_f64().unwrap() >= 0.3)
            .cloned()
            .collect()
    };
    let hand = detections("coco_det");
    assert!(
        hand.len() >= 3,
        "dog.jpg: a dog, a bicycle, a car: {hand:?}"
    );
    assert_eq!(hand, detections("centernet"));
}
