//! Uplink counters, read by the metrics collector at scrape time.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;
use prometheus_client::encoding::DescriptorEncoder;

use crate::telemetry::metrics::{MetricSource, counter, gauge};

#[derive(Debug, Default)]
pub struct UplinkStats {
    /// `mqtt` or `http` (the metrics' `uplink` label).
    pub kind: &'static str,
    pub connected: AtomicU64,
    /// Records put on the wire (a record sent twice counts twice).
    pub sent_total: AtomicU64,
    /// Records the fleet acknowledged (deleted from the outbox).
    pub acked_total: AtomicU64,
    /// Records sent again: in flight when a connection dropped, or in a
    /// batch that failed and is retried.
    pub retries_total: AtomicU64,
    /// Payload bytes sent (HTTP: compressed body bytes).
    pub bytes_total: AtomicU64,
    /// Records moved to the dead letters.
    pub dead_letters_total: AtomicU64,
    pub connects_total: AtomicU64,
    pub disconnects_total: AtomicU64,
    /// Records in messages not yet acknowledged.
    pub inflight: AtomicU64,
    pub errors_total: AtomicU64,
    /// Outbox operations (read, ack, dead letter) that failed and were
    /// retried; the broker connection stays up through them.
    pub outbox_errors_total: AtomicU64,
    /// Command-topic messages dropped because the OTA agent had not taken
    /// the previous ones (a flood): counted, logged at a limited rate.
    pub commands_dropped_total: AtomicU64,
    /// Sparkplug B rebirths asked for by NCMD and done (requests that
    /// came while one was pending were folded into it).
    pub sparkplug_rebirths_total: AtomicU64,
    /// Sparkplug B node commands (NCMD) received, whatever they asked.
    pub sparkplug_commands_total: AtomicU64,
    /// Sparkplug B DBIRTHs published (first births, new metric sets, rebirths).
    pub sparkplug_dbirths_total: AtomicU64,
    /// Payload bytes of Sparkplug B births and deaths (NBIRTH, DBIRTH,
    /// DDEATH), also counted in `bytes_total`.
    pub sparkplug_birth_bytes_total: AtomicU64,
    /// Metrics dropped from a device's set to keep it within its bounds
    /// (least recently seen streams first).
    pub sparkplug_metrics_evicted_total: AtomicU64,
    /// Metrics declared now, over all devices of the connection.
    pub sparkplug_metrics: AtomicU64,
    /// Sparkplug B node commands (or metrics in them) not acted on:
    /// malformed, or not a command this node takes.
    pub sparkplug_commands_ignored_total: AtomicU64,
    last_error: Mutex<Option<(SystemTime, String)>>,
}

impl UplinkStats {
    pub fn new(kind: &'static str) -> UplinkStats {
        UplinkStats {
            kind,
            ..UplinkStats::default()
        }
    }

    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub fn set_connected(&self, up: bool) {
        self.connected.store(u64::from(up), Ordering::Relaxed);
    }

    pub fn is_connected(&self) -> bool {
        Self::get(&self.connected) == 1
    }

    pub fn error(&self, e: impl Into<String>) {
        Self::add(&self.errors_total, 1);
        *self.last_error.lock() = Some((SystemTime::now(), e.into()));
    }

    /// The last error and when it happened.
    pub fn last_error(&self) -> Option<(SystemTime, String)> {
        self.last_error.lock().clone()
    }
}

