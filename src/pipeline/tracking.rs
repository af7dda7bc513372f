//! Tracking plugged into a pipeline: [`crate::track::PipelineTracking`] as
//! the pipeline's stream hook. The hook's per-stream state is a stream's
//! tracker, so it lives in (and is bounded by) the pipeline's stream table;
//! a stream that leaves it ends its tracks (`stream_end`), and a pipeline
//! that stops or is replaced by another config ends them with `restart`.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::hook::{FrameMeta, HookOutput, StreamEnd, StreamHook};
use super::snapshot::thumbnail;
use crate::telemetry::logging::RateLimitedLog;
use crate::track::{EndReason, PipelineTracking, StreamState};

pub struct TrackingHook {
    tracking: Arc<PipelineTracking>,
    /// A full disk fails every snapshot of every frame: said once in a while.
    log: RateLimitedLog,
}

impl TrackingHook {
    pub fn new(tracking: Arc<PipelineTracking>) -> Self {
        TrackingHook {
            tracking,
            log: RateLimitedLog::new(Duration::from_secs(5)),
        }
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
                // A snapshot is a convenience: a full disk costs it (counted
                // by the store), not the frame.
                if let Err(e) = store.put(name, &jpeg)
                    && let Some(suppressed) = self.log.allow("snapshot")
                {
                    tracing::warn!(
                        pipeline = meta.pipeline,
                        error = %e,
                        suppressed,
                        failed = store.failed(),
                        "track snapshot not kept"
                    );
                }
            }
        }
        HookOutput {
            skip_record: !step.send_frame,
            events: step.events.into_iter().collect(),
        }
    }

    fn moving(&self, st: &StreamState) -> Vec<[f32; 4]> {
        st.moving_boxes()
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
