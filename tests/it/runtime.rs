//! Finding ONNX Runtime: a clear message and exit code 3 when it is missing
//! or too old, naming every place looked at and how to get one.

use std::process::Command;

use crate::common::*;

fn bare() -> Command {
    let mut c = outpost();
    c.env_remove("ORT_DYLIB_PATH")
        .env("LD_LIBRARY_PATH", "/nonexistent");
    c
}

#[test]
fn missing_runtime_lists_the_search_and_the_fix() {
    let o = run(bare().args(["models", "inspect", "sensor_mlp"]));
    // The system loader may find one on a machine where it is installed; then nothing to check.
    if o.status.success() {
        return;
    }
    assert_fails(&o, 3, "ONNX Runtime 1.31 or newer not found");
    let err = stderr(&o);
    assert!(
        err.contains("lib/ beside the binary") && err.contains("system library path"),
        "{err}"
    );
    assert!(err.contains("models/fetch"), "{err}");
}

#[test]
fn an_explicit_path_that_does_not_exist_is_an_error_not_skipped() {
    let o = run(outpost().args([
        "models",
        "inspect",
        "sensor_mlp",
        "--onnxruntime",
        "/nonexistent/libonnxruntime.so",
    ]));
    assert_fails(&o, 3, "/nonexistent/libonnxruntime.so");
    let o = run(outpost()
        .env("ORT_DYLIB_PATH", "/nonexistent/libort.so")
        .args(["models", "inspect", "sensor_mlp"]));
    assert_fails(&o, 3, "$ORT_DYLIB_PATH");
}

#[test]
fn a_library_older_than_the_api_is_refused_with_its_version() {
    // A stand-in library that exports OrtGetApiBase and reports version 1.20.0.
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("old.c");
    std::fs::write(
        &src,
        r#"
typedef struct { const void* (*GetApi)(unsigned); const char* (*GetVersionString)(void); } OrtApiBase;
static const void* get_api(unsigned v) { (void)v; return 0; }
static const char* version(void) { return "1.20.0"; }
static const OrtApiBase base = { get_api, version };
const OrtApiBase* OrtGetApiBase(void) { return &base; }
"#,
    )
    .unwrap();
    let lib = tmp.path().join("libonnxruntime.so");
    let cc = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .status()
        .expect("cc (gcc) is needed for this test");
    assert!(cc.success());
    let o = run(outpost()
        .env("ORT_DYLIB_PATH", &lib)
        .args(["models", "inspect", "sensor_mlp"]));
    assert_fails(&o, 3, "1.20.0");
    assert!(stderr(&o).contains("1.31"), "{}", stderr(&o));

    // The same library found beside the binary is refused, not skipped for the system one.
    let not_a_lib = tmp.path().join("not.so");
    std::fs::write(&not_a_lib, b"not an ELF file").unwrap();
    let o = run(outpost().arg("--onnxruntime").arg(&not_a_lib).args([
        "models",
        "inspect",
        "sensor_mlp",
    ]));
    assert_fails(&o, 3, "cannot be used");
}
