//! The worker on a fake engine (no ONNX Runtime): every inference mode
//! (one run per item, micro-batches, state batched across streams), the
//! rule for outputs without a batch axis, each drop reason and an engine
//! error in the middle of a batch.

use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::Value;

use super::testkit::*;
use crate::backend::fake::Answer;
use crate::backend::{RunError, Tensor};
use crate::pipeline::{Batching, DropReason};
use crate::record::ResultRecord;
use crate::source::{Frame, FrameError, FrameErrorKind};

#[test]
fn one_run_per_item_when_not_batching() {
    let r = rig(PLAIN, "", sums());
    let (frames, replies): (Vec<_>, Vec<_>) = (0..3)
        .map(|i| frame("s", [i as f32, 1.0, 1.0, 1.0]))
        .unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(*r.runs.lock(), vec![1, 1, 1]);
    let recs = r.sink.0.lock().clone();
    assert_eq!(recs.len(), 3);
    for (i, rec) in recs.iter().enumerate() {
        assert_eq!(y_of(rec), vec![i as f64 + 3.0, i as f64]);
    }
    for mut rx in replies {
        assert_eq!(rx.try_recv().unwrap().unwrap().len(), 1);
    }
    assert_eq!(r.pipeline.stats.runs.batch_sizes.summary().count, 3);
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
    assert_eq!(*r.runs.lock(), vec![4, 2]);
    let recs = r.sink.0.lock().clone();
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
    assert_eq!(*r.runs.lock(), vec![3]);
    let recs = r.sink.0.lock().clone();
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
        let mut n = c.lock();
        *n += 1;
        if *n == 2 {
            return Err(RunError::Engine("device lost".into()));
        }
        inner(inputs)
    });
    let r = rig(PLAIN, "max_batch = 2", answer);
    let (frames, replies): (Vec<_>, Vec<_>) = (0..6).map(|i| frame("s", [i as f32; 4])).unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(*r.runs.lock(), vec![2, 2, 2]);
    let outcomes: Vec<Option<FrameErrorKind>> = replies
        .into_iter()
        .map(|mut rx| rx.try_recv().unwrap().err().map(|e| e.kind))
        .collect();
    let e = Some(FrameErrorKind::Engine);
    assert_eq!(outcomes, vec![None, None, e, e, None, None]);
    assert_eq!(r.sink.0.lock().len(), 4);
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
    assert_eq!(r.sink.0.lock().len(), 1);
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
    assert_eq!(*r.runs.lock(), vec![1, 1, 1, 1]);
    let got: Vec<(String, Vec<f64>)> = r
        .sink
        .0
        .lock()
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
    assert_eq!(*r.runs.lock(), vec![3, 2, 1]);
    let got: Vec<(String, Vec<f64>)> = r
        .sink
        .0
        .lock()
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
        if *f.lock() {
            return Err(RunError::Engine("transient".into()));
        }
        inner(inputs)
    });
    let r = rig(STATEFUL, "", answer);
    r.pipeline.process(vec![frame("a", [0.0; 4]).0], 0);
    *fail.lock() = true;
    r.pipeline.process(vec![frame("a", [0.0; 4]).0], 0);
    *fail.lock() = false;
    r.pipeline.process(vec![frame("a", [0.0; 4]).0], 0);
    let ys: Vec<Vec<f64>> = r.sink.0.lock().iter().map(y_of).collect();
    assert_eq!(ys, vec![vec![1.0], vec![2.0]]);
    assert_eq!(drops(&r.pipeline), vec![("inference_error", 1)]);
}

#[test]
fn records_carry_the_model_and_sequence() {
    let r = rig(PLAIN, "", sums());
    r.pipeline.process(vec![frame("s", [1.0; 4]).0], 0);
    let rec = r.sink.0.lock()[0].clone();
    assert_eq!(
        (rec.id.as_str(), rec.model.as_str(), rec.ep.as_str()),
        ("gw/1/1", "fake@1.0.0", "cpu")
    );
    assert!(matches!(rec.outputs, Value::Object(_)));
}

