//! The cascade on a fake engine: a frame's boxes through a stage model,
//! thumbnails, a failing stage, a stage output without a batch axis, the
//! crops of frames of several streams in one stage run (and a run or a crop
//! that fails only its own frames), the items of an image pyramid merged
//! into one record, and a failing main model, all through the one
//! inference path.

use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::Pipeline;
use super::testkit::*;
use crate::backend::fake::Answer;
use crate::backend::{RunError, Tensor};
use crate::model::registry::LoadedModel;
use crate::pipeline::IdGen;
use crate::pipeline::stages::{Cascade as Stages, Refine};
use crate::preprocess::PreprocessConfig;
use crate::preprocess::crop::Rgb;
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

/// The mean of each crop's values: `p` = (mean, 7) per crop, what a crop
/// of a uniform frame gives wherever it sits in its run.
fn mean_of_crop() -> Answer {
    Box::new(|inputs| {
        let x = input(inputs, "x");
        let means: Vec<f32> = x
            .outer_iter()
            .map(|c| c.mean().unwrap_or_default())
            .collect();
        let p =
            ndarray::Array2::from_shape_fn(
                (means.len(), 2),
                |(i, j)| {
                    if j == 0 { means[i] } else { 7.0 }
                },
            );
        Ok(vec![("p".into(), Tensor::F32(p.into_dyn()))])
    })
}

/// A 32x32 decoded RGB frame, as a camera hands it on.
fn picture(stream: &str) -> (Frame, Reply) {
    picture_of(stream, 128)
}

/// A 32x32 decoded RGB frame of one grey `level`.
fn picture_of(stream: &str, level: u8) -> (Frame, Reply) {
    let (mut f, rx) = frame_of(stream, vec![level; 32 * 32 * 3]);
    f.raw = Some(RawImage::rgb(32, 32));
    (f, rx)
}

struct Cascade {
    pipeline: Pipeline,
    sink: Arc<Sink>,
    det_runs: Arc<Mutex<Vec<usize>>>,
    /// The batch size of each run of the stage model.
    stage_runs: Arc<Mutex<Vec<usize>>>,
}

fn cascade(det: (&str, Answer), stage: Option<(&str, Answer)>, extra: &str) -> Cascade {
    cascade_with(det, stage, extra, "")
}

