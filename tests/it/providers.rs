//! The CUDA and TensorRT providers go through the same selection as the CPU
//! one. On a machine without them (this ONNX Runtime build has none), their
//! registration fails cleanly and the cpu provider takes over, with the
//! reason logged.

use crate::common::*;

#[test]
fn gpu_providers_fall_back_to_cpu_with_reasons() {
    let o = run(outpost().args([
        "-v",
        "models",
        "inspect",
        "sensor_mlp",
        "--json",
        "--ep",
        "tensorrt,cuda,cpu",
    ]));
    let v = json(&o);
    assert_eq!(v["provider"], "cpu");
    let fb = v["fallbacks"].as_array().unwrap();
    let provs: Vec<&str> = fb.iter().map(|f| f["provider"].as_str().unwrap()).collect();
    assert_eq!(provs, ["tensorrt", "cuda"]);
    for f in fb {
        assert!(!f["reason"].as_str().unwrap().is_empty());
    }
    let log = stderr(&o);
    assert!(
        log.contains("falling back") && log.contains("tensorrt") && log.contains("cuda"),
        "log:\n{log}"
    );
}

#[test]
fn bench_and_infer_report_the_serving_provider() {
    let v = json(&run(outpost().args([
        "bench",
        "--model",
        "sensor_mlp",
        "--iterations",
        "10",
        "--json",
        "--ep",
        "cuda,cpu",
    ])));
    assert_eq!(v["provider"], "cpu");
    assert_eq!(v["fallbacks"][0]["provider"], "cuda");
}

#[test]
fn no_usable_provider_is_an_error() {
    let o = run(outpost().args(["models", "inspect", "sensor_mlp", "--ep", "tensorrt,cuda"]));
    assert_fails(&o, 4, "no provider in [tensorrt, cuda] could serve it");
}

#[test]
fn bad_provider_names_are_usage_errors() {
    let o = run(outpost().args(["models", "inspect", "sensor_mlp", "--ep", "tpu"]));
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("unknown execution provider `tpu`"));
}