/// Variable-length readings (`none` preprocessing: a `.npy` payload): `x`
/// [batch, n] -> `y` [batch, 2].
const FREE_WIDTH: &str = r#"
name = "fake"
version = "1.0.0"
file = "fake.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", "n"]
[[outputs]]
name = "y"
dtype = "f32"
shape = ["batch", 2]
[preprocess]
type = "none"
[postprocess]
type = "raw"
"#;

#[test]
fn items_of_different_shapes_in_one_batch_are_dropped_as_batch_errors() {
    let r = rig(FREE_WIDTH, "max_batch = 2", sums());
    assert_eq!(r.pipeline.mode().batching, Batching::Stacked { max: 2 });
    let (frames, replies): (Vec<_>, Vec<_>) = [vec![1.0, 2.0], vec![1.0, 2.0, 3.0], vec![5.0; 3]]
        .iter()
        .map(|v| frame_of("s", npy(v)))
        .unzip();
    r.pipeline.process(frames, 0);
    // The first two cannot share a run; the third runs alone.
    assert_eq!(*r.runs.lock(), vec![1]);
    let answers: Vec<_> = replies.into_iter().map(answer).collect();
    let e = Err(FrameErrorKind::Engine);
    assert_eq!(answers, vec![e, e, Ok(1)]);
    assert_eq!(drops(&r.pipeline), vec![("batch_error", 2)]);
    assert_eq!(
        r.pipeline.stats.drop_count(DropReason::Batch),
        2,
        "counted under the enum's label"
    );
}

#[test]
fn a_postprocessing_error_drops_that_frame_only() {
    // A model that leaves out its output for readings starting below zero.
    let answer_fn: Answer = Box::new(|inputs| {
        if input(inputs, "x")[[0, 0]] < 0.0 {
            return Ok(vec![]);
        }
        sums()(inputs)
    });
    let manifest = PLAIN.replace(
        "[postprocess]\ntype = \"raw\"",
        "[postprocess]\ntype = \"softmax_topk\"\noutput = \"y\"\nk = 1",
    );
    let r = rig(&manifest, "", answer_fn);
    let (bad, rx1) = frame("s", [-1.0; 4]);
    let (good, rx2) = frame("s", [1.0, 3.0, 0.0, 0.0]);
    r.pipeline.process(vec![bad, good], 0);
    assert_eq!(answer(rx1), Err(FrameErrorKind::Engine));
    assert_eq!(answer(rx2), Ok(1));
    assert_eq!(drops(&r.pipeline), vec![("postprocess_error", 1)]);
    assert_eq!(r.sink.records().len(), 1);
}

#[test]
fn an_engine_error_mid_batch_across_streams_fails_that_run_only() {
    let calls = Arc::new(Mutex::new(0));
    let c = calls.clone();
    let mut inner = counter();
    let answer_fn: Answer = Box::new(move |inputs| {
        let mut n = c.lock();
        *n += 1;
        if *n == 2 {
            return Err(RunError::Engine("device lost".into()));
        }
        inner(inputs)
    });
    let r = rig(STATEFUL, "max_batch = 8", answer_fn);
    let (frames, replies): (Vec<_>, Vec<_>) = [("a", 0.0), ("b", 10.0), ("a", 0.0), ("a", 0.0)]
        .into_iter()
        .map(|(s, v)| frame(s, [v; 4]))
        .unzip();
    r.pipeline.process(frames, 0);
    // Runs [a b], [a] (fails), [a].
    assert_eq!(*r.runs.lock(), vec![2, 1, 1]);
    let answers: Vec<_> = replies.into_iter().map(answer).collect();
    assert_eq!(
        answers,
        vec![Ok(1), Ok(1), Err(FrameErrorKind::Engine), Ok(1)]
    );
    let got: Vec<(String, Vec<f64>)> = r
        .sink
        .records()
        .iter()
        .map(|r| (r.stream.clone(), y_of(r)))
        .collect();
    // The failed run left `a`'s state as it was: its third frame counts 2.
    assert_eq!(
        got,
        vec![
            ("a".to_string(), vec![1.0]),
            ("b".to_string(), vec![11.0]),
            ("a".to_string(), vec![2.0]),
        ]
    );
    assert_eq!(drops(&r.pipeline), vec![("inference_error", 1)]);
}

