//! The acknowledgements of a QoS 1 MQTT source, as a state machine without
//! I/O (the mqtt source drives it; the tests here drive it by hand).
//!
//! Invariants:
//! - A message is acknowledged only once nothing of it can be lost: its
//!   records are durable in the outbox, or it gave no record (no event, a
//!   malformed payload, an engine error: counted as a drop already), or it
//!   was dropped by a policy the config chose (counted).
//! - A message whose record cannot be stored now (outbox or disk full) is
//!   kept and handed in again after a growing delay; it is never
//!   acknowledged meanwhile.
//! - Acknowledgements go out in the order the messages came (MQTT 3.1.1
//!   section 4.6), so one that waits holds back those after it.
//! - Packet ids are only valid on the connection that delivered them: a
//!   lost connection forgets every pending message (the broker sends them
//!   again on the next one), and an answer for a forgotten message is
//!   ignored.
//! - What is held is bounded (the source reads no more at its
//!   `max_inflight`, the broker sends no more past its in-flight window),
//!   so a burst after a restart waits instead of being dropped.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{FrameError, FrameErrorKind};
use crate::record::ResultRecord;

/// A message's place in the window, unique for the life of the source.
pub type Slot = u64;

/// What became of a message handed to the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Its records were stored; acknowledged once they are durable.
    Stored,
    /// Nothing of it is left to lose (no record, refused, dropped by
    /// policy): acknowledged.
    Done,
    /// Its record could not be stored now: handed in again later.
    Retry,
    /// Not handled because the daemon is stopping: never acknowledged on
    /// this connection, so the broker sends it again to the next one.
    Hold,
}

