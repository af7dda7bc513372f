//! The GPU path on a machine without a GPU: the real GPU build of ONNX
//! Runtime (onnxruntime-gpu, `models/fetch --gpu`) is loaded, its CUDA and
//! TensorRT providers fail to register with ONNX Runtime's own reason, and
//! the model is served on the CPU with those reasons in `models inspect`,
//! `/v1/status` and the log. The I/O binding code that CUDA sessions use is
//! run here with host buffers and checked against plain runs.

use outpost::backend::binding::Placement;
use outpost::backend::ort::{Runtime, SessionOptions};
use outpost::backend::{DType, Provider, Tensor};
use outpost::model::registry::load_manifest;

use crate::common::*;

/// The GPU build `models/fetch --gpu` puts in place.
fn gpu_ort_lib() -> std::path::PathBuf {
    let p = root().join("models/lib/x86_64-nvidia/libonnxruntime.so");
    assert!(
        p.exists()
            && root()
                .join("models/lib/x86_64-nvidia/libonnxruntime_providers_cuda.so")
                .exists(),
        "{} (and its provider libraries) missing: run models/fetch --gpu",
        p.display()
    );
    p
}

fn assert_onnxruntime_reason(reason: &str, provider_lib: &str) {
    // ONNX Runtime's own words: it tried to load the provider library and
    // says which CUDA library the loader could not find.
    assert!(
        reason.contains("Failed to load library") && reason.contains(provider_lib),
        "reason: {reason}"
    );
    assert!(reason.contains(".so"), "reason names no library: {reason}");
}

#[test]
fn gpu_build_falls_back_to_cpu_with_onnxruntime_reasons() {
    let o = run(outpost().env("ORT_DYLIB_PATH", gpu_ort_lib()).args([
        "-v",
        "models",
        "inspect",
        "classifier",
        "--json",
        "--ep",
        "tensorrt,cuda,cpu",
    ]));
    let v = json(&o);
    assert_eq!(v["provider"], "cpu", "{v}");
    assert!(
        v["runtime"]["path"]
            .as_str()
            .unwrap()
            .contains("x86_64-nvidia"),
        "{v}"
    );
    let fb = v["fallbacks"].as_array().unwrap();
    assert_eq!(fb.len(), 2, "{v}");
    assert_eq!(fb[0]["provider"], "tensorrt");
    assert_onnxruntime_reason(
        fb[0]["reason"].as_str().unwrap(),
        "libonnxruntime_providers_tensorrt.so",
    );
    assert_eq!(fb[1]["provider"], "cuda");
    assert_onnxruntime_reason(
        fb[1]["reason"].as_str().unwrap(),
        "libonnxruntime_providers_cuda.so",
    );
    let log = stderr(&o);
    assert!(
        log.contains("execution provider failed to register")
            && log.contains("libonnxruntime_providers_cuda.so"),
        "log:\n{log}"
    );
}

#[test]
fn gpu_build_fallback_reasons_in_status_and_log() {
    let config = format!(
        r#"{}
[runtime]
providers = ["cuda", "cpu"]
[runtime.cuda]
cuda_graph = true
"#,
        sensors_over_http("")
    );
    let mut d = Daemon::start_full(
        &config,
        tempfile::tempdir().unwrap(),
        &[("ORT_DYLIB_PATH", gpu_ort_lib().display().to_string())],
        true,
    );
    let st = d.status();
    let p = &st["pipelines"][0];
    assert_eq!(p["provider"], "cpu", "{st}");
    assert_eq!(p["provider_fallbacks"][0]["provider"], "cuda", "{st}");
    assert_onnxruntime_reason(
        p["provider_fallbacks"][0]["reason"].as_str().unwrap(),
        "libonnxruntime_providers_cuda.so",
    );
    let log = d.log();
    assert!(
        log.contains("execution provider failed to register")
            && log.contains("libonnxruntime_providers_cuda.so"),
        "log:\n{log}"
    );
    d.terminate();
}

fn outputs_close(a: &[(String, Tensor)], b: &[(String, Tensor)]) {
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(b) {
        assert_eq!(na, nb);
        assert_eq!(ta.shape(), tb.shape(), "{na}");
        // Same runtime, same kernels, same inputs: the bound run gives the same numbers.
        assert_eq!(ta.to_f64_vec(), tb.to_f64_vec(), "{na}");
    }
}

#[test]
fn bound_runs_match_plain_runs_and_allocate_once_per_shape() {
    let rt = Runtime::load(Some(&ort_lib())).unwrap();
    let opts = SessionOptions {
        providers: vec![Provider::Cpu],
        ..Default::default()
    };
    let model = load_manifest(&rt, &model_dir().join("classifier/manifest.toml"), &opts).unwrap();
    let one = Tensor::pseudo_random(DType::F32, &[1, 3, 224, 224], 7);
    let one_b = Tensor::pseudo_random(DType::F32, &[1, 3, 224, 224], 8);
    let two = Tensor::pseudo_random(DType::F32, &[2, 3, 224, 224], 9);
    let plain: Vec<_> = [&one, &one_b, &two]
        .iter()
        .map(|t| {
            model
                .with_session(|s| s.run_prechecked(&[("input", t)]).unwrap())
                .unwrap()
        })
        .collect();
    model.with_session(|s| {
        s.bind_buffers(Placement::Cpu);
        assert_eq!(s.binding_mode(), Some((Placement::Cpu, false)));
        let first = s.run_prechecked(&[("input", &one)]).unwrap();
        outputs_close(&first, &plain[0]);
        let after_first = s.binding().unwrap().unwrap().allocations;
        assert!(
            after_first >= 2,
            "an input and an output buffer: {after_first}"
        );
        // Same shape, new data: no allocation, new result.
        for _ in 0..3 {
            let again = s.run_prechecked(&[("input", &one_b)]).unwrap();
            outputs_close(&again, &plain[1]);
        }
        assert_eq!(s.binding().unwrap().unwrap().allocations, after_first);
        // A new shape gets buffers of its own, once.
        let batch2 = s.run_prechecked(&[("input", &two)]).unwrap();
        outputs_close(&batch2, &plain[2]);
        let after_two = s.binding().unwrap().unwrap().allocations;
        assert!(after_two > after_first);
        let batch2 = s.run_prechecked(&[("input", &two)]).unwrap();
        outputs_close(&batch2, &plain[2]);
        assert_eq!(s.binding().unwrap().unwrap().allocations, after_two);
    });
}

#[test]
fn bench_runs_the_bound_path() {
    let v = json(&run(outpost().args([
        "bench",
        "--model",
        "silero_vad",
        "--iterations",
        "20",
        "--warmup",
        "2",
        "--io-binding",
        "--json",
    ])));
    assert_eq!(v["provider"], "cpu");
    assert_eq!(v["io_binding"]["placement"], "cpu");
    // input, state, sr and two outputs: allocated once for 22 runs.
    assert_eq!(v["io_binding"]["allocations"], 5, "{v}");
}
