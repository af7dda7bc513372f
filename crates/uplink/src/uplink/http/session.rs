//! The HTTP uplink's state, free of I/O, as the MQTT one's (rumqttc's
//! `state.rs` is the model): the batches read from the outbox and not yet
//! delivered, the retry time, the byte-rate cap.
//!
//! The driver (`http/mod.rs`) asks [`Session::next`] what to do and
//! carries out one [`Command`] at a time — read the outbox, POST a batch,
//! ack to the outbox, dead-letter a record — answering each before it asks
//! again ([`Session::page`], [`Session::answered`] (or
//! [`Session::not_posted`]), [`Session::ack_done`],
//! [`Session::dead_letter_done`]); [`Next::Wait`] says until when. Time
//! comes in as arguments (the driver reads the [`Clocks`] it is handed) and
//! the backoff's randomness is the [`Jitter`] the session is built with, so
//! the tests drive it with simulated clocks and a seed.
//!
//! Invariants:
//! - Batches go oldest first; 2xx acknowledges the whole batch to the
//!   outbox, once; timeouts, connection errors, 408, 429 and 5xx send the
//!   same batch again (same `Idempotency-Key`) after a backoff or the
//!   server's `Retry-After`; another 4xx splits the batch in halves until
//!   the refused records stand alone, and only those are dead-lettered.
//! - After a failed outbox ack or dead letter the outbox is read again from
//!   its oldest record: nothing is skipped (the fleet drops duplicates by
//!   the stable idempotency key and record ids).
//! - A delivery's `Date` is the fleet's time, handed back to the driver
//!   for the clock (a reference against a clock far ahead), only when the
//!   connection authenticates the fleet (`Settings::date_is_evidence`:
//!   https, the server's certificate verified): over plain HTTP anyone on
//!   the path can write it.
//!
//! [`Clocks`]: crate::clock::clocks::Clocks

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::{Verdict, classify, fleet_time, idempotency_key};
use crate::backoff::{Backoff, Jitter};
use crate::outbox::{Entry, Key, OutboxError};
use crate::uplink::pace::TokenBucket;
use crate::uplink::stats::UplinkStats;
use crate::uplink::{OutboxOp, UplinkError};

/// What the session needs from `[uplink]`.
#[derive(Debug, Clone)]
pub struct Settings {
    pub device: String,
    /// Records per batch (and per outbox read).
    pub batch_records: usize,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// Body bytes per second at most; 0 = no cap.
    pub max_bytes_per_s: u64,
    /// The fleet is authenticated (https with its certificate verified):
    /// a delivery's `Date` is evidence of the time. Over plain HTTP it is
    /// not.
    pub date_is_evidence: bool,
}

/// A response, reduced to what the session needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub retry_after: Option<String>,
    /// The `Date` header.
    pub date: Option<String>,
    /// An excerpt of the body (empty on success).
    pub body: String,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Read the oldest `limit` records; answer with [`Session::page`].
    Read { limit: usize },
    /// POST these records (each through the clock's correction, gzip
    /// NDJSON) with this `Idempotency-Key`; tell [`Session::posting`] the
    /// body's size, then answer with [`Session::answered`].
    Post { batch: Vec<Entry>, key: String },
    /// Delete delivered records; answer with [`Session::ack_done`].
    Ack(Vec<Key>),
    /// Move a refused record to the dead letters; answer with
    /// [`Session::dead_letter_done`].
    DeadLetter { key: Key, reason: String },
}

/// The answer of [`Session::next`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Do(Command),
    /// Wait this long (a retry, the rate cap); `None`: until the outbox
    /// has an append (or an idle poll).
    Wait(Option<Duration>),
}

/// Why a POST got no answer from the fleet endpoint: the HTTP client's
/// error with its causes (reqwest's own words hide them).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unreachable {
    #[error("{0}")]
    Send(String),
    #[error("{0}")]
    Body(String),
}

/// The operation handed out and not answered yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    Read,
    Post,
    Ack,
    DeadLetter,
}

