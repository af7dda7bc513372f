//! Hysteresis events over a scalar probability (voice activity and the like).
//!
//! Per stream: Idle -> (p >= on) -> Active(unconfirmed). An active event is
//! confirmed, and `start` emitted with its original start time, once it has
//! lasted `min_duration_s`; it ends when p stays below `off` for
//! `min_silence_s` (a return to >= `on` cancels the pending end). Values
//! between `off` and `on` keep whatever is happening. An unconfirmed event
//! that ends is dropped silently, so a short blip sends nothing upstream.
//! At most one event per item.
//!
//! Times come from the item's `start_s`/`end_s`; items without them (not
//! audio) count as one unit of time each, starting at 0.

use std::collections::HashMap;

use serde_json::json;

use super::{PostError, Postprocessor, find, floats};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_min_duration_s() -> f64 {
    0.25
}
pub(super) fn default_min_silence_s() -> f64 {
    0.1
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Idle,
    Active {
        start: f64,
        confirmed: bool,
        /// End of the last window at or above the hysteresis floor.
        last_active_end: f64,
        /// Start of the current run below `off`, if any.
        silence_since: Option<f64>,
    },
}

#[derive(Debug, Clone, Copy)]
struct StreamState {
    state: State,
    /// Items seen, for streams without times.
    items: u64,
}

/// Emits `start` / `end` events per stream.
pub struct ThresholdPostprocessor {
    output: String,
    on: f32,
    off: f32,
    min_duration_s: f64,
    min_silence_s: f64,
    streams: HashMap<String, StreamState>,
}

impl ThresholdPostprocessor {
    pub fn new(output: String, on: f32, off: f32, min_duration_s: f64, min_silence_s: f64) -> Self {
        ThresholdPostprocessor {
            output,
            on,
            off,
            min_duration_s,
            min_silence_s,
            streams: HashMap::new(),
        }
    }

    /// Advances one stream by one probability over `[t0, t1)`.
    fn step(&self, st: &mut State, p: f32, t0: f64, t1: f64) -> Option<serde_json::Value> {
        match st {
            State::Idle => {
                if p >= self.on {
                    *st = State::Active {
                        start: t0,
                        confirmed: false,
                        last_active_end: t1,
                        silence_since: None,
                    };
                    return self.confirm(st);
                }
                None
            }
            State::Active {
                start,
                confirmed,
                last_active_end,
                silence_since,
            } => {
                if p >= self.on || (p >= self.off && silence_since.is_none()) {
                    *silence_since = None;
                    *last_active_end = t1;
                } else if p < self.off && silence_since.is_none() {
                    *silence_since = Some(t0);
                }
                if let Some(s) = *silence_since
                    && t1 - s >= self.min_silence_s
                {
                    let (start, confirmed) = (*start, *confirmed);
                    *st = State::Idle;
                    return confirmed.then(
                        || json!({"event": "end", "t": s, "start": start, "duration_s": s - start}),
                    );
                }
                self.confirm(st)
            }
        }
    }

    fn confirm(&self, st: &mut State) -> Option<serde_json::Value> {
        if let State::Active {
            start,
            confirmed: confirmed @ false,
            last_active_end,
            ..
        } = st
            && *last_active_end - *start >= self.min_duration_s
        {
            *confirmed = true;
            return Some(json!({"event": "start", "t": *start}));
        }
        None
    }
}

