//! The one inference path: items in, one outcome per item out, in the items'
//! order, whatever the pipeline's batching (one run per item, stacked runs,
//! state batched across streams), and the cascade stages' batches of crops
//! ([`run_batch`]). Every run is counted by one function
//! ([`RunStats::count`], into the counters of the model that ran: the
//! pipeline's or a stage's), and a run's outputs reach its items by one
//! rule ([`LoadedModel::split_outputs`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use super::LatencyHistogram;
use super::drops::{DropReason, Dropped};
use super::mode::{Batching, Mode};
use crate::backend::{RunError, Tensor};
use crate::model::registry::LoadedModel;
use crate::model::state::StreamStates;

/// One item to run: its main input and the stream it belongs to.
pub struct Job<'a> {
    pub stream: &'a str,
    pub tensor: &'a Tensor,
}

/// An item's outputs and the time of the run it was part of, µs.
#[derive(Debug)]
pub struct Ran {
    pub outputs: Vec<(String, Tensor)>,
    pub us: u64,
}

/// What one item came to.
pub type Outcome = Result<Ran, Dropped>;

/// The inference runs of one model in one place: the pipeline's model
/// (`PipelineStats::runs`) or a cascade stage's (`StageStats::runs`).
#[derive(Default)]
pub struct RunStats {
    /// Inference runs.
    pub batches: AtomicU64,
    /// Items over all runs.
    pub batch_items: AtomicU64,
    /// Time in inference over all runs, µs.
    pub inference_us_total: AtomicU64,
    /// Inference alone (a batch counts once), µs.
    pub inference_us: LatencyHistogram,
    /// Items per inference run.
    pub batch_sizes: LatencyHistogram,
}

impl RunStats {
    /// Counts one run of `items` items that took `us` (failed runs too).
    pub fn count(&self, us: u64, items: usize) {
        self.inference_us_total.fetch_add(us, Ordering::Relaxed);
        self.inference_us.record(us);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.batch_items.fetch_add(items as u64, Ordering::Relaxed);
        self.batch_sizes.record(items as u64);
    }
}

/// One run of a batch of `n` items built beforehand (`inputs`, the items
/// on the batch axis), counted in `runs`; each item's outputs, in order.
/// The stateless runs of several items go through here: the pipeline's
/// stacked frames and a cascade stage's crops.
pub fn run_batch(
    model: &LoadedModel,
    inputs: &[(&str, &Tensor)],
    n: usize,
    runs: &RunStats,
) -> Result<Vec<Ran>, RunError> {
    let t0 = Instant::now();
    let out = model.run(inputs);
    let us = t0.elapsed().as_micros() as u64;
    runs.count(us, n);
    Ok(model
        .split_outputs(out?, n)
        .into_iter()
        .map(|outputs| Ran { outputs, us })
        .collect())
}

/// What a worker needs to run items of one pipeline.
pub struct Engine<'a> {
    /// The model serving now (taken once for the set of frames).
    pub model: &'a LoadedModel,
    pub mode: &'a Mode,
    /// Each stream's model state (stateful models only).
    pub states: &'a Mutex<StreamStates>,
    pub main_input: &'a str,
    /// Inputs fed the same to every run.
    pub constants: &'a [(String, Tensor)],
    /// Where the model's runs are counted.
    pub runs: &'a RunStats,
}

