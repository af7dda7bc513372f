//! From detections to events: multi-object tracking per stream, zones and
//! lines, and the events a pipeline sends instead of a record per frame.
//!
//! `[pipelines.track]` builds one [`TrackingSpec`] per pipeline; each
//! stream gets a [`StreamTracker`] fed each frame's detections (read from
//! the postprocessed value by [`value::detections`]) with the frame's time.
//! It answers with each detection's track id (written back into the value
//! for local outputs by [`value::annotate`]) and the frame's [`Event`]s.
//! The tracker does no I/O and reads no clock, so all of it is tested
//! frame by frame; [`TrackStats`] holds the counts a pipeline reports.
//!
//! Association and the Kalman filter are trackforge's ByteTrack; see
//! `tracker.rs` for what is added on top and its invariants, `zones.rs`
//! for those of zones and lines, `occupancy.rs` for the counts of objects
//! per zone and `speed.rs` for speeds in calibrated zones.

pub mod config;
pub mod events;
pub mod fit;
pub mod geometry;
pub mod hook;
pub mod motion;
pub mod occupancy;
pub mod snapshots;
pub mod speed;
pub mod stats;
pub mod tracker;
pub mod value;
pub mod view;
pub mod zones;

pub use self::config::{Directions, Emit, LineConfig, TrackConfig, ZoneConfig};
pub use self::events::{
    Direction, EndReason, Event, EventKind, OccupancyEvent, Speed, TrackSummary,
};
pub use self::hook::{PipelineTracking, Step, StreamState, TrackingSetup};
pub use self::speed::SpeedUnit;
pub use self::stats::{TrackCounts, TrackStats, ZoneCount};
pub use self::tracker::{Detection, FrameOutput, StreamTracker, Tracked, TrackingSpec};
pub use self::view::{CameraLive, Geometry, LiveBox, LiveTracks, TrackingView};

#[cfg(test)]
mod tests;