#[test]
fn every_run_is_counted_once_whatever_the_mode() {
    for (extra, manifest, answer_fn, runs) in [
        ("", PLAIN, sums(), 4u64),
        ("max_batch = 4", PLAIN, sums(), 1),
        ("max_batch = 4", STATEFUL, counter(), 2),
    ] {
        let r = rig(manifest, extra, answer_fn);
        let (frames, _): (Vec<_>, Vec<_>) = ["a", "b", "c", "a"]
            .into_iter()
            .map(|s| frame(s, [1.0; 4]))
            .unzip();
        r.pipeline.process(frames, 0);
        let s = &r.pipeline.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            (
                get(&s.runs.batches),
                get(&s.runs.batch_items),
                get(&s.items)
            ),
            (runs, 4, 4),
            "{extra} {}",
            r.pipeline.mode().stateful
        );
        assert_eq!(s.runs.batch_sizes.summary().count, runs);
        assert_eq!(s.runs.inference_us.summary().count, runs);
        assert_eq!((get(&s.frames_done), get(&s.records)), (4, 4));
    }
}

// The stream hook, with the counting hook of the test kit.

fn ns(recs: &[ResultRecord]) -> Vec<(String, Value)> {
    recs.iter()
        .map(|r| (r.stream.clone(), r.outputs.clone()))
        .map(|(s, o)| match o.get("event") {
            Some(_) => (s, o),
            None => (s, o["n"].clone()),
        })
        .collect()
}

#[test]
fn the_hook_sees_each_streams_results_in_order_and_its_events_become_records() {
    let (hook, log) = counting(2, false);
    let r = rig_with(PLAIN, "max_batch = 8", sums(), Some(hook));
    assert!(
        r.pipeline.serial(),
        "a hook needs each stream's frames in order"
    );
    assert_eq!(r.pipeline.mode().batching, Batching::One);
    let (frames, replies): (Vec<_>, Vec<_>) = ["a", "a", "b", "a"]
        .into_iter()
        .map(|s| frame(s, [1.0; 4]))
        .unzip();
    r.pipeline.process(frames, 0);
    let recs = r.sink.records();
    assert_eq!(
        ns(&recs),
        vec![
            ("a".into(), serde_json::json!(1)),
            ("a".into(), serde_json::json!(2)),
            ("a".into(), serde_json::json!({"event": "every", "n": 2})),
            ("b".into(), serde_json::json!(1)),
            ("a".into(), serde_json::json!(3)),
        ]
    );
    // The hook changed the record (`n`) and kept what the model gave.
    assert_eq!(y_of(&recs[0]), vec![4.0, 1.0]);
    // The frame with the event is answered with both records.
    let answers: Vec<_> = replies.into_iter().map(answer).collect();
    assert_eq!(answers, vec![Ok(1), Ok(2), Ok(1), Ok(1)]);
    assert_eq!(
        *log.lock(),
        vec!["start a None".to_string(), "start b None".to_string()]
    );
    assert_eq!(r.pipeline.streams_held().held, 2);
}

