//! What the console draws of a pipeline's tracking: the zones and lines as
//! configured, and the tracked boxes of the newest frame; in a pipeline
//! over several cameras (`cameras = [...]`) also those of each camera's
//! newest frame, so each camera's view shows its own.
//!
//! Bounds: at most [`LIVE_BOXES`] boxes a frame; the pipeline's newest
//! frame, plus one per camera of the pipeline's camera list, which is fixed
//! when the pipeline is built (never taken from the streams that arrive).

use std::time::SystemTime;

use serde::Serialize;

use super::events::rfc3339;

/// Tracked boxes of the newest frame kept for the console, at most.
pub const LIVE_BOXES: usize = 64;

/// The zones and lines as configured, in source-frame pixels.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Geometry {
    pub zones: Vec<ZoneShape>,
    pub lines: Vec<LineShape>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ZoneShape {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub camera: Option<String>,
    pub polygon: Vec<[f32; 2]>,
}

/// `points[0]` to `points[1]`; crossing from its left to its right (seen
/// with the first point at the top) is `in`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LineShape {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub camera: Option<String>,
    pub points: [[f32; 2]; 2],
}

/// The newest frame's tracked boxes: written once a frame (under a short
/// lock), read by the console's feed once a second.
#[derive(Debug, Default)]
pub(super) struct LiveSlot {
    /// The source frame's width and height, from the newest frame that had one.
    pub frame_size: Option<[u32; 2]>,
    pub tracks: Option<LiveTracks>,
    /// Each camera's own, in the pipeline's camera order.
    pub cameras: Vec<CameraLive>,
}

impl LiveSlot {
    /// A slot for a pipeline whose streams are the cameras `names` (none:
    /// only the newest frame is kept).
    pub fn with_cameras(names: &[String]) -> LiveSlot {
        LiveSlot {
            cameras: names
                .iter()
                .map(|n| CameraLive {
                    name: n.clone(),
                    frame_size: None,
                    live: None,
                })
                .collect(),
            ..LiveSlot::default()
        }
    }

    /// The newest frame's boxes (of `tracks.stream`).
    pub fn keep(&mut self, size: Option<[u32; 2]>, tracks: LiveTracks) {
        if let Some(c) = self.cameras.iter_mut().find(|c| c.name == tracks.stream) {
            if size.is_some() {
                c.frame_size = size;
            }
            c.live = Some(tracks.clone());
        }
        if size.is_some() {
            self.frame_size = size;
        }
        self.tracks = Some(tracks);
    }

    /// The stream ended: its boxes are no longer live.
    pub fn end(&mut self, stream: &str) {
        if self.tracks.as_ref().is_some_and(|t| t.stream == stream) {
            self.tracks = None;
        }
        if let Some(c) = self.cameras.iter_mut().find(|c| c.name == stream) {
            c.live = None;
        }
    }
}

/// One camera's newest frame in a pipeline over several cameras.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CameraLive {
    /// The camera: the stream's name.
    pub name: String,
    /// `[width, height]` of its frames; `null` before the first one.
    pub frame_size: Option<[u32; 2]>,
    /// `null` before its first frame and after its stream ended.
    pub live: Option<LiveTracks>,
}

/// The tracked boxes of the pipeline's newest frame (of whichever stream).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveTracks {
    pub stream: String,
    #[serde(serialize_with = "rfc3339")]
    pub ts: SystemTime,
    /// At most [`LIVE_BOXES`], those with a track id only.
    pub boxes: Vec<LiveBox>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveBox {
    pub track: String,
    pub label: String,
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
    pub score: f32,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub stationary: bool,
}

/// What the console draws of a pipeline's tracking.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrackingView {
    pub geometry: Geometry,
    /// `[width, height]` of the source frames; `null` before the first one.
    pub frame_size: Option<[u32; 2]>,
    /// `null` before the first frame and after its stream ended.
    pub live: Option<LiveTracks>,
    /// A pipeline over several cameras: each camera's frame size and
    /// tracked boxes, in the pipeline's camera order; absent otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cameras: Vec<CameraLive>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracks(stream: &str, n: usize) -> LiveTracks {
        LiveTracks {
            stream: stream.into(),
            ts: SystemTime::UNIX_EPOCH,
            boxes: (0..n)
                .map(|i| LiveBox {
                    track: format!("gw/site/{stream}/1-{i}"),
                    label: "car".into(),
                    bbox: [0.0, 0.0, 1.0, 1.0],
                    score: 0.5,
                    stationary: false,
                })
                .collect(),
        }
    }

    #[test]
    fn each_camera_keeps_its_own_newest_boxes_and_no_other_stream_does() {
        let mut s = LiveSlot::with_cameras(&["gate".into(), "yard".into()]);
        s.keep(Some([320, 240]), tracks("gate", 2));
        s.keep(Some([640, 480]), tracks("yard", 1));
        s.keep(None, tracks("elsewhere", 3));
        assert_eq!(s.cameras.len(), 2);
        assert_eq!(s.cameras[0].frame_size, Some([320, 240]));
        assert_eq!(s.cameras[0].live.as_ref().map(|t| t.boxes.len()), Some(2));
        assert_eq!(s.cameras[1].frame_size, Some([640, 480]));
        assert_eq!(s.cameras[1].live.as_ref().map(|t| t.boxes.len()), Some(1));
        assert_eq!(
            s.tracks.as_ref().map(|t| t.stream.as_str()),
            Some("elsewhere")
        );
        assert_eq!(s.frame_size, Some([640, 480]));
        s.end("gate");
        assert!(s.cameras[0].live.is_none() && s.cameras[1].live.is_some());
        // Without cameras only the newest frame is kept.
        let mut one = LiveSlot::default();
        one.keep(Some([8, 8]), tracks("a", 1));
        assert!(one.cameras.is_empty());
        one.end("a");
        assert!(one.tracks.is_none());
    }
}
