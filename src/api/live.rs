//! The console's live feed: one producer for every open console.
//!
//! Every [`PERIOD`] a single task samples the daemon (frames/s in and out
//! and the p99 end-to-end latency of the frames finished in that second,
//! per pipeline; outbox backlog; acked/s; CPU) into a ring of the last ten
//! minutes. Only while at least one console is connected does it also render
//! the status (the same JSON as `/v1/status`) with the newest records, once,
//! and publish that text on a watch channel: twenty consoles cost one
//! rendering and twenty copies of a few kilobytes per second, not twenty
//! renderings.
//!
//! Bounds: a watch channel holds only the latest tick, so a slow console
//! skips ticks instead of queueing them; at most [`MAX_CLIENTS`] event
//! streams at once (more are answered 503); the history is [`HISTORY_POINTS`]
//! points. The sampler runs on the async runtime and only reads counters and
//! takes the histograms' locks as `/metrics` does, so it never holds up
//! inference (which runs on its own threads).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use parking_lot::Mutex;
use tokio::sync::watch;

use super::ApiState;
use crate::pipeline::PipelineStats;
use crate::telemetry::system::{self, CpuTimes};

/// How often the feed samples and publishes.
pub const PERIOD: Duration = Duration::from_secs(1);
/// Ten minutes of points.
pub const HISTORY_POINTS: usize = 600;
/// Event streams served at once.
pub const MAX_CLIENTS: usize = 64;
/// Records of each pipeline carried by a tick.
const RECORDS_PER_TICK: usize = 5;

/// The shared producer and what it keeps.
pub struct Live {
    pub(super) state: ApiState,
    tick: watch::Sender<Option<Arc<str>>>,
    history: Mutex<VecDeque<Arc<str>>>,
    clients: AtomicUsize,
}

/// What the sampler remembers from the previous sample.
#[derive(Default)]
struct Sampler {
    at: Option<(Instant, SystemTime)>,
    pipelines: HashMap<String, PrevPipeline>,
    acked_total: Option<u64>,
    cpu: Option<CpuTimes>,
    process_cpu_s: Option<f64>,
}

struct PrevPipeline {
    frames_in: u64,
    frames_done: u64,
    e2e: Vec<(u64, u64)>,
}

