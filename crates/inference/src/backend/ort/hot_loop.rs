//! The benchmark's unbound hot loop: inputs converted to ONNX Runtime values
//! once, then each step runs the session on them and copies state outputs
//! (f32) into their inputs in place. What `outpost bench` times when no
//! device binding is in use; ONNX Runtime's types stay in this room.

use ort::session::SessionInputValue;
use ort::value::DynValue;

use super::OrtSession;
use crate::backend::{DType, InferenceSession, RunError, Tensor, check_inputs};

/// One inference step with prepared values; what the timed loop repeats.
pub struct HotLoop {
    values: Vec<DynValue>,
    /// (index of the state input in `values`, name of the output feeding it)
    state: Vec<(usize, String)>,
}

impl HotLoop {
    /// Prepares values in the session's input order. `state` pairs (input,
    /// output) must name f32 inputs; the output is copied into its input
    /// after every step.
    pub fn new(
        session: &OrtSession,
        inputs: &[(String, Tensor)],
        state: &[(&str, &str)],
    ) -> Result<HotLoop, RunError> {
        let io = session.io();
        check_inputs(io, inputs.iter().map(|(n, t)| (n.as_str(), t)))?;
        let mut values = Vec::with_capacity(io.inputs.len());
        for spec in &io.inputs {
            // check_inputs guarantees every input is present.
            let (_, t) = inputs
                .iter()
                .find(|(n, _)| *n == spec.name)
                .ok_or_else(|| RunError::Engine(format!("missing {}", spec.name)))?;
            values.push(t.to_ort().map_err(|e| RunError::Engine(e.to_string()))?);
        }
        let mut pairs = Vec::new();
        for (input, output) in state {
            match io.inputs.iter().position(|i| i.name == *input) {
                Some(i) if io.inputs[i].dtype == DType::F32 => pairs.push((i, output.to_string())),
                _ => {
                    return Err(RunError::Engine(format!(
                        "state input `{input}` must be an f32 input of the model"
                    )));
                }
            }
        }
        Ok(HotLoop {
            values,
            state: pairs,
        })
    }

    /// One run, state fed back.
    #[inline]
    pub fn step(&mut self, session: &mut OrtSession) -> Result<(), RunError> {
        self.step_raw(session)
            .map_err(|e| RunError::Engine(e.to_string()))
    }

    fn step_raw(&mut self, session: &mut OrtSession) -> ort::Result<()> {
        let inputs: Vec<SessionInputValue<'_>> =
            self.values.iter().map(|v| v.view().into()).collect();
        let outputs = session.raw().run(inputs.as_slice())?;
        drop(inputs);
        for (idx, out) in &self.state {
            let Some(src) = outputs.get(out.as_str()) else {
                return Err(ort::Error::new(format!("state output `{out}` missing")));
            };
            let (_, src) = src.try_extract_tensor::<f32>()?;
            let (_, dst) = self.values[*idx].try_extract_tensor_mut::<f32>()?;
            if src.len() != dst.len() {
                return Err(ort::Error::new(format!(
                    "state output `{out}` has {} values, its input {}",
                    src.len(),
                    dst.len()
                )));
            }
            dst.copy_from_slice(src);
        }
        Ok(())
    }
}
