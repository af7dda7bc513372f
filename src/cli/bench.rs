//! `outpost bench --model MODEL`: latency percentiles and throughput.
//!
//! The timed loop is the same work a pipeline does per frame, and nothing
//! more: inputs are prepared once as ONNX Runtime values, each iteration runs
//! the session and, for stateful models, copies the state outputs back into
//! the state inputs (as a stream would).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::backend::binding::Placement;
use crate::backend::ort::{HotLoop, OrtSession};
use crate::backend::{InferenceSession, Tensor, check_inputs};
use crate::model::manifest::StatePair;
use crate::model::registry::open_model_arg;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// A path to an .onnx file or the name of a model in the model directory.
    #[arg(long)]
    pub model: String,
    /// Timed iterations.
    #[arg(long, default_value_t = 1000)]
    pub iterations: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 50)]
    pub warmup: usize,
    /// Batch size for the batch axis of generated inputs.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Inputs as NAME=FILE.npy instead of generated ones (any not given are generated).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    pub inputs: Vec<String>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Pause between timed iterations (e.g. `10ms`: a 100 frames/s stream),
    /// to see the latency of a run that starts on a core that did other work
    /// or slept; 0 = back to back.
    #[arg(long, value_parser = humantime_serde::re::humantime::parse_duration, default_value = "0s")]
    pub interval: Duration,
    /// How to pass the interval: `sleep` (the thread blocks, as a daemon
    /// waiting for frames) or `spin` (the thread stays on the core).
    #[arg(long, value_enum, default_value_t = Pause::Sleep)]
    pub pause: Pause,
    /// End to end from a picture (PNG/JPEG): each iteration preprocesses it
    /// as the model's manifest says (on the GPU when the model runs on
    /// CUDA/TensorRT and this build has the `cuda` feature), runs the model
    /// and copies the outputs back.
    #[arg(long, value_name = "FILE")]
    pub image: Option<PathBuf>,
    /// Run through I/O binding even on the CPU provider (host buffers): the
    /// bound path of CUDA/TensorRT sessions, on any machine.
    #[arg(long)]
    pub io_binding: bool,
    #[command(flatten)]
    pub run: super::RunOpts,
}

/// How `bench --interval` passes the time between iterations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Pause {
    Sleep,
    Spin,
}

fn pause(d: Duration, how: Pause) {
    if d.is_zero() {
        return;
    }
    match how {
        Pause::Sleep => std::thread::sleep(d),
        Pause::Spin => {
            let end = Instant::now() + d;
            while Instant::now() < end {
                std::hint::spin_loop();
            }
        }
    }
}

/// One bound inference step: the inputs are uploaded into the session's
/// bound buffers, the outputs copied back, and state outputs become the next
/// state inputs.
pub struct BoundLoop {
    feed: Vec<(String, Tensor)>,
    /// (index of the state input in `feed`, name of the output feeding it)
    state: Vec<(usize, String)>,
}

impl BoundLoop {
    pub fn new(
        session: &OrtSession,
        inputs: &[(String, Tensor)],
        state: &[StatePair],
    ) -> anyhow::Result<BoundLoop> {
        check_inputs(session.io(), inputs.iter().map(|(n, t)| (n.as_str(), t)))?;
        let mut pairs = Vec::new();
        for p in state {
            match inputs.iter().position(|(n, _)| *n == p.input) {
                Some(i) => pairs.push((i, p.output.clone())),
                None => anyhow::bail!("state input `{}` is not an input of the model", p.input),
            }
        }
        Ok(BoundLoop {
            feed: inputs.to_vec(),
            state: pairs,
        })
    }

    pub fn step(&mut self, session: &mut OrtSession) -> anyhow::Result<()> {
        let refs: Vec<(&str, &Tensor)> = self.feed.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut outs = session.run_prechecked(&refs)?;
        for (idx, out) in &self.state {
            let Some(pos) = outs.iter().position(|(n, _)| n == out) else {
                anyhow::bail!("state output `{out}` missing");
            };
            self.feed[*idx].1 = outs.swap_remove(pos).1;
        }
        Ok(())
    }
}

/// Latency figures of one benchmark.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub p50_us: f64,
    pub p90_us: f64,
    pub p99_us: f64,
    pub max_us: f64,
    pub mean_us: f64,
    pub throughput_per_s: f64,
}

