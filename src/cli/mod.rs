//! Command-line interface: one file per subcommand.

pub mod bench;
pub mod bench_image;
pub mod check;
pub mod config;
pub mod fleet;
pub mod infer;
pub mod modbus;
pub mod models;
pub mod ota;
pub mod outbox;
pub mod plan;
pub mod run;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Parser, Subcommand};

use crate::backend::Provider;
use crate::backend::ort::{Runtime, SessionOptions};
use crate::config::Config;
pub use crate::telemetry::logging::LogFormat;

#[derive(Debug, Parser)]
#[command(
    name = "outpost",
    version,
    about = "Edge inference daemon: local ONNX Runtime / TensorRT inference, durable outbox, fleet uplink"
)]
pub struct Cli {
    /// Config file (TOML); its [runtime] section and model_dir apply to every command.
    #[arg(long, global = true, env = "OUTPOST_CONFIG")]
    pub config: Option<PathBuf>,
    /// Model directory (folders with manifest.toml); overrides the config.
    #[arg(long, global = true, env = "OUTPOST_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
    /// Path of libonnxruntime.so; overrides the config and the search.
    #[arg(long, global = true)]
    pub onnxruntime: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// More logging (-v info, -vv debug); default shows warnings and errors.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the daemon: pipelines, outbox, uplinks, local API.
    Run(run::RunArgs),
    /// Validate a config file and list every problem.
    Check(check::CheckArgs),
    /// Config helpers (`config example`).
    #[command(subcommand)]
    Config(config::ConfigCommand),
    /// Inspect and list models.
    #[command(subcommand)]
    Models(models::ModelsCommand),
    /// Run a model once on inputs from .npy files and print its outputs.
    Infer(infer::InferArgs),
    /// Measure a model's latency and throughput.
    Bench(bench::BenchArgs),
    /// Will a model fit on a hardware target? Memory estimate and verdict.
    Plan(plan::PlanArgs),
    /// Inspect, export or purge a stopped daemon's outbox.
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
    /// Make an ed25519 key pair for signing OTA bundles.
    Keygen(ota::KeygenArgs),
    /// Build, sign and verify OTA bundles.
    #[command(subcommand)]
    Bundle(ota::BundleCommand),
    /// The operator's side: devices on the fleet broker (`fleet status`).
    #[command(subcommand)]
    Fleet(fleet::FleetCommand),
    /// The floor over Modbus TCP: `modbus map` prints the register map.
    #[command(subcommand)]
    Modbus(modbus::ModbusCommand),
}

/// Options shared by the commands that run models.
#[derive(Debug, Clone, clap::Args)]
pub struct RunOpts {
    /// Execution providers in order of preference, e.g. `tensorrt,cuda,cpu`.
    #[arg(long, value_name = "LIST", value_parser = parse_providers)]
    pub ep: Option<ProviderList>,
    /// Intra-op threads.
    #[arg(long)]
    pub threads: Option<usize>,
    /// CUDA graphs for CUDA/TensorRT sessions (as `[runtime.cuda] cuda_graph = true`).
    #[arg(long)]
    pub cuda_graph: bool,
    /// No I/O binding for CUDA/TensorRT sessions (as `[runtime.cuda] io_binding = false`).
    #[arg(long, conflicts_with = "cuda_graph")]
    pub no_io_binding: bool,
}

/// A comma-separated provider preference list (one clap value).
#[derive(Debug, Clone)]
pub struct ProviderList(pub Vec<Provider>);

fn parse_providers(s: &str) -> Result<ProviderList, crate::backend::ProviderError> {
    Provider::parse_list(s).map(ProviderList)
}

/// What a command needs to run models: the config, the runtime, the options.
pub struct Ctx {
    pub config: Config,
    pub model_dir: PathBuf,
    pub runtime: Arc<Runtime>,
    pub session: SessionOptions,
}

impl Ctx {
    pub fn new(cli: &Cli, run: &RunOpts) -> anyhow::Result<Ctx> {
        let config = match &cli.config {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        let model_dir = match (&cli.model_dir, &cli.config) {
            (Some(d), _) => d.clone(),
            (None, Some(_)) => config.model_dir.clone(),
            // Without a config, a checkout's models/ is the natural place.
            (None, None) if Path::new("models").is_dir() => PathBuf::from("models"),
            (None, None) => config.model_dir.clone(),
        };
        let lib = cli
            .onnxruntime
            .as_deref()
            .or(config.runtime.onnxruntime.as_deref());
        let runtime = Runtime::load(lib)?;
        let r = &config.runtime;
        let session = SessionOptions {
            providers: run
                .ep
                .clone()
                .map(|l| l.0)
                .unwrap_or_else(|| r.providers.clone()),
            intra_threads: run.threads.unwrap_or(r.intra_threads),
            tensorrt: r.tensorrt.clone(),
            cuda_device_id: r.cuda_device_id,
            cuda: crate::backend::ort::CudaOptions {
                io_binding: r.cuda.io_binding && !run.no_io_binding,
                cuda_graph: r.cuda.cuda_graph || run.cuda_graph,
            },
            cache_dir: config.tensorrt_cache_dir(),
        };
        Ok(Ctx {
            config,
            model_dir,
            runtime,
            session,
        })
    }
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match &cli.command {
        Command::Run(a) => run::run(&cli, a),
        Command::Check(a) => check::run(&cli, a),
        Command::Config(c) => config::run(c),
        Command::Models(m) => models::run(&cli, m),
        Command::Infer(a) => infer::run(&cli, a),
        Command::Bench(a) => bench::run(&cli, a),
        Command::Plan(a) => plan::run(&cli, a),
        Command::Outbox(c) => outbox::run(&cli, c),
        Command::Keygen(a) => ota::keygen(a),
        Command::Bundle(c) => ota::run(&cli, c),
        Command::Fleet(c) => fleet::run(c),
        Command::Modbus(c) => modbus::run(&cli, c),
    }
}
