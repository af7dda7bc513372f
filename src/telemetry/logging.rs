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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(syslog_priority(&Level::ERROR), 3);
        assert_eq!(syslog_priority(&Level::WARN), 4);
        assert_eq!(syslog_priority(&Level::INFO), 6);
        assert_eq!(syslog_priority(&Level::DEBUG), 7);
    }
}
