//! The scheduler with real worker threads over pipelines on a fake engine
//! (no ONNX Runtime): each queue policy's drop reason and answer, a
//! source's own drop reasons, batches of what is queued, `max_delay`, one
//! worker at a time for a serial pipeline, the idle-stream sweeper, stop,
//! and per-stream state carried across a reload.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{Scheduler, SchedulerConfig};
use crate::pipeline::RecordSink;
use crate::pipeline::realtime::RealtimeStats;
use crate::pipeline::worker::testkit::*;
use crate::record::ResultRecord;
use crate::source::{FrameError, FrameErrorKind};

fn scheduler_of(pipelines: Vec<crate::pipeline::Pipeline>) -> Scheduler {
    Scheduler::new(pipelines.into_iter().map(Arc::new).collect())
}

fn one(
    manifest: &str,
    extra: &str,
    sink: Arc<dyn RecordSink>,
) -> (Scheduler, Arc<Mutex<Vec<usize>>>) {
    let (p, runs) = build(manifest, &config(extra), sums(), None, sink, 1);
    (scheduler_of(vec![p]), runs)
}

/// Starts `n` workers; returns what to join after `stop`.
fn start(s: &Scheduler, n: usize) -> Vec<std::thread::JoinHandle<()>> {
    let cfg = SchedulerConfig {
        workers: n,
        ..SchedulerConfig::default()
    };
    s.start_workers(&cfg, &Arc::new(RealtimeStats::default()))
        .unwrap()
}

fn stop(s: &Scheduler, handles: Vec<std::thread::JoinHandle<()>>) {
    s.stop();
    for h in handles {
        h.join().unwrap();
    }
}

