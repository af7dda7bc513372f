//! The MQTT uplink's state, free of I/O (rumqttc's `state.rs` is the
//! model): the records read from the outbox and not yet sent, the births
//! (the retained "online" status, Sparkplug B's NBIRTH and DBIRTHs), the
//! in-flight window and the Sparkplug sequence state.
//!
//! The driver (`mqtt/mod.rs`) feeds it events — a connection is being made
//! ([`Session::connecting`]), CONNACK ([`Session::connected`]), rumqttc gave
//! a publish its packet id ([`Session::sent`]), a PUBACK
//! ([`Session::puback`]), the outbox has new records
//! ([`Session::appended`]), a Sparkplug node command, the connection is
//! gone ([`Session::disconnected`]), a stop ([`Session::close`]) — and asks
//! it what to do with [`Session::next`], which hands out one [`Command`] at
//! a time (publish, subscribe, read the outbox, ack to the outbox, dead
//! letter) until it says [`Next::Wait`]. The driver carries each command
//! out in the order given and answers every outbox command before it asks
//! again ([`Session::page`], [`Session::ack_done`],
//! [`Session::dead_letter_done`]). Time comes in as arguments (the driver
//! reads the clocks it is handed) and the outbox backoff draws from the
//! [`Jitter`] the session is built with.
//!
//! Invariants:
//! - Every publish is booked in the in-flight table and queued for rumqttc
//!   by one function ([`Session::publish`]), and the driver hands the
//!   queue to rumqttc in order, so the table's FIFO of requested publishes
//!   is the order rumqttc reports their packet ids in. A publish rumqttc
//!   refuses ends the connection (and this table with it).
//! - At most `max_inflight` messages are in flight, but for the two a
//!   Sparkplug B record may bring beyond it (its DDEATH and DBIRTH go with
//!   its DDATA).
//! - A record is acknowledged to the outbox only after the PUBACK of the
//!   message that carried it, and once: keys whose outbox ack has not
//!   succeeded yet (and records whose dead-letter move has not) are kept
//!   across connections and retried. The outbox is read only when none is
//!   left (they go first, and a failure holds every outbox operation back
//!   until its retry), so such a record is never read again for sending.
//! - A failed outbox operation never ends the broker connection: it is
//!   counted, logged at a limited rate and retried after a backoff, while
//!   what is already read keeps going and PUBACKs keep coming.
//! - Each connection reads the outbox from its oldest record: whatever was
//!   in flight when the last one dropped goes again; per stream, records go
//!   in key order.
//! - After every CONNACK the "online" status goes first, then (Sparkplug B)
//!   the NBIRTH, and a device's DBIRTH before its first DDATA.

mod sparkplug;

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backoff::{Backoff, Jitter};
use crate::outbox::{Entry, Key, OutboxError};
use crate::telemetry::logging::RateLimitedLog;
use crate::uplink::inflight::{BookError, InFlight};
use crate::uplink::message::{Batcher, Message};
use crate::uplink::pace::TokenBucket;
use crate::uplink::sparkplug::{self as sp, Bounds, Topics};
use crate::uplink::stats::UplinkStats;
use crate::uplink::{OutboxOp, UplinkError};

/// How often a line that a flood repeats is logged at most (with the
/// number left out since).
const LOG_EVERY: Duration = Duration::from_secs(10);

/// What the session needs from `[uplink]`.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Messages published and not yet acknowledged, at most.
    pub max_inflight: usize,
    /// Records read from the outbox at a time.
    pub page: usize,
    pub batcher: Batcher,
    /// Retained "online" after every CONNACK, "offline" at a stop.
    pub status_topic: String,
    /// Subscribed to after every CONNACK (one SUBSCRIBE).
    pub subscriptions: Vec<String>,
    /// With `payload = "sparkplug_b"`: this edge node's topics.
    pub sparkplug: Option<Topics>,
    /// How big Sparkplug births may grow and how often they may come.
    pub bounds: Bounds,
    /// Payload bytes per second at most; 0 = no cap.
    pub max_bytes_per_s: u64,
    /// Retry delays of a failed outbox operation.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