impl Postprocessor for ThresholdPostprocessor {
    fn process(
        &mut self,
        stream: &str,
        meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<serde_json::Value>, PostError> {
        let t = find(outputs, &self.output)?;
        let values = floats(t);
        let [p] = values[..] else {
            return Err(PostError::BadShape {
                name: self.output.clone(),
                shape: t.shape().to_vec(),
                expected: "a single probability".into(),
            });
        };
        let mut st = *self
            .streams
            .entry(stream.to_string())
            .or_insert(StreamState {
                state: State::Idle,
                items: 0,
            });
        let n = st.items as f64;
        let t0 = meta.start_s.unwrap_or(n);
        let t1 = meta.end_s.unwrap_or(t0 + 1.0);
        st.items += 1;
        // A NaN probability counts as silence rather than poisoning the state.
        let p = if p.is_nan() { 0.0 } else { p };
        let event = self.step(&mut st.state, p, t0, t1);
        self.streams.insert(stream.to_string(), st);
        Ok(event)
    }

    fn reset(&mut self, stream: &str) {
        self.streams.remove(stream);
        // After many streams went (idle), the table's own memory goes too.
        if self.streams.len() * 4 < self.streams.capacity() {
            self.streams.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::{ArrayD, IxDyn};

    /// Feeds 32 ms windows (silero hop) with the given probabilities; returns
    /// (window index, event) pairs.
    fn run(
        p: &mut ThresholdPostprocessor,
        stream: &str,
        probs: &[f32],
    ) -> Vec<(usize, serde_json::Value)> {
        let mut events = Vec::new();
        for (i, v) in probs.iter().enumerate() {
            let meta = ItemMeta {
                start_s: Some(i as f64 * 0.032),
                end_s: Some(i as f64 * 0.032 + 0.036),
                image: None,
                level_scale: None,
            };
            let out = vec![(
                "output".to_string(),
                Tensor::F32(ArrayD::from_elem(IxDyn(&[1, 1]), *v)),
            )];
            if let Some(e) = p.process(stream, &meta, &out).unwrap() {
                events.push((i, e));
            }
        }
        events
    }

    fn vad() -> ThresholdPostprocessor {
        ThresholdPostprocessor::new("output".into(), 0.5, 0.35, 0.25, 0.1)
    }

    fn seq(parts: &[(f32, usize)]) -> Vec<f32> {
        parts
            .iter()
            .flat_map(|(v, n)| std::iter::repeat_n(*v, *n))
            .collect()
    }

    #[test]
    fn one_utterance_gives_start_then_end() {
        let probs = seq(&[(0.05, 10), (0.95, 20), (0.1, 10)]);
        let ev = run(&mut vad(), "mic", &probs);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert_eq!(ev[0].1["event"], "start");
        assert!((ev[0].1["t"].as_f64().unwrap() - 0.32).abs() < 1e-9);
        // Confirmed once 0.25 s has passed: window 10 + 7 (7*0.032+0.036 >= 0.25).
        assert_eq!(ev[0].0, 17);
        assert_eq!(ev[1].1["event"], "end");
        assert!((ev[1].1["t"].as_f64().unwrap() - 0.96).abs() < 1e-9);
        assert!((ev[1].1["duration_s"].as_f64().unwrap() - 0.64).abs() < 1e-9);
        assert!((ev[1].1["start"].as_f64().unwrap() - 0.32).abs() < 1e-9);
    }

    #[test]
    fn short_blips_send_nothing() {
        let probs = seq(&[(0.0, 5), (0.9, 3), (0.0, 10), (0.9, 2), (0.0, 10)]);
        assert!(run(&mut vad(), "mic", &probs).is_empty());
    }

    #[test]
    fn hysteresis_and_hangover_prevent_flapping() {
        // Mid values (between off and on) keep speech going; a dip shorter
        // than the hangover (2 windows = 64 ms < 100 ms + window) is bridged.
        let probs = seq(&[(0.9, 10), (0.4, 10), (0.1, 2), (0.9, 10), (0.0, 10)]);
        let ev = run(&mut vad(), "mic", &probs);
        let kinds: Vec<_> = ev
            .iter()
            .map(|(_, e)| e["event"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(kinds, vec!["start", "end"], "{ev:?}");
        // Mid values while a silence is pending do not cancel it.
        let probs = seq(&[(0.9, 10), (0.1, 1), (0.4, 5)]);
        let ev = run(&mut vad(), "mic2", &probs);
        assert_eq!(ev.len(), 2, "{ev:?}");
    }

    #[test]
    fn streams_are_independent_and_reset_forgets() {
        let mut p = vad();
        run(&mut p, "a", &seq(&[(0.9, 20)]));
        assert!(run(&mut p, "b", &seq(&[(0.0, 20)])).is_empty());
        p.reset("a");
        // After reset, silence on "a" does not end anything.
        assert!(run(&mut p, "a", &seq(&[(0.0, 20)])).is_empty());
    }

    #[test]
    fn items_without_times_count_units_and_shape_is_checked() {
        let mut p = ThresholdPostprocessor::new("o".into(), 0.5, 0.5, 0.0, 0.0);
        let one = |v: f32| {
            vec![(
                "o".to_string(),
                Tensor::F32(ArrayD::from_elem(IxDyn(&[1]), v)),
            )]
        };
        let e = p
            .process("s", &ItemMeta::default(), &one(0.9))
            .unwrap()
            .unwrap();
        assert_eq!(e, json!({"event": "start", "t": 0.0}));
        let e = p
            .process("s", &ItemMeta::default(), &one(0.1))
            .unwrap()
            .unwrap();
        assert_eq!(e["event"], "end");
        assert_eq!(e["t"], 1.0);
        let two = vec![("o".to_string(), Tensor::F32(ArrayD::zeros(IxDyn(&[2]))))];
        assert_eq!(
            p.process("s", &ItemMeta::default(), &two)
                .unwrap_err()
                .reason(),
            "bad_shape"
        );
    }
}
