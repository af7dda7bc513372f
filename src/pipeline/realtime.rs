//! Real-time settings of the inference threads (`[scheduler] cpus`,
//! `realtime_priority`, `lock_memory`), for sites that need a latency bound
//! under load. `realtime_priority` also applies to the daemon's I/O threads
//! (sources, local outputs, uplink, API), which carry every frame to the
//! inference threads and every record out of them; threads started from
//! them (the outbox writer, sled's I/O threads, GStreamer's) inherit it.
//!
//! Each setting that the system refuses (no `CAP_SYS_NICE` for SCHED_FIFO,
//! no `CAP_IPC_LOCK` or too small `RLIMIT_MEMLOCK` for mlockall, a CPU that
//! is not there) is logged with what to do about it and counted in
//! `outpost_scheduler_setup_errors_total{setting}`; the daemon keeps
//! running with normal scheduling. Nothing here spins: idle workers sleep
//! on a condition variable.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;

use crate::telemetry::metrics::{MetricSource, counter};

/// Refusals of the real-time settings, by setting.
#[derive(Debug, Default)]
pub struct RealtimeStats {
    errors: Mutex<BTreeMap<&'static str, u64>>,
    /// An I/O thread's refusal was logged (every thread of the runtime
    /// asks; one log line says it).
    io_refused: AtomicBool,
}

impl RealtimeStats {
    fn failed(&self, setting: &'static str, detail: String) {
        *self.errors.lock().entry(setting).or_default() += 1;
        tracing::error!(setting, "{detail}; continuing without it");
    }

    pub fn errors(&self) -> BTreeMap<&'static str, u64> {
        self.errors.lock().clone()
    }
}

impl MetricSource for RealtimeStats {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut rows: Vec<(Vec<(&'static str, String)>, u64)> = Vec::new();
        for s in ["cpus", "realtime_priority", "lock_memory"] {
            rows.push((
                vec![("setting", s.to_string())],
                self.errors().get(s).copied().unwrap_or(0),
            ));
        }
        counter(
            enc,
            "outpost_scheduler_setup_errors",
            "Real-time settings the system refused ([scheduler] cpus, realtime_priority, lock_memory)",
            &rows,
        )
    }
}

fn os_error(what: &str) -> String {
    let e = std::io::Error::last_os_error();
    format!("{what}: {e}")
}

/// Pins the calling thread to one CPU.
pub fn pin_current_thread(cpu: usize, stats: &RealtimeStats) {
    // SAFETY: cpu_set_t is plain data; CPU_SET checks nothing but we bound
    // `cpu` by the set's size first; sched_setaffinity(0, ..) affects only
    // the calling thread.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
            -1
        } else {
            libc::CPU_SET(cpu, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
        }
    };
    if ok != 0 {
        stats.failed(
            "cpus",
            os_error(&format!(
                "cannot pin an inference thread to CPU {cpu} (is it online and in this service's cpuset?)"
            )),
        );
    }
}

/// Makes the calling thread SCHED_FIFO at `priority`; false when refused
/// (errno says why).
fn set_fifo(priority: u32) -> bool {
    let param = libc::sched_param {
        sched_priority: priority as libc::c_int,
    };
    // SAFETY: a valid sched_param; pid 0 is the calling thread.
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0 }
}

/// Counts and logs a refused SCHED_FIFO for `threads`.
fn fifo_refused(threads: &str, priority: u32, stats: &RealtimeStats) {
    stats.failed(
        "realtime_priority",
        os_error(&format!(
            "cannot run {threads} at SCHED_FIFO priority {priority} (needs CAP_SYS_NICE or RLIMIT_RTPRIO >= {priority}; under systemd see systemd/outpost-realtime.conf)"
        )),
    );
}

/// Makes the calling thread SCHED_FIFO at `priority` (1..=99).
pub fn fifo_current_thread(priority: u32, stats: &RealtimeStats) {
    if !set_fifo(priority) {
        fifo_refused("inference threads", priority, stats);
    }
}

/// Makes the calling I/O thread SCHED_FIFO at `priority`. Runs on every
/// thread the I/O runtime starts; a refusal is counted and logged once.
pub fn fifo_io_thread(priority: u32, stats: &RealtimeStats) {
    if !set_fifo(priority) && !stats.io_refused.swap(true, Ordering::Relaxed) {
        fifo_refused("the I/O threads", priority, stats);
    }
}

/// Locks every page of the process, now and later, into memory.
pub fn lock_memory(stats: &RealtimeStats) {
    // SAFETY: mlockall takes flags only.
    let rc = unsafe { libc::mlockall(libc::MCL_CURRENT | libc::MCL_FUTURE) };
    if rc != 0 {
        stats.failed(
            "lock_memory",
            os_error(
                "cannot lock the daemon's memory (mlockall needs CAP_IPC_LOCK or LimitMEMLOCK=infinity; under systemd see systemd/outpost-realtime.conf)",
            ),
        );
    } else {
        tracing::info!("memory locked (mlockall)");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_counted_not_fatal() {
        let s = RealtimeStats::default();
        // CPU 100000 is beyond any cpu_set_t: refused, counted.
        pin_current_thread(100_000, &s);
        assert_eq!(s.errors().get("cpus"), Some(&1));
        // Pinning to CPU 0 of this machine works (it is in every cpuset here).
        let t = std::thread::spawn(|| {
            let s = RealtimeStats::default();
            pin_current_thread(0, &s);
            s.errors()
        });
        assert!(t.join().unwrap().is_empty());
    }

    #[test]
    fn io_thread_refusals_are_counted_once() {
        // Priority 100 is out of SCHED_FIFO's range even for root: refused
        // on every thread, counted and logged once.
        let s = std::sync::Arc::new(RealtimeStats::default());
        for _ in 0..3 {
            let s = s.clone();
            std::thread::spawn(move || fifo_io_thread(100, &s))
                .join()
                .unwrap();
        }
        assert_eq!(s.errors().get("realtime_priority"), Some(&1));
    }
}