impl Outcome {
    /// Sorts a pipeline's answer. `None`: the answer channel was closed
    /// without an answer (nobody can tell what happened to the frame).
    pub fn of(answer: Option<&Result<Vec<ResultRecord>, FrameError>>, stopping: bool) -> Outcome {
        match answer {
            Some(Ok(records)) if !records.is_empty() => Outcome::Stored,
            Some(Ok(_)) => Outcome::Done,
            Some(Err(e)) => match e.kind {
                FrameErrorKind::Unavailable if stopping => Outcome::Hold,
                FrameErrorKind::Unavailable => Outcome::Retry,
                FrameErrorKind::Malformed
                | FrameErrorKind::Engine
                | FrameErrorKind::Store
                | FrameErrorKind::Dropped => Outcome::Done,
            },
            None if stopping => Outcome::Hold,
            // Unanswered while running (a worker that failed mid-frame):
            // handed in again rather than acknowledged and lost.
            None => Outcome::Retry,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// In the pipeline (or about to be handed in).
    Processing,
    /// Stored; waiting for the commit that makes ticket `n` durable.
    Stored(u64),
    /// Waiting for its next try (`attempt` tries failed so far).
    Retry { at: Instant, attempt: u32 },
    /// Can be acknowledged.
    Ready,
    /// Never acknowledged on this connection.
    Held,
}

#[derive(Debug)]
struct Entry<P> {
    slot: Slot,
    message: P,
    state: State,
    attempts: u32,
}

/// The messages of one connection that are not acknowledged yet, oldest
/// first. `P` is what an acknowledgement needs (the publish packet).
#[derive(Debug)]
pub struct Acks<P> {
    pending: VecDeque<Entry<P>>,
    next_slot: Slot,
    /// Stored answers so far: each gets the next ticket.
    tickets: u64,
    /// Every ticket up to this one is durable.
    durable: u64,
    stopping: bool,
}

/// The first delay before a message is handed in again.
pub const RETRY_FIRST: Duration = Duration::from_millis(100);
/// The longest delay between two tries.
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// The delay after `attempt` failed tries (1, 2, ...): doubling from
/// [`RETRY_FIRST`] up to [`RETRY_MAX`].
pub fn retry_delay(attempt: u32) -> Duration {
    crate::backoff::doubled(RETRY_FIRST, RETRY_MAX, attempt.saturating_sub(1))
}

impl<P> Default for Acks<P> {
    fn default() -> Self {
        Acks {
            pending: VecDeque::new(),
            next_slot: 0,
            tickets: 0,
            durable: 0,
            stopping: false,
        }
    }
}

impl<P: Clone> Acks<P> {
    pub fn new() -> Acks<P> {
        Acks::default()
    }

    /// A message came; it is handed to the pipeline under the returned slot.
    pub fn received(&mut self, message: P) -> Slot {
        self.push(message, State::Processing)
    }

    /// A message that is acknowledged without being handed in (dropped
    /// before the pipeline by a counted policy, e.g. `too_large`).
    pub fn received_done(&mut self, message: P) {
        self.push(message, State::Ready);
    }

    fn push(&mut self, message: P, state: State) -> Slot {
        let slot = self.next_slot;
        self.next_slot += 1;
        self.pending.push_back(Entry {
            slot,
            message,
            state,
            attempts: 0,
        });
        slot
    }

    fn entry(&mut self, slot: Slot) -> Option<&mut Entry<P>> {
        // Slots grow along the queue: a binary search finds one.
        let i = self.pending.binary_search_by_key(&slot, |e| e.slot).ok()?;
        self.pending.get_mut(i)
    }

    /// The pipeline answered for `slot`. An answer for a message of a lost
    /// connection (or one already answered) changes nothing.
    pub fn answered(&mut self, slot: Slot, outcome: Outcome, now: Instant) {
        let stopping = self.stopping;
        let ticket = self.tickets + 1;
        let Some(e) = self.entry(slot) else { return };
        if e.state != State::Processing {
            return;
        }
        e.state = match outcome {
            Outcome::Stored => State::Stored(ticket),
            Outcome::Done => State::Ready,
            Outcome::Retry if stopping => State::Held,
            Outcome::Retry => {
                e.attempts += 1;
                State::Retry {
                    at: now + retry_delay(e.attempts),
                    attempt: e.attempts,
                }
            }
            Outcome::Hold => State::Held,
        };
        if outcome == Outcome::Stored {
            self.tickets = ticket;
        }
    }

    /// The ticket a durability wait started now must reach, when some
    /// stored message waits for one. The wait must start after this call
    /// (every ticket up to it belongs to a record already appended).
    pub fn wanted(&self) -> Option<u64> {
        (self.tickets > self.durable).then_some(self.tickets)
    }

    /// Everything stored up to `ticket` is durable.
    pub fn durable(&mut self, ticket: u64) {
        self.durable = self.durable.max(ticket);
        for e in self.pending.iter_mut() {
            if let State::Stored(t) = e.state
                && t <= self.durable
            {
                e.state = State::Ready;
            }
        }
    }

    /// The messages to acknowledge now, in arrival order: the ready ones at
    /// the front of the window.
    pub fn take_ready(&mut self) -> Vec<P> {
        let mut out = Vec::new();
        while self
            .pending
            .front()
            .is_some_and(|e| e.state == State::Ready)
        {
            if let Some(e) = self.pending.pop_front() {
                out.push(e.message);
            }
        }
        out
    }

    /// When the next message waiting for a retry is due.
    pub fn next_retry(&self) -> Option<Instant> {
        self.pending
            .iter()
            .filter_map(|e| match e.state {
                State::Retry { at, .. } => Some(at),
                _ => None,
            })
            .min()
    }

    /// The messages due for another try at `now`, with their slots and the
    /// number of tries that failed; they are in the pipeline again.
    pub fn due(&mut self, now: Instant) -> Vec<(Slot, P, u32)> {
        let mut out = Vec::new();
        for e in self.pending.iter_mut() {
            if let State::Retry { at, attempt } = e.state
                && at <= now
            {
                e.state = State::Processing;
                out.push((e.slot, e.message.clone(), attempt));
            }
        }
        out
    }

    /// The connection was lost: its packet ids mean nothing on the next
    /// one, and the broker sends every unacknowledged message again.
    /// Returns how many were forgotten.
    pub fn connection_lost(&mut self) -> usize {
        let n = self.pending.len();
        self.pending.clear();
        n
    }

    /// The daemon is stopping: nothing is handed in again; what the
    /// pipeline still answers is acknowledged as usual.
    pub fn stop(&mut self) {
        self.stopping = true;
        for e in self.pending.iter_mut() {
            if matches!(e.state, State::Retry { .. }) {
                e.state = State::Held;
            }
        }
    }

    /// Whether some message may still become ready to acknowledge (the
    /// stop waits for these).
    pub fn unsettled(&self) -> bool {
        self.pending.iter().any(|e| {
            matches!(
                e.state,
                State::Processing | State::Stored(_) | State::Retry { .. }
            )
        }) && !self.blocked()
    }

    /// A held message at the front keeps every later one from being
    /// acknowledged on this connection.
    fn blocked(&self) -> bool {
        self.pending.front().is_some_and(|e| e.state == State::Held)
    }

    /// Messages not acknowledged yet.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(kind: FrameErrorKind) -> Result<Vec<ResultRecord>, FrameError> {
        Err(FrameError::new(kind, "x"))
    }

    #[test]
    fn answers_sort_into_outcomes() {
        let rec = ResultRecord {
            id: "d/1/0".into(),
            device: "d".into(),
            pipeline: "p".into(),
            stream: "s".into(),
            seq: 0,
            ts: "2026-01-01T00:00:00Z".into(),
            model: "m@1".into(),
            ep: "cpu".into(),
            latency_us: 1,
            outputs: serde_json::json!({}),
            captured: None,
            clock: None,
        };
        assert_eq!(Outcome::of(Some(&Ok(vec![rec])), false), Outcome::Stored);
        assert_eq!(Outcome::of(Some(&Ok(vec![])), false), Outcome::Done);
        for k in [
            FrameErrorKind::Malformed,
            FrameErrorKind::Engine,
            FrameErrorKind::Store,
            FrameErrorKind::Dropped,
        ] {
            assert_eq!(Outcome::of(Some(&err(k)), false), Outcome::Done, "{k:?}");
        }
        let full = err(FrameErrorKind::Unavailable);
        assert_eq!(Outcome::of(Some(&full), false), Outcome::Retry);
        assert_eq!(Outcome::of(Some(&full), true), Outcome::Hold);
        assert_eq!(Outcome::of(None, false), Outcome::Retry);
        assert_eq!(Outcome::of(None, true), Outcome::Hold);
    }

    #[test]
    fn a_stored_message_is_acknowledged_only_once_durable() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s = a.received(1u16);
        assert!(a.take_ready().is_empty());
        assert_eq!(a.wanted(), None);
        a.answered(s, Outcome::Stored, now);
        assert!(a.take_ready().is_empty(), "stored is not durable");
        let t = a.wanted().unwrap();
        a.durable(t);
        assert_eq!(a.take_ready(), vec![1]);
        assert!(a.is_empty());
        assert_eq!(a.wanted(), None);
    }

