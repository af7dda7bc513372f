//! `outpost run --config FILE`: the daemon.

use std::path::PathBuf;

use crate::config::Config;
use crate::daemon::{self, RunOptions};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Print every stored result record as one JSON line on stdout (demos).
    #[arg(long)]
    pub print_records: bool,
    /// Model directory override.
    #[arg(long, value_name = "DIR")]
    pub models: Option<PathBuf>,
}

pub fn run(cli: &super::Cli, a: &RunArgs) -> anyhow::Result<()> {
    let Some(path) = cli.config.as_ref() else {
        anyhow::bail!("outpost run needs --config FILE (see `outpost config example`)");
    };
    let mut cfg = Config::load(path)?;
    if let Some(d) = a.models.as_ref().or(cli.model_dir.as_ref()) {
        cfg.model_dir = d.clone();
    }
    if let Some(lib) = &cli.onnxruntime {
        cfg.runtime.onnxruntime = Some(lib.clone());
    }
    // A daemon update installed under data_dir: the packaged binary counts
    // the start and hands over to the slot's binary (exec; no return).
    crate::ota::slots::handoff(&cfg.data_dir);
    let model_dir_override = a.models.clone().or(cli.model_dir.clone());
    daemon::run(
        cfg,
        RunOptions {
            print_records: a.print_records,
            config_path: Some(path.clone()),
            model_dir_override,
        },
    )?;
    Ok(())
}
