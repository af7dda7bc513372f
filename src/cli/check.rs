//! `outpost check --config FILE`: validate and list every problem.

use std::path::PathBuf;

use crate::config::Config;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The config to check (defaults to the global --config).
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
}

pub fn run(cli: &super::Cli, a: &CheckArgs) -> anyhow::Result<()> {
    let Some(path) = a.file.as_ref().or(cli.config.as_ref()) else {
        anyhow::bail!("no config to check: pass --config FILE");
    };
    let cfg = Config::load(path)?;
    println!(
        "{}: ok (data_dir {}, model_dir {}, providers {})",
        path.display(),
        cfg.data_dir.display(),
        cfg.model_dir.display(),
        cfg.runtime
            .providers
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join(",")
    );
    Ok(())
}
