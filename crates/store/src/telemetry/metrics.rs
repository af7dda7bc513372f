//! Prometheus metrics (OpenMetrics text through prometheus-client).
//!
//! Components keep their own counters (atomics, HDR histograms); one
//! collector reads them at scrape time, so a scrape costs nothing between
//! scrapes and no number is kept twice. Values the hardware does not report
//! are absent, never zero.

//!
//! This room holds the pieces every component uses to report (the
//! [`MetricSource`] trait and the family writers); the daemon's own
//! collector, which reads pipelines and the outbox, is the local API's
//! (`api::metrics`), so telemetry depends on no component.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Anything else that reports metrics (uplinks register here).
pub trait MetricSource: Send + Sync + std::fmt::Debug + 'static {
    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error>;
}

/// Label pairs of one row.
pub type Labels = Vec<(&'static str, String)>;

/// Writes one counter family.
pub fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, u64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// Writes one gauge family (f64 values).
pub fn gauge(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Labels, f64)],
) -> Result<(), std::fmt::Error> {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// OpenMetrics text of a registry.
pub fn render(r: &Registry) -> String {
    let mut s = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut s, r);
    s
}
