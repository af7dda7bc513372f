//! Paths and helpers shared by the integration tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn model_dir() -> PathBuf {
    root().join("models")
}

/// The ONNX Runtime library `models/fetch` puts in place for this machine.
pub fn ort_lib() -> PathBuf {
    let arch = std::env::consts::ARCH;
    let p = root()
        .join("models/lib")
        .join(arch)
        .join("libonnxruntime.so");
    assert!(
        p.exists(),
        "{} missing: run models/fetch && models/build first",
        p.display()
    );
    p
}

/// The model file of a model folder, checked present.
pub fn model_file(name: &str, file: &str) -> PathBuf {
    let p = model_dir().join(name).join(file);
    assert!(
        p.exists(),
        "{} missing: run models/fetch && models/build first",
        p.display()
    );
    p
}

/// `outpost` with the fetched runtime and the checkout's model dir.
pub fn outpost() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_outpost"));
    c.env("ORT_DYLIB_PATH", ort_lib())
        .env("OUTPOST_MODEL_DIR", model_dir())
        .env_remove("OUTPOST_CONFIG")
        .env_remove("RUST_LOG")
        .current_dir(root());
    c
}

pub fn run(c: &mut Command) -> Output {
    c.output().expect("spawn outpost")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean failure: the exit code, a message, and no panic.
pub fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "exit status; stderr:\n{err}\nstdout:\n{}",
        stdout(o)
    );
    assert!(err.contains(needle), "stderr lacks `{needle}`:\n{err}");
    assert!(!err.contains("panicked"), "panic:\n{err}");
}

pub fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "outpost failed: {}\n{}",
        o.status,
        stderr(o)
    );
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", stdout(o)))
}

/// Copies a model folder (manifest and model file) into `dst/<name>`.
pub fn copy_model(name: &str, dst: &Path) -> PathBuf {
    let src = model_dir().join(name);
    let to = dst.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        if e.path().is_file() {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
    to
}
