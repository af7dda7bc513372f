//! What the pipeline's unit tests share: models on a fake engine (no ONNX
//! Runtime), a record sink that keeps what it is given, frames with reply
//! channels, and a stream hook that counts.

use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::Pipeline;
use crate::backend::fake::{Answer, FakeEngine};
use crate::backend::{ModelIo, Tensor};
use crate::model::manifest::Manifest;
use crate::model::registry::LoadedModel;
use crate::pipeline::hook::{DynStreamHook, FrameMeta, HookOutput, StreamEnd, StreamHook};
use crate::pipeline::{IdGen, PipelineConfig, RecordSink};
use crate::record::ResultRecord;
use crate::source::{Frame, FrameError, FrameErrorKind};

pub type Reply = tokio::sync::oneshot::Receiver<Result<Vec<ResultRecord>, FrameError>>;

/// Keeps what the pipeline stores; refuses records whose stream is `full`.
#[derive(Default)]
pub struct Sink(pub Mutex<Vec<ResultRecord>>);

impl RecordSink for Sink {
    fn store(&self, record: &ResultRecord, _json: &[u8]) -> Result<(), FrameError> {
        if record.stream == "full" {
            return Err(FrameError::new(FrameErrorKind::Unavailable, "outbox full"));
        }
        self.0.lock().push(record.clone());
        Ok(())
    }
}

impl Sink {
    pub fn records(&self) -> Vec<ResultRecord> {
        self.0.lock().clone()
    }
}

/// A 4-value sensor model: `x` [batch, 4] -> `y` [batch, 2].
pub const PLAIN: &str = r#"
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
pub const STATEFUL: &str = r#"
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

/// A model on the fake engine, and the batch size of each of its runs.
pub fn model(manifest: &str, answer: Answer) -> (Arc<LoadedModel>, Arc<Mutex<Vec<usize>>>) {
    let manifest: Manifest = toml::from_str(manifest).unwrap();
    let io = ModelIo {
        inputs: manifest.inputs.iter().map(|i| i.spec()).collect(),
        outputs: manifest.outputs.iter().map(|o| o.spec()).collect(),
    };
    let runs = Arc::new(Mutex::new(Vec::new()));
    let engine = FakeEngine {
        io,
        answer,
        runs: runs.clone(),
    };
    let model = Arc::new(LoadedModel::with_engine(manifest, Box::new(engine)).unwrap());
    (model, runs)
}

/// A pipeline `p` (http source) of `model` with `extra` config lines.
pub fn config(extra: &str) -> PipelineConfig {
    toml::from_str(&format!(
        "name = \"p\"\nmodel = \"fake\"\nsource = {{ type = \"http\" }}\n{extra}"
    ))
    .unwrap()
}

pub struct Rig {
    pub pipeline: Pipeline,
    pub sink: Arc<Sink>,
    pub runs: Arc<Mutex<Vec<usize>>>,
}

pub fn rig(manifest: &str, pipeline_extra: &str, answer: Answer) -> Rig {
    rig_with(manifest, pipeline_extra, answer, None)
}

pub fn rig_with(
    manifest: &str,
    pipeline_extra: &str,
    answer: Answer,
    hook: Option<Box<dyn DynStreamHook>>,
) -> Rig {
    let sink = Arc::new(Sink::default());
    let (pipeline, runs) = build(
        manifest,
        &config(pipeline_extra),
        answer,
        hook,
        sink.clone(),
        1,
    );
    Rig {
        pipeline,
        sink,
        runs,
    }
}

/// A pipeline of `cfg` on a fake model, storing into `sink`, for a pool of
/// `workers`; and the batch size of each run of its model.
pub fn build(
    manifest: &str,
    cfg: &PipelineConfig,
    answer: Answer,
    hook: Option<Box<dyn DynStreamHook>>,
    sink: Arc<dyn RecordSink>,
    workers: usize,
) -> (Pipeline, Arc<Mutex<Vec<usize>>>) {
    let (model, runs) = model(manifest, answer);
    let pipeline = Pipeline::build(
        cfg.clone(),
        model,
        std::path::Path::new("."),
        workers,
        sink,
        Arc::new(IdGen::new("gw".into(), 1)),
        hook,
    )
    .unwrap();
    (pipeline, runs)
}