#[derive(Debug)]
pub struct Session {
    set: Settings,
    stats: Arc<UplinkStats>,
    jitter: Box<dyn Jitter>,
    backoff: Backoff,
    bucket: TokenBucket,
    /// Batches to deliver, the front one first.
    work: VecDeque<Vec<Entry>>,
    awaiting: Option<Awaiting>,
    /// Nothing before this (a retry after a failure).
    retry_at: Option<Instant>,
    /// The last read found the outbox empty.
    caught_up: bool,
    /// The front batch was delivered: its outbox ack goes next.
    ack: Option<Vec<Key>>,
    /// The front batch is one refused record: its dead letter goes next.
    dead: Option<(Key, String)>,
}

impl Session {
    pub fn new(
        set: Settings,
        stats: Arc<UplinkStats>,
        jitter: Box<dyn Jitter>,
        now: Instant,
    ) -> Session {
        Session {
            backoff: Backoff::new(set.backoff_min, set.backoff_max),
            bucket: TokenBucket::new(set.max_bytes_per_s, now),
            set,
            stats,
            jitter,
            work: VecDeque::new(),
            awaiting: None,
            retry_at: None,
            caught_up: false,
            ack: None,
            dead: None,
        }
    }

    /// The outbox has records appended (or the idle poll came).
    pub fn appended(&mut self) {
        self.caught_up = false;
    }

    /// The next thing to do.
    pub fn next(&mut self, now: Instant) -> Next {
        if self.awaiting.is_some() {
            return Next::Wait(None);
        }
        if let Some(d) = self
            .retry_at
            .map(|at| at.saturating_duration_since(now))
            .filter(|d| !d.is_zero())
        {
            return Next::Wait(Some(d));
        }
        self.retry_at = None;
        if let Some(keys) = &self.ack {
            self.awaiting = Some(Awaiting::Ack);
            return Next::Do(Command::Ack(keys.clone()));
        }
        if let Some((key, reason)) = &self.dead {
            self.awaiting = Some(Awaiting::DeadLetter);
            return Next::Do(Command::DeadLetter {
                key: *key,
                reason: reason.clone(),
            });
        }
        let Some(batch) = self.work.front() else {
            if self.caught_up {
                return Next::Wait(None);
            }
            self.awaiting = Some(Awaiting::Read);
            return Next::Do(Command::Read {
                limit: self.set.batch_records,
            });
        };
        let wait = self.bucket.ready_in(now);
        if !wait.is_zero() {
            return Next::Wait(Some(wait));
        }
        let keys: Vec<Key> = batch.iter().map(|e| e.key).collect();
        let key = idempotency_key(&self.set.device, &keys);
        let batch = batch.clone();
        self.awaiting = Some(Awaiting::Post);
        Next::Do(Command::Post { batch, key })
    }

    /// The answer to [`Command::Read`].
    pub fn page(&mut self, now: Instant, page: Result<Vec<Entry>, OutboxError>) {
        if self.awaiting != Some(Awaiting::Read) {
            return;
        }
        self.awaiting = None;
        match page {
            Ok(p) if p.is_empty() => self.caught_up = true,
            Ok(p) => self.work.push_back(p),
            Err(source) => self.outbox_failed(now, OutboxOp::Read, source),
        }
    }

    /// The body of the batch handed out is `bytes` long and goes now.
    pub fn posting(&mut self, now: Instant, bytes: usize) {
        let n = self.work.front().map_or(0, |b| b.len()) as u64;
        self.bucket.take(bytes, now);
        UplinkStats::add(&self.stats.sent_total, n);
        UplinkStats::add(&self.stats.bytes_total, bytes as u64);
    }

    /// The batch could not even be posted (its body could not be made):
    /// tried again after a backoff.
    pub fn not_posted(&mut self, now: Instant, reason: String) {
        if self.awaiting != Some(Awaiting::Post) {
            return;
        }
        self.awaiting = None;
        self.stats.error(reason);
        self.retry_after(now, None);
    }

