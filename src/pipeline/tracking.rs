//! Tracking plugged into a pipeline: [`crate::track::PipelineTracking`] as
//! the pipeline's stream hook. The hook's per-stream state is a stream's
//! tracker, so it lives in (and is bounded by) the pipeline's stream table;
//! a stream that leaves it ends its tracks (`stream_end`), and a pipeline
//! that stops or is replaced by another config ends them with `restart`.

use std::sync::Arc;
use std::time::SystemTime;

use serde_json::Value;

use super::hook::{FrameMeta, HookOutput, StreamEnd, StreamHook};
use super::snapshot::thumbnail;
use crate::track::{EndReason, PipelineTracking, StreamState};

pub struct TrackingHook {
    tracking: Arc<PipelineTracking>,
}

impl TrackingHook {
    pub fn new(tracking: Arc<PipelineTracking>) -> Self {
        TrackingHook { tracking }
    }
}

impl StreamHook for TrackingHook {
    type State = StreamState;

    fn start(&self, meta: &FrameMeta<'_>) -> StreamState {
        self.tracking.stream(meta.stream)
    }

    fn frame(&self, st: &mut StreamState, meta: &FrameMeta<'_>, value: &mut Value) -> HookOutput {
        let step = self.tracking.frame(st, meta.time, meta.size, value);
        if let (Some(store), Some(picture)) = (self.tracking.snapshots(), meta.picture) {
            for (name, b) in &step.best_crops {
                let [x0, y0, x1, y1] = b.map(|v| v.round() as i64);
                let crop = picture.crop(x0, y0, x1.max(x0 + 1), y1.max(y0 + 1));
                let Some(jpeg) = thumbnail(&crop, self.tracking.snapshot_max_bytes()) else {
                    continue;
                };
                // A snapshot is a convenience: a full disk costs it, not the frame.
                if let Err(e) = store.put(name, &jpeg) {
                    tracing::warn!(pipeline = meta.pipeline, error = %e, "track snapshot not kept");
                }
            }
        }
        HookOutput {
            skip_record: !step.send_frame,
            events: step.events.into_iter().collect(),
        }
    }

    fn end(&self, _stream: &str, mut st: StreamState, why: StreamEnd) -> Vec<Value> {
        let reason = match why {
            StreamEnd::Lru | StreamEnd::Idle => EndReason::StreamEnd,
            StreamEnd::Closed => EndReason::Restart,
        };
        self.tracking
            .end(&mut st, reason, SystemTime::now())
            .into_iter()
            .collect()
    }
}
