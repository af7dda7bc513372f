//! The per-stream hook after postprocessing: where state that follows a
//! stream from frame to frame (object tracks, zones, line crossings) plugs
//! into a pipeline.
//!
//! Invariants:
//! - A hook sees each result of a stream in the order the frames came: a
//!   pipeline with a hook is run by one worker at a time.
//! - A stream's state is made by [`StreamHook::start`] at its first result
//!   and lives in the pipeline's stream table, so it is bounded by
//!   `max_streams` (the least recently seen evicted, counted) and expired
//!   after `stream_idle`, like every other per-stream state.
//! - Every state that leaves is handed to [`StreamHook::end`] once, with
//!   why: evicted, expired, or the pipeline replaced by a changed config.
//!   A reload that leaves the pipeline's config unchanged hands the states
//!   to the new pipeline instead ([`super::Pipeline::adopt_streams`]).

use std::any::Any;
use std::time::SystemTime;

use serde_json::Value;

use crate::stream_table::Reason;

/// What a hook knows of the frame a result came from.
#[derive(Debug, Clone, Copy)]
pub struct FrameMeta<'a> {
    pub pipeline: &'a str,
    pub stream: &'a str,
    /// When the frame was captured (cameras), else when it arrived.
    pub time: SystemTime,
    /// The source frame's width and height in pixels (image pipelines).
    pub size: Option<(u32, u32)>,
    /// The decoded source frame, where the pipeline decodes one anyway (a
    /// pipeline with stages crops its boxes from it).
    pub picture: Option<&'a crate::preprocess::crop::Rgb>,
}

/// What a hook makes of one result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HookOutput {
    /// The frame's own record is not stored (`emit = "events"`): the local
    /// outputs still get it, the outbox does not.
    pub skip_record: bool,
    /// Records of their own for this stream (events): each is the
    /// `outputs` of a record, stored and sent after the frame's.
    pub events: Vec<Value>,
}

/// Why a stream's state ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// A new stream needed its place: it was the least recently seen.
    Lru,
    /// Not seen for `stream_idle`.
    Idle,
    /// Its pipeline was replaced by one with another config, or removed.
    Closed,
}

impl From<Reason> for StreamEnd {
    fn from(r: Reason) -> StreamEnd {
        match r {
            Reason::Lru => StreamEnd::Lru,
            Reason::Idle => StreamEnd::Idle,
        }
    }
}

/// State per stream, fed each postprocessed result of the stream.
pub trait StreamHook: Send + Sync + 'static {
    /// What the hook keeps per stream.
    type State: Send + 'static;

    /// A stream's state at its first result.
    fn start(&self, meta: &FrameMeta<'_>) -> Self::State;

    /// One result of the stream (`value`: the record's `outputs`, e.g.
    /// `{"boxes": [...]}`), which the hook may change before the local
    /// outputs and the outbox get it.
    fn frame(&self, state: &mut Self::State, meta: &FrameMeta<'_>, value: &mut Value)
    -> HookOutput;

    /// Boxes (`[x0, y0, x1, y1]`, source pixels) of what the state follows
    /// that may still move: a motion gate runs the detector while there
    /// are any, even when the picture shows no motion.
    fn moving(&self, _state: &Self::State) -> Vec<[f32; 4]> {
        Vec::new()
    }

    /// The stream's state leaves: its last events (tracks that end).
    fn end(&self, _stream: &str, _state: Self::State, _why: StreamEnd) -> Vec<Value> {
        Vec::new()
    }
}

/// A stream's state as the pipeline holds it, whatever the hook's type.
pub type AnyState = Box<dyn Any + Send>;

/// A [`StreamHook`] behind a pointer: what a pipeline holds. Every
/// `StreamHook` is one.
pub trait DynStreamHook: Send + Sync {
    fn start_any(&self, meta: &FrameMeta<'_>) -> AnyState;
    fn frame_any(
        &self,
        state: &mut AnyState,
        meta: &FrameMeta<'_>,
        value: &mut Value,
    ) -> HookOutput;
    fn end_any(&self, stream: &str, state: AnyState, why: StreamEnd) -> Vec<Value>;
    fn moving_any(&self, state: &AnyState) -> Vec<[f32; 4]>;
}

impl<H: StreamHook> DynStreamHook for H {
    fn start_any(&self, meta: &FrameMeta<'_>) -> AnyState {
        Box::new(self.start(meta))
    }

    fn frame_any(
        &self,
        state: &mut AnyState,
        meta: &FrameMeta<'_>,
        value: &mut Value,
    ) -> HookOutput {
        // A pipeline holds the states of its own hook only; anything else
        // starts over rather than being misread.
        if !state.is::<H::State>() {
            *state = self.start_any(meta);
        }
        match state.downcast_mut::<H::State>() {
            Some(s) => self.frame(s, meta, value),
            None => HookOutput::default(),
        }
    }

    fn end_any(&self, stream: &str, state: AnyState, why: StreamEnd) -> Vec<Value> {
        match state.downcast::<H::State>() {
            Ok(s) => self.end(stream, *s, why),
            Err(_) => Vec::new(),
        }
    }

    fn moving_any(&self, state: &AnyState) -> Vec<[f32; 4]> {
        state
            .downcast_ref::<H::State>()
            .map(|s| self.moving(s))
            .unwrap_or_default()
    }
}
