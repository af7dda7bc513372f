//! How large a pipeline's records may be, and whether its tracking events
//! fit: the uplink's `max_packet_bytes` and a UDP output's datagram bound
//! every record, and a frame's events are split and shortened to fit
//! (`track/fit.rs`), down to the smallest record an event can take.

use super::Config;
use crate::pipeline::PipelineConfig;
use crate::track::Emit;
use crate::track::fit::{Shape, smallest_record_bytes};

/// Room for a model's version in `name@version` (the manifest is not read
/// here; "1.0.0" or "2026.12.01-rc1" fit).
const VERSION_ROOM: usize = 16;
/// Room for a stream name that no config names (senders pick them) and
/// for a label (a model's class names; COCO's longest is 14 bytes).
const NAME_ROOM: usize = 32;

/// What limits a pipeline's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordLimit {
    /// `uplink.max_packet_bytes` of the MQTT uplink (or the default 1 MiB).
    Uplink(usize),
    /// A UDP output's datagram.
    Datagram(usize),
}

impl RecordLimit {
    pub fn bytes(self) -> usize {
        match self {
            RecordLimit::Uplink(b) | RecordLimit::Datagram(b) => b,
        }
    }
}

impl Config {
    /// The largest record `p` sends whole to the uplink and its local
    /// outputs: what a frame's tracking events are split to fit.
    pub fn record_limit(&self, p: &PipelineConfig) -> RecordLimit {
        let uplink = crate::uplink::max_record_bytes(self.uplink.as_ref());
        match crate::output::largest_record(&p.outputs) {
            Some(d) if d < uplink => RecordLimit::Datagram(d),
            _ => RecordLimit::Uplink(uplink),
        }
    }

    /// A pipeline whose tracking events, shortened as far as they go,
    /// would not fit its records (names too long for a small
    /// `max_packet_bytes`): the problem, with both figures.
    pub(super) fn check_event_room(
        &self,
        at: &str,
        p: &PipelineConfig,
        cameras: &[&str],
    ) -> Option<String> {
        if p.track.is_none() || p.emit == Some(Emit::Frames) {
            return None;
        }
        let model = format!("{}@{}", p.model, "0".repeat(VERSION_ROOM));
        let stream = cameras
            .iter()
            .map(|c| c.to_string())
            .chain([".".repeat(NAME_ROOM)])
            .max_by_key(String::len)
            .unwrap_or_default();
        let label = p
            .zones
            .iter()
            .flat_map(|z| &z.classes)
            .chain(p.lines.iter().flat_map(|l| &l.classes))
            .cloned()
            .chain([".".repeat(NAME_ROOM)])
            .max_by_key(String::len)
            .unwrap_or_default();
        let device = self.device_name();
        let need = smallest_record_bytes(&Shape {
            device: &device,
            pipeline: &p.name,
            model: &model,
            stream: &stream,
            label: &label,
            zones: &p.zones,
            lines: &p.lines,
        });
        let limit = self.record_limit(p);
        if need <= limit.bytes() {
            return None;
        }
        let what = match limit {
            RecordLimit::Uplink(b) => format!("uplink.max_packet_bytes is {b}"),
            RecordLimit::Datagram(b) => format!("its udp output sends datagrams of {b} bytes"),
        };
        Some(format!(
            "{at}: its largest tracking event needs a record of {need} bytes, shortened as far as it goes, and {what}: raise max_packet_bytes to at least {need} (or shorten the device, pipeline, camera, zone and line names)"
        ))
    }
}