impl Live {
    /// Starts the sampler; it ends when the daemon stops or the API is gone.
    pub fn start(state: ApiState) -> Arc<Live> {
        let (tick, _) = watch::channel(None);
        let stop = state.shutdown.clone();
        let live = Arc::new(Live {
            state,
            tick,
            history: Mutex::new(VecDeque::with_capacity(HISTORY_POINTS)),
            clients: AtomicUsize::new(0),
        });
        let weak = Arc::downgrade(&live);
        tokio::spawn(async move {
            let mut sampler = Sampler::default();
            let mut every = tokio::time::interval(PERIOD);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tokio::select! {
                    _ = every.tick() => {}
                    _ = stop.cancelled() => return,
                }
                let Some(live) = weak.upgrade() else { return };
                live.sample(&mut sampler);
            }
        });
        live
    }

    /// Consoles connected now.
    pub fn clients(&self) -> usize {
        self.clients.load(Ordering::Relaxed)
    }

    fn sample(&self, s: &mut Sampler) {
        let now = (Instant::now(), SystemTime::now());
        let dt =
            s.at.map(|(t, _)| now.0.duration_since(t).as_secs_f64())
                .filter(|d| *d > 0.0);
        let rate = |cur: u64, prev: Option<u64>| -> serde_json::Value {
            match (prev, dt) {
                // A counter that went down belongs to a new pipeline (reload).
                (Some(p), Some(dt)) => round2(cur.checked_sub(p).unwrap_or(cur) as f64 / dt),
                _ => serde_json::Value::Null,
            }
        };
        let sched = self.state.scheduler();
        let mut pipelines = serde_json::Map::new();
        let mut next = HashMap::new();
        for p in sched.pipelines() {
            let st = &p.stats;
            let (fin, fdone) = (
                PipelineStats::get(&st.frames_in),
                PipelineStats::get(&st.frames_done),
            );
            let e2e = st.e2e_us.recorded();
            let prev = s.pipelines.get(p.name());
            let p99 = prev
                .and_then(|prev| interval_quantile(&prev.e2e, &e2e, 0.99))
                .map_or(serde_json::Value::Null, serde_json::Value::from);
            pipelines.insert(
                p.name().to_string(),
                serde_json::json!([
                    rate(fin, prev.map(|x| x.frames_in)),
                    rate(fdone, prev.map(|x| x.frames_done)),
                    p99
                ]),
            );
            next.insert(
                p.name().to_string(),
                PrevPipeline {
                    frames_in: fin,
                    frames_done: fdone,
                    e2e,
                },
            );
        }
        s.pipelines = next;
        let o = self.state.outbox.stats();
        let acked_per_s = rate(o.acked_total, s.acked_total);
        s.acked_total = Some(o.acked_total);
        let cpu_now = system::cpu_times();
        let cpu = match (s.cpu, cpu_now) {
            (Some(a), Some(b)) => b.percent_since(&a).map(round2),
            _ => None,
        };
        s.cpu = cpu_now;
        let proc_now = crate::telemetry::device::process().cpu_seconds;
        let process_cpu = match (s.process_cpu_s, proc_now, dt) {
            (Some(a), Some(b), Some(dt)) => Some(round2((b - a).max(0.0) * 100.0 / dt)),
            _ => None,
        };
        s.process_cpu_s = proc_now;
        s.at = Some(now);
        let t_ms = now
            .1
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let point = serde_json::json!({
            "t": t_ms,
            "backlog": o.records,
            "acked_per_s": acked_per_s,
            "cpu": cpu,
            "process_cpu": process_cpu,
            "pipelines": pipelines,
        });
        let point: Arc<str> = point.to_string().into();
        {
            let mut h = self.history.lock();
            if h.len() >= HISTORY_POINTS {
                h.pop_front();
            }
            h.push_back(point.clone());
        }
        if self.tick.receiver_count() == 0 {
            // Nobody listens: drop the last tick, so the next console to
            // connect does not start from an old one.
            self.tick.send_replace(None);
            return;
        }
        // Plain structs with string keys: serializing cannot fail.
        let status = serde_json::to_string(&super::status::Status::read(&self.state))
            .unwrap_or_else(|_| "null".into());
        let mut text = String::with_capacity(status.len() + point.len() + 1024);
        text.push_str("{\"status\":");
        text.push_str(&status);
        text.push_str(",\"point\":");
        text.push_str(&point);
        text.push_str(",\"records\":{");
        for (i, p) in sched.pipelines().iter().enumerate() {
            if i > 0 {
                text.push(',');
            }
            text.push_str(&serde_json::Value::from(p.name()).to_string());
            text.push(':');
            text.push_str(&self.state.recent.latest_json(p.name(), RECORDS_PER_TICK));
        }
        text.push_str("}}");
        self.tick.send_replace(Some(text.into()));
    }

    /// The history as one JSON array, oldest first.
    fn history_json(&self) -> String {
        let h = self.history.lock();
        let mut out = String::with_capacity(2 + h.iter().map(|p| p.len() + 1).sum::<usize>());
        out.push('[');
        for (i, p) in h.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(p);
        }
        out.push(']');
        out
    }
}

fn round2(x: f64) -> serde_json::Value {
    serde_json::Value::from((x * 100.0).round() / 100.0)
}

