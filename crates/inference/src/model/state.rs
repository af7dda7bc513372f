//! Per-stream state of stateful models (recurrent state fed back from an
//! output to an input, as silero VAD's `stateN` -> `state`).
//!
//! Invariants: each stream has its own state; a stream's first call sees
//! zeros; a failed call leaves the stream's state as it was, so one bad frame
//! does not poison the stream.
//!
//! Batching across streams (as Triton's sequence batcher does): one run
//! takes items of distinct streams, each stream's state is gathered into
//! the state input's batch axis (silero: axis 1 of [2, batch, 128]) and the
//! returned state scattered back. The caller never puts two items of one
//! stream in the same run, and runs a stream's items in order.

use std::collections::HashMap;

use super::manifest::Manifest;
use super::registry::LoadedModel;
use crate::backend::{Dim, RunError, Tensor, is_batch_name};

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
        // After many streams went (idle), the table's own memory goes too.
        if self.streams.len() * 4 < self.streams.capacity() {
            self.streams.shrink_to_fit();
        }
    }

    /// The batch axis of each state input (None: a state without one cannot
    /// be batched across streams).
    pub fn batch_axes(manifest: &Manifest) -> Option<Vec<usize>> {
        manifest
            .state
            .iter()
            .map(|p| {
                let spec = manifest.inputs.iter().find(|i| i.name == p.input)?;
                spec.shape
                    .iter()
                    .position(|d| matches!(d, Dim::Symbolic(s) if is_batch_name(s)))
            })
            .collect()
    }

    /// A new stream's zero state at `batch` (its size held to the limit
    /// on declared tensors before it is allocated).
    fn zeros(model: &LoadedModel, batch: usize) -> Result<Vec<Tensor>, RunError> {
        model
            .manifest
            .state
            .iter()
            .map(|p| {
                let spec = model.manifest.inputs.iter().find(|i| i.name == p.input);
                // validate() guarantees the state input is declared.
                let (dtype, shape) = match spec {
                    Some(s) => (s.dtype, s.spec().concrete_shape(batch)?),
                    None => Default::default(),
                };
                Ok(Tensor::filled(dtype, &shape, 0.0))
            })
            .collect()
    }

    /// One run over items of distinct `streams`: `inputs` hold the batched
    /// main input (axis 0 = `streams.len()`) and constants; each stream's
    /// state goes into its place on the state's batch axis (`axes`, from
    /// [`StreamStates::batch_axes`]). Returns each item's outputs (state
    /// outputs left out), in the order of `streams`.
    pub fn run_batch(
        &mut self,
        model: &LoadedModel,
        streams: &[&str],
        axes: &[usize],
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<Vec<(String, Tensor)>>, RunError> {
        let pairs = &model.manifest.state;
        let n = streams.len();
        for s in streams {
            if !self.streams.contains_key(*s) {
                self.streams.insert(s.to_string(), Self::zeros(model, 1)?);
            }
        }
        let mut batched: Vec<Tensor> = Vec::with_capacity(pairs.len());
        for (k, axis) in axes.iter().enumerate().take(pairs.len()) {
            let parts: Vec<&Tensor> = streams
                .iter()
                .filter_map(|s| self.streams.get(*s).and_then(|st| st.get(k)))
                .collect();
            batched
                .push(Tensor::concat(&parts, *axis).map_err(|e| RunError::Engine(e.to_string()))?);
        }
        let mut all: Vec<(&str, &Tensor)> = inputs.to_vec();
        for (p, t) in pairs.iter().zip(batched.iter()) {
            all.push((p.input.as_str(), t));
        }
        let outputs = model.run(&all)?;
        let mut rest: Vec<(String, Tensor)> = Vec::with_capacity(outputs.len());
        let mut new_state: Vec<Option<Vec<Tensor>>> = vec![None; pairs.len()];
        for (name, t) in outputs {
            if let Some(k) = pairs.iter().position(|p| p.output == name) {
                let axis = axes.get(k).copied().unwrap_or(0);
                match t.split(axis, n) {
                    Some(pieces) if t.shape().get(axis) == Some(&n) => new_state[k] = Some(pieces),
                    _ => {
                        return Err(RunError::Engine(format!(
                            "state output `{name}` of shape {:?} has no batch of {n} on axis {axis}",
                            t.shape()
                        )));
                    }
                }
                continue;
            }
            rest.push((name, t));
        }
        let per_item = model.split_outputs(rest, n);
        if new_state.iter().any(Option::is_none) {
            return Err(RunError::Engine(
                "the model did not return every declared state output".into(),
            ));
        }
        // Scatter: stream j gets piece j of every state output.
        let mut columns: Vec<std::vec::IntoIter<Tensor>> = new_state
            .into_iter()
            .flatten()
            .map(|v| v.into_iter())
            .collect();
        for s in streams {
            let st: Vec<Tensor> = columns.iter_mut().filter_map(|c| c.next()).collect();
            if let Some(slot) = self.streams.get_mut(*s) {
                *slot = st;
            }
        }
        Ok(per_item)
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
        // Looked up by &str first: a stream's name is copied once, at its first frame.
        if !self.streams.contains_key(stream) {
            let zeros = Self::zeros(model, batch)?;
            self.streams.insert(stream.to_string(), zeros);
        }
        let Some(state) = self.streams.get_mut(stream) else {
            return Err(RunError::Engine(format!("no state for stream {stream}")));
        };
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