impl Engine<'_> {
    /// Runs `jobs` as the pipeline's mode says; returns one outcome per job,
    /// in order. A stream's items run in their order; a failed run fails
    /// its items only.
    pub fn run(&self, jobs: &[Job<'_>]) -> Vec<Outcome> {
        match &self.mode.batching {
            Batching::Stacked { max } if jobs.len() > 1 => jobs
                .chunks((*max).max(1))
                .flat_map(|chunk| self.stacked(chunk))
                .collect(),
            Batching::AcrossStreams { max, axes } if jobs.len() > 1 => {
                self.across_streams(jobs, (*max).max(1), axes)
            }
            _ => jobs.iter().map(|j| self.one(j)).collect(),
        }
    }

    /// The main input and the constants.
    fn inputs<'t>(&'t self, main: &'t Tensor) -> Vec<(&'t str, &'t Tensor)> {
        std::iter::once((self.main_input, main))
            .chain(self.constants.iter().map(|(n, t)| (n.as_str(), t)))
            .collect()
    }

    /// One run of one item (with its stream's state, for a stateful model).
    fn one(&self, job: &Job<'_>) -> Outcome {
        let inputs = self.inputs(job.tensor);
        let t0 = Instant::now();
        let out = if self.mode.stateful {
            self.states.lock().run(self.model, job.stream, &inputs)
        } else {
            self.model.run(&inputs)
        };
        let us = t0.elapsed().as_micros() as u64;
        self.runs.count(us, 1);
        out.map(|outputs| Ran { outputs, us })
            .map_err(|e| Dropped::new(DropReason::Inference, e))
    }

    /// One run of `chunk` stacked on the batch axis.
    fn stacked(&self, chunk: &[Job<'_>]) -> Vec<Outcome> {
        let parts: Vec<&Tensor> = chunk.iter().map(|j| j.tensor).collect();
        let batch = match Tensor::concat0(&parts) {
            Ok(b) => b,
            // Items of different shapes (e.g. images of other sizes without
            // resize) cannot share a run.
            Err(e) => return fail(chunk.len(), Dropped::new(DropReason::Batch, e)),
        };
        match run_batch(self.model, &self.inputs(&batch), chunk.len(), self.runs) {
            Ok(per_item) => per_item.into_iter().map(Ok).collect(),
            Err(e) => fail(chunk.len(), Dropped::new(DropReason::Inference, e)),
        }
    }

    /// Stateful batching: the k-th item of each stream goes to run k, so a
    /// run never holds two items of one stream and each stream's items run
    /// in order; runs go in order; outcomes come back in the jobs' order.
    fn across_streams(&self, jobs: &[Job<'_>], max: usize, axes: &[usize]) -> Vec<Outcome> {
        let mut runs: Vec<Vec<usize>> = Vec::new();
        let mut seen: Vec<(&str, usize)> = Vec::new();
        for (w, job) in jobs.iter().enumerate() {
            let k = match seen.iter_mut().find(|(s, _)| *s == job.stream) {
                Some((_, n)) => {
                    *n += 1;
                    *n - 1
                }
                None => {
                    seen.push((job.stream, 1));
                    0
                }
            };
            if runs.len() <= k {
                runs.push(Vec::new());
            }
            runs[k].push(w);
        }
        let mut out: Vec<Option<Outcome>> = jobs.iter().map(|_| None).collect();
        for chunk in runs.iter().flat_map(|r| r.chunks(max)) {
            let parts: Vec<&Tensor> = chunk.iter().map(|w| jobs[*w].tensor).collect();
            let streams: Vec<&str> = chunk.iter().map(|w| jobs[*w].stream).collect();
            let results = match Tensor::concat0(&parts) {
                Ok(batch) => {
                    let inputs = self.inputs(&batch);
                    let t0 = Instant::now();
                    let r = self
                        .states
                        .lock()
                        .run_batch(self.model, &streams, axes, &inputs);
                    let us = t0.elapsed().as_micros() as u64;
                    self.runs.count(us, chunk.len());
                    match r {
                        Ok(per_item) => per_item
                            .into_iter()
                            .map(|outputs| Ok(Ran { outputs, us }))
                            .collect(),
                        Err(e) => fail(chunk.len(), Dropped::new(DropReason::Inference, e)),
                    }
                }
                Err(e) => fail(chunk.len(), Dropped::new(DropReason::Batch, e)),
            };
            for (w, r) in chunk.iter().zip(results) {
                out[*w] = Some(r);
            }
        }
        out.into_iter()
            .map(|o| {
                // Every job is in exactly one run above.
                o.unwrap_or_else(|| Err(Dropped::new(DropReason::Inference, "not run")))
            })
            .collect()
    }
}

/// The same failure for each of `n` items.
fn fail(n: usize, d: Dropped) -> Vec<Outcome> {
    (0..n).map(|_| Err(d.clone())).collect()
}
