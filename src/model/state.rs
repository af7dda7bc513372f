//! Per-stream state of stateful models (recurrent state fed back from an
//! output to an input, as silero VAD's `stateN` -> `state`).
//!
//! Invariants: each stream has its own state; a stream's first call sees
//! zeros; a failed call leaves the stream's state as it was, so one bad frame
//! does not poison the stream.

use std::collections::HashMap;

use super::registry::LoadedModel;
use crate::backend::{RunError, Tensor};

/// State tensors of every stream of one model.
#[derive(Default)]
pub struct StreamStates {
    streams: HashMap<String, Vec<Tensor>>,
}

impl StreamStates {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// Forgets a stream (it ended, or it must start over).
    pub fn reset(&mut self, stream: &str) {
        self.streams.remove(stream);
    }

    /// Runs `model` for `stream` with the caller's inputs plus the stream's
    /// state inputs, and keeps the returned state for the stream's next call.
    /// Outputs that are state are not returned.
    pub fn run(
        &mut self,
        model: &LoadedModel,
        stream: &str,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        let pairs = &model.manifest.state;
        if pairs.is_empty() {
            return model.run(inputs);
        }
        let batch = inputs
            .first()
            .and_then(|(_, t)| t.shape().first().copied())
            .unwrap_or(1);
        let state = self.streams.entry(stream.to_string()).or_insert_with(|| {
            pairs
                .iter()
                .map(|p| {
                    let spec = model.manifest.inputs.iter().find(|i| i.name == p.input);
                    // validate() guarantees the state input is declared.
                    let (dtype, shape) = spec
                        .map(|s| (s.dtype, s.spec().concrete_shape(batch)))
                        .unwrap_or_default();
                    Tensor::filled(dtype, &shape, 0.0)
                })
                .collect()
        });
        let mut all: Vec<(&str, &Tensor)> = inputs.to_vec();
        for (p, t) in pairs.iter().zip(state.iter()) {
            all.push((p.input.as_str(), t));
        }
        let outputs = model.run(&all)?;
        let mut rest = Vec::with_capacity(outputs.len());
        let mut new_state: Vec<Option<Tensor>> = vec![None; pairs.len()];
        for (name, t) in outputs {
            match pairs.iter().position(|p| p.output == name) {
                Some(i) => new_state[i] = Some(t),
                None => rest.push((name, t)),
            }
        }
        if new_state.iter().all(Option::is_some) {
            *state = new_state.into_iter().flatten().collect();
        } else {
            return Err(RunError::Engine(
                "the model did not return every declared state output".into(),
            ));
        }
        Ok(rest)
    }
}
