//! `outpost check --config FILE`: validate and list every problem: the
//! config's (every TOML error it can name), then what it refers to on this
//! machine: each model's manifest, file and ONNX header, each replay file
//! (`--no-files` skips those, for a config checked on another machine).

use std::path::PathBuf;

use crate::config::{Config, ConfigError};
use crate::model::manifest::Manifest;
use crate::source::SourceConfig;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// The config to check (defaults to the global --config).
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Check the config only, not the models and files it names (for a
    /// config written on another machine than the one that runs it).
    #[arg(long)]
    pub no_files: bool,
}

pub fn run(cli: &super::Cli, a: &CheckArgs) -> anyhow::Result<()> {
    let Some(path) = a.file.as_ref().or(cli.config.as_ref()) else {
        anyhow::bail!("no config to check: pass --config FILE");
    };
    let mut cfg = Config::load(path)?;
    if let Some(d) = &cli.model_dir {
        cfg.model_dir = d.clone();
    }
    if !a.no_files {
        let problems = file_problems(&cfg);
        if !problems.is_empty() {
            return Err(ConfigError::Invalid {
                path: path.display().to_string(),
                problems,
            }
            .into());
        }
    }
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

/// Every problem with the models and files the config names.
pub fn file_problems(cfg: &Config) -> Vec<String> {
    let mut p = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, pl) in cfg.pipelines.iter().enumerate() {
        let at = format!("pipelines[{i}] ({})", pl.name);
        if seen.insert(pl.model.clone()) {
            p.extend(
                model_problems(cfg, &pl.model)
                    .into_iter()
                    .map(|e| format!("{at}: model `{}`: {e}", pl.model)),
            );
        }
        if let SourceConfig::Replay { file, .. } = &pl.source
            && !file.is_file()
        {
            p.push(format!(
                "{at}: source.file {}: no such file",
                file.display()
            ));
        }
    }
    p
}

/// A model's manifest, file, checksum and ONNX header.
fn model_problems(cfg: &Config, name: &str) -> Vec<String> {
    let dir = cfg.model_dir.join(name);
    let m = match Manifest::load(&dir.join("manifest.toml")) {
        Ok(m) => m,
        Err(e) => return vec![e.to_string()],
    };
    let file = dir.join(&m.file);
    let bytes = match std::fs::read(&file) {
        Ok(b) => b,
        Err(e) => return vec![format!("{}: {e}", file.display())],
    };
    let mut p = Vec::new();
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&bytes))
    };
    if !sha.eq_ignore_ascii_case(&m.sha256) {
        p.push(format!(
            "{}: sha256 is {sha}, the manifest says {}",
            file.display(),
            m.sha256
        ));
    }
    if let Err(e) = crate::model::onnx::inspect_bytes(bytes::Bytes::from(bytes)) {
        p.push(format!("{}: {e}", file.display()));
    }
    p
}
