//! Why a frame gave no record: one enum that names the reason once for the
//! counters (`outpost_frames_dropped_total{reason}`), `/v1/status` (`drops`),
//! the log line and the error kind a waiting sender is answered with.
//!
//! The labels are an interface (dashboards and tests read them): a variant
//! keeps its label for good.

use crate::source::{FrameError, FrameErrorKind};

/// Why a frame, or one item of it, was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// Pushed out of a full `drop_oldest` queue by a newer frame.
    QueueFullDropOldest,
    /// Refused by a full `drop_newest` queue.
    QueueFullDropNewest,
    /// A camera frame replaced by a newer one: a camera outrunning its
    /// model is the design, so these are counted but not logged.
    Stale,
    /// The payload could not be decoded; the preprocessor's own label
    /// (`bad_size`, `bad_json`, `undecodable_image`, ...).
    Decode(&'static str),
    /// Items of different shapes could not share one run.
    Batch,
    /// The engine failed the run.
    Inference,
    /// The outputs could not be turned into a result.
    Postprocess,
    /// A cascade stage failed; the record is still made (marked
    /// `stage_error`), so this counts a fault, not a lost frame.
    Stage,
    /// The record could not be encoded or stored.
    Store,
    /// Reported by the source before the frame reached the queue, under the
    /// source's label (`kernel_overflow`, `bad_frame`, ...).
    Source(&'static str),
}

impl DropReason {
    /// The metric label and `/v1/status` key.
    pub fn label(self) -> &'static str {
        match self {
            DropReason::QueueFullDropOldest => "queue_full_drop_oldest",
            DropReason::QueueFullDropNewest => "queue_full_drop_newest",
            DropReason::Stale => "stale",
            DropReason::Decode(l) | DropReason::Source(l) => l,
            DropReason::Batch => "batch_error",
            DropReason::Inference => "inference_error",
            DropReason::Postprocess => "postprocess_error",
            DropReason::Stage => "stage_error",
            DropReason::Store => "store_error",
        }
    }

    /// A reason a source reports by its label: the pipeline's own reasons
    /// by their variant (a camera's `stale` is the pipeline's), any other
    /// label as the source's.
    pub fn from_source(label: &'static str) -> DropReason {
        [
            DropReason::QueueFullDropOldest,
            DropReason::QueueFullDropNewest,
            DropReason::Stale,
            DropReason::Batch,
            DropReason::Inference,
            DropReason::Postprocess,
            DropReason::Stage,
            DropReason::Store,
        ]
        .into_iter()
        .find(|r| r.label() == label)
        .unwrap_or(DropReason::Source(label))
    }

    /// Who can act on it, for the answer to a sender that waits.
    pub fn kind(self) -> FrameErrorKind {
        match self {
            DropReason::QueueFullDropOldest
            | DropReason::QueueFullDropNewest
            | DropReason::Stale => FrameErrorKind::Dropped,
            // A preprocessing that does not fit the model is the daemon's
            // configuration, not the sender's payload.
            DropReason::Decode("config") => FrameErrorKind::Engine,
            DropReason::Decode(_) | DropReason::Source(_) => FrameErrorKind::Malformed,
            DropReason::Batch
            | DropReason::Inference
            | DropReason::Postprocess
            | DropReason::Stage => FrameErrorKind::Engine,
            DropReason::Store => FrameErrorKind::Store,
        }
    }

    /// Whether a drop of this reason is logged (rate-limited) as well as counted.
    pub fn logged(self) -> bool {
        self != DropReason::Stale
    }

    /// The answer to a sender waiting for a frame dropped for this reason.
    pub fn error(self, detail: impl Into<String>) -> FrameError {
        FrameError::new(self.kind(), detail)
    }

    /// The answer to a sender whose frame a full queue dropped.
    pub fn queue_error(self) -> FrameError {
        self.error(format!("dropped from the full queue ({})", self.label()))
    }
}

impl std::fmt::Display for DropReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

/// A dropped frame or item: the reason and what happened, for the log and
/// the answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub reason: DropReason,
    pub detail: String,
}

impl Dropped {
    pub fn new(reason: DropReason, detail: impl std::fmt::Display) -> Dropped {
        Dropped {
            reason,
            detail: detail.to_string(),
        }
    }

    /// The answer to a sender that waits for the frame.
    pub fn error(&self) -> FrameError {
        self.reason.error(self.detail.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_the_ones_metrics_and_status_show() {
        let all = [
            (DropReason::QueueFullDropOldest, "queue_full_drop_oldest"),
            (DropReason::QueueFullDropNewest, "queue_full_drop_newest"),
            (DropReason::Stale, "stale"),
            (DropReason::Decode("bad_size"), "bad_size"),
            (DropReason::Batch, "batch_error"),
            (DropReason::Inference, "inference_error"),
            (DropReason::Postprocess, "postprocess_error"),
            (DropReason::Stage, "stage_error"),
            (DropReason::Store, "store_error"),
            (DropReason::Source("kernel_overflow"), "kernel_overflow"),
        ];
        for (r, label) in all {
            assert_eq!(r.label(), label);
            assert_eq!(r.to_string(), label);
        }
    }

    #[test]
    fn a_sources_label_names_the_pipelines_reason_when_it_is_one() {
        assert_eq!(DropReason::from_source("stale"), DropReason::Stale);
        assert!(!DropReason::from_source("stale").logged());
        assert_eq!(
            DropReason::from_source("bad_frame"),
            DropReason::Source("bad_frame")
        );
        assert!(DropReason::from_source("bad_frame").logged());
    }

    #[test]
    fn each_reason_answers_with_who_can_act_on_it() {
        use FrameErrorKind::*;
        assert_eq!(DropReason::QueueFullDropNewest.kind(), Dropped);
        assert_eq!(DropReason::Decode("bad_json").kind(), Malformed);
        assert_eq!(DropReason::Decode("config").kind(), Engine);
        assert_eq!(DropReason::Inference.kind(), Engine);
        assert_eq!(DropReason::Batch.kind(), Engine);
        assert_eq!(DropReason::Store.kind(), Store);
        assert_eq!(
            DropReason::QueueFullDropOldest.queue_error().detail,
            "dropped from the full queue (queue_full_drop_oldest)"
        );
    }
}
