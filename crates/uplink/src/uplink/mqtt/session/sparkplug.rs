//! The Sparkplug B side of the session: a record's messages under the byte
//! cap (births and deaths charged like the data), NCMD rebirths paced and
//! folded, node commands counted and logged at a limited rate. What each
//! message holds is decided by [`crate::uplink::sparkplug::Session`]; this
//! file queues it and keeps the counts.

use std::time::{Duration, Instant};

use super::Session;
use crate::outbox::Key;
use crate::uplink::sparkplug::{self as sp, Step};
use crate::uplink::stats::UplinkStats;

impl Session {
    /// An NCMD rebirth once its pacing allows: its births are queued, to go
    /// before any more DDATA. `Some(wait)` while it must wait.
    pub(super) fn due_rebirth(&mut self, now: Instant, now_ms: u64) -> Option<Duration> {
        if self.conn.rebirths_asked == 0 {
            return None;
        }
        let node = self.conn.node.as_mut()?;
        let wait = node.rebirth_wait(now);
        if !wait.is_zero() {
            return Some(wait);
        }
        let (births, evicted) = node.rebirth(now, now_ms);
        self.conn.births = births.into();
        UplinkStats::add(&self.stats.sparkplug_rebirths_total, 1);
        if let Some(suppressed) = self.log.allow("sparkplug_rebirth") {
            tracing::info!(
                bd_seq = self.conn.bd_seq,
                dbirths = self.conn.births.len() - 1,
                asked = self.conn.rebirths_asked,
                suppressed,
                "uplink: Sparkplug rebirth: NBIRTH and DBIRTHs again"
            );
        }
        self.conn.rebirths_asked = 0;
        self.evicted_streams("(rebirth)", evicted);
        None
    }

    /// The record at the head of `buf` as Sparkplug B: its DDATA, after the
    /// births it needs (charged to the cap with it); `Some(wait)` when its
    /// device may not be born again yet (it stays at the head); a record
    /// that cannot be encoded goes to the dead letters.
    pub(super) fn send_sparkplug(&mut self, now: Instant, now_ms: u64) -> Option<Duration> {
        let (Some(node), Some(m)) = (self.conn.node.as_mut(), self.conn.buf.front()) else {
            return None;
        };
        // The records behind this one, for a birth to declare too.
        let ahead = self.conn.buf.iter().skip(1).map(|m| m.payload.as_slice());
        let step = node.record(&m.payload, ahead, now, now_ms);
        let metrics = node.metrics() as u64;
        let out = match step {
            Ok(Step::Wait(w)) => return Some(w),
            Ok(Step::Send { out, evicted }) => {
                self.evicted_streams(&sparkplug_device(&out), evicted);
                out
            }
            Err(reason) => {
                let m = self.conn.buf.pop_front()?;
                for key in m.keys {
                    tracing::warn!(%key, %reason, "uplink: record cannot go out as Sparkplug B; moved to the dead letters");
                    self.dead.push_back((key, reason.to_string()));
                }
                return None;
            }
        };
        let m = self.conn.buf.pop_front()?;
        self.stats
            .sparkplug_metrics
            .store(metrics, std::sync::atomic::Ordering::Relaxed);
        // Births and deaths are charged to the cap like the data.
        self.bucket
            .take(out.iter().map(|o| o.payload.len()).sum(), now);
        UplinkStats::add(&self.stats.sent_total, m.keys.len() as u64);
        let mut keys = Some(m.keys);
        for o in out {
            self.publish_out(o, &mut keys);
        }
        None
    }

    /// One Sparkplug message; its DDATA takes the record's `keys` (a birth
    /// or a death carries no record: its PUBACK acks nothing).
    pub(super) fn publish_out(&mut self, o: sp::Out, keys: &mut Option<Vec<Key>>) {
        let bytes = o.payload.len() as u64;
        UplinkStats::add(&self.stats.bytes_total, bytes);
        if !o.data {
            UplinkStats::add(&self.stats.sparkplug_birth_bytes_total, bytes);
        }
        if o.kind == "DBIRTH" {
            UplinkStats::add(&self.stats.sparkplug_dbirths_total, 1);
        }
        let k = if o.data { keys.take() } else { None };
        self.publish(o.topic, o.payload, false, k.unwrap_or_default());
    }

    /// A Sparkplug NCMD: a rebirth is asked for (done once its pacing
    /// allows, folding the requests that came meanwhile); anything else is
    /// counted and logged at a limited rate (a host, or anyone on the
    /// broker, can send thousands).
    pub fn node_command(&mut self, topic: &str, payload: &[u8]) {
        UplinkStats::add(&self.stats.sparkplug_commands_total, 1);
        let ignored = |why: &str| {
            UplinkStats::add(&self.stats.sparkplug_commands_ignored_total, 1);
            if let Some(suppressed) = self.log.allow("sparkplug_ncmd_ignored") {
                tracing::warn!(%topic, %why, suppressed, "uplink: Sparkplug node command ignored");
            }
        };
        let cmd = match sp::node_command(payload) {
            Ok(c) => c,
            Err(why) => return ignored(&why.to_string()),
        };
        for why in &cmd.ignored {
            ignored(why);
        }
        if cmd.rebirth && self.conn.node.is_some() {
            self.conn.rebirths_asked += 1;
        }
    }

    /// Counts (and logs, at a limited rate) streams evicted from a
    /// Sparkplug device's metric set.
    fn evicted_streams(&self, device: &str, e: sp::Evicted) {
        if e.metrics == 0 {
            return;
        }
        UplinkStats::add(
            &self.stats.sparkplug_metrics_evicted_total,
            e.metrics as u64,
        );
        if let Some(suppressed) = self.log.allow("sparkplug_evicted") {
            tracing::warn!(
                device,
                metrics = e.metrics,
                streams = e.streams,
                max_metrics = self.set.bounds.max_metrics,
                max_birth_bytes = self.set.bounds.max_payload,
                suppressed,
                "uplink: Sparkplug device metric set full: the least recently seen streams were dropped from its birth (DDEATH, DBIRTH)"
            );
        }
    }
}

/// The Sparkplug device (pipeline) the messages of one record are for.
fn sparkplug_device(out: &[sp::Out]) -> String {
    out.last()
        .and_then(|o| o.topic.rsplit('/').next())
        .unwrap_or_default()
        .to_string()
}
