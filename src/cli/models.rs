//! `outpost models inspect MODEL`, `outpost models list` and `outpost
//! models import FILE.onnx`.

use std::path::PathBuf;

use anyhow::Context;

use crate::model::import::{GraphFacts, Hints, ImportRefused, guess};
use crate::model::manifest::{Manifest, size_problems};
use crate::model::registry::{LoadedModel, ModelError, Registry, load_manifest, open_model_arg};

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
    /// A model folder from an .onnx file: a manifest with every input and
    /// output, and the pre- and postprocessing recognised from the graph.
    Import {
        /// The .onnx file.
        file: PathBuf,
        /// The model's name (its folder in the model directory); default:
        /// the file's name without `.onnx`.
        #[arg(long)]
        name: Option<String>,
        /// Class names, one per line (a text recogniser: its dictionary).
        #[arg(long)]
        labels: Option<PathBuf>,
        /// The output a detector's postprocess reads, where several outputs
        /// fit a layout (the others are left out).
        #[arg(long)]
        output: Option<String>,
        /// The model's version (MAJOR.MINOR.PATCH).
        #[arg(long, default_value = "1.0.0")]
        version: String,
        /// The model's license (SPDX); default: the model's metadata, else `unknown`.
        #[arg(long)]
        license: Option<String>,
        /// Replace a model folder of that name.
        #[arg(long)]
        force: bool,
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
        ModelsCommand::Import {
            file,
            name,
            labels,
            output,
            version,
            license,
            force,
            run,
        } => {
            let ctx = super::Ctx::new(cli, run)?;
            import(
                &ctx,
                file,
                name.as_deref(),
                Given {
                    labels: labels.as_deref(),
                    output: output.as_deref(),
                    version,
                    license: license.as_deref(),
                    force: *force,
                },
            )
        }
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

/// What the user gave `models import` beside the file and its name.
struct Given<'a> {
    labels: Option<&'a std::path::Path>,
    output: Option<&'a str>,
    version: &'a str,
    license: Option<&'a str>,
    force: bool,
}

/// The lines of a `--labels` file; what is not text is refused (exit 2),
/// as a usage error.
fn read_labels(p: &std::path::Path) -> Result<Vec<String>, ImportRefused> {
    let refuse = |reason: String| ImportRefused {
        file: p.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(p).map_err(|e| refuse(format!("cannot read: {e}")))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        refuse(format!(
            "not UTF-8 text (byte {}): --labels is a text file of class names, one a line",
            e.utf8_error().valid_up_to()
        ))
    })?;
    Ok(text
        .lines()
        .map(|l| l.trim_end_matches('\r').to_string())
        .collect())
}

