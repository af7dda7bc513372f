//! What a camera's log and outbox say of its ups and downs: a
//! `camera_down` / `camera_up` record per transition, a log line when it
//! goes down and when it comes back, and, while it stays down, lines at
//! growing intervals rather than one per reconnect. Its status and
//! metrics count every reconnect.

use std::time::Duration;

use super::fanout::Shared;
use crate::clock::clocks::Clocks;
use crate::telemetry::logging::BackoffLog;

/// A camera that stays down logs its first failure, then one line after
/// this long, the interval doubling up to [`FAILURES_LOGGED_AT_MOST`]:
/// 48 cameras with 47 of them dead, each retried within 8 s, wrote 510-700
/// lines a minute (160-220 MiB a day), all saying the same; now 47 lines
/// every 10 minutes once the interval is at its cap. Its status and metrics
/// keep every failure; its recovery is logged.
const FAILURE_LOG_FIRST: Duration = Duration::from_secs(60);
const FAILURES_LOGGED_AT_MOST: Duration = Duration::from_secs(600);

/// What has been said of the camera's ups and downs: its last `camera_up`
/// / `camera_down` record, and its failures in the log.
pub(super) struct Said<'c> {
    /// None: nothing reported yet; Some(up).
    reported: Option<bool>,
    failures: BackoffLog,
    clocks: &'c dyn Clocks,
}

impl<'c> Said<'c> {
    pub(super) fn new(clocks: &'c dyn Clocks) -> Said<'c> {
        Said {
            reported: None,
            failures: BackoffLog::new(FAILURE_LOG_FIRST, FAILURES_LOGGED_AT_MOST),
            clocks,
        }
    }

    /// A failed run, retried in `delay`.
    pub(super) fn down(&mut self, sh: &Shared, error: &str, delay: Duration, permanent: bool) {
        if let Some(f) = self.failures.failed(self.clocks.monotonic()) {
            if permanent {
                tracing::error!(
                    camera = %sh.shown,
                    name = %sh.def.name,
                    pipelines = %sh.pipelines(),
                    error = %error,
                    failed_attempts = f.failures,
                    retry_in_s = delay.as_secs(),
                    "camera failed permanently (another try cannot mend this); retrying slowly"
                );
            } else if f.failures == 1 {
                tracing::warn!(
                    camera = %sh.shown,
                    name = %sh.def.name,
                    pipelines = %sh.pipelines(),
                    error = %error,
                    retry_in_ms = delay.as_millis() as u64,
                    "camera down; reconnecting"
                );
            } else {
                tracing::warn!(
                    camera = %sh.shown,
                    name = %sh.def.name,
                    pipelines = %sh.pipelines(),
                    error = %error,
                    failed_attempts = f.failures,
                    not_logged = f.unlogged,
                    down_s = f.since.as_secs(),
                    next_line_in_s = f.next_in.as_secs(),
                    "camera still down; reconnecting"
                );
            }
        }
        if self.reported != Some(false) {
            sh.event(Some(error));
            self.reported = Some(false);
        }
    }

    /// The first frame of a run.
    pub(super) fn up(&mut self, sh: &Shared) {
        match self.failures.succeeded(self.clocks.monotonic()) {
            Some(r) => tracing::info!(
                camera = %sh.shown,
                name = %sh.def.name,
                failed_attempts = r.failures,
                down_s = r.after.as_secs_f64(),
                "camera streaming again"
            ),
            None => tracing::info!(camera = %sh.shown, name = %sh.def.name, "camera streaming"),
        }
        if self.reported != Some(true) {
            sh.event(None);
            self.reported = Some(true);
        }
    }
}