/// One QoS 1 publish for rumqttc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Publish {
    pub topic: String,
    pub payload: Vec<u8>,
    pub retain: bool,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Hand to rumqttc now (QoS 1), in the order given.
    Publish(Publish),
    /// Subscribe at QoS 1 (one SUBSCRIBE).
    Subscribe(Vec<String>),
    /// Read up to `limit` records with a key above `after`; answer with
    /// [`Session::page`].
    Read { after: Option<Key>, limit: usize },
    /// Delete these acknowledged records; answer with [`Session::ack_done`].
    Ack(Vec<Key>),
    /// Move a record that can never be sent to the dead letters; answer
    /// with [`Session::dead_letter_done`].
    DeadLetter { key: Key, reason: String },
}

/// The answer of [`Session::next`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    Do(Command),
    /// Nothing to do until an event, an append to the outbox (when
    /// [`Session::waits_for_records`]), or this long (the rate cap, a
    /// Sparkplug rebirth's pacing, an outbox retry).
    Wait(Option<Duration>),
}

/// The session's own errors: its bookkeeping no longer matches rumqttc's.
/// The connection must end (the records go again on the next one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StateError {
    #[error(transparent)]
    Book(#[from] BookError),
}

/// The state of one connection, thrown away when it ends.
#[derive(Debug, Default)]
struct Conn {
    /// CONNACK came.
    connected: bool,
    /// A stop: no more data, only what is queued and the acks.
    closing: bool,
    flight: InFlight,
    /// Messages built from the outbox, not yet published.
    buf: VecDeque<Message>,
    /// The last key read from the outbox by this connection.
    cursor: Option<Key>,
    /// The last read found nothing newer: wait for an append.
    caught_up: bool,
    /// Sparkplug B births and sequence numbers of this connection.
    node: Option<sp::Session>,
    bd_seq: u64,
    /// Sparkplug births to publish before anything else (the NBIRTH of the
    /// connection, those of a rebirth), within the in-flight window and
    /// the byte cap.
    births: VecDeque<sp::Out>,
    /// NCMD rebirths asked for and not yet done (folded into one).
    rebirths_asked: u64,
}

/// The MQTT uplink's state over all its connections.
#[derive(Debug)]
pub struct Session {
    set: Settings,
    stats: Arc<UplinkStats>,
    /// Lines a flood could repeat (node commands, evictions, outbox
    /// failures): one per reason and interval.
    log: RateLimitedLog,
    bucket: TokenBucket,
    /// Sparkplug's bdSeq of the next CONNECT (one more with each, mod 256).
    next_bd_seq: u64,
    conn: Conn,
    /// Publishes and subscriptions for rumqttc, in order.
    out: VecDeque<Command>,
    /// Records the broker acknowledged whose outbox ack has not succeeded.
    unflushed: BTreeSet<Key>,
    /// Records that can never be sent, not yet moved to the dead letters.
    dead: VecDeque<(Key, String)>,
    /// The outbox command handed out and not answered yet.
    awaiting: Option<OutboxOp>,
    outbox_backoff: Backoff,
    /// The draws of the outbox backoff.
    jitter: Box<dyn Jitter>,
    /// After a failed outbox operation: none before this.
    outbox_retry_at: Option<Instant>,
}

/// What [`Session::fill`] came to.
enum Fill {
    /// Commands were queued.
    Queued,
    /// The outbox must be read first.
    Read,
    Wait(Option<Duration>),
}

impl Session {
    pub fn new(
        set: Settings,
        stats: Arc<UplinkStats>,
        jitter: Box<dyn Jitter>,
        now: Instant,
    ) -> Session {
        Session {
            jitter,
            bucket: TokenBucket::new(set.max_bytes_per_s, now),
            outbox_backoff: Backoff::new(set.backoff_min, set.backoff_max),
            set,
            stats,
            log: RateLimitedLog::new(LOG_EVERY),
            next_bd_seq: 0,
            conn: Conn::default(),
            out: VecDeque::new(),
            unflushed: BTreeSet::new(),
            dead: VecDeque::new(),
            awaiting: None,
            outbox_retry_at: None,
        }
    }

