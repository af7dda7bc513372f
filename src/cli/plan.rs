//! `outpost plan --model MODEL --target TARGET`: the memory a model needs on
//! a hardware target at a precision, against what the target has. Runs
//! without ONNX Runtime (see `crate::plan` for the formula).

use std::path::{Path, PathBuf};

use crate::backend::Provider;
use crate::config::Config;
use crate::plan::target::{DEFAULT_TARGET_DIRS, Precision, find_target};
use crate::plan::{Plan, PlanRequest, model_facts, plan};

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// A path to an .onnx file or the name of a model in the model directory.
    #[arg(long)]
    pub model: String,
    /// A target name (a file `<name>.toml` in the targets directory) or a path to one.
    #[arg(long)]
    pub target: String,
    /// Precision of the weights; the target's default_precision when absent.
    #[arg(long, value_parser = parse_precision)]
    pub precision: Option<Precision>,
    /// Execution provider to plan for; the target's first provider when absent.
    #[arg(long, value_parser = parse_provider)]
    pub ep: Option<Provider>,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: u64,
    /// TensorRT workspace ceiling in bytes (default: the TensorRT EP's 1 GiB).
    #[arg(long)]
    pub workspace_bytes: Option<u64>,
    /// Directory of target TOML files; default `targets` in the working
    /// directory, then /usr/share/outpost/targets.
    #[arg(long)]
    pub targets_dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

fn parse_provider(s: &str) -> Result<Provider, crate::backend::ProviderError> {
    s.parse()
}

/// The model directory as the other commands pick it, without loading the runtime.
fn model_dir(cli: &super::Cli) -> anyhow::Result<PathBuf> {
    Ok(match (&cli.model_dir, &cli.config) {
        (Some(d), _) => d.clone(),
        (None, Some(c)) => Config::load(c)?.model_dir,
        (None, None) if Path::new("models").is_dir() => PathBuf::from("models"),
        (None, None) => Config::default().model_dir,
    })
}

pub fn run(cli: &super::Cli, a: &PlanArgs) -> anyhow::Result<()> {
    let dirs: Vec<PathBuf> = match &a.targets_dir {
        Some(d) => vec![d.clone()],
        None => DEFAULT_TARGET_DIRS.iter().map(PathBuf::from).collect(),
    };
    let target = find_target(&a.target, &dirs)?;
    let model = model_facts(&a.model, &model_dir(cli)?)?;
    let p = plan(
        &model,
        &target,
        &PlanRequest {
            precision: a.precision,
            provider: a.ep,
            batch: a.batch,
            workspace_bytes: a.workspace_bytes,
        },
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print_human(&p);
    }
    Ok(())
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

fn signed_mib(b: i64) -> String {
    let s = mib(b.unsigned_abs());
    if b < 0 { format!("-{s}") } else { s }
}

fn print_human(p: &Plan) {
    println!("model       {}  ({})", p.model, p.model_path);
    println!(
        "target      {}   provider {}, precision {}, batch {}",
        p.target, p.provider, p.precision, p.batch
    );
    println!("parameters  {}", p.parameters);
    for pool in &p.pools {
        println!();
        println!(
            "{} pool: {} of {} ({:.1} %)",
            pool.name,
            mib(pool.used_bytes),
            mib(pool.capacity_bytes),
            pool.used_bytes as f64 * 100.0 / pool.capacity_bytes.max(1) as f64
        );
        for i in &pool.items {
            println!("  {:<20} {:>12}   {}", i.what, mib(i.bytes), i.formula);
        }
        println!(
            "  {:<20} {:>12}   {}",
            "headroom",
            signed_mib(pool.headroom_bytes),
            pool.verdict.as_str()
        );
    }
    println!();
    println!(
        "verdict     {} (headroom {})",
        p.verdict.as_str(),
        signed_mib(p.headroom_bytes)
    );
    for n in &p.notes {
        println!("note        {n}");
    }
}
