//! `outpost models inspect MODEL` and `outpost models list`.

use crate::model::registry::{LoadedModel, Registry, open_model_arg};

#[derive(Debug, clap::Subcommand)]
pub enum ModelsCommand {
    /// Inputs, outputs, opset, parameters and the provider that serves a model.
    Inspect {
        /// A path to an .onnx file or the name of a model in the model directory.
        model: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        run: super::RunOpts,
    },
    /// Every model in the model directory, loaded and checked.
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        run: super::RunOpts,
    },
}

/// A model's description as `inspect --json` prints it.
pub fn describe(m: &LoadedModel) -> serde_json::Value {
    let io = |v: &[crate::backend::IoSpec]| {
        v.iter()
            .map(|s| serde_json::json!({"name": s.name, "dtype": s.dtype, "shape": s.shape}))
            .collect::<Vec<_>>()
    };
    serde_json::json!({
        "name": m.manifest.name,
        "version": m.manifest.version,
        "id": m.id(),
        "path": m.path.display().to_string(),
        "sha256": m.manifest.sha256,
        "source": m.manifest.source,
        "license": m.manifest.license,
        "opset": m.info.opset(),
        "opsets": m.info.opsets.iter().map(|(d, v)| serde_json::json!({"domain": d, "version": v})).collect::<Vec<_>>(),
        "ir_version": m.info.ir_version,
        "producer": m.info.producer,
        "parameters": m.info.parameters,
        "nodes": m.info.nodes,
        "provider": m.provider,
        "fallbacks": m.fallbacks,
        "inputs": io(&m.io.inputs),
        "outputs": io(&m.io.outputs),
        "state": m.manifest.state.iter().map(|s| serde_json::json!({"input": s.input, "output": s.output})).collect::<Vec<_>>(),
        "preprocess": m.manifest.preprocess,
        "postprocess": m.manifest.postprocess,
        "warmup_ms": m.warmup.as_secs_f64() * 1e3,
    })
}

fn print_human(m: &LoadedModel, runtime: &crate::backend::ort::RuntimeInfo) {
    println!("model       {}  ({})", m.id(), m.path.display());
    println!("sha256      {}", m.manifest.sha256);
    println!("source      {} [{}]", m.manifest.source, m.manifest.license);
    let opsets: Vec<String> = m
        .info
        .opsets
        .iter()
        .map(|(d, v)| format!("{d} {v}"))
        .collect();
    println!(
        "opset       {}   (ir {}, producer {})",
        opsets.join(", "),
        m.info.ir_version,
        m.info.producer
    );
    println!(
        "parameters  {}   ({} nodes)",
        m.info.parameters, m.info.nodes
    );
    println!("provider    {}", m.provider);
    for f in &m.fallbacks {
        println!("  skipped   {}: {}", f.provider, f.reason);
    }
    println!(
        "runtime     ONNX Runtime {} ({})",
        runtime.version, runtime.path
    );
    println!("inputs");
    for s in &m.io.inputs {
        println!(
            "  {:<32} {:<5} {}",
            s.name,
            s.dtype.as_str(),
            s.shape_string()
        );
    }
    println!("outputs");
    for s in &m.io.outputs {
        println!(
            "  {:<32} {:<5} {}",
            s.name,
            s.dtype.as_str(),
            s.shape_string()
        );
    }
    for s in &m.manifest.state {
        println!("state       {} <- {} (kept per stream)", s.input, s.output);
    }
    println!("warm-up     {:.2} ms", m.warmup.as_secs_f64() * 1e3);
}

pub fn run(cli: &super::Cli, cmd: &ModelsCommand) -> anyhow::Result<()> {
    match cmd {
        ModelsCommand::Inspect { model, json, run } => {
            let ctx = super::Ctx::new(cli, run)?;
            let m = open_model_arg(&ctx.runtime, model, &ctx.model_dir, &ctx.session)?;
            if *json {
                let mut v = describe(&m);
                v["runtime"] = serde_json::to_value(&ctx.runtime.info)?;
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print_human(&m, &ctx.runtime.info);
            }
            Ok(())
        }
        ModelsCommand::List { json, run } => {
            let ctx = super::Ctx::new(cli, run)?;
            let (reg, errors) = Registry::load_dir(&ctx.runtime, &ctx.model_dir, &ctx.session);
            if *json {
                let v = serde_json::json!({
                    "model_dir": ctx.model_dir.display().to_string(),
                    "models": reg.models().map(|m| describe(m)).collect::<Vec<_>>(),
                    "errors": errors.iter().map(|e| e.to_string()).collect::<Vec<_>>(),
                });
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for m in reg.models() {
                    println!(
                        "{:<24} {:<10} {:<9} {:>12} params  {}",
                        m.manifest.name,
                        m.manifest.version,
                        m.provider.as_str(),
                        m.info.parameters,
                        m.manifest.license
                    );
                }
                for e in &errors {
                    println!("refused: {e}");
                }
            }
            if reg.is_empty() && !errors.is_empty() {
                anyhow::bail!("no model in {} could be loaded", ctx.model_dir.display());
            }
            Ok(())
        }
    }
}