/// [`cascade`] with `stage_extra` lines in the stage's table.
fn cascade_with(
    det: (&str, Answer),
    stage: Option<(&str, Answer)>,
    extra: &str,
    stage_extra: &str,
) -> Cascade {
    let (model, det_runs) = model(det.0, det.1);
    let mut stages: Vec<Arc<LoadedModel>> = Vec::new();
    let mut cfg = extra.to_string();
    let mut stage_runs = Arc::default();
    if let Some((manifest, answer)) = stage {
        let (m, runs) = super::testkit::model(manifest, answer);
        stages.push(m);
        stage_runs = runs;
        cfg.push_str(&format!("\n[[stages]]\nmodel = \"cls\"\n{stage_extra}\n"));
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
        stage_runs,
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
    assert!(c.pipeline.mode().cascade && c.pipeline.batchable());
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

fn get(a: &std::sync::atomic::AtomicU64) -> u64 {
    a.load(std::sync::atomic::Ordering::Relaxed)
}

/// Each record's `outputs` by its stream.
fn outputs_by_stream(sink: &Sink) -> std::collections::BTreeMap<String, Value> {
    sink.records()
        .into_iter()
        .map(|r| (r.stream, r.outputs))
        .collect()
}

/// With `max_batch`, the detector of a cascade runs the ready frames of
/// several cameras in one run too; each frame's result is what it is alone.
#[test]
fn a_cascade_with_max_batch_runs_the_ready_frames_through_its_detector_together() {
    let c = cascade(
        (DET, text_map(true)),
        Some((CLS, mean_of_crop())),
        "max_batch = 8",
    );
    assert!(c.pipeline.batchable());
    let (fa, ra) = picture_of("cam-a", 60);
    let (fb, rb) = picture_of("cam-b", 200);
    c.pipeline.process(vec![fa, fb], 0);
    assert_eq!((answer(ra), answer(rb)), (Ok(1), Ok(1)));
    assert_eq!(*c.det_runs.lock(), vec![2]);
    assert_eq!(*c.stage_runs.lock(), vec![4]);
    let alone = cascade((DET, text_map(true)), Some((CLS, mean_of_crop())), "");
    for (stream, level) in [("cam-a", 60), ("cam-b", 200)] {
        let (f, rx) = picture_of(stream, level);
        alone.pipeline.process(vec![f], 0);
        assert_eq!(answer(rx), Ok(1));
    }
    assert_eq!(outputs_by_stream(&c.sink), outputs_by_stream(&alone.sink));
}

#[test]
fn the_crops_of_frames_of_several_streams_run_as_one_stage_batch() {
    let c = cascade((DET, text_map(true)), Some((CLS, mean_of_crop())), "");
    let (fa, ra) = picture_of("cam-a", 60);
    let (fb, rb) = picture_of("cam-b", 200);
    c.pipeline.process(vec![fa, fb], 0);
    assert_eq!((answer(ra), answer(rb)), (Ok(1), Ok(1)));
    // The detector runs each frame; the stage runs the 4 crops of both once.
    assert_eq!(*c.det_runs.lock(), vec![1, 1]);
    assert_eq!(*c.stage_runs.lock(), vec![4]);
    let st = c.pipeline.stage_stats()[0].1;
    assert_eq!(
        (
            get(&st.runs.batches),
            get(&st.runs.batch_items),
            get(&st.crops)
        ),
        (1, 4, 4)
    );
    let sizes = st.runs.batch_sizes.summary();
    assert_eq!((sizes.count, sizes.max_us), (1, Some(4)));
    assert_eq!(st.runs.inference_us.summary().count, 1);
    assert_eq!(st.latency_us.summary().count, 1, "one set");
    // The pipeline's own counters hold its model's runs only.
    assert_eq!(get(&c.pipeline.stats.runs.batches), 2);
    let together = outputs_by_stream(&c.sink);

    // Each box got its own frame's result: the same as each frame alone.
    let alone = cascade((DET, text_map(true)), Some((CLS, mean_of_crop())), "");
    for (stream, level) in [("cam-a", 60), ("cam-b", 200)] {
        let (f, rx) = picture_of(stream, level);
        alone.pipeline.process(vec![f], 0);
        assert_eq!(answer(rx), Ok(1));
    }
    assert_eq!(*alone.stage_runs.lock(), vec![2, 2]);
    assert_eq!(together, outputs_by_stream(&alone.sink));
    for (stream, level) in [("cam-a", 60.0), ("cam-b", 200.0)] {
        let b = boxes(&together[stream]);
        assert_eq!(b.len(), 2, "{}", together[stream]);
        for x in &b {
            let p = x["p"]["data"][0].as_f64().unwrap();
            assert!((p - level / 255.0).abs() < 1e-4, "{stream}: {x}");
        }
    }
    assert!(c.pipeline.stats.drops().is_empty());
}

#[test]
fn a_failed_stage_run_fails_only_the_frames_whose_crops_it_held() {
    // Two crops per run: frame a's two, then frame b's two; the model
    // refuses b's bright crops.
    let refuse_bright: Answer = {
        let mut inner = mean_of_crop();
        Box::new(move |inputs| {
            if input(inputs, "x").iter().any(|v| *v > 0.5) {
                return Err(RunError::Engine("too bright".into()));
            }
            inner(inputs)
        })
    };
    let c = cascade_with(
        (DET, text_map(true)),
        Some((CLS, refuse_bright)),
        "",
        "max_batch = 2",
    );
    let (fa, ra) = picture_of("cam-a", 60);
    let (fb, rb) = picture_of("cam-b", 200);
    c.pipeline.process(vec![fa, fb], 0);
    assert_eq!((answer(ra), answer(rb)), (Ok(1), Ok(1)));
    assert_eq!(*c.stage_runs.lock(), vec![2, 2]);
    let out = outputs_by_stream(&c.sink);
    let a = &out["cam-a"];
    assert!(a.get("stage_error").is_none(), "{a}");
    assert!(
        boxes(a).iter().all(|x| x["p"]["data"][1] == json!(7.0)),
        "{a}"
    );
    let b = &out["cam-b"];
    assert!(
        b["stage_error"]
            .as_str()
            .is_some_and(|e| e.contains("cls@1.0.0") && e.contains("too bright")),
        "{b}"
    );
    assert_eq!(boxes(b).len(), 2, "the boxes as the detector gave them");
    assert!(boxes(b).iter().all(|x| x.get("p").is_none()), "{b}");
    let st = c.pipeline.stage_stats()[0].1;
    assert_eq!(
        (get(&st.runs.batches), get(&st.crops), get(&st.errors)),
        (2, 2, 1)
    );
    assert_eq!(drops(&c.pipeline), vec![("stage_error", 1)]);
}

#[test]
fn a_box_that_gives_no_crop_fails_its_own_frame_only() {
    let (stage_model, stage_runs) = super::testkit::model(CLS, mean_of_crop());
    let cfg = config("[[stages]]\nmodel = \"cls\"\n");
    let pre: PreprocessConfig =
        toml::from_str("type = \"image\"\nwidth = 16\nheight = 16").unwrap();
    let mut stages = Stages::new(&cfg, pre).unwrap();
    stages.add_stages(&cfg, &[stage_model]).unwrap();
    let grey = |level: u8| Rgb {
        width: 32,
        height: 32,
        pixels: vec![level; 32 * 32 * 3],
    };
    let (pa, pb) = (grey(60), grey(200));
    let good = json!({"boxes": [
        {"box": [4, 4, 28, 12], "score": 0.9},
        {"box": [4, 20, 28, 28], "score": 0.8},
    ]});
    // Frame b's second box lies far outside any frame.
    let bad = json!({"boxes": [
        {"box": [4, 4, 28, 12], "score": 0.9},
        {"box": [1.0e9, 0, 2.0e9, 5], "score": 0.8},
    ]});
    let (mut va, mut vb) = (good.clone(), bad.clone());
    let errors = stages.refine(&mut [
        Refine {
            picture: Some(&pa),
            stream: "cam-a",
            value: &mut va,
        },
        Refine {
            picture: Some(&pb),
            stream: "cam-b",
            value: &mut vb,
        },
    ]);
    assert!(errors[0].is_none(), "{errors:?}");
    assert!(
        errors[1]
            .as_deref()
            .is_some_and(|e| e.contains("cls@1.0.0") && e.contains("far outside")),
        "{errors:?}"
    );
    // Frame a's crops ran, and only they.
    assert_eq!(*stage_runs.lock(), vec![2]);
    assert_eq!(boxes(&va).len(), 2, "{va}");
    for x in boxes(&va) {
        let p = x["p"]["data"][0].as_f64().unwrap();
        assert!((p - 60.0 / 255.0).abs() < 1e-4, "{x}");
    }
    // The same as frame a alone.
    let mut alone = good.clone();
    let e = stages.refine(&mut [Refine {
        picture: Some(&pa),
        stream: "cam-a",
        value: &mut alone,
    }]);
    assert_eq!(e, vec![None]);
    assert_eq!(alone, va);
    // Frame b keeps its boxes as they came, marked.
    let mut marked = bad.clone();
    marked["stage_error"] = json!(errors[1].clone().unwrap());
    assert_eq!(vb, marked);
    let st = stages.stats()[0].1;
    assert_eq!((get(&st.errors), get(&st.runs.batches)), (1, 2));
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
