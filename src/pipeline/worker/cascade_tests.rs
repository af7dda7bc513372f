//! The cascade on a fake engine: a frame's boxes through a stage model,
//! thumbnails, a failing stage, a stage output without a batch axis, the
//! items of an image pyramid merged into one record, and a failing main
//! model, all through the one inference path.

use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::Pipeline;
use super::testkit::*;
use crate::backend::fake::Answer;
use crate::backend::{RunError, Tensor};
use crate::model::registry::LoadedModel;
use crate::pipeline::IdGen;
use crate::preprocess::raw::RawImage;
use crate::source::{Frame, FrameErrorKind};

/// A text detector: 16x16 images -> a probability map of the same size.
const DET: &str = r#"
name = "fake"
version = "1.0.0"
file = "det.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", 3, 16, 16]
[[outputs]]
name = "map"
dtype = "f32"
shape = ["batch", 1, 16, 16]
[preprocess]
type = "image"
width = 16
height = 16
[postprocess]
type = "text_boxes"
output = "map"
threshold = 0.5
box_threshold = 0.5
"#;

/// A crop classifier: 8x8 crops -> `p` (two values per crop).
const CLS: &str = r#"
name = "cls"
version = "1.0.0"
file = "cls.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", 3, 8, 8]
[[outputs]]
name = "p"
dtype = "f32"
shape = ["batch", 2]
[preprocess]
type = "image"
width = 8
height = 8
[postprocess]
type = "raw"
"#;

/// One block of text: map pixels rows 2..6, columns 2..14 (and, when
/// `two`, rows 10..14 too).
fn text_map(two: bool) -> Answer {
    Box::new(move |inputs| {
        let n = input(inputs, "x").shape()[0];
        let mut m = ndarray::Array4::<f32>::zeros((n, 1, 16, 16));
        for b in 0..n {
            for x in 2..14 {
                for y in 2..6 {
                    m[[b, 0, y, x]] = 0.9;
                }
                if two {
                    for y in 10..14 {
                        m[[b, 0, y, x]] = 0.9;
                    }
                }
            }
        }
        Ok(vec![("map".into(), Tensor::F32(m.into_dyn()))])
    })
}

/// `p` = (crop index in its run, 7) for each crop.
fn classify() -> Answer {
    Box::new(|inputs| {
        let n = input(inputs, "x").shape()[0];
        let p =
            ndarray::Array2::from_shape_fn((n, 2), |(i, j)| if j == 0 { i as f32 } else { 7.0 });
        Ok(vec![("p".into(), Tensor::F32(p.into_dyn()))])
    })
}

/// A 32x32 decoded RGB frame, as a camera hands it on.
fn picture(stream: &str) -> (Frame, Reply) {
    let (mut f, rx) = frame_of(stream, vec![128u8; 32 * 32 * 3]);
    f.raw = Some(RawImage::rgb(32, 32));
    (f, rx)
}

struct Cascade {
    pipeline: Pipeline,
    sink: Arc<Sink>,
    det_runs: Arc<Mutex<Vec<usize>>>,
}

fn cascade(det: (&str, Answer), stage: Option<(&str, Answer)>, extra: &str) -> Cascade {
    let (model, det_runs) = model(det.0, det.1);
    let mut stages: Vec<Arc<LoadedModel>> = Vec::new();
    let mut cfg = extra.to_string();
    if let Some((manifest, answer)) = stage {
        stages.push(super::testkit::model(manifest, answer).0);
        cfg.push_str("\n[[stages]]\nmodel = \"cls\"\n");
    }
    let sink = Arc::new(Sink::default());
    let pipeline = Pipeline::build(
        config(&cfg),
        model,
        std::path::Path::new("."),
        2,
        sink.clone(),
        Arc::new(IdGen::new("gw".into(), 1)),
        None,
    )
    .and_then(|p| p.with_stages(&stages))
    .unwrap();
    Cascade {
        pipeline,
        sink,
        det_runs,
    }
}

fn boxes(v: &Value) -> Vec<Value> {
    v["boxes"].as_array().cloned().unwrap_or_default()
}

