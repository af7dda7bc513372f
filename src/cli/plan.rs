//! `outpost plan --model MODEL --target TARGET`: the memory a model needs on
//! a hardware target at a precision, against what the target has. Runs
//! without ONNX Runtime (see `crate::plan` for the formula).
//! `outpost plan --records-per-second R`: what keeping R records a second
//! writes to the flash a day (see `crate::plan::flash`).

use std::path::{Path, PathBuf};

use crate::backend::Provider;
use crate::config::Config;
use crate::plan::flash::{FlashPlan, flash_plan};
use crate::plan::target::{DEFAULT_TARGET_DIRS, Precision, find_target};
use crate::plan::{Plan, PlanRequest, model_facts, plan};

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    /// A path to an .onnx file or the name of a model in the model directory.
    #[arg(long, requires = "target")]
    pub model: Option<String>,
    /// A target name (a file `<name>.toml` in the targets directory) or a path to one.
    #[arg(long, requires = "model")]
    pub target: Option<String>,
    /// Records a second the outbox keeps: prints the bytes the flash takes
    /// a day and the disk a day of outage fills.
    #[arg(long, required_unless_present = "model")]
    pub records_per_second: Option<f64>,
    /// The flash's size ("32GB", "64 GiB"), for its lifetime at that rate.
    #[arg(long, value_parser = parse_size, requires = "records_per_second")]
    pub flash_size: Option<u64>,
    /// Program/erase cycles the flash is rated for (with --flash-size).
    #[arg(long, default_value_t = 1000)]
    pub flash_cycles: u64,
    /// Bytes of one result record (`outpost outbox stats`: bytes / records).
    #[arg(long, default_value_t = 450.0)]
    pub record_bytes: f64,
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

fn parse_size(s: &str) -> Result<u64, crate::bytesize::SizeError> {
    crate::bytesize::parse(s)
}

fn parse_precision(s: &str) -> Result<Precision, crate::plan::target::UnknownPrecision> {
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
    let flash = a.records_per_second.map(|r| {
        let interval = match &cli.config {
            Some(c) => Config::load(c).map(|c| c.outbox.flush_interval),
            None => Ok(crate::outbox::OutboxConfig::default().flush_interval),
        };
        interval.map(|i| {
            flash_plan(
                r,
                a.record_bytes,
                i,
                a.flash_size.map(|b| (b, a.flash_cycles)),
            )
        })
    });
    let flash = flash.transpose()?;
    let (Some(model), Some(target)) = (&a.model, &a.target) else {
        if let Some(f) = &flash {
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({ "flash": f }))?
                );
            } else {
                print_flash(f, a.flash_size, a.flash_cycles);
            }
        }
        return Ok(());
    };
    let dirs: Vec<PathBuf> = match &a.targets_dir {
        Some(d) => vec![d.clone()],
        None => DEFAULT_TARGET_DIRS.iter().map(PathBuf::from).collect(),
    };
    let target = find_target(target, &dirs)?;
    let model = model_facts(model, &model_dir(cli)?)?;
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
        let mut v = serde_json::to_value(&p)?;
        if let (Some(f), Some(o)) = (&flash, v.as_object_mut()) {
            o.insert("flash".into(), serde_json::to_value(f)?);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print_human(&p);
        if let Some(f) = &flash {
            println!();
            print_flash(f, a.flash_size, a.flash_cycles);
        }
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

fn gb(b: f64) -> String {
    format!("{:.2} GB", b / 1e9)
}

fn print_flash(f: &FlashPlan, size: Option<u64>, cycles: u64) {
    println!(
        "flash       {} records/s kept, {:.0} group commits/s",
        f.records_per_second, f.commits_per_second
    );
    println!(
        "  written a day        {:>12}   the outbox's log, page rewrites included",
        gb(f.written_bytes_per_day)
    );
    println!(
        "  a day of outage      {:>12}   disk the kept records fill (size max_bytes for the longest outage)",
        gb(f.outage_disk_bytes_per_day)
    );
    if let (Some(days), Some(size)) = (f.lifetime_days, size) {
        println!(
            "  lifetime             {:>9.0} days   {} rated for {cycles} cycles, the daemon's writes alone",
            days,
            gb(size as f64)
        );
    }
}
