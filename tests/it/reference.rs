//! `outpost infer` against outputs computed by the Python onnxruntime
//! package on the same inputs (written by models/build).

use std::path::Path;

use outpost::backend::Tensor;

use crate::common::*;

const TOLERANCE: f64 = 1e-4;

/// The tensor name a reference file stands for: models/build replaces
/// characters unsafe in file names with '_'.
fn sanitize(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn npys(dir: &Path) -> Vec<(String, std::path::PathBuf)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e} (run models/build)", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "npy"))
        .map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    v.sort();
    v
}

fn check_reference(model: &str, refdir: &str) {
    let dir = model_dir().join(model).join(refdir);
    let inputs = npys(&dir.join("in"));
    let expected = npys(&dir.join("out"));
    assert!(
        !inputs.is_empty() && !expected.is_empty(),
        "no reference data in {}",
        dir.display()
    );
    let mut cmd = outpost();
    cmd.args(["infer", "--model", model, "--json", "--ep", "cpu"]);
    for (name, path) in &inputs {
        cmd.arg("--input").arg(format!("{name}={}", path.display()));
    }
    let v = json(&run(&mut cmd));
    assert_eq!(v["provider"], "cpu");
    let outputs = v["outputs"].as_object().expect("outputs object");
    assert_eq!(outputs.len(), expected.len(), "{model}: output count");
    for (real_name, out) in outputs {
        let (_, path) = expected
            .iter()
            .find(|(n, _)| *n == sanitize(real_name))
            .unwrap_or_else(|| panic!("{model}: no reference for output {real_name}"));
        let want = Tensor::read_npy(path).unwrap();
        let shape: Vec<usize> = serde_json::from_value(out["shape"].clone()).unwrap();
        assert_eq!(shape, want.shape(), "{model}/{real_name}: shape");
        let got: Vec<f64> = out["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let want = want.to_f64_vec();
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(
            worst <= TOLERANCE,
            "{model}/{real_name}: max abs diff {worst:e} > {TOLERANCE:e}"
        );
        assert!(
            want.iter().any(|x| *x != 0.0),
            "{model}/{real_name}: reference is all zeros, the test would prove nothing"
        );
    }
}

#[test]
fn silero_vad_matches_python_onnxruntime() {
    check_reference("silero_vad", "ref");
}

#[test]
fn ppocr_det_matches_python_onnxruntime() {
    check_reference("ppocr_det", "ref");
}

#[test]
fn ppocr_cls_matches_python_onnxruntime() {
    check_reference("ppocr_cls", "ref");
}

#[test]
fn classifier_matches_python_onnxruntime() {
    check_reference("classifier", "ref");
}

#[test]
fn classifier_batch4_matches_python_onnxruntime() {
    check_reference("classifier", "ref_batch4");
}

#[test]
fn sensor_mlp_matches_python_onnxruntime() {
    check_reference("sensor_mlp", "ref");
}

#[test]
fn infer_by_path_matches_infer_by_name() {
    let file = model_file("sensor_mlp", "sensor_mlp.onnx");
    let input = model_dir().join("sensor_mlp/ref/in/input.npy");
    let by_name = json(&run(outpost()
        .args(["infer", "--model", "sensor_mlp", "--json", "--input"])
        .arg(format!("input={}", input.display()))));
    let by_path = json(&run(outpost()
        .args(["infer", "--json", "--input"])
        .arg(format!("input={}", input.display()))
        .arg("--model")
        .arg(&file)));
    assert_eq!(by_name["outputs"], by_path["outputs"]);
    assert_eq!(
        by_path["model"], "sensor_mlp@1.0.0",
        "the manifest beside the file applies"
    );
}
