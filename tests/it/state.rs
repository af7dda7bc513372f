//! Stateful models keep their state per stream (silero VAD: `stateN` -> `state`).

use outpost::backend::Provider;
use outpost::backend::Tensor;
use outpost::backend::ort::{Runtime, SessionOptions};
use outpost::model::registry::load_manifest;
use outpost::model::state::StreamStates;

use crate::common::*;

fn chunk(freq: f32, phase: usize) -> Tensor {
    let v: Vec<f32> = (0..576)
        .map(|i| 0.3 * (2.0 * std::f32::consts::PI * freq * (i + phase) as f32 / 16000.0).sin())
        .collect();
    Tensor::F32(ndarray::ArrayD::from_shape_vec(ndarray::IxDyn(&[1, 576]), v).unwrap())
}

#[test]
fn state_is_kept_per_stream() {
    let rt = Runtime::load(Some(&ort_lib())).unwrap();
    let opts = SessionOptions {
        providers: vec![Provider::Cpu],
        ..Default::default()
    };
    let model = load_manifest(&rt, &model_dir().join("silero_vad/manifest.toml"), &opts).unwrap();
    let sr = Tensor::filled(outpost::backend::DType::I64, &[], 16000.0);
    let (a1, a2) = (chunk(440.0, 0), chunk(440.0, 512));

    let mut states = StreamStates::new();
    let out = |v: Vec<(String, Tensor)>| {
        assert_eq!(v.len(), 1, "state outputs are kept, not returned");
        v[0].1.to_f64_vec()[0]
    };
    let first_a = out(states
        .run(&model, "mic-a", &[("input", &a1), ("sr", &sr)])
        .unwrap());
    let second_a = out(states
        .run(&model, "mic-a", &[("input", &a2), ("sr", &sr)])
        .unwrap());
    // A new stream starts from zeros: its first chunk scores like mic-a's first.
    let first_b = out(states
        .run(&model, "mic-b", &[("input", &a1), ("sr", &sr)])
        .unwrap());
    assert_eq!(first_a, first_b);
    assert_eq!(states.streams(), 2);

    // mic-a's second call used mic-a's state: it differs from the same chunk on a fresh stream.
    let fresh = out(states
        .run(&model, "fresh", &[("input", &a2), ("sr", &sr)])
        .unwrap());
    assert_ne!(second_a, fresh, "state was not carried over");

    // A bad frame does not touch the stream's state.
    let bad = Tensor::filled(outpost::backend::DType::F32, &[1, 100], 0.0);
    let mut copy = StreamStates::new();
    copy.run(&model, "s", &[("input", &a1), ("sr", &sr)])
        .unwrap();
    assert!(
        copy.run(&model, "s", &[("input", &bad), ("sr", &sr)])
            .is_err()
    );
    let after_bad = out(copy
        .run(&model, "s", &[("input", &a2), ("sr", &sr)])
        .unwrap());
    assert_eq!(after_bad, second_a);

    // Reset starts the stream over.
    states.reset("mic-a");
    assert_eq!(
        out(states
            .run(&model, "mic-a", &[("input", &a1), ("sr", &sr)])
            .unwrap()),
        first_a
    );
}