    // ---- events ------------------------------------------------------------

    /// A new connection is being made: its Sparkplug bdSeq (for the will
    /// of its CONNECT). Whatever the last connection had is gone.
    pub fn connecting(&mut self) -> u64 {
        self.disconnected();
        let bd_seq = self.next_bd_seq;
        self.next_bd_seq = (bd_seq + 1) % 256;
        self.conn.bd_seq = bd_seq;
        self.conn.node = self
            .set
            .sparkplug
            .clone()
            .map(|t| sp::Session::new(t, bd_seq, self.set.bounds));
        bd_seq
    }

    /// CONNACK: "online" goes first, then the subscriptions and (Sparkplug
    /// B) the NBIRTH, before any record.
    pub fn connected(&mut self, now: Instant, now_ms: u64) {
        self.conn.connected = true;
        self.publish(
            self.set.status_topic.clone(),
            b"online".to_vec(),
            true,
            Vec::new(),
        );
        // The NBIRTH goes first of all births, under the byte cap, once the
        // subscription to NCMD below is on its way.
        if let Some(node) = self.conn.node.as_mut() {
            self.conn.births = VecDeque::from([node.nbirth(now, now_ms)]);
        }
        if !self.set.subscriptions.is_empty() {
            self.out
                .push_back(Command::Subscribe(self.set.subscriptions.clone()));
        }
    }

    /// rumqttc put the oldest requested publish on the wire as `pkid`.
    pub fn sent(&mut self, pkid: u16) -> Result<(), StateError> {
        Ok(self.conn.flight.sent(pkid)?)
    }

    /// A PUBACK: the records of its message are acknowledged to the outbox
    /// with the next [`Command::Ack`].
    pub fn puback(&mut self, pkid: u16) {
        if let Some(keys) = self.conn.flight.acked(pkid) {
            self.unflushed.extend(keys);
        }
        self.set_inflight_gauge();
    }

    /// The outbox has records appended since it was last found empty.
    pub fn appended(&mut self) {
        self.conn.caught_up = false;
    }

    /// The connection is gone: what was in flight or read goes again on
    /// the next one; acknowledged records not yet deleted stay so.
    pub fn disconnected(&mut self) {
        // What was in flight goes again on the next connection.
        UplinkStats::add(&self.stats.retries_total, self.conn.flight.records() as u64);
        self.conn = Conn::default();
        self.out.clear();
        // A page read for the old connection must not land in the new one.
        if self.awaiting == Some(OutboxOp::Read) {
            self.awaiting = None;
        }
        self.stats
            .inflight
            .store(0, std::sync::atomic::Ordering::Relaxed);
    }

    /// A stop: "offline" (retained) and, Sparkplug B, the NDEATH (a clean
    /// disconnect fires no will); no more data. The acks still go, one try
    /// now whatever the outbox backoff says.
    pub fn close(&mut self, now_ms: u64) {
        if !self.conn.connected {
            return;
        }
        self.conn.closing = true;
        self.publish(
            self.set.status_topic.clone(),
            b"offline".to_vec(),
            true,
            Vec::new(),
        );
        if let Some(t) = &self.set.sparkplug {
            let topic = t.node("NDEATH");
            self.publish(
                topic,
                sp::ndeath(self.conn.bd_seq, now_ms),
                false,
                Vec::new(),
            );
        }
        self.outbox_retry_at = None;
    }

    // ---- answers to outbox commands ------------------------------------------

    /// The answer to [`Command::Read`].
    pub fn page(&mut self, now: Instant, page: Result<Vec<Entry>, OutboxError>) {
        if self.awaiting != Some(OutboxOp::Read) {
            return;
        }
        self.awaiting = None;
        let page = match page {
            Ok(p) => p,
            Err(e) => return self.outbox_failed(now, OutboxOp::Read, e),
        };
        self.outbox_ok();
        let Some(last) = page.last() else {
            self.conn.caught_up = true;
            return;
        };
        self.conn.cursor = Some(last.key);
        let built = self.set.batcher.build(page);
        for (key, reason) in built.rejected {
            tracing::warn!(%key, %reason, "uplink: record can never be sent; moved to the dead letters");
            self.dead.push_back((key, reason));
        }
        self.conn.buf.extend(built.messages);
    }

