//! `outpost infer --model MODEL --input NAME=FILE.npy ...`: one run, outputs as JSON.

use std::path::PathBuf;
use std::time::Instant;

use crate::backend::Tensor;
use crate::model::registry::open_model_arg;

#[derive(Debug, clap::Args)]
pub struct InferArgs {
    /// A path to an .onnx file or the name of a model in the model directory.
    #[arg(long)]
    pub model: String,
    /// An input as NAME=FILE.npy; repeat for each input.
    #[arg(long = "input", value_name = "NAME=FILE.npy", value_parser = parse_input)]
    pub inputs: Vec<(String, PathBuf)>,
    /// Print one JSON object (outputs with dtype, shape and data).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub run: super::RunOpts,
}

/// An `--input` that is not `NAME=FILE.npy`.
#[derive(Debug, thiserror::Error)]
#[error("`{0}` is not NAME=FILE.npy")]
pub struct NotNamedInput(String);

fn parse_input(s: &str) -> Result<(String, PathBuf), NotNamedInput> {
    match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !p.is_empty() => Ok((n.to_string(), PathBuf::from(p))),
        _ => Err(NotNamedInput(s.to_string())),
    }
}

/// An input the user gave that cannot be fed to the model.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadInput(pub String);

pub fn run(cli: &super::Cli, a: &InferArgs) -> anyhow::Result<()> {
    // Read the inputs before loading anything: a bad file fails fast.
    let mut tensors = Vec::with_capacity(a.inputs.len());
    for (name, path) in &a.inputs {
        if tensors.iter().any(|(n, _): &(String, Tensor)| n == name) {
            return Err(BadInput(format!("input `{name}` given twice")).into());
        }
        let t = Tensor::read_npy(path).map_err(|e| BadInput(e.to_string()))?;
        tensors.push((name.clone(), t));
    }
    let ctx = super::Ctx::new(cli, &a.run)?;
    let model = open_model_arg(&ctx.runtime, &a.model, &ctx.model_dir, &ctx.session)?;
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let t0 = Instant::now();
    let outputs = model
        .run(&refs)
        .map_err(|e| BadInput(format!("{}: {e}", model.id())))?;
    let latency_us = t0.elapsed().as_micros() as u64;
    if a.json {
        let mut outs = serde_json::Map::new();
        for (n, t) in &outputs {
            outs.insert(n.clone(), t.to_json());
        }
        let v = serde_json::json!({
            "model": model.id(),
            "provider": model.provider,
            "latency_us": latency_us,
            "outputs": outs,
        });
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!(
            "model {}  provider {}  latency {} us",
            model.id(),
            model.provider,
            latency_us
        );
        for (n, t) in &outputs {
            let v = t.to_f64_vec();
            let head: Vec<String> = v.iter().take(8).map(|x| format!("{x:.6}")).collect();
            let more = if v.len() > 8 {
                format!(" ... ({} values)", v.len())
            } else {
                String::new()
            };
            println!(
                "{n}  {} {:?}  [{}{}]",
                t.dtype(),
                t.shape(),
                head.join(", "),
                more
            );
        }
    }
    Ok(())
}