/// Recognises the model, writes its folder under a hidden name in the
/// model directory, loads it back from there as `check` and the daemon
/// will, and only then renames it into place: a model refused at any step
/// leaves nothing in the model directory.
fn import(
    ctx: &super::Ctx,
    file: &std::path::Path,
    name: Option<&str>,
    given: Given,
) -> anyhow::Result<()> {
    let shown = file.display().to_string();
    let refuse = |reason: String| ImportRefused {
        file: shown.clone(),
        reason,
    };
    // One buffer for the graph's facts, the checksum and the copy written:
    // the facts slice it rather than copy it.
    let bytes =
        bytes::Bytes::from(std::fs::read(file).with_context(|| format!("cannot read {shown}"))?);
    let facts = GraphFacts::read(bytes.clone()).map_err(|e| refuse(e.to_string()))?;
    // What the graph declares, before anything is allocated for it.
    let mut too_large = size_problems("input", &facts.inputs);
    too_large.extend(size_problems("output", &facts.outputs));
    if !too_large.is_empty() {
        return Err(ModelError::TooLarge {
            path: shown,
            problems: too_large,
        }
        .into());
    }
    let hints = Hints {
        labels: given.labels.map(read_labels).transpose()?,
        output: given.output.map(str::to_string),
    };
    let g =
        guess(&facts.inputs, &facts.outputs, &facts, &hints).map_err(|e| refuse(e.to_string()))?;
    let name = match name {
        Some(n) => n.to_string(),
        None => file
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into()),
    };
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(refuse(format!(
            "the name `{name}` must be letters, digits, '_' or '-' (give --name)"
        ))
        .into());
    }
    let dir = ctx.model_dir.join(&name);
    if dir.exists() && !given.force {
        return Err(refuse(format!("{} exists (--force replaces it)", dir.display())).into());
    }
    let file_name = format!("{name}.onnx");
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    let manifest = Manifest {
        name: name.clone(),
        version: given.version.to_string(),
        file: file_name.clone(),
        sha256: sha,
        source: format!(
            "imported from {} by outpost models import",
            file.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ),
        license: given
            .license
            .map(str::to_string)
            .or(facts.license.clone())
            .unwrap_or_else(|| "unknown".into()),
        description: format!("{} (recognised by outpost models import)", g.kind),
        inputs: g.inputs.clone(),
        outputs: g.outputs.clone(),
        state: g.state.clone(),
        preprocess: g.preprocess.clone(),
        postprocess: g.postprocess.clone(),
        stage: Default::default(),
    };
    let problems = manifest.validate(Some(&name));
    if !problems.is_empty() {
        return Err(refuse(problems.join("; ")).into());
    }
    let text = toml::to_string_pretty(&manifest).context("writing the manifest")?;
    let header = format!(
        "# Written by `outpost models import` from {shown}. What it guessed, and why:\n{}\n",
        g.notes
            .iter()
            .map(|n| format!("# - {}", one_line(n)))
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Staged in a hidden folder of the model directory (the same file
    // system, so the last step is a rename; the registry reads only
    // `<dir>/<name>/manifest.toml`, so it never sees the stage).
    let stage = Stage::new(&ctx.model_dir, &name)?;
    let staged = stage.path.join(&name);
    let written = (|| -> std::io::Result<()> {
        std::fs::create_dir_all(&staged)?;
        crate::fsio::write_atomic(&staged.join(&file_name), &bytes)?;
        if !g.labels.is_empty() {
            crate::fsio::write_atomic(
                &staged.join("labels.txt"),
                (g.labels.join("\n") + "\n").as_bytes(),
            )?;
        }
        crate::fsio::write_atomic(
            &staged.join("manifest.toml"),
            format!("{header}{text}").as_bytes(),
        )
    })();
    written.with_context(|| format!("cannot write into {}", stage.path.display()))?;
    // Loaded back as the daemon will: the manifest against the model.
    let back = load_manifest(&ctx.runtime, &staged.join("manifest.toml"), &ctx.session)?;
    stage
        .install(&staged, &dir, given.force)
        .with_context(|| format!("cannot move the model into {}", dir.display()))?;
    println!("{}: {}", back.id(), g.kind);
    for n in &g.notes {
        println!("  - {}", one_line(n));
    }
    println!("wrote {}", dir.join("manifest.toml").display());
    Ok(())
}

/// A note on one line: the graph's own names (outputs, classes) may hold
/// control characters, which must not break the manifest's comments (nor
/// reach a terminal).
fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A hidden folder of the model directory an import writes into; removed
/// with whatever is left in it when the import ends, however it ends.
struct Stage {
    path: PathBuf,
}

impl Stage {
    fn new(model_dir: &std::path::Path, name: &str) -> anyhow::Result<Stage> {
        let path = model_dir.join(format!(".import-{name}-{}", std::process::id()));
        // A stage left by a process that died with this id is stale.
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Stage { path })
    }

    /// Moves the staged folder to `dir`; with `force`, the folder there
    /// moves into the stage first (and goes with it).
    fn install(
        &self,
        staged: &std::path::Path,
        dir: &std::path::Path,
        force: bool,
    ) -> std::io::Result<()> {
        if force && dir.exists() {
            std::fs::rename(dir, self.path.join("replaced"))?;
        }
        std::fs::rename(staged, dir)?;
        if let Some(parent) = dir.parent() {
            crate::fsio::fsync_dir(parent)?;
        }
        Ok(())
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