#[test]
fn events_only_keeps_the_frames_own_records_out_of_the_outbox() {
    let (hook, _) = counting(2, true);
    let r = rig_with(PLAIN, "", sums(), Some(hook));
    let (frames, replies): (Vec<_>, Vec<_>) = (0..4).map(|_| frame("a", [1.0; 4])).unzip();
    r.pipeline.process(frames, 0);
    assert_eq!(
        ns(&r.sink.records()),
        vec![
            ("a".into(), serde_json::json!({"event": "every", "n": 2})),
            ("a".into(), serde_json::json!({"event": "every", "n": 4})),
        ]
    );
    let answers: Vec<_> = replies.into_iter().map(answer).collect();
    assert_eq!(answers, vec![Ok(0), Ok(1), Ok(0), Ok(1)]);
    assert_eq!(r.pipeline.stats.drops().len(), 0, "skipping is no drop");
}

#[test]
fn an_evicted_stream_ends_its_hook_state_and_starts_over_when_it_comes_back() {
    let (hook, log) = counting(100, false);
    let r = rig_with(PLAIN, "max_streams = 1", sums(), Some(hook));
    for s in ["a", "a", "b", "a"] {
        r.pipeline.process(vec![frame(s, [1.0; 4]).0], 0);
    }
    assert_eq!(
        ns(&r.sink.records()),
        vec![
            ("a".into(), serde_json::json!(1)),
            ("a".into(), serde_json::json!(2)),
            // `b` takes `a`'s place: `a` ends before `b`'s first record.
            (
                "a".into(),
                serde_json::json!({"event": "end", "n": 2, "why": "Lru"})
            ),
            ("b".into(), serde_json::json!(1)),
            (
                "b".into(),
                serde_json::json!({"event": "end", "n": 1, "why": "Lru"})
            ),
            ("a".into(), serde_json::json!(1)),
        ]
    );
    let held = r.pipeline.streams_held();
    assert_eq!((held.held, held.evicted_lru), (1, 2));
    assert_eq!(log.lock().len(), 5, "{:?}", log.lock());
}

#[test]
fn idle_streams_end_their_hook_state_without_new_frames() {
    let (hook, _) = counting(100, false);
    let r = rig_with(PLAIN, "stream_idle = \"20ms\"", sums(), Some(hook));
    r.pipeline.process(vec![frame("a", [1.0; 4]).0], 0);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while r.pipeline.expire_idle_streams() == 0 {
        assert!(std::time::Instant::now() < deadline, "never expired");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let recs = r.sink.records();
    assert_eq!(
        recs[1].outputs,
        serde_json::json!({"event": "end", "n": 1, "why": "Idle"})
    );
    assert_eq!(recs[1].stream, "a");
    assert_eq!(r.pipeline.streams_held().evicted_idle, 1);
}

#[test]
fn a_reload_keeps_hook_state_only_when_the_pipelines_config_is_unchanged() {
    let (hook, _) = counting(100, false);
    let old = rig_with(PLAIN, "", sums(), Some(hook));
    for _ in 0..2 {
        old.pipeline.process(vec![frame("a", [1.0; 4]).0], 0);
    }
    // Same config: `a` goes on counting in the new pipeline, nothing ends.
    let (hook, _) = counting(100, false);
    let same = rig_with(PLAIN, "", sums(), Some(hook));
    assert_eq!(same.pipeline.adopt_streams(&old.pipeline), 1);
    same.pipeline.process(vec![frame("a", [1.0; 4]).0], 0);
    assert_eq!(
        ns(&same.sink.records()),
        vec![("a".into(), serde_json::json!(3))]
    );
    assert_eq!(old.sink.records().len(), 2, "no end event");
    // Another config: the states end in the old pipeline, the new starts over.
    let (hook, _) = counting(100, false);
    let other = rig_with(PLAIN, "queue = 10", sums(), Some(hook));
    assert_eq!(other.pipeline.adopt_streams(&same.pipeline), 0);
    other.pipeline.process(vec![frame("a", [1.0; 4]).0], 0);
    assert_eq!(
        ns(&same.sink.records())[1],
        (
            "a".into(),
            serde_json::json!({"event": "end", "n": 3, "why": "Closed"})
        )
    );
    assert_eq!(
        ns(&other.sink.records()),
        vec![("a".into(), serde_json::json!(1))]
    );
}