    #[test]
    fn a_durability_wait_covers_only_what_was_stored_before_it() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s1 = a.received(1u16);
        let s2 = a.received(2u16);
        a.answered(s1, Outcome::Stored, now);
        let t = a.wanted().unwrap();
        // Stored after the wait started: not covered by it.
        a.answered(s2, Outcome::Stored, now);
        a.durable(t);
        assert_eq!(a.take_ready(), vec![1]);
        let t2 = a.wanted().unwrap();
        assert!(t2 > t);
        a.durable(t2);
        assert_eq!(a.take_ready(), vec![2]);
    }

    #[test]
    fn acknowledgements_keep_arrival_order() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s: Vec<Slot> = (1..=3u16).map(|m| a.received(m)).collect();
        // The third finishes first (another worker), then the first.
        a.answered(s[2], Outcome::Done, now);
        assert!(a.take_ready().is_empty());
        a.answered(s[0], Outcome::Done, now);
        assert_eq!(a.take_ready(), vec![1]);
        a.answered(s[1], Outcome::Done, now);
        assert_eq!(a.take_ready(), vec![2, 3]);
    }

    #[test]
    fn messages_dropped_before_the_pipeline_are_acknowledged_in_turn() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s = a.received(1u16);
        a.received_done(2);
        assert!(a.take_ready().is_empty());
        a.answered(s, Outcome::Done, now);
        assert_eq!(a.take_ready(), vec![1, 2]);
    }

    #[test]
    fn a_message_not_stored_now_is_tried_again_with_growing_delays() {
        let t0 = Instant::now();
        let mut a = Acks::new();
        let s = a.received(7u16);
        a.answered(s, Outcome::Retry, t0);
        assert!(a.take_ready().is_empty());
        assert_eq!(a.next_retry(), Some(t0 + RETRY_FIRST));
        assert!(a.due(t0).is_empty());
        let due = a.due(t0 + RETRY_FIRST);
        assert_eq!(due, vec![(s, 7, 1)]);
        assert_eq!(a.next_retry(), None);
        // Fails again: twice the delay.
        let t1 = t0 + RETRY_FIRST;
        a.answered(s, Outcome::Retry, t1);
        assert_eq!(a.next_retry(), Some(t1 + 2 * RETRY_FIRST));
        let due = a.due(t1 + 2 * RETRY_FIRST);
        assert_eq!(due.len(), 1);
        a.answered(s, Outcome::Stored, t1);
        a.durable(a.wanted().unwrap());
        assert_eq!(a.take_ready(), vec![7]);
        assert_eq!(retry_delay(1), RETRY_FIRST);
        assert_eq!(retry_delay(30), RETRY_MAX);
    }

    #[test]
    fn a_lost_connection_forgets_its_packet_ids() {
        let now = Instant::now();
        let mut a = Acks::new();
        let old = a.received(5u16);
        let stored = a.received(6u16);
        a.answered(stored, Outcome::Stored, now);
        let t = a.wanted().unwrap();
        assert_eq!(a.connection_lost(), 2);
        // The new connection reuses packet id 5 for another message.
        let new = a.received(5u16);
        // Late answers and commits for the old connection's messages
        // acknowledge nothing on the new one.
        a.answered(old, Outcome::Done, now);
        a.durable(t);
        assert!(a.take_ready().is_empty());
        a.answered(new, Outcome::Done, now);
        assert_eq!(a.take_ready(), vec![5]);
        assert!(a.is_empty());
    }

    #[test]
    fn an_answer_counts_once() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s1 = a.received(1u16);
        let _s2 = a.received(2u16);
        a.answered(s1, Outcome::Stored, now);
        // A second answer for the same slot (cannot happen, but harmless).
        a.answered(s1, Outcome::Done, now);
        assert!(a.take_ready().is_empty());
    }

    #[test]
    fn stopping_holds_what_cannot_be_stored_and_finishes_the_rest() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s1 = a.received(1u16);
        let s2 = a.received(2u16);
        let s3 = a.received(3u16);
        a.answered(s3, Outcome::Retry, now);
        a.stop();
        assert!(a.unsettled());
        assert!(a.due(now + RETRY_MAX).is_empty(), "no retry while stopping");
        a.answered(s1, Outcome::Stored, now);
        a.durable(a.wanted().unwrap());
        assert!(a.unsettled());
        a.answered(s2, Outcome::Retry, now);
        assert!(!a.unsettled());
        assert_eq!(a.take_ready(), vec![1]);
        // 2 and 3 stay unacknowledged: the broker sends them again.
        assert_eq!(a.len(), 2);
        assert!(a.take_ready().is_empty());
    }

    #[test]
    fn a_held_message_at_the_front_settles_the_stop() {
        let now = Instant::now();
        let mut a = Acks::new();
        let s1 = a.received(1u16);
        let _s2 = a.received(2u16);
        a.stop();
        a.answered(s1, Outcome::Hold, now);
        // 2 could never be acknowledged before 1: nothing to wait for.
        assert!(!a.unsettled());
    }
}