impl MetricSource for UplinkStats {
    fn encode(&self, enc: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let l = || vec![("uplink", self.kind.to_string())];
        let g = Self::get;
        gauge(
            enc,
            "outpost_uplink_connected",
            "1 while the uplink is connected to the fleet",
            &[(l(), g(&self.connected) as f64)],
        )?;
        gauge(
            enc,
            "outpost_uplink_inflight_records",
            "Records sent and not yet acknowledged",
            &[(l(), g(&self.inflight) as f64)],
        )?;
        gauge(
            enc,
            "outpost_uplink_sparkplug_metrics",
            "Sparkplug B metrics declared now, over all devices (pipelines)",
            &[(l(), g(&self.sparkplug_metrics) as f64)],
        )?;
        for (name, help, c) in [
            (
                "outpost_uplink_sent",
                "Records sent (resends count again)",
                &self.sent_total,
            ),
            (
                "outpost_uplink_acked",
                "Records acknowledged by the fleet and deleted",
                &self.acked_total,
            ),
            (
                "outpost_uplink_retries",
                "Records sent again after a failure",
                &self.retries_total,
            ),
            (
                "outpost_uplink_bytes",
                "Payload bytes sent",
                &self.bytes_total,
            ),
            (
                "outpost_uplink_dead_letters",
                "Records the fleet refused, moved to the dead letters",
                &self.dead_letters_total,
            ),
            (
                "outpost_uplink_connects",
                "Connections established",
                &self.connects_total,
            ),
            (
                "outpost_uplink_disconnects",
                "Connections lost or failed",
                &self.disconnects_total,
            ),
            (
                "outpost_uplink_errors",
                "Errors (connection, HTTP, outbox)",
                &self.errors_total,
            ),
            (
                "outpost_uplink_outbox_errors",
                "Outbox operations (read, ack, dead letter) that failed and were retried",
                &self.outbox_errors_total,
            ),
            (
                "outpost_uplink_commands_dropped",
                "Command-topic messages dropped while the OTA agent was busy",
                &self.commands_dropped_total,
            ),
            (
                "outpost_uplink_sparkplug_rebirths",
                "Sparkplug B rebirths asked for by a node command (NCMD) and done",
                &self.sparkplug_rebirths_total,
            ),
            (
                "outpost_uplink_sparkplug_commands",
                "Sparkplug B node commands (NCMD) received",
                &self.sparkplug_commands_total,
            ),
            (
                "outpost_uplink_sparkplug_dbirths",
                "Sparkplug B DBIRTHs published",
                &self.sparkplug_dbirths_total,
            ),
            (
                "outpost_uplink_sparkplug_birth_bytes",
                "Payload bytes of Sparkplug B births and deaths (NBIRTH, DBIRTH, DDEATH)",
                &self.sparkplug_birth_bytes_total,
            ),
            (
                "outpost_uplink_sparkplug_metrics_evicted",
                "Sparkplug B metrics dropped from a device's set to keep it within its bounds",
                &self.sparkplug_metrics_evicted_total,
            ),
            (
                "outpost_uplink_sparkplug_commands_ignored",
                "Sparkplug B node commands (or metrics in them) ignored: malformed or not taken",
                &self.sparkplug_commands_ignored_total,
            ),
        ] {
            counter(enc, name, help, &[(l(), g(c))])?;
        }
        let last = self.last_error();
        gauge(
            enc,
            "outpost_uplink_last_error_timestamp_seconds",
            "When the last uplink error happened (unix seconds; 0: none yet)",
            &[(
                l(),
                last.as_ref()
                    .and_then(|(t, _)| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                    .map_or(0.0, |d| d.as_secs_f64()),
            )],
        )?;
        if let Some((_, msg)) = last {
            // Cut: a label value is no place for a whole response body.
            let msg: String = msg.chars().take(200).collect();
            gauge(
                enc,
                "outpost_uplink_last_error_info",
                "The last uplink error, as a label",
                &[(vec![("uplink", self.kind.to_string()), ("error", msg)], 1.0)],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_are_named_and_labelled() {
        let s = std::sync::Arc::new(UplinkStats::new("mqtt"));
        UplinkStats::add(&s.sent_total, 5);
        UplinkStats::add(&s.acked_total, 4);
        s.set_connected(true);
        s.error("broker said no");
        #[derive(Debug)]
        struct C(std::sync::Arc<UplinkStats>);
        impl prometheus_client::collector::Collector for C {
            fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
                self.0.encode(&mut enc)
            }
        }
        let mut reg = prometheus_client::registry::Registry::default();
        reg.register_collector(Box::new(C(s.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
        for want in [
            "outpost_uplink_connected{uplink=\"mqtt\"} 1",
            "outpost_uplink_sent_total{uplink=\"mqtt\"} 5",
            "outpost_uplink_acked_total{uplink=\"mqtt\"} 4",
            "outpost_uplink_dead_letters_total{uplink=\"mqtt\"} 0",
            "outpost_uplink_last_error_info{uplink=\"mqtt\",error=\"broker said no\"} 1",
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
    }
}
