//! The model directory: one bad model is refused with an error naming its
//! file, the others still load.

use crate::common::*;

fn set_manifest(dir: &std::path::Path, f: impl FnOnce(String) -> String) {
    let p = dir.join("manifest.toml");
    let s = std::fs::read_to_string(&p).unwrap();
    std::fs::write(&p, f(s)).unwrap();
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

#[test]
fn bad_models_are_refused_and_the_rest_load() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    copy_model("sensor_mlp", dir);
    copy_model("silero_vad", dir);

    // Checksum mismatch: one byte of the model changed.
    let corrupt = copy_model("classifier", dir);
    let f = corrupt.join("classifier.onnx");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 10] ^= 0xFF;
    std::fs::write(&f, b).unwrap();

    // Not ONNX, with a manifest whose checksum matches (so the parse is what refuses it).
    let junk = dir.join("junk");
    std::fs::create_dir_all(&junk).unwrap();
    let bytes = b"GIF89a not a model".to_vec();
    std::fs::write(junk.join("junk.onnx"), &bytes).unwrap();
    let mlp_manifest = std::fs::read_to_string(dir.join("sensor_mlp/manifest.toml")).unwrap();
    let old_sha = mlp_manifest
        .lines()
        .find(|l| l.starts_with("sha256"))
        .unwrap()
        .to_string();
    std::fs::write(
        junk.join("manifest.toml"),
        mlp_manifest
            .replace("name = \"sensor_mlp\"", "name = \"junk\"")
            .replace("file = \"sensor_mlp.onnx\"", "file = \"junk.onnx\"")
            .replace(&old_sha, &format!("sha256 = \"{}\"", sha256_hex(&bytes))),
    )
    .unwrap();

    // A manifest that disagrees with the model's real inputs.
    let liar = dir.join("liar");
    std::fs::create_dir_all(&liar).unwrap();
    std::fs::copy(
        dir.join("sensor_mlp/sensor_mlp.onnx"),
        liar.join("sensor_mlp.onnx"),
    )
    .unwrap();
    std::fs::write(
        liar.join("manifest.toml"),
        mlp_manifest.replace("name = \"sensor_mlp\"", "name = \"liar\""),
    )
    .unwrap();
    set_manifest(&liar, |s| {
        s.replacen("shape = [\"batch\", 16]", "shape = [\"batch\", 32]", 1)
    });

    // Truncated file with a stale checksum.
    let trunc = copy_model("ppocr_cls", dir);
    let f = trunc.join("ch_ppocr_mobile_v2.0_cls_infer.onnx");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();

    let o = run(outpost()
        .args(["models", "list", "--json", "--model-dir"])
        .arg(dir));
    let v = json(&o);
    let names: Vec<&str> = v["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["sensor_mlp", "silero_vad"]);
    let errors: Vec<String> = v["errors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap().to_string())
        .collect();
    assert_eq!(errors.len(), 4, "{errors:#?}");
    let find = |needle: &str| {
        errors
            .iter()
            .find(|e| e.contains(needle))
            .unwrap_or_else(|| panic!("no error about {needle}: {errors:#?}"))
            .clone()
    };
    assert!(find("classifier.onnx").contains("sha256 is"));
    assert!(find("junk.onnx").contains("not an ONNX model"));
    assert!(find("liar").contains("manifest says shape [batch, 32], the model says [batch, 16]"));
    assert!(find("ch_ppocr_mobile_v2.0_cls_infer.onnx").contains("sha256 is"));
}

#[test]
fn models_list_loads_every_fetched_and_built_model() {
    let v = json(&run(outpost().args(["models", "list", "--json"])));
    let names: Vec<&str> = v["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "classifier",
            "coco_det",
            "det_batch",
            "det_detr",
            "det_rtdetr",
            "det_ssd",
            "det_yolov5",
            "det_yolov8",
            "det_yolox",
            "mtcnn_onet",
            "mtcnn_pnet",
            "mtcnn_rnet",
            "ppocr_cls",
            "ppocr_det",
            "ppocr_rec",
            "sensor_mlp",
            "silero_vad"
        ]
    );
    assert!(
        v["errors"].as_array().unwrap().is_empty(),
        "{}",
        v["errors"]
    );
    let classifier = v["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "classifier")
        .unwrap();
    let params = classifier["parameters"].as_u64().unwrap();
    assert!(
        (2_000_000..=6_000_000).contains(&params),
        "classifier has {params} parameters"
    );
    assert_eq!(classifier["opset"], 17);
}

#[test]
fn inspect_reports_io_opset_parameters_and_provider() {
    let v = json(&run(outpost().args([
        "models",
        "inspect",
        "silero_vad",
        "--json",
    ])));
    assert_eq!(v["id"], "silero_vad@6.2.3");
    assert_eq!(v["opset"], 16);
    assert!(v["parameters"].as_u64().unwrap() > 100_000);
    assert_eq!(v["provider"], "cpu");
    let inputs: Vec<&str> = v["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(inputs, ["input", "state", "sr"]);
    assert_eq!(v["inputs"][2]["dtype"], "i64");
    assert_eq!(v["state"][0]["input"], "state");
    assert_eq!(v["state"][0]["output"], "stateN");
    assert_eq!(v["runtime"]["version"], "1.31.1");
    let text = stdout(&run(outpost().args(["models", "inspect", "silero_vad"])));
    assert!(
        text.contains("provider    cpu") && text.contains("state       state <- stateN"),
        "{text}"
    );
}

#[test]
fn bench_prints_percentiles_throughput_and_provider() {
    let v = json(&run(outpost().args([
        "bench",
        "--model",
        "sensor_mlp",
        "--iterations",
        "200",
        "--warmup",
        "5",
        "--json",
        "--ep",
        "cpu",
    ])));
    for k in ["p50_us", "p90_us", "p99_us", "max_us", "throughput_per_s"] {
        assert!(v[k].as_f64().unwrap() > 0.0, "{k}: {v}");
    }
    assert!(
        v["p50_us"].as_f64() <= v["p99_us"].as_f64()
            && v["p99_us"].as_f64() <= v["max_us"].as_f64()
    );
    assert_eq!(v["provider"], "cpu");
    assert_eq!(v["iterations"], 200);
    // A batch of 4 on the batch axis, and a stateful model with its state fed back.
    let v = json(&run(outpost().args([
        "bench",
        "--model",
        "classifier",
        "--iterations",
        "3",
        "--warmup",
        "1",
        "--batch",
        "4",
        "--json",
    ])));
    assert_eq!(v["batch"], 4);
    let v = json(&run(outpost().args([
        "bench",
        "--model",
        "silero_vad",
        "--iterations",
        "50",
        "--json",
    ])));
    assert_eq!(v["provider"], "cpu");
    let o = run(outpost().args(["bench", "--model", "sensor_mlp", "--iterations", "0"]));
    assert_fails(&o, 1, "at least 1");
}
