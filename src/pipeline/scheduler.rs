//! The scheduler: every pipeline's bounded queue, and a pool of dedicated
//! OS threads (never the async runtime's workers) that run inference.
//!
//! Invariants:
//! - Priority tiers realtime > normal > batch share the workers by weight
//!   (8 : 4 : 1 turns of a 13-slot wheel). A tier with no runnable work gives
//!   its turns away, so an idle device runs any tier at full speed, and a
//!   flooded realtime pipeline still leaves batch pipelines 1 turn in 13.
//! - Within a tier, runnable pipelines are served round-robin.
//! - A pipeline whose processing is stateful (recurrent model state, audio
//!   windows, event thresholds) is run by one worker at a time, so its
//!   streams see their frames in order.
//! - Stop: sources stop first; workers finish every queued frame, then exit.
//! - One more thread (`streams`) expires each pipeline's idle streams every
//!   sweep interval, so their state goes whether frames arrive or not.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use super::drops::DropReason;
use super::queue::{BoundedQueue, LaneQueue, Offer, PipelineQueue};
use super::realtime::RealtimeStats;
use super::worker::Pipeline;
use crate::source::{Frame, FrameSink};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    Realtime,
    #[default]
    Normal,
    Batch,
}

impl Priority {
    fn tier(self) -> usize {
        match self {
            Priority::Realtime => 0,
            Priority::Normal => 1,
            Priority::Batch => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Realtime => "realtime",
            Priority::Normal => "normal",
            Priority::Batch => "batch",
        }
    }
}

/// `[scheduler]`: the inference worker pool and its real-time settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Inference threads; 0 = one per CPU core.
    pub workers: usize,
    /// CPUs the inference threads are pinned to: worker i runs on
    /// `cpus[i % len]`. Empty = not pinned. (With `runtime.intra_threads =
    /// 1` inference runs on these threads; ONNX Runtime's own pool threads
    /// are not pinned.)
    pub cpus: Vec<usize>,
    /// SCHED_FIFO priority (1..=99) of the inference threads and of the
    /// daemon's I/O threads; unset = normal scheduling. Needs CAP_SYS_NICE, which the systemd unit grants only
    /// through the drop-in `systemd/outpost-realtime.conf`. Refused: logged,
    /// counted, and the daemon runs on at normal priority.
    pub realtime_priority: Option<u32>,
    /// mlockall(MCL_CURRENT | MCL_FUTURE) at start: no page of the daemon is
    /// paged out (needs CAP_IPC_LOCK or LimitMEMLOCK=infinity).
    pub lock_memory: bool,
}

impl SchedulerConfig {
    pub fn worker_count(&self) -> usize {
        if self.workers > 0 {
            self.workers
        } else {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
        }
    }

    /// Every problem, each naming its key.
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(r) = self.realtime_priority
            && !(1..=99).contains(&r)
        {
            p.push(format!(
                "scheduler.realtime_priority: {r} is out of range 1..=99"
            ));
        }
        for (i, c) in self.cpus.iter().enumerate() {
            if *c >= 1024 {
                p.push(format!("scheduler.cpus: CPU {c} is out of range 0..1024"));
            }
            if self.cpus[..i].contains(c) {
                p.push(format!("scheduler.cpus: CPU {c} listed twice"));
            }
        }
        p
    }
}

/// The weighted wheel: 8 realtime turns, 4 normal, 1 batch.
const WHEEL: [usize; 13] = [0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 2];

struct SchedState {
    queues: Vec<PipelineQueue<Frame>>,
    busy: Vec<bool>,
    slot: usize,
    rr: [usize; 3],
    /// Workers blocked on `work` now: a frame or a released pipeline signals
    /// the condvar only when one waits (a signal is a system call even when
    /// nobody waits, one per frame at full load).
    waiting: usize,
}