#[test]
fn each_box_gets_its_stage_result_and_a_thumbnail() {
    let c = cascade(
        (DET, text_map(true)),
        Some((CLS, classify())),
        "max_batch = 8\nthumbnails = { max_bytes = 2000 }",
    );
    assert!(c.pipeline.mode().cascade && !c.pipeline.batchable());
    let (f, rx) = picture("cam");
    c.pipeline.process(vec![f], 0);
    assert_eq!(answer(rx), Ok(1));
    assert_eq!(*c.det_runs.lock(), vec![1]);
    let recs = c.sink.records();
    let b = boxes(&recs[0].outputs);
    assert_eq!(b.len(), 2, "{}", recs[0].outputs);
    for x in &b {
        assert_eq!(x["p"]["data"][1], json!(7.0), "{x}");
        assert!(x["thumbnail"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(x.get("crop").is_none(), "crops are for the stages only");
    }
    // Both crops went through the stage in one run.
    let mut firsts: Vec<f64> = b
        .iter()
        .map(|x| x["p"]["data"][0].as_f64().unwrap())
        .collect();
    firsts.sort_by(f64::total_cmp);
    assert_eq!(firsts, vec![0.0, 1.0]);
    let stages = c.pipeline.stage_stats();
    assert_eq!(stages[0].0, "cls@1.0.0");
    assert_eq!(
        stages[0].1.crops.load(std::sync::atomic::Ordering::Relaxed),
        2
    );
    assert!(c.pipeline.stats.drops().is_empty());
}

#[test]
fn a_failing_stage_marks_the_record_and_is_counted() {
    let fail: Answer = Box::new(|_| Err(RunError::Engine("stage down".into())));
    let c = cascade((DET, text_map(false)), Some((CLS, fail)), "");
    for _ in 0..2 {
        let (f, rx) = picture("cam");
        c.pipeline.process(vec![f], 0);
        assert_eq!(answer(rx), Ok(1), "the record is still made");
    }
    let recs = c.sink.records();
    let out = &recs[1].outputs;
    assert!(
        out["stage_error"]
            .as_str()
            .is_some_and(|e| e.contains("cls@1.0.0") && e.contains("stage down")),
        "{out}"
    );
    assert_eq!(boxes(out).len(), 1, "the boxes as the detector gave them");
    assert!(boxes(out)[0].get("p").is_none());
    assert_eq!(drops(&c.pipeline), vec![("stage_error", 2)]);
    let stages = c.pipeline.stage_stats();
    assert_eq!(
        stages[0]
            .1
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

#[test]
fn a_stage_output_without_a_batch_axis_is_the_same_for_every_crop() {
    // The one rule of the worker, in the stages too: `scale` [3] is given
    // whole to each crop.
    let manifest = CLS.replace(
        "[preprocess]",
        "[[outputs]]\nname = \"scale\"\ndtype = \"f32\"\nshape = [3]\n[preprocess]",
    );
    let mut inner = classify();
    let answer_fn: Answer = Box::new(move |inputs| {
        let mut out = inner(inputs)?;
        out.push((
            "scale".into(),
            Tensor::F32(ndarray::arr1(&[1.0f32, 2.0, 3.0]).into_dyn()),
        ));
        Ok(out)
    });
    let c = cascade((DET, text_map(true)), Some((&manifest, answer_fn)), "");
    let (f, rx) = picture("cam");
    c.pipeline.process(vec![f], 0);
    assert_eq!(answer(rx), Ok(1));
    let recs = c.sink.records();
    let b = boxes(&recs[0].outputs);
    assert_eq!(b.len(), 2);
    for x in &b {
        assert_eq!(x["scale"]["data"], json!([1.0, 2.0, 3.0]), "{x}");
        assert!(recs[0].outputs.get("stage_error").is_none());
    }
}

/// A sliding-window net on any image size: `y` [batch, 2].
const WINDOW: &str = r#"
name = "fake"
version = "1.0.0"
file = "pnet.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", 3, "h", "w"]
[[outputs]]
name = "y"
dtype = "f32"
shape = ["batch", 2]
[preprocess]
type = "pyramid"
window = 12
min_size = 12
[postprocess]
type = "raw"
"#;

/// `y` = (height, width) of the level.
fn level_size() -> Answer {
    Box::new(|inputs| {
        let x = input(inputs, "x");
        let (h, w) = (x.shape()[2] as f32, x.shape()[3] as f32);
        let y =
            ndarray::Array2::from_shape_fn((x.shape()[0], 2), |(_, j)| if j == 0 { h } else { w });
        Ok(vec![("y".into(), Tensor::F32(y.into_dyn()))])
    })
}

#[test]
fn a_pyramids_levels_run_one_by_one_and_make_one_record() {
    let c = cascade((WINDOW, level_size()), None, "max_batch = 8");
    let (f, rx) = picture("cam");
    c.pipeline.process(vec![f], 0);
    assert_eq!(answer(rx), Ok(1));
    let runs = c.det_runs.lock().clone();
    assert!(runs.len() > 1 && runs.iter().all(|n| *n == 1), "{runs:?}");
    let items = c
        .pipeline
        .stats
        .items
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(items as usize, runs.len());
    let recs = c.sink.records();
    assert_eq!(recs.len(), 1);
    // The default merge keeps the first level: the full-size one.
    assert_eq!(y_of(&recs[0]), vec![32.0, 32.0]);
}

#[test]
fn a_failing_main_model_drops_the_frame_once() {
    let calls = Arc::new(Mutex::new(0));
    let n = calls.clone();
    let mut inner = level_size();
    let answer_fn: Answer = Box::new(move |inputs| {
        let mut n = n.lock();
        *n += 1;
        // The second level of the first frame fails.
        if *n == 2 {
            return Err(RunError::Engine("device lost".into()));
        }
        inner(inputs)
    });
    let c = cascade((WINDOW, answer_fn), None, "");
    let (f1, rx1) = picture("cam");
    let (f2, rx2) = picture("cam");
    c.pipeline.process(vec![f1, f2], 0);
    assert_eq!(answer(rx1), Err(FrameErrorKind::Engine));
    assert_eq!(answer(rx2), Ok(1));
    assert_eq!(drops(&c.pipeline), vec![("inference_error", 1)]);
    assert_eq!(c.sink.records().len(), 1);
}