    /// The answer to [`Command::Ack`].
    pub fn ack_done(&mut self, now: Instant, keys: &[Key], r: Result<(), OutboxError>) {
        if self.awaiting != Some(OutboxOp::Ack) {
            return;
        }
        self.awaiting = None;
        match r {
            Ok(()) => {
                let before = self.unflushed.len();
                for k in keys {
                    self.unflushed.remove(k);
                }
                UplinkStats::add(
                    &self.stats.acked_total,
                    (before - self.unflushed.len()) as u64,
                );
                self.outbox_ok();
            }
            Err(e) => self.outbox_failed(now, OutboxOp::Ack, e),
        }
    }

    /// The answer to [`Command::DeadLetter`].
    pub fn dead_letter_done(&mut self, now: Instant, key: Key, r: Result<(), OutboxError>) {
        if self.awaiting != Some(OutboxOp::DeadLetter) {
            return;
        }
        self.awaiting = None;
        match r {
            Ok(()) => {
                if let Some(i) = self.dead.iter().position(|d| d.0 == key) {
                    self.dead.remove(i);
                    UplinkStats::add(&self.stats.dead_letters_total, 1);
                }
                self.outbox_ok();
            }
            Err(e) => self.outbox_failed(now, OutboxOp::DeadLetter, e),
        }
    }

    fn outbox_ok(&mut self) {
        self.outbox_backoff.reset();
        self.outbox_retry_at = None;
    }

    /// A local fault (a full disk, an I/O error): counted, logged at a
    /// limited rate and retried after a backoff; the broker connection
    /// stays up, so a disk problem never causes reconnects.
    fn outbox_failed(&mut self, now: Instant, op: OutboxOp, source: OutboxError) {
        let e = UplinkError::Outbox { op, source };
        UplinkStats::add(&self.stats.outbox_errors_total, 1);
        self.stats.error(e.to_string());
        let delay = self.outbox_backoff.next(self.jitter.as_mut());
        self.outbox_retry_at = Some(now + delay);
        if let Some(suppressed) = self.log.allow("outbox_failed") {
            tracing::warn!(
                error = %e,
                retry_in = ?delay,
                suppressed,
                "uplink: outbox operation failed; retried while the broker connection stays up"
            );
        }
    }

    // ---- what to do ------------------------------------------------------------

    /// The next thing to do: publishes and subscriptions in order, outbox
    /// operations, until [`Next::Wait`].
    pub fn next(&mut self, now: Instant, now_ms: u64) -> Next {
        loop {
            if let Some(c) = self.out.pop_front() {
                return Next::Do(c);
            }
            if self.awaiting.is_some() {
                // The driver answers before it asks again.
                return Next::Wait(None);
            }
            let retry_in = self
                .outbox_retry_at
                .map(|at| at.saturating_duration_since(now))
                .filter(|d| !d.is_zero());
            if retry_in.is_none() {
                if !self.unflushed.is_empty() {
                    self.awaiting = Some(OutboxOp::Ack);
                    return Next::Do(Command::Ack(self.unflushed.iter().copied().collect()));
                }
                if let Some((key, reason)) = self.dead.front() {
                    self.awaiting = Some(OutboxOp::DeadLetter);
                    return Next::Do(Command::DeadLetter {
                        key: *key,
                        reason: reason.clone(),
                    });
                }
            }
            let outbox_waits = !self.unflushed.is_empty() || !self.dead.is_empty();
            match self.fill(now, now_ms) {
                Fill::Queued => continue,
                Fill::Read => match retry_in {
                    Some(d) => return Next::Wait(Some(d)),
                    None => {
                        self.awaiting = Some(OutboxOp::Read);
                        return Next::Do(Command::Read {
                            after: self.conn.cursor,
                            limit: self.set.page,
                        });
                    }
                },
                // Queued before the wait: handed out first.
                Fill::Wait(_) if !self.out.is_empty() => continue,
                Fill::Wait(w) => {
                    let retry = retry_in.filter(|_| outbox_waits);
                    return Next::Wait(match (w, retry) {
                        (Some(a), Some(b)) => Some(a.min(b)),
                        (a, b) => a.or(b),
                    });
                }
            }
        }
    }