struct Inner {
    pipelines: Vec<Arc<Pipeline>>,
    state: Mutex<SchedState>,
    work: Condvar,
    spaces: Vec<Arc<Notify>>,
    stopping: AtomicBool,
    /// When each worker started its current batch (None: idle), for the watchdog.
    busy_since: Mutex<Vec<Option<Instant>>>,
    /// Pipelines paused through the API: their frames wait (or drop by policy).
    paused: Vec<AtomicBool>,
    /// The idle-stream sweeper, woken (unparked) by `stop`.
    sweeper: Mutex<Option<std::thread::Thread>>,
}

/// Streams expired in one sweep from which their freed memory is handed
/// back to the system (a few KiB each; fewer are not worth the arena walk).
const TRIM_AFTER_EXPIRED: usize = 256;

/// How often idle streams are looked for: a quarter of the shortest
/// `stream_idle`, between 10 ms and 1 s (a stream goes at most that much
/// after its idle time; a look costs one lock per pipeline).
fn sweep_interval(pipelines: &[Arc<Pipeline>]) -> Duration {
    pipelines
        .iter()
        .map(|p| p.cfg.stream_idle / 4)
        .min()
        .unwrap_or(Duration::from_secs(1))
        .clamp(Duration::from_millis(10), Duration::from_secs(1))
}

/// Shared handle to the queues and workers.
#[derive(Clone)]
pub struct Scheduler {
    inner: Arc<Inner>,
}

/// Picks the next pipeline to serve, by the wheel, among those with queued
/// frames that are not held by another worker. Pure over its inputs.
fn pick(
    tiers: &[usize],
    runnable: &[bool],
    slot: &mut usize,
    rr: &mut [usize; 3],
) -> Option<usize> {
    let n = tiers.len();
    for step in 0..WHEEL.len() {
        let pos = (*slot + step) % WHEEL.len();
        let tier = WHEEL[pos];
        for k in 0..n {
            let i = (rr[tier] + k) % n;
            if tiers[i] == tier && runnable[i] {
                *slot = pos + 1;
                rr[tier] = i + 1;
                return Some(i);
            }
        }
    }
    None
}

