//! silero VAD, one 576-sample chunk (512 new + 64 context), 1 intra-op
//! thread: a bare `ort` session-run loop against outpost's bench loop on the
//! same model and inputs. The two should be within noise of each other: the
//! daemon adds no work per frame beyond what ONNX Runtime needs.
//!
//! Needs models/fetch (silero VAD, libonnxruntime) and ORT_DYLIB_PATH or the
//! default models/lib/<arch>/libonnxruntime.so.

// A failed unwrap here is a failed test or run, with its place.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use criterion::{Criterion, criterion_group, criterion_main};
use ndarray::{Array0, Array2, Array3};
use ort::session::Session;
use ort::value::Tensor as OrtTensor;
use outpost::backend::Provider;
use outpost::backend::ort::HotLoop;
use outpost::backend::ort::{Runtime, SessionOptions};
use outpost::model::registry::load_manifest;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn chunk() -> Array2<f32> {
    Array2::from_shape_fn((1, 576), |(_, i)| {
        0.3 * (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 16000.0).sin()
    })
}

fn bench(c: &mut Criterion) {
    let lib = std::env::var_os("ORT_DYLIB_PATH")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            root()
                .join("models/lib")
                .join(std::env::consts::ARCH)
                .join("libonnxruntime.so")
        });
    let rt = Runtime::load(Some(&lib)).expect("ONNX Runtime (run models/fetch)");
    let model_path = root().join("models/silero_vad/silero_vad.onnx");

    let mut g = c.benchmark_group("silero_vad_1thread");

    // Bare ort: the loop a user of the crate would write.
    let open = || -> ort::Result<Session> {
        Session::builder(rt.env())?
            .with_intra_threads(1)?
            .with_inter_threads(1)?
            .commit_from_file(&model_path)
    };
    let mut session = open().expect("silero session");
    let input = OrtTensor::from_array(chunk()).unwrap();
    let mut state = OrtTensor::from_array(Array3::<f32>::zeros((2, 1, 128))).unwrap();
    let sr = OrtTensor::from_array(Array0::from_elem((), 16000i64)).unwrap();
    g.bench_function("bare_ort", |b| {
        b.iter(|| {
            let out = session
                .run(ort::inputs!["input" => &input, "state" => &state, "sr" => &sr])
                .unwrap();
            let (_, new_state) = out["stateN"].try_extract_tensor::<f32>().unwrap();
            let new_state = new_state.to_vec();
            drop(out);
            state.extract_tensor_mut().1.copy_from_slice(&new_state);
        })
    });

    // outpost: the registry-loaded model and the loop `outpost bench` times.
    let opts = SessionOptions {
        providers: vec![Provider::Cpu],
        intra_threads: 1,
        ..Default::default()
    };
    let model = load_manifest(&rt, &root().join("models/silero_vad/manifest.toml"), &opts)
        .expect("silero manifest");
    let inputs = vec![
        (
            "input".to_string(),
            outpost::backend::Tensor::F32(chunk().into_dyn()),
        ),
        (
            "state".to_string(),
            outpost::backend::Tensor::F32(Array3::<f32>::zeros((2, 1, 128)).into_dyn()),
        ),
        (
            "sr".to_string(),
            outpost::backend::Tensor::I64(Array0::from_elem((), 16000i64).into_dyn()),
        ),
    ];
    model.with_session(|s| {
        let state: Vec<(&str, &str)> = model
            .manifest
            .state
            .iter()
            .map(|p| (p.input.as_str(), p.output.as_str()))
            .collect();
        let mut hot = HotLoop::new(s, &inputs, &state).unwrap();
        g.bench_function("outpost_bench_loop", |b| b.iter(|| hot.step(s).unwrap()));
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(50).measurement_time(std::time::Duration::from_secs(5));
    targets = bench
}
criterion_main!(benches);