    /// The answer to [`Command::Post`]: the endpoint's response, or why
    /// none came; `wall` is the system clock (for a `Retry-After` date).
    /// Returns the fleet's time (unix µs) from a delivery's `Date`, for
    /// the clock, when the connection authenticates the fleet.
    pub fn answered(
        &mut self,
        now: Instant,
        wall: SystemTime,
        answer: Result<Answer, Unreachable>,
    ) -> Option<i64> {
        if self.awaiting != Some(Awaiting::Post) {
            return None;
        }
        self.awaiting = None;
        let n = self.work.front().map_or(0, |b| b.len()) as u64;
        let (verdict, date) = match answer {
            Ok(a) => {
                if !self.stats.is_connected() {
                    tracing::info!(status = a.status, "uplink: the fleet endpoint answers");
                }
                self.stats.set_connected(true);
                let v = classify(a.status, a.retry_after.as_deref(), wall, &a.body);
                (v, a.date)
            }
            Err(e) => {
                if self.stats.is_connected() {
                    tracing::warn!(error = %e, "uplink: the fleet endpoint is unreachable");
                    UplinkStats::add(&self.stats.disconnects_total, 1);
                }
                self.stats.set_connected(false);
                let v = Verdict::Retry {
                    after: None,
                    reason: e.to_string(),
                };
                (v, None)
            }
        };
        match verdict {
            Verdict::Ack => {
                self.ack = self.work.front().map(|b| b.iter().map(|e| e.key).collect());
                if !self.set.date_is_evidence {
                    return None;
                }
                return fleet_time(date.as_deref());
            }
            Verdict::Retry { after, reason } => {
                UplinkStats::add(&self.stats.retries_total, n);
                self.stats.error(reason.clone());
                let delay = self.retry_after(now, after);
                tracing::warn!(%reason, records = n, retry_in = ?delay, "uplink: batch not delivered; retrying");
            }
            Verdict::Reject { reason } => {
                self.stats.error(reason.clone());
                let batch = self.work.pop_front()?;
                if let [one] = batch.as_slice() {
                    tracing::warn!(key = %one.key, %reason, "uplink: record refused by the fleet; moved to the dead letters");
                    self.dead = Some((one.key, reason));
                    self.work.push_front(batch);
                } else {
                    // Bisect: the halves go first, oldest half first.
                    let mut left = batch;
                    let right = left.split_off(left.len() / 2);
                    tracing::debug!(%reason, records = n, "uplink: batch refused; splitting it");
                    self.work.push_front(right);
                    self.work.push_front(left);
                }
            }
        }
        None
    }

    /// The answer to [`Command::Ack`].
    pub fn ack_done(&mut self, now: Instant, r: Result<(), OutboxError>) {
        if self.awaiting != Some(Awaiting::Ack) {
            return;
        }
        self.awaiting = None;
        let keys = self.ack.take().unwrap_or_default();
        match r {
            Ok(()) => {
                self.work.pop_front();
                UplinkStats::add(&self.stats.acked_total, keys.len() as u64);
                self.backoff.reset();
            }
            Err(source) => self.outbox_failed(now, OutboxOp::Ack, source),
        }
    }

    /// The answer to [`Command::DeadLetter`].
    pub fn dead_letter_done(&mut self, now: Instant, r: Result<(), OutboxError>) {
        if self.awaiting != Some(Awaiting::DeadLetter) {
            return;
        }
        self.awaiting = None;
        self.dead = None;
        match r {
            Ok(()) => {
                self.work.pop_front();
                UplinkStats::add(&self.stats.dead_letters_total, 1);
            }
            Err(source) => self.outbox_failed(now, OutboxOp::DeadLetter, source),
        }
    }

    /// A failed outbox operation: counted, retried after a backoff, and
    /// the outbox read again from its oldest record (a record whose ack
    /// failed goes again; none is skipped).
    fn outbox_failed(&mut self, now: Instant, op: OutboxOp, source: OutboxError) {
        let e = UplinkError::Outbox { op, source };
        UplinkStats::add(&self.stats.outbox_errors_total, 1);
        self.stats.error(e.to_string());
        let delay = self.retry_after(now, None);
        tracing::error!(error = %e, retry_in = ?delay, "uplink: outbox operation failed; the outbox is read again");
        self.work.clear();
        self.ack = None;
        self.dead = None;
        self.caught_up = false;
    }

    /// Nothing before `after` (at least `backoff_min`) or the next backoff.
    fn retry_after(&mut self, now: Instant, after: Option<Duration>) -> Duration {
        let delay = match after {
            Some(a) => a.max(self.set.backoff_min),
            None => self.backoff.next(self.jitter.as_mut()),
        };
        self.retry_at = Some(now + delay);
        delay
    }
}

#[cfg(test)]
mod tests;
