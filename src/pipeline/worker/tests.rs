//! The worker on a fake engine (no ONNX Runtime): every inference mode
//! (one run per item, micro-batches, state batched across streams), the
//! rule for outputs without a batch axis, each drop reason and an engine
//! error in the middle of a batch.

use std::sync::{Arc, Mutex};

use serde_json::Value;

use super::Pipeline;
use crate::backend::fake::{Answer, FakeEngine};
use crate::backend::{IoSpec, ModelIo, RunError, Tensor};
use crate::model::manifest::Manifest;
use crate::model::registry::LoadedModel;
use crate::pipeline::{IdGen, PipelineConfig, RecordSink};
use crate::record::ResultRecord;
use crate::source::{Frame, FrameError, FrameErrorKind};

/// Keeps what the pipeline stores; refuses records whose stream is `full`.
#[derive(Default)]
struct Sink(Mutex<Vec<ResultRecord>>);

impl RecordSink for Sink {
    fn store(&self, record: &ResultRecord, _json: &[u8]) -> Result<(), FrameError> {
        if record.stream == "full" {
            return Err(FrameError::new(FrameErrorKind::Unavailable, "outbox full"));
        }
        self.0.lock().unwrap().push(record.clone());
        Ok(())
    }
}

/// A 4-value sensor model: `x` [batch, 4] -> `y` [batch, 2] (plus what
/// `extra` declares), with the preprocessing and postprocessing the tests need.
const PLAIN: &str = r#"
name = "fake"
version = "1.0.0"
file = "fake.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", 4]
[[outputs]]
name = "y"
dtype = "f32"
shape = ["batch", 2]
[preprocess]
type = "sensor"
length = 4
[postprocess]
type = "raw"
"#;

/// A recurrent model: `x` [batch, 4] and state `h` [batch, 1] -> `y`
/// [batch, 1] and `hN` [batch, 1], fed back.
const STATEFUL: &str = r#"
name = "fake"
version = "1.0.0"
file = "fake.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", 4]
[[inputs]]
name = "h"
dtype = "f32"
shape = ["batch", 1]
[[outputs]]
name = "y"
dtype = "f32"
shape = ["batch", 1]
[[outputs]]
name = "hN"
dtype = "f32"
shape = ["batch", 1]
[[state]]
input = "h"
output = "hN"
[preprocess]
type = "sensor"
length = 4
[postprocess]
type = "raw"
"#;

struct Rig {
    pipeline: Pipeline,
    sink: Arc<Sink>,
    runs: Arc<Mutex<Vec<usize>>>,
}

fn rig(manifest: &str, pipeline_extra: &str, answer: Answer) -> Rig {
    let manifest: Manifest = toml::from_str(manifest).unwrap();
    let io = ModelIo {
        inputs: manifest
            .inputs
            .iter()
            .map(|i| i.spec())
            .collect::<Vec<IoSpec>>(),
        outputs: manifest.outputs.iter().map(|o| o.spec()).collect(),
    };
    let runs = Arc::new(Mutex::new(Vec::new()));
    let engine = FakeEngine {
        io,
        answer,
        runs: runs.clone(),
    };
    let model = Arc::new(LoadedModel::with_engine(manifest, Box::new(engine)).unwrap());
    let cfg: PipelineConfig = toml::from_str(&format!(
        "name = \"p\"\nmodel = \"fake\"\nsource = {{ type = \"http\" }}\n{pipeline_extra}"
    ))
    .unwrap();
    let sink = Arc::new(Sink::default());
    let pipeline = Pipeline::new(
        cfg,
        model,
        std::path::Path::new("."),
        1,
        sink.clone(),
        Arc::new(IdGen::new("gw".into(), 1)),
    )
    .unwrap();
    Rig {
        pipeline,
        sink,
        runs,
    }
}

fn input(inputs: &[(&str, &Tensor)], name: &str) -> ndarray::ArrayD<f32> {
    match inputs.iter().find(|(n, _)| *n == name).map(|(_, t)| *t) {
        Some(Tensor::F32(a)) => a.clone(),
        other => panic!("input {name}: {other:?}"),
    }
}