/// Percentiles by the nearest-rank method over sorted samples.
pub fn summarize(samples: &mut [Duration], total: Duration, items_per_iter: usize) -> Summary {
    samples.sort_unstable();
    let n = samples.len().max(1);
    let us = |d: Duration| d.as_nanos() as f64 / 1e3;
    let rank = |q: f64| {
        let r = ((q * n as f64).ceil() as usize).clamp(1, n) - 1;
        samples.get(r).copied().map(us).unwrap_or(0.0)
    };
    let sum: Duration = samples.iter().sum();
    Summary {
        p50_us: rank(0.50),
        p90_us: rank(0.90),
        p99_us: rank(0.99),
        max_us: samples.last().copied().map(us).unwrap_or(0.0),
        mean_us: us(sum) / n as f64,
        throughput_per_s: if total.is_zero() {
            0.0
        } else {
            (samples.len() * items_per_iter) as f64 / total.as_secs_f64()
        },
    }
}

/// Peak resident memory of this process (VmHWM), where Linux reports it.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident bytes of this process's own executable file (its text and
/// read-only data, from /proc/self/smaps): a debug build's is many times a
/// release build's, so a comparison with `plan` can take it out.
pub fn exe_resident_bytes() -> Option<u64> {
    let exe = std::fs::read_link("/proc/self/exe").ok()?;
    let exe = exe.to_str()?;
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let mut in_exe = false;
    let mut kb = 0u64;
    for line in smaps.lines() {
        let mut f = line.split_whitespace();
        let Some(first) = f.next() else { continue };
        if first.ends_with(':') {
            if in_exe && first == "Rss:" {
                kb += f.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        } else {
            // A mapping's header: address perms offset dev inode [path]
            // (the path may hold spaces: compare the line's end).
            in_exe = line
                .strip_suffix(exe)
                .is_some_and(|head| head.ends_with(' '));
        }
    }
    Some(kb * 1024)
}

pub fn run(cli: &super::Cli, a: &BenchArgs) -> anyhow::Result<()> {
    if a.iterations == 0 || a.batch == 0 {
        anyhow::bail!("--iterations and --batch must be at least 1");
    }
    let mut given = Vec::new();
    for s in &a.inputs {
        let Some((n, p)) = s.split_once('=') else {
            return Err(super::infer::BadInput(format!("`{s}` is not NAME=FILE.npy")).into());
        };
        let t = Tensor::read_npy(&PathBuf::from(p))
            .map_err(|e| super::infer::BadInput(e.to_string()))?;
        given.push((n.to_string(), t));
    }
    let ctx = super::Ctx::new(cli, &a.run)?;
    let model = open_model_arg(&ctx.runtime, &a.model, &ctx.model_dir, &ctx.session)?;
    // --batch is the user's: a batch too large to allocate is a usage error.
    let mut inputs = model
        .synthetic_inputs(a.batch)
        .map_err(|e| super::infer::BadInput(format!("--batch {}: input {e}", a.batch)))?;
    for (n, t) in given {
        match inputs.iter_mut().find(|(m, _)| *m == n) {
            Some(slot) => slot.1 = t,
            None => inputs.push((n, t)),
        }
    }
    let threads = ctx.session.intra_threads;
    let (mut samples, total, binding) = model
        .with_session(
            |s| -> anyhow::Result<(Vec<Duration>, Duration, serde_json::Value)> {
                if a.io_binding && s.binding_mode().is_none() {
                    s.bind_buffers(Placement::Cpu);
                }
                if let Some(image) = &a.image {
                    let mut hot =
                        super::bench_image::ImageLoop::new(s, &model, image, a.batch, &inputs)?;
                    for _ in 0..a.warmup {
                        hot.step(s)?;
                    }
                    let mut samples = Vec::with_capacity(a.iterations);
                    let start = Instant::now();
                    for _ in 0..a.iterations {
                        pause(a.interval, a.pause);
                        let t0 = Instant::now();
                        hot.step(s)?;
                        samples.push(t0.elapsed());
                    }
                    let mode = s.binding_mode();
                    let info = serde_json::json!({
                        "placement": mode.map(|(p, _)| format!("{p:?}").to_lowercase()),
                        "cuda_graph": mode.map(|(_, g)| g),
                        "preprocess": hot.path,
                        "preprocess_cpu_reason": hot.reason,
                    });
                    return Ok((samples, start.elapsed(), info));
                }
                if let Some((placement, graph)) = s.binding_mode() {
                    // The bound path: upload, run, download per iteration, as a pipeline does.
                    let mut hot = BoundLoop::new(s, &inputs, &model.manifest.state)
                        .map_err(|e| super::infer::BadInput(e.to_string()))?;
                    for _ in 0..a.warmup {
                        hot.step(s)?;
                    }
                    let mut samples = Vec::with_capacity(a.iterations);
                    let start = Instant::now();
                    for _ in 0..a.iterations {
                        pause(a.interval, a.pause);
                        let t0 = Instant::now();
                        hot.step(s)?;
                        samples.push(t0.elapsed());
                    }
                    let allocations = s.binding()?.map(|b| b.allocations).unwrap_or(0);
                    let info = serde_json::json!({
                        "placement": format!("{placement:?}").to_lowercase(),
                        "cuda_graph": graph,
                        "allocations": allocations,
                    });
                    return Ok((samples, start.elapsed(), info));
                }
                let state: Vec<(&str, &str)> = model
                    .manifest
                    .state
                    .iter()
                    .map(|p| (p.input.as_str(), p.output.as_str()))
                    .collect();
                let mut hot = HotLoop::new(s, &inputs, &state)
                    .map_err(|e| super::infer::BadInput(e.to_string()))?;
                for _ in 0..a.warmup {
                    hot.step(s)?;
                }
                let bar = indicatif::ProgressBar::new(a.iterations as u64);
                if a.json || !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                    bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
                }
                let mut samples = Vec::with_capacity(a.iterations);
                let start = Instant::now();
                for i in 0..a.iterations {
                    pause(a.interval, a.pause);
                    let t0 = Instant::now();
                    hot.step(s)?;
                    samples.push(t0.elapsed());
                    if i % 64 == 0 {
                        bar.set_position(i as u64);
                    }
                }
                let total = start.elapsed();
                bar.finish_and_clear();
                Ok((samples, total, serde_json::Value::Null))
            },
        )
        .ok_or_else(|| anyhow::anyhow!("{}: not served by ONNX Runtime", model.id()))??;
    let s = summarize(&mut samples, total, a.batch);
    let rss = peak_rss_bytes();
    if a.json {
        let v = serde_json::json!({
            "model": model.id(),
            "provider": model.provider,
            "fallbacks": model.fallbacks,
            "iterations": a.iterations,
            "warmup": a.warmup,
            "batch": a.batch,
            "threads": threads,
            "interval_us": a.interval.as_micros() as u64,
            "p50_us": s.p50_us,
            "p90_us": s.p90_us,
            "p99_us": s.p99_us,
            "max_us": s.max_us,
            "mean_us": s.mean_us,
            "throughput_per_s": s.throughput_per_s,
            "peak_rss_bytes": rss,
            "exe_resident_bytes": exe_resident_bytes(),
            "io_binding": binding,
        });
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!(
            "model      {}  provider {}  threads {}  batch {}",
            model.id(),
            model.provider,
            threads,
            a.batch
        );
        println!("iterations {} (+{} warm-up)", a.iterations, a.warmup);
        if !binding.is_null() {
            println!("io binding {binding}");
        }
        println!(
            "latency    p50 {:.1} us   p90 {:.1} us   p99 {:.1} us   max {:.1} us   mean {:.1} us",
            s.p50_us, s.p90_us, s.p99_us, s.max_us, s.mean_us
        );
        println!("throughput {:.0} items/s", s.throughput_per_s);
        if let Some(r) = rss {
            println!("peak rss   {:.1} MiB", r as f64 / (1024.0 * 1024.0));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let mut v: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let s = summarize(&mut v, Duration::from_millis(10), 2);
        assert_eq!(s.p50_us, 50.0);
        assert_eq!(s.p90_us, 90.0);
        assert_eq!(s.p99_us, 99.0);
        assert_eq!(s.max_us, 100.0);
        assert_eq!(s.throughput_per_s, 20_000.0);
    }
}