/// Waits (bounded) until `cond` holds.
fn wait_for(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Queues a frame; the queue must take it.
fn submit(s: &Scheduler, i: usize, f: crate::source::Frame) {
    assert!(s.submit(i, f).is_ok(), "refused");
}

fn done(s: &Scheduler, i: usize) -> u64 {
    s.pipelines()[i].stats.frames_done.load(Ordering::Relaxed)
}

fn dropped_detail(rx: Reply) -> (FrameErrorKind, String) {
    let mut rx = rx;
    match rx.try_recv() {
        Ok(Err(FrameError { kind, detail })) => (kind, detail),
        other => panic!("not dropped: {other:?}"),
    }
}

#[test]
fn a_full_queue_drops_by_its_policy_and_answers_the_sender() {
    let sink = Arc::new(Sink::default());
    let (s, _) = one(
        PLAIN,
        "queue = 2\nwhen_full = \"drop_newest\"",
        sink.clone(),
    );
    let mut replies = Vec::new();
    for _ in 0..3 {
        let (f, rx) = frame("s", [1.0; 4]);
        assert!(s.submit(0, f).is_ok());
        replies.push(rx);
    }
    let p = &s.pipelines()[0];
    assert_eq!(drops(p), vec![("queue_full_drop_newest", 1)]);
    assert_eq!(
        (p.stats.frames_in.load(Ordering::Relaxed), s.queue_depth(0)),
        (3, 2)
    );
    assert_eq!(
        dropped_detail(replies.pop().unwrap()),
        (
            FrameErrorKind::Dropped,
            "dropped from the full queue (queue_full_drop_newest)".into()
        )
    );

    let (s, _) = one(PLAIN, "queue = 1", sink.clone());
    let (f1, rx1) = frame("s", [1.0; 4]);
    let (f2, _rx2) = frame("s", [2.0; 4]);
    submit(&s, 0, f1);
    submit(&s, 0, f2);
    assert_eq!(
        drops(&s.pipelines()[0]),
        vec![("queue_full_drop_oldest", 1)]
    );
    assert_eq!(
        dropped_detail(rx1),
        (
            FrameErrorKind::Dropped,
            "dropped from the full queue (queue_full_drop_oldest)".into()
        )
    );

    let (s, _) = one(PLAIN, "queue = 1\nwhen_full = \"block\"", sink);
    submit(&s, 0, frame("s", [1.0; 4]).0);
    assert!(s.submit(0, frame("s", [2.0; 4]).0).is_err(), "handed back");
    assert!(
        drops(&s.pipelines()[0]).is_empty(),
        "blocking drops nothing"
    );
}

#[test]
fn a_sources_drops_are_counted_under_its_own_labels() {
    let (s, _) = one(PLAIN, "", Arc::new(Sink::default()));
    let input = s.input(0);
    input.count_drop("kernel_overflow", "12 datagrams");
    input.count_drop("stale", "queue full");
    input.count_drop("stale", "queue full");
    let p = &s.pipelines()[0];
    assert_eq!(drops(p), vec![("kernel_overflow", 1), ("stale", 2)]);
    assert_eq!(p.stats.drop_count(crate::pipeline::DropReason::Stale), 2);
    assert_eq!(p.stats.frames_in.load(Ordering::Relaxed), 3);
}

#[test]
fn a_worker_batches_what_is_queued_and_stop_finishes_every_frame() {
    let sink = Arc::new(Sink::default());
    let (s, runs) = one(PLAIN, "max_batch = 4", sink.clone());
    let replies: Vec<Reply> = (0..10)
        .map(|i| {
            let (f, rx) = frame("s", [i as f32; 4]);
            submit(&s, 0, f);
            rx
        })
        .collect();
    let handles = start(&s, 1);
    stop(&s, handles);
    // Queued before the worker started: taken max_batch at a time.
    assert_eq!(*runs.lock(), vec![4, 4, 2]);
    assert_eq!(done(&s, 0), 10);
    assert!(replies.into_iter().all(|rx| answer(rx) == Ok(1)));
    let firsts: Vec<f64> = sink.records().iter().map(|r| y_of(r)[1]).collect();
    assert_eq!(firsts, (0..10).map(f64::from).collect::<Vec<_>>());
}

#[test]
fn without_max_delay_a_lone_frame_runs_at_once_and_with_it_the_batch_fills() {
    let (s, runs) = one(PLAIN, "max_batch = 4", Arc::new(Sink::default()));
    let handles = start(&s, 1);
    submit(&s, 0, frame("s", [1.0; 4]).0);
    wait_for("the frame", || done(&s, 0) == 1);
    assert_eq!(*runs.lock(), vec![1], "never waits for company");
    stop(&s, handles);

    // A long max_delay: the frames that follow the first join its run.
    let (s, runs) = one(
        PLAIN,
        "max_batch = 4\nmax_delay = \"5s\"",
        Arc::new(Sink::default()),
    );
    let handles = start(&s, 1);
    for i in 0..4 {
        submit(&s, 0, frame("s", [i as f32; 4]).0);
    }
    wait_for("the batch", || done(&s, 0) == 4);
    assert_eq!(*runs.lock(), vec![4]);
    stop(&s, handles);
}

/// Counts how many workers store at once (and keeps the records).
#[derive(Default)]
struct Overlap {
    now: AtomicUsize,
    most: AtomicUsize,
    records: Mutex<Vec<ResultRecord>>,
}

impl RecordSink for Overlap {
    fn store(&self, record: &ResultRecord, _json: &[u8]) -> Result<(), FrameError> {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        // Long enough for another worker to come in, were it let.
        std::thread::sleep(Duration::from_millis(1));
        self.records.lock().push(record.clone());
        self.now.fetch_sub(1, Ordering::SeqCst);
        Ok(())
    }
}

#[test]
fn a_serial_pipeline_is_run_by_one_worker_at_a_time_in_each_streams_order() {
    let sink = Arc::new(Overlap::default());
    let (p, _) = build(STATEFUL, &config(""), counter(), None, sink.clone(), 4);
    assert!(p.serial());
    let s = scheduler_of(vec![p]);
    let handles = start(&s, 4);
    for i in 0..30 {
        let stream = ["a", "b", "c"][i % 3];
        submit(&s, 0, frame(stream, [0.0; 4]).0);
    }
    wait_for("every frame", || done(&s, 0) == 30);
    stop(&s, handles);
    assert_eq!(sink.most.load(Ordering::SeqCst), 1);
    let recs = sink.records.lock().clone();
    for stream in ["a", "b", "c"] {
        let ys: Vec<f64> = recs
            .iter()
            .filter(|r| r.stream == stream)
            .map(|r| y_of(r)[0])
            .collect();
        assert_eq!(ys, (1..=10).map(f64::from).collect::<Vec<_>>(), "{stream}");
    }
}

#[test]
fn the_sweeper_ends_idle_streams_without_new_frames() {
    let sink = Arc::new(Sink::default());
    let (hook, _) = counting(100, false);
    let cfg = config("stream_idle = \"30ms\"");
    let (p, _) = build(PLAIN, &cfg, sums(), Some(hook), sink.clone(), 1);
    let s = scheduler_of(vec![p]);
    let handles = start(&s, 1);
    submit(&s, 0, frame("a", [1.0; 4]).0);
    wait_for("the end event", || sink.records().len() == 2);
    stop(&s, handles);
    let recs = sink.records();
    assert_eq!(
        recs[1].outputs,
        serde_json::json!({"event": "end", "n": 1, "why": "Idle"})
    );
    assert_eq!(s.pipelines()[0].streams_held().evicted_idle, 1);
}

#[test]
fn a_reload_carries_hook_state_to_the_same_pipeline_and_ends_the_removed_ones() {
    let sink = Arc::new(Sink::default());
    let hooked = |name: &str, sink: &Arc<Sink>| {
        let (hook, _) = counting(100, false);
        let mut cfg = config("");
        cfg.name = name.into();
        build(PLAIN, &cfg, sums(), Some(hook), sink.clone(), 1).0
    };
    let old = scheduler_of(vec![hooked("p", &sink), hooked("q", &sink)]);
    let handles = start(&old, 1);
    for name in [0, 0, 1] {
        submit(&old, name, frame("a", [1.0; 4]).0);
    }
    stop(&old, handles);
    let new = scheduler_of(vec![hooked("p", &sink)]);
    assert_eq!(new.adopt_streams(&old), 1);
    let handles = start(&new, 1);
    submit(&new, 0, frame("a", [1.0; 4]).0);
    stop(&new, handles);
    let got: Vec<(String, serde_json::Value)> = sink
        .records()
        .iter()
        .skip(3)
        .map(|r| (r.pipeline.clone(), r.outputs.clone()))
        .collect();
    assert_eq!(got[0].0, "q", "the removed pipeline's stream ends");
    assert_eq!(
        got[0].1,
        serde_json::json!({"event": "end", "n": 1, "why": "Closed"})
    );
    assert_eq!(got[1].0, "p");
    assert_eq!(got[1].1["n"], 3, "p's stream went on counting");
}