/// `y` = (sum of the row, first value) for each row of `x`.
fn sums() -> Answer {
    Box::new(|inputs| {
        let x = input(inputs, "x");
        let n = x.shape()[0];
        let mut y = ndarray::Array2::<f32>::zeros((n, 2));
        for (i, row) in x.outer_iter().enumerate() {
            y[[i, 0]] = row.sum();
            y[[i, 1]] = row[0];
        }
        Ok(vec![("y".into(), Tensor::F32(y.into_dyn()))])
    })
}

/// A frame of four readings on `stream`, with a reply channel.
fn frame(
    stream: &str,
    v: [f32; 4],
) -> (
    Frame,
    tokio::sync::oneshot::Receiver<Result<Vec<ResultRecord>, FrameError>>,
) {
    let mut f = Frame::new(stream, serde_json::to_vec(&v).unwrap().into());
    let (tx, rx) = tokio::sync::oneshot::channel();
    f.reply = Some(tx);
    (f, rx)
}

fn y_of(r: &ResultRecord) -> Vec<f64> {
    r.outputs["y"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

fn drops(p: &Pipeline) -> Vec<(&'static str, u64)> {
    p.stats.drops().into_iter().collect()
}

#[test]
fn one_run_per_item_when_not_batching() {
    let r = rig(PLAIN, "", sums());
    let (frames, replies): (Vec<_>, Vec<_>) = (0..3)
        .map(|i| frame("s", [i as f32, 1.0, 1.0, 1.0]))
        .unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(*r.runs.lock().unwrap(), vec![1, 1, 1]);
    let recs = r.sink.0.lock().unwrap().clone();
    assert_eq!(recs.len(), 3);
    for (i, rec) in recs.iter().enumerate() {
        assert_eq!(y_of(rec), vec![i as f64 + 3.0, i as f64]);
    }
    for mut rx in replies {
        assert_eq!(rx.try_recv().unwrap().unwrap().len(), 1);
    }
    assert_eq!(r.pipeline.stats.batch_sizes.summary().count, 3);
}

#[test]
fn a_micro_batch_runs_once_and_each_item_gets_its_own_row() {
    let r = rig(PLAIN, "max_batch = 4", sums());
    assert!(r.pipeline.batchable());
    let (frames, _replies): (Vec<_>, Vec<_>) = (0..6)
        .map(|i| frame(&format!("s{i}"), [i as f32, 0.0, 0.0, 0.0]))
        .unzip();
    r.pipeline.process(frames, 0);
    // Six items in runs of at most max_batch, in order.
    assert_eq!(*r.runs.lock().unwrap(), vec![4, 2]);
    let recs = r.sink.0.lock().unwrap().clone();
    let got: Vec<(String, Vec<f64>)> = recs.iter().map(|r| (r.stream.clone(), y_of(r))).collect();
    let want: Vec<(String, Vec<f64>)> = (0..6)
        .map(|i| (format!("s{i}"), vec![i as f64, i as f64]))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn an_output_without_a_batch_axis_is_the_same_for_every_item() {
    let answer: Answer = Box::new(|inputs| {
        let n = input(inputs, "x").shape()[0];
        Ok(vec![
            (
                "y".into(),
                Tensor::F32(ndarray::Array2::<f32>::ones((n, 2)).into_dyn()),
            ),
            // Not [batch, ...]: one value for the whole run.
            (
                "scale".into(),
                Tensor::F32(ndarray::arr1(&[7.0f32, 8.0, 9.0]).into_dyn()),
            ),
        ])
    });
    let manifest =
        format!("{PLAIN}\n[[outputs]]\nname = \"scale\"\ndtype = \"f32\"\nshape = [3]\n")
            .replace("[preprocess]", "[x_pre]");
    // The extra output goes before the tables that follow [[outputs]].
    let manifest = manifest.replace(
        "[x_pre]\ntype = \"sensor\"\nlength = 4\n[postprocess]\ntype = \"raw\"\n",
        "",
    ) + "[preprocess]\ntype = \"sensor\"\nlength = 4\n[postprocess]\ntype = \"raw\"\n";
    let r = rig(&manifest, "max_batch = 4", answer);
    let (frames, _): (Vec<_>, Vec<_>) = (0..3).map(|i| frame("s", [i as f32; 4])).unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(*r.runs.lock().unwrap(), vec![3]);
    let recs = r.sink.0.lock().unwrap().clone();
    assert_eq!(recs.len(), 3);
    for rec in &recs {
        assert_eq!(
            rec.outputs["scale"]["data"],
            serde_json::json!([7.0, 8.0, 9.0])
        );
        assert_eq!(rec.outputs["y"]["shape"], serde_json::json!([1, 2]));
    }
}

#[test]
fn an_engine_error_mid_batch_fails_that_batch_only() {
    let calls = Arc::new(Mutex::new(0));
    let c = calls.clone();
    let mut inner = sums();
    let answer: Answer = Box::new(move |inputs| {
        let mut n = c.lock().unwrap();
        *n += 1;
        if *n == 2 {
            return Err(RunError::Engine("device lost".into()));
        }
        inner(inputs)
    });
    let r = rig(PLAIN, "max_batch = 2", answer);
    let (frames, replies): (Vec<_>, Vec<_>) = (0..6).map(|i| frame("s", [i as f32; 4])).unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(*r.runs.lock().unwrap(), vec![2, 2, 2]);
    let outcomes: Vec<Option<FrameErrorKind>> = replies
        .into_iter()
        .map(|mut rx| rx.try_recv().unwrap().err().map(|e| e.kind))
        .collect();
    let e = Some(FrameErrorKind::Engine);
    assert_eq!(outcomes, vec![None, None, e, e, None, None]);
    assert_eq!(r.sink.0.lock().unwrap().len(), 4);
    assert_eq!(drops(&r.pipeline), vec![("inference_error", 2)]);
}

#[test]
fn each_drop_reason_is_counted_and_answered() {
    let answer: Answer = Box::new(|inputs| {
        let x = input(inputs, "x");
        if x[[0, 0]] < 0.0 {
            // A model that answers without its declared output.
            return Ok(vec![]);
        }
        sums()(inputs)
    });
    let r = rig(PLAIN, "", answer);
    let (bad_size, rx1) = {
        let mut f = Frame::new("s", b"[1, 2, 3]".to_vec().into());
        let (tx, rx) = tokio::sync::oneshot::channel();
        f.reply = Some(tx);
        (f, rx)
    };
    let (full, rx2) = frame("full", [1.0; 4]);
    let (good, rx3) = frame("s", [1.0; 4]);
    r.pipeline.process(vec![bad_size, full, good], 0);
    let kind = |mut rx: tokio::sync::oneshot::Receiver<Result<Vec<ResultRecord>, FrameError>>| {
        rx.try_recv().unwrap().err().map(|e| e.kind)
    };
    assert_eq!(kind(rx1), Some(FrameErrorKind::Malformed));
    assert_eq!(kind(rx2), Some(FrameErrorKind::Unavailable));
    assert_eq!(kind(rx3), None);
    let d = drops(&r.pipeline);
    assert!(d.contains(&("store_error", 1)), "{d:?}");
    assert_eq!(d.iter().map(|(_, n)| n).sum::<u64>(), 2, "{d:?}");
    assert_eq!(r.sink.0.lock().unwrap().len(), 1);
}

/// `hN` = `h` + 1 and `y` = `hN` + the row's first value, for each row.
fn counter() -> Answer {
    Box::new(|inputs| {
        let x = input(inputs, "x");
        let h = input(inputs, "h");
        let n = x.shape()[0];
        let mut hn = ndarray::Array2::<f32>::zeros((n, 1));
        let mut y = ndarray::Array2::<f32>::zeros((n, 1));
        for i in 0..n {
            hn[[i, 0]] = h[[i, 0]] + 1.0;
            y[[i, 0]] = hn[[i, 0]] + x[[i, 0]];
        }
        Ok(vec![
            ("y".into(), Tensor::F32(y.into_dyn())),
            ("hN".into(), Tensor::F32(hn.into_dyn())),
        ])
    })
}

#[test]
fn state_is_kept_per_stream_one_run_at_a_time() {
    let r = rig(STATEFUL, "", counter());
    assert!(r.pipeline.serial());
    let (frames, _): (Vec<_>, Vec<_>) = [("a", 0.0), ("a", 0.0), ("b", 10.0), ("a", 0.0)]
        .into_iter()
        .map(|(s, v)| frame(s, [v; 4]))
        .unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(*r.runs.lock().unwrap(), vec![1, 1, 1, 1]);
    let got: Vec<(String, Vec<f64>)> = r
        .sink
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|r| (r.stream.clone(), y_of(r)))
        .collect();
    // a counts 1, 2, 3; b starts at zeros of its own.
    let want = vec![
        ("a".to_string(), vec![1.0]),
        ("a".to_string(), vec![2.0]),
        ("b".to_string(), vec![11.0]),
        ("a".to_string(), vec![3.0]),
    ];
    assert_eq!(got, want);
}

#[test]
fn state_batched_across_streams_never_puts_one_stream_twice_in_a_run() {
    let r = rig(STATEFUL, "max_batch = 8", counter());
    assert!(r.pipeline.batchable());
    let order = [
        ("a", 0.0),
        ("a", 0.0),
        ("b", 10.0),
        ("c", 20.0),
        ("a", 0.0),
        ("b", 10.0),
    ];
    let (frames, _): (Vec<_>, Vec<_>) = order.into_iter().map(|(s, v)| frame(s, [v; 4])).unzip();
    r.pipeline.process(frames, 0);
    // Run k takes the k-th item of each stream: [a b c], [a b], [a].
    assert_eq!(*r.runs.lock().unwrap(), vec![3, 2, 1]);
    let got: Vec<(String, Vec<f64>)> = r
        .sink
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|r| (r.stream.clone(), y_of(r)))
        .collect();
    // Records in the frames' order, each stream's state carried over.
    let want: Vec<(String, Vec<f64>)> = vec![
        ("a".into(), vec![1.0]),
        ("a".into(), vec![2.0]),
        ("b".into(), vec![11.0]),
        ("c".into(), vec![21.0]),
        ("a".into(), vec![3.0]),
        ("b".into(), vec![12.0]),
    ];
    assert_eq!(got, want);
}

#[test]
fn a_failed_stateful_run_leaves_the_streams_state_as_it_was() {
    let fail = Arc::new(Mutex::new(false));
    let f = fail.clone();
    let mut inner = counter();
    let answer: Answer = Box::new(move |inputs| {
        if *f.lock().unwrap() {
            return Err(RunError::Engine("transient".into()));
        }
        inner(inputs)
    });
    let r = rig(STATEFUL, "", answer);
    r.pipeline.process(vec![frame("a", [0.0; 4]).0], 0);
    *fail.lock().unwrap() = true;
    r.pipeline.process(vec![frame("a", [0.0; 4]).0], 0);
    *fail.lock().unwrap() = false;
    r.pipeline.process(vec![frame("a", [0.0; 4]).0], 0);
    let ys: Vec<Vec<f64>> = r.sink.0.lock().unwrap().iter().map(y_of).collect();
    assert_eq!(ys, vec![vec![1.0], vec![2.0]]);
    assert_eq!(drops(&r.pipeline), vec![("inference_error", 1)]);
}

#[test]
fn records_carry_the_model_and_sequence() {
    let r = rig(PLAIN, "", sums());
    r.pipeline.process(vec![frame("s", [1.0; 4]).0], 0);
    let rec = r.sink.0.lock().unwrap()[0].clone();
    assert_eq!(
        (rec.id.as_str(), rec.model.as_str(), rec.ep.as_str()),
        ("gw/1/1", "fake@1.0.0", "cpu")
    );
    assert!(matches!(rec.outputs, Value::Object(_)));
}
