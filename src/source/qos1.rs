//! The I/O side of a QoS 1 mqtt source's acknowledgements: the tasks that
//! wait for each frame's answer and for the outbox commit that makes its
//! records durable, and the acknowledgements handed to the MQTT client, in
//! the order [`super::acks`] releases them. The mqtt source drives it from
//! its event loop, which keeps running while these complete.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rumqttc::{AsyncClient, Publish};
use tokio::task::{JoinHandle, JoinSet};

use super::acks::{Acks, Outcome, Slot};
use super::{Frame, FrameError};
use crate::backoff::Backoff;
use crate::outbox::{Outbox, OutboxError};
use crate::record::ResultRecord;
use crate::telemetry::logging::RateLimitedLog;

/// A frame's answer, for the slot it was handed in under.
type Answered = (Slot, Option<Result<Vec<ResultRecord>, FrameError>>);

/// What woke the acknowledgement side.
pub enum Wake {
    Answer(Answered),
    /// The durability wait for this ticket ended.
    Committed(u64, Result<(), OutboxError>),
    /// A message waiting for another try is due, or a failed wait may be
    /// tried again.
    Timer,
}

/// The QoS 1 side of a running source: the acknowledgement window and the
/// tasks that complete it.
pub struct Window {
    pub acks: Acks<Publish>,
    /// One task per frame in the pipeline, waiting for its answer.
    answers: JoinSet<Answered>,
    outbox: Option<Outbox>,
    /// The durability wait in progress and the ticket it covers.
    commit: Option<(u64, JoinHandle<Result<(), OutboxError>>)>,
    /// After a failed wait: the next one not before this.
    commit_after: Option<Instant>,
    commit_backoff: Backoff,
    /// Acknowledgements the client's request queue had no room for yet
    /// (only this loop's poll drains it, so one must never be lost).
    unsent: VecDeque<Publish>,
    /// Acknowledgements handed to the client, and those it has written.
    pub handed: u64,
    pub written: u64,
    log: RateLimitedLog,
}

impl Window {
    pub fn new(outbox: Option<Outbox>) -> Window {
        Window {
            acks: Acks::new(),
            answers: JoinSet::new(),
            outbox,
            commit: None,
            commit_after: None,
            commit_backoff: Backoff::new(Duration::from_millis(50), Duration::from_secs(5)),
            unsent: VecDeque::new(),
            handed: 0,
            written: 0,
            log: RateLimitedLog::new(Duration::from_secs(5)),
        }
    }

    /// A frame of stream `stream` for the message in `slot`, whose answer
    /// comes back here.
    pub fn frame(&mut self, slot: Slot, p: &Publish, stream: String) -> Frame {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut frame = Frame::new(stream, p.payload.clone());
        frame.reply = Some(tx);
        self.answers.spawn(async move { (slot, rx.await.ok()) });
        frame
    }

    /// Hands the ready acknowledgements to the client, in order, and starts
    /// the durability wait that stored frames need.
    pub fn advance(&mut self, client: &AsyncClient) {
        // An acknowledgement needs the packet id, not the payload.
        self.unsent
            .extend(self.acks.take_ready().into_iter().map(|mut p| {
                p.payload = bytes::Bytes::new();
                p
            }));
        while let Some(p) = self.unsent.front() {
            if client.try_ack(p).is_err() {
                break;
            }
            self.handed += 1;
            self.unsent.pop_front();
        }
        if self.commit.is_some() || self.commit_after.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let Some(ticket) = self.acks.wanted() else {
            return;
        };
        self.commit_after = None;
        match self.outbox.clone() {
            Some(ob) => {
                let wait = tokio::task::spawn_blocking(move || ob.wait_committed());
                self.commit = Some((ticket, wait));
            }
            // No store to wait for (not the daemon's case).
            None => self.acks.durable(ticket),
        }
    }

    /// The next answer, finished durability wait or due retry.
    pub async fn wake(&mut self) -> Wake {
        let retry = match (self.acks.next_retry(), self.commit_after) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let Window {
            answers, commit, ..
        } = self;
        let waiting = commit.is_some();
        let wait = async {
            match commit.as_mut() {
                Some((t, h)) => {
                    let r = match h.await {
                        Ok(r) => r,
                        Err(e) => Err(OutboxError::Flush(format!("durability wait: {e}"))),
                    };
                    (*t, r)
                }
                None => std::future::pending().await,
            }
        };
        let sleep = async {
            match retry {
                Some(t) => tokio::time::sleep_until(t.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            Some(j) = answers.join_next(), if !answers.is_empty() => match j {
                Ok(a) => Wake::Answer(a),
                // The waiting task cannot fail; if it did, its frame
                // stays unacknowledged until the connection ends.
                Err(_) => Wake::Timer,
            },
            (t, r) = wait, if waiting => {
                *commit = None;
                Wake::Committed(t, r)
            }
            _ = sleep => Wake::Timer,
        }
    }

    /// Applies what woke it; returns the messages due for another try.
    pub fn apply(
        &mut self,
        wake: Wake,
        pipeline: &str,
        stopping: bool,
    ) -> Vec<(Slot, Publish, u32)> {
        let now = Instant::now();
        match wake {
            Wake::Answer((slot, answer)) => {
                let outcome = Outcome::of(answer.as_ref(), stopping);
                if outcome == Outcome::Retry
                    && let Some(suppressed) = self.log.allow("retry")
                {
                    let why = match &answer {
                        Some(Err(e)) => e.to_string(),
                        _ => "no answer".to_string(),
                    };
                    tracing::warn!(pipeline, reason = %why, suppressed, "mqtt source: a frame's record was not stored; it stays unacknowledged and is handed in again");
                }
                self.acks.answered(slot, outcome, now);
            }
            Wake::Committed(ticket, Ok(())) => {
                self.commit_backoff.reset();
                self.commit_after = None;
                self.acks.durable(ticket);
            }
            Wake::Committed(_, Err(e)) => {
                let delay = self.commit_backoff.next_delay();
                self.commit_after = Some(now + delay);
                if let Some(suppressed) = self.log.allow("commit") {
                    tracing::warn!(pipeline, error = %e, retry_in = ?delay, suppressed, "mqtt source: records not yet durable; their frames stay unacknowledged");
                }
            }
            Wake::Timer => {
                if self.commit_after.is_some_and(|t| now >= t) {
                    self.commit_after = None;
                }
            }
        }
        if stopping {
            Vec::new()
        } else {
            self.acks.due(now)
        }
    }

    /// The connection is gone: its packet ids are void, and the broker
    /// sends every unacknowledged message again on the next one.
    pub fn connection_lost(&mut self, pipeline: &str) {
        let n = self.acks.connection_lost();
        self.unsent.clear();
        self.handed = 0;
        self.written = 0;
        if n > 0 {
            tracing::info!(
                pipeline,
                unacknowledged = n,
                "mqtt source: connection lost; the broker sends the unacknowledged frames again"
            );
        }
    }

    /// Whether every acknowledgement that can be made was written.
    pub fn settled(&self) -> bool {
        !self.acks.unsettled() && self.unsent.is_empty() && self.written >= self.handed
    }
}

/// The window's next wake-up; never, for a QoS 0 source.
pub async fn wake_of(window: &mut Option<Window>) -> Wake {
    match window {
        Some(w) => w.wake().await,
        None => std::future::pending().await,
    }
}