/// The `q` quantile of what was recorded between two readings of one
/// histogram's buckets (`earlier` and `now`, ascending by value). A bucket
/// that went down means the histogram is a new one: `now` alone counts.
pub fn interval_quantile(earlier: &[(u64, u64)], now: &[(u64, u64)], q: f64) -> Option<u64> {
    let mut deltas = Vec::with_capacity(now.len());
    let mut j = 0;
    let mut reset = false;
    for &(v, c) in now {
        while j < earlier.len() && earlier[j].0 < v {
            // A bucket gone from `now` was emptied: a reset.
            reset = true;
            j += 1;
        }
        let before = match earlier.get(j) {
            Some(&(ev, ec)) if ev == v => {
                j += 1;
                ec
            }
            _ => 0,
        };
        if c < before {
            reset = true;
        }
        deltas.push((v, c.saturating_sub(before)));
    }
    if reset || j < earlier.len() {
        deltas = now.to_vec();
    }
    let total: u64 = deltas.iter().map(|d| d.1).sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
    let mut seen = 0;
    for (v, c) in deltas {
        seen += c;
        if seen >= rank {
            return Some(v);
        }
    }
    None
}

/// Decrements the client count when an event stream ends.
struct ClientSlot(Arc<Live>);

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.0.clients.fetch_sub(1, Ordering::Relaxed);
    }
}

struct Stream {
    rx: watch::Receiver<Option<Arc<str>>>,
    stop: tokio_util::sync::CancellationToken,
    pending: VecDeque<Event>,
    _slot: ClientSlot,
}

/// `GET /v1/events`: Server-Sent Events. First `history` (the last ten
/// minutes of points), then a `tick` every [`PERIOD`]:
/// `{"status": <as /v1/status>, "point": {...}, "records": {pipeline: [...]}}`.
pub async fn events(State(live): State<Arc<Live>>) -> Response {
    if live.clients.fetch_add(1, Ordering::Relaxed) >= MAX_CLIENTS {
        live.clients.fetch_sub(1, Ordering::Relaxed);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": "too many open consoles"})),
        )
            .into_response();
    }
    let slot = ClientSlot(live.clone());
    let rx = live.tick.subscribe();
    let mut pending = VecDeque::new();
    pending.push_back(
        Event::default()
            .event("history")
            .retry(Duration::from_secs(2))
            .data(live.history_json()),
    );
    if let Some(t) = rx.borrow().clone() {
        pending.push_back(Event::default().event("tick").data(&*t));
    }
    let st = Stream {
        rx,
        stop: live.state.shutdown.clone(),
        pending,
        _slot: slot,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.pending.pop_front() {
                return Some((Ok::<Event, std::convert::Infallible>(ev), st));
            }
            tokio::select! {
                r = st.rx.changed() => if r.is_err() { return None },
                _ = st.stop.cancelled() => return None,
            }
            let t = st.rx.borrow_and_update().clone();
            if let Some(t) = t {
                st.pending
                    .push_back(Event::default().event("tick").data(&*t));
            }
        }
    });
    Sse::new(stream).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_of_what_was_recorded_in_between() {
        let earlier = [(10, 100), (20, 5)];
        let now = [(10, 100), (20, 5), (500, 10), (900, 1)];
        // In between: ten at 500, one at 900.
        assert_eq!(interval_quantile(&earlier, &now, 0.5), Some(500));
        assert_eq!(interval_quantile(&earlier, &now, 0.99), Some(900));
        assert_eq!(interval_quantile(&earlier, &now, 0.0), Some(500));
        // Nothing new.
        assert_eq!(interval_quantile(&now, &now, 0.99), None);
        // First reading: everything counts.
        assert_eq!(interval_quantile(&[], &[(7, 3)], 0.99), Some(7));
    }

    #[test]
    fn a_histogram_that_shrank_is_a_new_one() {
        // A reload replaced the pipeline: its histogram started over.
        let earlier = [(10, 100), (20, 5)];
        let now = [(30, 2)];
        assert_eq!(interval_quantile(&earlier, &now, 0.99), Some(30));
        let now = [(10, 3)];
        assert_eq!(interval_quantile(&earlier, &now, 0.99), Some(10));
    }
}
