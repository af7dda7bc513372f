//! Bad models and bad inputs: a clear error and a non-zero exit, never a panic.

use crate::common::*;

fn mlp_input(file: &str) -> String {
    format!(
        "input={}",
        model_dir().join("sensor_mlp").join(file).display()
    )
}

#[test]
fn wrong_shape_is_refused() {
    let o = run(outpost().args([
        "infer",
        "--model",
        "sensor_mlp",
        "--input",
        &mlp_input("bad/wrong_shape.npy"),
    ]));
    assert_fails(
        &o,
        5,
        "input `input`: the model expects shape [batch, 16], got [1, 15]",
    );
}

#[test]
fn wrong_dtype_is_refused() {
    let o = run(outpost().args([
        "infer",
        "--model",
        "sensor_mlp",
        "--input",
        &mlp_input("bad/wrong_dtype.npy"),
    ]));
    assert_fails(&o, 5, "input `input`: the model expects f32, got f64");
    let o = run(outpost().args([
        "infer",
        "--model",
        "sensor_mlp",
        "--input",
        &mlp_input("bad/i64.npy"),
    ]));
    assert_fails(&o, 5, "expects f32, got i64");
}

#[test]
fn missing_and_unknown_inputs_are_refused() {
    let o = run(outpost().args(["infer", "--model", "sensor_mlp"]));
    assert_fails(&o, 5, "missing input `input`");
    let silero_in = format!(
        "input={}",
        model_dir().join("silero_vad/ref/in/input.npy").display()
    );
    let o = run(outpost().args(["infer", "--model", "silero_vad", "--input", &silero_in]));
    assert_fails(&o, 5, "missing input `state`");
    let o = run(outpost()
        .args([
            "infer",
            "--model",
            "sensor_mlp",
            "--input",
            &mlp_input("ref/in/input.npy"),
        ])
        .arg("--input")
        .arg(format!(
            "extra={}",
            model_dir().join("sensor_mlp/ref/in/input.npy").display()
        )));
    assert_fails(&o, 5, "unknown input `extra`");
}

#[test]
fn unreadable_and_non_npy_input_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let o = run(outpost().args([
        "infer",
        "--model",
        "sensor_mlp",
        "--input",
        "input=/nonexistent/x.npy",
    ]));
    assert_fails(&o, 5, "/nonexistent/x.npy: cannot read");
    let junk = tmp.path().join("junk.npy");
    std::fs::write(&junk, b"this is not numpy").unwrap();
    let o = run(outpost()
        .args(["infer", "--model", "sensor_mlp", "--input"])
        .arg(format!("input={}", junk.display())));
    assert_fails(&o, 5, "not a NumPy .npy file");
    let o = run(outpost().args([
        "infer",
        "--model",
        "sensor_mlp",
        "--input",
        "no-equals-sign",
    ]));
    assert_eq!(o.status.code(), Some(2), "usage error");
}

#[test]
fn non_onnx_empty_and_truncated_model_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let input = mlp_input("ref/in/input.npy");
    let cases: [(&str, Vec<u8>, &str); 3] = [
        (
            "text.onnx",
            b"definitely not a protobuf model\n".to_vec(),
            "not an ONNX model",
        ),
        ("empty.onnx", Vec::new(), "empty file"),
        (
            "truncated.onnx",
            {
                let b = std::fs::read(model_file("classifier", "classifier.onnx")).unwrap();
                b[..b.len() / 3].to_vec()
            },
            "not an ONNX model",
        ),
    ];
    for (name, bytes, needle) in cases {
        let p = tmp.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        let o = run(outpost()
            .args(["infer", "--input", &input, "--model"])
            .arg(&p));
        assert_fails(&o, 4, needle);
        assert!(
            stderr(&o).contains(name),
            "error names the file: {}",
            stderr(&o)
        );
        let o = run(outpost().args(["models", "inspect"]).arg(&p));
        assert_fails(&o, 4, needle);
    }
}

#[test]
fn unknown_model_name_lists_the_available_ones() {
    let o = run(outpost().args(["models", "inspect", "no_such_model"]));
    assert_fails(&o, 4, "model `no_such_model` not found");
    assert!(stderr(&o).contains("silero_vad"), "{}", stderr(&o));
}

#[test]
fn a_config_with_several_mistakes_reports_them_all() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("outpost.toml");
    std::fs::write(
        &cfg,
        "device = \"${OUTPOST_TEST_UNSET_VAR}\"\n[runtime]\nproviders = [\"cuda\", \"cuda\"]\nintra_threads = 0\n",
    )
    .unwrap();
    // Interpolation problems come first (they make the text unparseable as intended).
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "OUTPOST_TEST_UNSET_VAR");
    let o = run(outpost()
        .env("OUTPOST_TEST_UNSET_VAR", "gw-1")
        .arg("check")
        .arg(&cfg));
    assert_fails(&o, 2, "2 problem(s)");
    assert!(
        stderr(&o).contains("listed twice") && stderr(&o).contains("intra_threads"),
        "{}",
        stderr(&o)
    );
    std::fs::write(&cfg, "[runtime]\nprovider = [\"cpu\"]\n").unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert_fails(&o, 2, "unknown key `provider`");
    std::fs::write(
        &cfg,
        "device = \"gw-1\"\n[runtime]\nproviders = [\"cpu\"]\n",
    )
    .unwrap();
    let o = run(outpost().arg("check").arg(&cfg));
    assert!(o.status.success(), "{}", stderr(&o));
}