impl Scheduler {
    pub fn new(pipelines: Vec<Arc<Pipeline>>) -> Scheduler {
        let queues = pipelines
            .iter()
            .map(|p| {
                // A pipeline over several cameras holds each camera's
                // latest frames apart and serves them in turn.
                if p.stats.cameras.is_empty() {
                    PipelineQueue::Fifo(BoundedQueue::new(p.cfg.queue, p.cfg.when_full()))
                } else {
                    PipelineQueue::Lanes(LaneQueue::new(p.stats.cameras.0.len(), p.cfg.queue))
                }
            })
            .collect();
        let n = pipelines.len();
        Scheduler {
            inner: Arc::new(Inner {
                spaces: (0..n).map(|_| Arc::new(Notify::new())).collect(),
                pipelines,
                state: Mutex::new(SchedState {
                    queues,
                    busy: vec![false; n],
                    slot: 0,
                    rr: [0; 3],
                    waiting: 0,
                }),
                work: Condvar::new(),
                stopping: AtomicBool::new(false),
                busy_since: Mutex::new(Vec::new()),
                paused: (0..n).map(|_| AtomicBool::new(false)).collect(),
                sweeper: Mutex::new(None),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SchedState> {
        self.inner.state.lock()
    }

    pub fn pipelines(&self) -> &[Arc<Pipeline>] {
        &self.inner.pipelines
    }

    /// Queues a frame. `Err(frame)` only for `when_full = "block"` with a full
    /// queue: wait on [`Scheduler::space`] and try again.
    pub fn submit(&self, idx: usize, frame: Frame) -> Result<(), Frame> {
        let Some(p) = self.inner.pipelines.get(idx) else {
            return Ok(());
        };
        let lane = p.stats.cameras.index(&frame.stream);
        if let Some(c) = lane.and_then(|l| p.stats.cameras.0.get(l)) {
            c.frames_in.fetch_add(1, Ordering::Relaxed);
        }
        let (offer, waiting) = {
            let mut st = self.lock();
            let offer = st.queues[idx].offer(lane.unwrap_or(usize::MAX), frame);
            (offer, st.waiting > 0)
        };
        match offer {
            Offer::Queued => {}
            Offer::QueuedDroppedOldest(old) => {
                let reason = p.drop_oldest_reason();
                if let Some(c) = p.stats.cameras.get(&old.stream) {
                    c.add_drop(reason.label());
                }
                p.count_drop(reason, &format!("stream {}", old.stream));
                answer_dropped(old, reason);
            }
            Offer::Dropped(new) => {
                let reason = DropReason::QueueFullDropNewest;
                p.count_drop(reason, &format!("stream {}", new.stream));
                p.stats.frames_in.fetch_add(1, Ordering::Relaxed);
                answer_dropped(new, reason);
                return Ok(());
            }
            Offer::Full(f) => return Err(f),
        }
        p.stats.frames_in.fetch_add(1, Ordering::Relaxed);
        if waiting {
            self.inner.work.notify_one();
        }
        Ok(())
    }

    /// Pipeline `idx`'s way in, for its source.
    pub fn input(&self, idx: usize) -> Arc<dyn FrameSink> {
        Arc::new(PipelineInput {
            scheduler: self.clone(),
            idx,
            camera: None,
        })
    }

    /// The way in of camera `camera` (its place in the pipeline's
    /// cameras) of pipeline `idx`: its drops are counted on the camera too.
    pub fn camera_input(&self, idx: usize, camera: usize) -> Arc<dyn FrameSink> {
        Arc::new(PipelineInput {
            scheduler: self.clone(),
            idx,
            camera: Some(camera),
        })
    }

    /// Notified when a queue has room again.
    pub fn space(&self, idx: usize) -> Arc<Notify> {
        self.inner
            .spaces
            .get(idx)
            .cloned()
            .unwrap_or_else(|| Arc::new(Notify::new()))
    }

    /// Counts (and logs, rate-limited) a frame dropped before it reached a queue.
    pub fn count_drop(&self, idx: usize, reason: DropReason, detail: &str) {
        if let Some(p) = self.inner.pipelines.get(idx) {
            p.stats.frames_in.fetch_add(1, Ordering::Relaxed);
            p.count_drop(reason, detail);
        }
    }

    /// Takes over the per-stream hook state of `old`'s pipelines (the
    /// previous generation, stopped) where a pipeline of the same name has
    /// the same config; the streams of the others end (their last events
    /// stored). Run between the old generation's stop and this one's start.
    pub fn adopt_streams(&self, old: &Scheduler) -> usize {
        let mut adopted = 0;
        for o in old.pipelines() {
            match self.inner.pipelines.iter().find(|p| p.name() == o.name()) {
                Some(p) => adopted += p.adopt_streams(o),
                None => o.close_streams(),
            }
        }
        adopted
    }

    /// Ends every pipeline's per-stream hook state (their last events
    /// stored); for a stopped scheduler whose state is not taken over.
    pub fn close_streams(&self) {
        for p in &self.inner.pipelines {
            p.close_streams();
        }
    }

    pub fn queue_depth(&self, idx: usize) -> usize {
        self.lock().queues.get(idx).map(|q| q.len()).unwrap_or(0)
    }

    /// Starts the worker threads, each pinned and prioritised as `cfg` says,
    /// and the idle-stream sweeper (its handle is the last one).
    pub fn start_workers(
        &self,
        cfg: &SchedulerConfig,
        rt: &Arc<RealtimeStats>,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        let n = cfg.worker_count();
        *self.inner.busy_since.lock() = vec![None; n.max(1)];
        let mut handles = (0..n.max(1))
            .map(|w| {
                let s = self.clone();
                let cpu = (!cfg.cpus.is_empty()).then(|| cfg.cpus[w % cfg.cpus.len()]);
                let prio = cfg.realtime_priority;
                let rt = rt.clone();
                std::thread::Builder::new()
                    .name(format!("infer-{w}"))
                    .spawn(move || {
                        if let Some(c) = cpu {
                            super::realtime::pin_current_thread(c, &rt);
                        }
                        if let Some(p) = prio {
                            super::realtime::fifo_current_thread(p, &rt);
                        }
                        s.worker(w)
                    })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        let s = self.clone();
        let sweeper = std::thread::Builder::new()
            .name("streams".into())
            .spawn(move || s.sweep_streams())?;
        *self.inner.sweeper.lock() = Some(sweeper.thread().clone());
        handles.push(sweeper);
        Ok(handles)
    }

    /// Expires idle streams in every pipeline until the scheduler stops.
    fn sweep_streams(&self) {
        let every = sweep_interval(&self.inner.pipelines);
        while !self.inner.stopping.load(Ordering::SeqCst) {
            let mut expired = 0;
            for p in &self.inner.pipelines {
                expired += p.expire_idle_streams();
            }
            if expired >= TRIM_AFTER_EXPIRED {
                // The state of many streams was freed inside the workers'
                // malloc arenas, which glibc keeps: without this the RSS of
                // a burst of streams stays after they expire.
                #[cfg(target_env = "gnu")]
                // SAFETY: malloc_trim only returns free memory to the
                // system; it is thread-safe in glibc.
                unsafe {
                    libc::malloc_trim(0);
                }
            }
            // `stop` unparks: no waiting out the interval at shutdown.
            std::thread::park_timeout(every);
        }
    }

    /// The longest time any worker has spent on its current batch: a
    /// pipeline stuck in inference shows here, and the systemd watchdog
    /// stops being fed.
    pub fn longest_busy(&self) -> Duration {
        let now = Instant::now();
        self.inner
            .busy_since
            .lock()
            .iter()
            .flatten()
            .map(|t| now.duration_since(*t))
            .max()
            .unwrap_or_default()
    }

    /// Pauses or resumes a pipeline by name; false when there is none.
    pub fn set_paused(&self, name: &str, paused: bool) -> bool {
        let Some(i) = self.inner.pipelines.iter().position(|p| p.name() == name) else {
            return false;
        };
        self.inner.paused[i].store(paused, Ordering::SeqCst);
        self.inner.work.notify_all();
        true
    }

    pub fn is_paused(&self, idx: usize) -> bool {
        self.inner
            .paused
            .get(idx)
            .is_some_and(|p| p.load(Ordering::SeqCst))
    }

    /// Workers finish what is queued, then exit.
    pub fn stop(&self) {
        // Paused pipelines still finish what they hold: nothing queued is lost on stop.
        for p in &self.inner.paused {
            p.store(false, Ordering::SeqCst);
        }
        self.inner.stopping.store(true, Ordering::SeqCst);
        self.inner.work.notify_all();
        if let Some(t) = &*self.inner.sweeper.lock() {
            t.unpark();
        }
    }

    fn set_busy(&self, worker: usize, since: Option<Instant>) {
        if let Some(slot) = self.inner.busy_since.lock().get_mut(worker) {
            *slot = since;
        }
    }

    fn worker(&self, id: usize) {
        loop {
            let mut st = self.lock();
            let idx = loop {
                let tiers: Vec<usize> = self
                    .inner
                    .pipelines
                    .iter()
                    .map(|p| p.cfg.priority.tier())
                    .collect();
                let runnable: Vec<bool> = st
                    .queues
                    .iter()
                    .zip(&st.busy)
                    .enumerate()
                    .map(|(i, (q, b))| {
                        !q.is_empty() && !b && !self.inner.paused[i].load(Ordering::Relaxed)
                    })
                    .collect();
                let SchedState { slot, rr, .. } = &mut *st;
                if let Some(i) = pick(&tiers, &runnable, slot, rr) {
                    break i;
                }
                if self.inner.stopping.load(Ordering::SeqCst)
                    && st.queues.iter().all(|q| q.is_empty())
                    && !st.busy.iter().any(|b| *b)
                {
                    return;
                }
                st.waiting += 1;
                self.inner
                    .work
                    .wait_for(&mut st, Duration::from_millis(100));
                st.waiting -= 1;
            };
            let p = self.inner.pipelines[idx].clone();
            let max = p.take_limit();
            let mut frames = st.queues[idx].take(max);
            // Held before any wait below releases the lock: no other worker
            // may take a serial pipeline's frames meanwhile.
            if p.serial() {
                st.busy[idx] = true;
            }
            // Micro-batching: wait up to max_delay for the batch to fill.
            if p.batchable() && p.wants_more(&frames) && !p.cfg.max_delay.is_zero() {
                let deadline = Instant::now() + p.cfg.max_delay;
                while p.wants_more(&frames) && !self.inner.stopping.load(Ordering::SeqCst) {
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    st.waiting += 1;
                    self.inner.work.wait_for(&mut st, deadline - now);
                    st.waiting -= 1;
                    let more = st.queues[idx].take(max - frames.len());
                    frames.extend(more);
                }
            }
            drop(st);
            self.inner.spaces[idx].notify_waiters();
            self.set_busy(id, Some(Instant::now()));
            p.process(frames, id);
            self.set_busy(id, None);
            if p.serial() {
                let mut st = self.lock();
                st.busy[idx] = false;
                let waiting = st.waiting > 0;
                drop(st);
                if waiting {
                    self.inner.work.notify_all();
                }
            }
        }
    }
}

/// Tells whoever waits for a frame that the queue's policy dropped it, so a
/// source can tell that from a frame left unanswered by a stopping daemon
/// (a QoS 1 source acknowledges the first, never the second).
fn answer_dropped(frame: Frame, reason: DropReason) {
    if let Some(tx) = frame.reply {
        let _ = tx.send(Err(reason.queue_error()));
    }
}

/// One pipeline's input: what its source sees of the scheduler.
struct PipelineInput {
    scheduler: Scheduler,
    idx: usize,
    /// A camera of a pipeline reading several: its place among them.
    camera: Option<usize>,
}

impl FrameSink for PipelineInput {
    fn offer(&self, frame: Frame) -> Result<(), Frame> {
        self.scheduler.submit(self.idx, frame)
    }

    fn space(&self) -> Arc<Notify> {
        self.scheduler.space(self.idx)
    }

    fn count_drop(&self, reason: &'static str, detail: &str) {
        let reason = DropReason::from_source(reason);
        if let Some(c) = self.camera.and_then(|c| {
            let p = self.scheduler.pipelines().get(self.idx)?;
            p.stats.cameras.0.get(c).cloned()
        }) {
            c.frames_in.fetch_add(1, Ordering::Relaxed);
            c.add_drop(reason.label());
        }
        self.scheduler.count_drop(self.idx, reason, detail);
    }

    fn set_state(&self, state: &'static str) {
        if let Some(p) = self.scheduler.pipelines().get(self.idx) {
            p.stats.set_source_state(state);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(tiers: &[usize], runnable: &[bool], picks: usize) -> Vec<usize> {
        let (mut slot, mut rr) = (0, [0; 3]);
        (0..picks)
            .filter_map(|_| pick(tiers, runnable, &mut slot, &mut rr))
            .collect()
    }

    #[test]
    fn weights_share_the_wheel() {
        // Pipelines: 0 realtime, 1 normal, 2 batch, all with work.
        let picks = run(&[0, 1, 2], &[true, true, true], 13 * 10);
        let count = |i| picks.iter().filter(|p| **p == i).count();
        assert_eq!((count(0), count(1), count(2)), (80, 40, 10));
    }

    #[test]
    fn idle_tiers_give_their_turns_away() {
        let picks = run(&[0, 1, 2], &[false, false, true], 20);
        assert!(picks.iter().all(|p| *p == 2) && picks.len() == 20);
        assert_eq!(run(&[0, 2], &[false, false], 5), Vec::<usize>::new());
    }

    #[test]
    fn round_robin_within_a_tier() {
        let picks = run(&[1, 1, 1], &[true, true, true], 6);
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }
}

#[cfg(test)]
mod engine_tests;
