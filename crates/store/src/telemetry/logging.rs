//! tracing to stderr: plain text for terminals; under systemd (JOURNAL_STREAM
//! set) no timestamps (journald adds its own) and a `<N>` syslog priority
//! prefix on each line, so `journalctl -p warning` works; JSON for collectors.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// The syslog priority journald reads from a `<N>` line prefix.
pub fn syslog_priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Prefixes each event with its journald priority, then formats it as `inner` does.
struct Journald<F>(F);

impl<S, N, F> FormatEvent<S, N> for Journald<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "<{}>", syslog_priority(event.metadata().level()))?;
        self.0.format_event(ctx, writer, event)
    }
}

/// How log lines are written: plain text (journald-friendly when under
/// systemd) or one JSON object per line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides the verbosity.
pub fn init(format: LogFormat, verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info,ort=warn",
        _ => "debug,ort=info",
    };
    init_with_default(format, default);
}

/// As [`init`], with the default filter given (the daemon logs at info).
pub fn init_with_default(format: LogFormat, default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let under_journald = std::env::var_os("JOURNAL_STREAM").is_some();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text if under_journald => builder
            .event_format(Journald(
                tracing_subscriber::fmt::format()
                    .without_time()
                    .with_level(false)
                    .with_ansi(false),
            ))
            .try_init(),
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
    };
}

/// Logs at most once per interval per reason, with the count suppressed since.
#[derive(Debug)]
pub struct RateLimitedLog {
    every: Duration,
    last: Mutex<BTreeMap<&'static str, (Instant, u64)>>,
}

impl RateLimitedLog {
    pub fn new(every: Duration) -> Self {
        RateLimitedLog {
            every,
            last: Mutex::new(BTreeMap::new()),
        }
    }

    /// Some(suppressed count) when this event should be logged now.
    pub fn allow(&self, reason: &'static str) -> Option<u64> {
        let mut m = self.last.lock();
        let now = Instant::now();
        match m.get_mut(reason) {
            Some((t, n)) if now.duration_since(*t) < self.every => {
                *n += 1;
                None
            }
            Some((t, n)) => {
                let suppressed = *n;
                *t = now;
                *n = 0;
                Some(suppressed)
            }
            None => {
                m.insert(reason, (now, 0));
                Some(0)
            }
        }
    }
}

/// Logs a failure that repeats (a camera that stays down and reconnects
/// every few seconds) at intervals that grow: the first failure at once,
/// then at most one line per interval, the interval doubling from `first`
/// up to `cap`; a success ends the run and is worth a line of its own.
/// The state (counters, status) keeps every failure; the log only says
/// that it goes on. Free of I/O: the time is an argument, which the caller
/// reads from its `Clocks`.
#[derive(Debug, Clone)]
pub struct BackoffLog {
    first: Duration,
    cap: Duration,
    /// The failures since the last success; `None` while none.
    run: Option<FailureRun>,
}

#[derive(Debug, Clone)]
struct FailureRun {
    since: Instant,
    failures: u64,
    /// Failures not logged since the last line.
    unlogged: u64,
    /// The interval after the last line, and the time the next line may
    /// come.
    gap: Duration,
    next: Instant,
}

/// A failure to log now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Failure {
    /// Failures in this run, this one included.
    pub failures: u64,
    /// Failures since the last line that were not logged.
    pub unlogged: u64,
    /// How long the run has lasted.
    pub since: Duration,
    /// When the next line may come at the earliest.
    pub next_in: Duration,
}

/// A run of failures that a success ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    pub failures: u64,
    /// From the first failure to the success.
    pub after: Duration,
}

impl BackoffLog {
    pub fn new(first: Duration, cap: Duration) -> BackoffLog {
        BackoffLog {
            first,
            cap: cap.max(first),
            run: None,
        }
    }

    /// A failure at `now`: `Some` when it is to be logged.
    pub fn failed(&mut self, now: Instant) -> Option<Failure> {
        let Some(run) = &mut self.run else {
            self.run = Some(FailureRun {
                since: now,
                failures: 1,
                unlogged: 0,
                gap: self.first,
                next: now + self.first,
            });
            return Some(Failure {
                failures: 1,
                unlogged: 0,
                since: Duration::ZERO,
                next_in: self.first,
            });
        };
        run.failures += 1;
        if now < run.next {
            run.unlogged += 1;
            return None;
        }
        let unlogged = std::mem::take(&mut run.unlogged);
        run.gap = run.gap.saturating_mul(2).min(self.cap);
        run.next = now + run.gap;
        Some(Failure {
            failures: run.failures,
            unlogged,
            since: now.saturating_duration_since(run.since),
            next_in: run.gap,
        })
    }

    /// A success at `now`: `Some` when it ended a run of failures.
    pub fn succeeded(&mut self, now: Instant) -> Option<Recovery> {
        self.run.take().map(|run| Recovery {
            failures: run.failures,
            after: now.saturating_duration_since(run.since),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::clocks::{Clocks, SimulatedClocks};

    /// A camera down for an hour, retried every 8 s: its first failure is
    /// logged, then one line after 1, 2, 4 and 8 minutes, then one every 10.
    #[test]
    fn a_failure_that_goes_on_is_logged_at_doubling_intervals_up_to_the_cap() {
        let clocks = SimulatedClocks::new(1_796_083_200_000_000);
        let t0 = clocks.monotonic();
        let min = Duration::from_secs(60);
        let mut log = BackoffLog::new(min, 10 * min);
        let mut lines = Vec::new();
        let mut attempts = 0u64;
        while clocks.monotonic() - t0 < 60 * min {
            attempts += 1;
            if let Some(f) = log.failed(clocks.monotonic()) {
                lines.push((clocks.monotonic() - t0, f));
            }
            clocks.advance(Duration::from_secs(8));
        }
        let at: Vec<u64> = lines.iter().map(|(t, _)| t.as_secs()).collect();
        // 8-second steps: the first attempt at or after each due time.
        assert_eq!(at, [0, 64, 184, 424, 904, 1504, 2104, 2704, 3304]);
        let gaps: Vec<u64> = lines.iter().map(|(_, f)| f.next_in.as_secs()).collect();
        assert_eq!(gaps, [60, 120, 240, 480, 600, 600, 600, 600, 600]);
        // Each line counts the failures it stands for.
        assert_eq!(lines[0].1.failures, 1);
        assert_eq!(lines[1].1.unlogged, 7);
        assert_eq!(lines[1].1.failures, 9);
        assert_eq!(lines[8].1.since, Duration::from_secs(3304));
        let logged: u64 = lines.iter().map(|(_, f)| 1 + f.unlogged).sum();
        assert_eq!(logged, lines.last().unwrap().1.failures);
        assert_eq!(attempts, 450);
        // The success that ends it says how long and how many; the next
        // failure is news again, logged at once.
        let r = log.succeeded(clocks.monotonic()).unwrap();
        assert_eq!(r.failures, 450);
        assert_eq!(r.after, Duration::from_secs(3600));
        assert_eq!(log.succeeded(clocks.monotonic()), None);
        let f = log.failed(clocks.monotonic()).unwrap();
        assert_eq!((f.failures, f.unlogged, f.next_in), (1, 0, min));
        assert_eq!(log.failed(clocks.monotonic()), None);
    }

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(syslog_priority(&Level::ERROR), 3);
        assert_eq!(syslog_priority(&Level::WARN), 4);
        assert_eq!(syslog_priority(&Level::INFO), 6);
        assert_eq!(syslog_priority(&Level::DEBUG), 7);
    }
}
