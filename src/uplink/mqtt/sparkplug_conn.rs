//! The Sparkplug B side of one MQTT connection: a record's messages under
//! the byte cap (births and deaths charged like the data), NCMD rebirths
//! paced and folded, node commands counted and logged at a limited rate.
//! What to publish is decided by the I/O-free [`Session`]; this file only
//! publishes it and keeps the counts.

use std::time::{Duration, Instant};

use rumqttc::AsyncClient;

use super::{Conn, Ctx, unix_ms};
use crate::outbox::Key;
use crate::uplink::pace::TokenBucket;
use crate::uplink::sparkplug::{self, Session, Step};
use crate::uplink::stats::UplinkStats;

impl Conn {
    /// An NCMD rebirth once its pacing allows: its births are queued, to go
    /// before any more DDATA. `Some(wait)` while it must wait.
    pub(super) fn due_rebirth(&mut self, ctx: &Ctx, now: Instant) -> Option<Duration> {
        if self.rebirths_asked == 0 {
            return None;
        }
        let sp: &mut Session = self.sparkplug.as_mut()?;
        let wait = sp.rebirth_wait(now);
        if !wait.is_zero() {
            return Some(wait);
        }
        let (births, evicted) = sp.rebirth(now, unix_ms());
        self.births = births.into();
        UplinkStats::add(&ctx.stats.sparkplug_rebirths_total, 1);
        if let Some(suppressed) = ctx.log.allow("sparkplug_rebirth") {
            tracing::info!(
                bd_seq = self.bd_seq,
                dbirths = self.births.len() - 1,
                asked = self.rebirths_asked,
                suppressed,
                "uplink: Sparkplug rebirth: NBIRTH and DBIRTHs again"
            );
        }
        self.rebirths_asked = 0;
        evicted_streams(ctx, "(rebirth)", evicted);
        None
    }

    /// The record at the head of `buf` as Sparkplug B: its DDATA, after the
    /// births it needs (charged to the cap with it); `Some(wait)` when its
    /// device may not be born again yet (it stays at the head); a record
    /// that cannot be encoded goes to the dead letters.
    pub(super) fn send_sparkplug(
        &mut self,
        ctx: &Ctx,
        client: &AsyncClient,
        bucket: &mut TokenBucket,
        now: Instant,
    ) -> Result<Option<Duration>, String> {
        let (Some(sp), Some(m)) = (self.sparkplug.as_mut(), self.buf.front()) else {
            return Ok(None);
        };
        // The records behind this one, for a birth to declare too.
        let ahead = self.buf.iter().skip(1).map(|m| m.payload.as_slice());
        let step = sp.record(&m.payload, ahead, now, unix_ms());
        let metrics = sp.metrics() as u64;
        let out = match step {
            Ok(Step::Wait(w)) => return Ok(Some(w)),
            Ok(Step::Send { out, evicted }) => {
                evicted_streams(ctx, &sparkplug_device(&out), evicted);
                out
            }
            Err(reason) => {
                let Some(m) = self.buf.pop_front() else {
                    return Ok(None);
                };
                for key in m.keys {
                    tracing::warn!(%key, %reason, "uplink: record cannot go out as Sparkplug B; moved to the dead letters");
                    ctx.outbox
                        .dead_letter(key, &reason)
                        .map_err(|e| format!("outbox dead letter: {e}"))?;
                    UplinkStats::add(&ctx.stats.dead_letters_total, 1);
                }
                return Ok(None);
            }
        };
        let Some(m) = self.buf.pop_front() else {
            return Ok(None);
        };
        ctx.stats
            .sparkplug_metrics
            .store(metrics, std::sync::atomic::Ordering::Relaxed);
        // Births and deaths are charged to the cap like the data.
        bucket.take(out.iter().map(|o| o.payload.len()).sum(), now);
        UplinkStats::add(&ctx.stats.sent_total, m.keys.len() as u64);
        let mut keys = Some(m.keys);
        for o in out {
            self.publish_out(ctx, client, o, &mut keys)?;
        }
        Ok(None)
    }

    /// One Sparkplug message; its DDATA takes the record's `keys` (a birth
    /// or a death carries no record: its PUBACK acks nothing).
    pub(super) fn publish_out(
        &mut self,
        ctx: &Ctx,
        client: &AsyncClient,
        o: sparkplug::Out,
        keys: &mut Option<Vec<Key>>,
    ) -> Result<(), String> {
        let bytes = o.payload.len() as u64;
        UplinkStats::add(&ctx.stats.bytes_total, bytes);
        if !o.data {
            UplinkStats::add(&ctx.stats.sparkplug_birth_bytes_total, bytes);
        }
        if o.kind == "DBIRTH" {
            UplinkStats::add(&ctx.stats.sparkplug_dbirths_total, 1);
        }
        let k = if o.data { keys.take() } else { None };
        self.publish(client, o.topic, o.payload, k.unwrap_or_default())
    }

    /// A Sparkplug NCMD: a rebirth is asked for (done by `fill` once its
    /// pacing allows, folding the requests that came meanwhile); anything
    /// else is counted and logged at a limited rate (a host, or anyone on
    /// the broker, can send thousands).
    pub(super) fn node_command(&mut self, ctx: &Ctx, topic: &str, payload: &[u8]) {
        UplinkStats::add(&ctx.stats.sparkplug_commands_total, 1);
        let ignored = |why: &str| {
            UplinkStats::add(&ctx.stats.sparkplug_commands_ignored_total, 1);
            if let Some(suppressed) = ctx.log.allow("sparkplug_ncmd_ignored") {
                tracing::warn!(%topic, %why, suppressed, "uplink: Sparkplug node command ignored");
            }
        };
        let cmd = match sparkplug::node_command(payload) {
            Ok(c) => c,
            Err(why) => return ignored(&why.to_string()),
        };
        for why in &cmd.ignored {
            ignored(why);
        }
        if cmd.rebirth && self.sparkplug.is_some() {
            self.rebirths_asked += 1;
        }
    }
}

/// Counts (and logs, at a limited rate) streams evicted from a Sparkplug
/// device's metric set.
fn evicted_streams(ctx: &Ctx, device: &str, e: sparkplug::Evicted) {
    if e.metrics == 0 {
        return;
    }
    UplinkStats::add(&ctx.stats.sparkplug_metrics_evicted_total, e.metrics as u64);
    if let Some(suppressed) = ctx.log.allow("sparkplug_evicted") {
        tracing::warn!(
            device,
            metrics = e.metrics,
            streams = e.streams,
            max_metrics = ctx.bounds.max_metrics,
            max_birth_bytes = ctx.bounds.max_payload,
            suppressed,
            "uplink: Sparkplug device metric set full: the least recently seen streams were dropped from its birth (DDEATH, DBIRTH)"
        );
    }
}

/// The Sparkplug device (pipeline) the messages of one record are for.
fn sparkplug_device(out: &[sparkplug::Out]) -> String {
    out.last()
        .and_then(|o| o.topic.rsplit('/').next())
        .unwrap_or_default()
        .to_string()
}