    /// Publishes until the in-flight window is full, the outbox is drained
    /// or the rate cap (or a Sparkplug rebirth's pacing) says wait.
    fn fill(&mut self, now: Instant, now_ms: u64) -> Fill {
        if !self.conn.connected || self.conn.closing {
            return Fill::Wait(None);
        }
        let mut queued = false;
        let max = self.set.max_inflight;
        while self.conn.flight.messages() < max {
            if let Some(wait) = self.due_rebirth(now, now_ms) {
                return Fill::Wait(Some(wait));
            }
            if !self.conn.births.is_empty() {
                let wait = self.bucket.ready_in(now);
                if !wait.is_zero() {
                    return Fill::Wait(Some(wait));
                }
                let Some(b) = self.conn.births.pop_front() else {
                    break;
                };
                self.bucket.take(b.payload.len(), now);
                self.publish_out(b, &mut None);
                queued = true;
                continue;
            }
            let Some(m) = self.conn.buf.front() else {
                if self.conn.caught_up {
                    break;
                }
                // Queued publishes first: a read answers before the next ask.
                return if queued { Fill::Queued } else { Fill::Read };
            };
            let wait = self.bucket.ready_in(now);
            if !wait.is_zero() {
                return Fill::Wait(Some(wait));
            }
            if self.conn.node.is_some() {
                if let Some(wait) = self.send_sparkplug(now, now_ms) {
                    return Fill::Wait(Some(wait));
                }
                queued = true;
                continue;
            }
            let (n, bytes) = (m.keys.len() as u64, m.payload.len());
            self.bucket.take(bytes, now);
            let Some(m) = self.conn.buf.pop_front() else {
                break;
            };
            self.publish(m.topic, m.payload, false, m.keys);
            UplinkStats::add(&self.stats.sent_total, n);
            UplinkStats::add(&self.stats.bytes_total, bytes as u64);
            queued = true;
        }
        self.set_inflight_gauge();
        if queued {
            Fill::Queued
        } else {
            Fill::Wait(None)
        }
    }

    /// One QoS 1 publish carrying `keys`: booked in flight and queued for
    /// rumqttc, in that order, here and nowhere else (see the header).
    fn publish(&mut self, topic: String, payload: Vec<u8>, retain: bool, keys: Vec<Key>) {
        self.conn.flight.requested(&topic, keys);
        self.out.push_back(Command::Publish(Publish {
            topic,
            payload,
            retain,
        }));
    }

    fn set_inflight_gauge(&self) {
        self.stats.inflight.store(
            self.conn.flight.records() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    // ---- what the driver may ask ---------------------------------------------------

    pub fn is_connected(&self) -> bool {
        self.conn.connected
    }

    /// Connected, everything read sent, the outbox found empty: the driver
    /// waits for an append (then [`Session::appended`]).
    pub fn waits_for_records(&self) -> bool {
        self.conn.connected && !self.conn.closing && self.conn.caught_up && self.conn.buf.is_empty()
    }

    /// Messages requested and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.conn.flight.messages()
    }

    /// Records in those messages.
    pub fn in_flight_records(&self) -> usize {
        self.conn.flight.records()
    }

    /// The topic of the oldest publish on the wire without its PUBACK.
    pub fn oldest_unacked(&self) -> Option<&str> {
        self.conn.flight.oldest_unacked()
    }

    /// Records the broker acknowledged whose outbox ack has not succeeded.
    pub fn unflushed(&self) -> usize {
        self.unflushed.len()
    }

    /// True for the Sparkplug node command topic (see
    /// [`Session::node_command`]).
    pub fn is_node_command(&self, topic: &str) -> bool {
        self.set
            .sparkplug
            .as_ref()
            .is_some_and(|t| topic == t.node("NCMD"))
    }
}

#[cfg(test)]
mod tests;
