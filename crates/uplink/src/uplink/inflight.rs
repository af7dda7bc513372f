//! PUBACK -> outbox keys bookkeeping for one MQTT connection, free of I/O.
//!
//! rumqttc assigns packet ids inside its event loop and reports each with
//! `Event::Outgoing(Outgoing::Publish(pkid))`, in the order the publishes
//! were requested; `Packet::PubAck(pkid)` confirms one. So: a FIFO of the
//! keys of requested messages, moved to a map by pkid when rumqttc reports
//! the id, taken out by the PUBACK.
//!
//! Invariants:
//! - A message's keys are acknowledged only by the PUBACK of the pkid its
//!   publish was given; a PUBACK for an unknown pkid acknowledges nothing.
//! - A pkid reported again while its message is still unacknowledged means
//!   the bookkeeping no longer matches rumqttc's: that is an error, and the
//!   caller drops the connection and this state (the records are still in
//!   the outbox and go again; duplicates carry the same id).
//! - Each message keeps its topic until its PUBACK, so a connection the
//!   broker closes with publishes unacknowledged can name the oldest one
//!   (a broker that refuses a topic closes the connection on it, having
//!   acknowledged what came before).
//! - The state lives for one connection only: the uplink builds a fresh
//!   rumqttc event loop per connection, so rumqttc never retransmits a
//!   publish of an old connection behind this table's back.

use std::collections::{HashMap, VecDeque};

use crate::outbox::Key;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BookError {
    #[error("rumqttc reported publish pkid {0} that was never requested")]
    Unrequested(u16),
    #[error("rumqttc reused pkid {0} before its PUBACK")]
    Reused(u16),
}

#[derive(Debug, Default)]
pub struct InFlight {
    /// Requested, pkid not yet known; oldest first.
    queued: VecDeque<(String, Vec<Key>)>,
    /// On the wire: (order sent, topic, keys).
    by_pkid: HashMap<u16, (u64, String, Vec<Key>)>,
    records: usize,
    sent: u64,
}

impl InFlight {
    pub fn new() -> InFlight {
        InFlight::default()
    }

    /// A publish to `topic` was handed to rumqttc (keys may be empty: the
    /// birth message).
    pub fn requested(&mut self, topic: &str, keys: Vec<Key>) {
        self.records += keys.len();
        self.queued.push_back((topic.to_string(), keys));
    }

    /// rumqttc put the oldest requested publish on the wire as `pkid`.
    pub fn sent(&mut self, pkid: u16) -> Result<(), BookError> {
        if self.by_pkid.contains_key(&pkid) {
            return Err(BookError::Reused(pkid));
        }
        let (topic, keys) = self
            .queued
            .pop_front()
            .ok_or(BookError::Unrequested(pkid))?;
        self.sent += 1;
        self.by_pkid.insert(pkid, (self.sent, topic, keys));
        Ok(())
    }

    /// The keys a PUBACK confirms; `None` for a pkid not in flight.
    pub fn acked(&mut self, pkid: u16) -> Option<Vec<Key>> {
        let (_, _, keys) = self.by_pkid.remove(&pkid)?;
        self.records -= keys.len();
        Some(keys)
    }

    /// The topic of the oldest publish on the wire without its PUBACK.
    pub fn oldest_unacked(&self) -> Option<&str> {
        self.by_pkid
            .values()
            .min_by_key(|(order, _, _)| *order)
            .map(|(_, topic, _)| topic.as_str())
    }

    /// Messages requested and not yet acknowledged.
    pub fn messages(&self) -> usize {
        self.queued.len() + self.by_pkid.len()
    }

    /// Records in those messages.
    pub fn records(&self) -> usize {
        self.records
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u64) -> Key {
        Key(1, i)
    }

    #[test]
    fn pubacks_map_to_the_keys_of_their_message() {
        let mut f = InFlight::new();
        f.requested("b", vec![]); // birth
        f.requested("t", vec![k(0), k(1)]);
        f.requested("t", vec![k(2)]);
        assert_eq!((f.messages(), f.records()), (3, 3));
        f.sent(1).unwrap();
        f.sent(2).unwrap();
        // A PUBACK can come before rumqttc reports later publishes.
        assert_eq!(f.acked(2), Some(vec![k(0), k(1)]));
        assert_eq!(f.acked(1), Some(vec![]));
        f.sent(3).unwrap();
        assert_eq!(f.acked(3), Some(vec![k(2)]));
        assert_eq!((f.messages(), f.records()), (0, 0));
    }

    #[test]
    fn unknown_and_repeated_pubacks_acknowledge_nothing() {
        let mut f = InFlight::new();
        f.requested("t", vec![k(7)]);
        assert_eq!(f.acked(1), None, "not sent yet");
        f.sent(1).unwrap();
        assert_eq!(f.acked(9), None);
        assert_eq!(f.acked(1), Some(vec![k(7)]));
        assert_eq!(f.acked(1), None, "a duplicate PUBACK");
        assert_eq!(f.records(), 0);
    }

    #[test]
    fn pkids_are_reused_after_their_puback() {
        let mut f = InFlight::new();
        for round in 0..3u64 {
            for p in 1..=4u16 {
                f.requested("t", vec![k(round * 10 + p as u64)]);
                f.sent(p).unwrap();
            }
            for p in 1..=4u16 {
                assert_eq!(f.acked(p), Some(vec![k(round * 10 + p as u64)]));
            }
        }
    }

    #[test]
    fn bookkeeping_that_no_longer_matches_is_an_error() {
        let mut f = InFlight::new();
        assert_eq!(f.sent(1), Err(BookError::Unrequested(1)));
        f.requested("t", vec![k(1)]);
        f.requested("t", vec![k(2)]);
        f.sent(5).unwrap();
        assert_eq!(f.sent(5), Err(BookError::Reused(5)));
    }

    #[test]
    fn the_oldest_unacknowledged_publish_names_its_topic() {
        let mut f = InFlight::new();
        assert_eq!(f.oldest_unacked(), None);
        for (p, t) in [
            (7u16, "status"),
            (3, "spBv1.0/g/NBIRTH/n"),
            (9, "spBv1.0/g/DBIRTH/n/p"),
        ] {
            f.requested(t, vec![]);
            assert_eq!(
                f.oldest_unacked(),
                if p == 7 { None } else { Some("status") }
            );
            f.sent(p).unwrap();
        }
        assert_eq!(f.oldest_unacked(), Some("status"));
        f.acked(7);
        // Acknowledged in order up to the one the broker refused.
        assert_eq!(f.oldest_unacked(), Some("spBv1.0/g/NBIRTH/n"));
    }
}