pub fn input(inputs: &[(&str, &Tensor)], name: &str) -> ndarray::ArrayD<f32> {
    match inputs.iter().find(|(n, _)| *n == name).map(|(_, t)| *t) {
        Some(Tensor::F32(a)) => a.clone(),
        other => panic!("input {name}: {other:?}"),
    }
}

/// `y` = (sum of the row, first value) for each row of `x`.
pub fn sums() -> Answer {
    Box::new(|inputs| {
        let x = input(inputs, "x");
        let n = x.shape()[0];
        let mut y = ndarray::Array2::<f32>::zeros((n, 2));
        for (i, row) in x.outer_iter().enumerate() {
            y[[i, 0]] = row.sum();
            y[[i, 1]] = row.iter().next().copied().unwrap_or(0.0);
        }
        Ok(vec![("y".into(), Tensor::F32(y.into_dyn()))])
    })
}

/// `hN` = `h` + 1 and `y` = `hN` + the row's first value, for each row.
pub fn counter() -> Answer {
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

/// A frame of `payload` on `stream`, with a reply channel.
pub fn frame_of(stream: &str, payload: Vec<u8>) -> (Frame, Reply) {
    let mut f = Frame::new(stream, payload.into());
    let (tx, rx) = tokio::sync::oneshot::channel();
    f.reply = Some(tx);
    (f, rx)
}

/// A frame of four readings on `stream`, with a reply channel.
pub fn frame(stream: &str, v: [f32; 4]) -> (Frame, Reply) {
    frame_of(stream, serde_json::to_vec(&v).unwrap())
}

/// What a frame was answered with: its records, or the kind of its error.
pub fn answer(mut rx: Reply) -> Result<usize, FrameErrorKind> {
    match rx.try_recv() {
        Ok(Ok(recs)) => Ok(recs.len()),
        Ok(Err(e)) => Err(e.kind),
        Err(e) => panic!("frame not answered: {e}"),
    }
}

pub fn y_of(r: &ResultRecord) -> Vec<f64> {
    r.outputs["y"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

pub fn drops(p: &Pipeline) -> Vec<(&'static str, u64)> {
    p.stats.drops().into_iter().collect()
}

/// `[1, n]` f32 values as a `.npy` file (the `none` preprocessing's payload).
pub fn npy(values: &[f32]) -> Vec<u8> {
    let mut header = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'shape': (1, {}), }}",
        values.len()
    );
    // Magic (6) + version (2) + length (2) + header + newline, to 64 bytes.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    for v in values {
        out.extend(v.to_le_bytes());
    }
    out
}

/// What the counting hook was told, in order.
pub type Log = Arc<Mutex<Vec<String>>>;

/// The trivial stream hook: counts each stream's results, writes the count
/// into each (`n`), emits an event every `every` results, skips the
/// frame's own record when `events_only`, and says how many it counted
/// when the stream ends.
pub struct Counting {
    pub every: u64,
    pub events_only: bool,
    pub log: Log,
}

impl StreamHook for Counting {
    type State = u64;

    fn start(&self, meta: &FrameMeta<'_>) -> u64 {
        self.log
            .lock()
            .push(format!("start {} {:?}", meta.stream, meta.size));
        0
    }

    fn frame(&self, n: &mut u64, _meta: &FrameMeta<'_>, value: &mut Value) -> HookOutput {
        *n += 1;
        value["n"] = json!(*n);
        let events = if (*n).is_multiple_of(self.every) {
            vec![json!({"event": "every", "n": *n})]
        } else {
            Vec::new()
        };
        HookOutput {
            skip_record: self.events_only,
            events,
        }
    }

    fn end(&self, stream: &str, n: u64, why: StreamEnd) -> Vec<Value> {
        self.log.lock().push(format!("end {stream} {n} {why:?}"));
        vec![json!({"event": "end", "n": n, "why": format!("{why:?}")})]
    }
}

/// A counting hook and what it was told.
pub fn counting(every: u64, events_only: bool) -> (Box<dyn DynStreamHook>, Log) {
    let log: Log = Arc::default();
    (
        Box::new(Counting {
            every,
            events_only,
            log: log.clone(),
        }),
        log,
    )
}
