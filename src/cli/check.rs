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
        anyhow::bail!("no config to check: pass --config FILE (or - to read it from stdin)");
    };
    let stdin = path.as_os_str() == "-";
    let shown = if stdin {
        "stdin".to_string()
    } else {
        path.display().to_string()
    };
    let text = if stdin {
        std::io::read_to_string(std::io::stdin())
    } else {
        std::fs::read_to_string(path)
    }
    .map_err(|source| ConfigError::Io {
        path: shown.clone(),
        source,
    })?;
    // The files are checked on what could be read, so a missing model is
    // listed with every other problem, not only once the rest is right.
    let model_dir = cli.model_dir.clone();
    let mut cfg = Config::read(
        &text,
        &shown,
        |k| std::env::var(k).ok(),
        |read| {
            if a.no_files {
                return Vec::new();
            }
            let mut c = read.clone();
            if let Some(d) = &model_dir {
                c.model_dir = d.clone();
            }
            file_problems(&c)
        },
    )?;
    if let Some(d) = &cli.model_dir {
        cfg.model_dir = d.clone();
    }
    println!(
        "{shown}: ok (data_dir {}, model_dir {}, providers {})",
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

/// Every problem with the models and files the config names, each
/// starting with its key path (the config reader gives it its line).
pub fn file_problems(cfg: &Config) -> Vec<String> {
    let mut p = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (i, pl) in cfg.pipelines.iter().enumerate() {
        let models = std::iter::once((format!("pipelines[{i}].model"), &pl.model)).chain(
            pl.stages
                .iter()
                .enumerate()
                .map(|(j, st)| (format!("pipelines[{i}].stages[{j}].model"), &st.model)),
        );
        for (at, model) in models {
            if seen.insert(model.clone()) {
                p.extend(
                    model_problems(cfg, model)
                        .into_iter()
                        .map(|e| format!("{at}: model `{model}`: {e}")),
                );
            }
        }
        if let SourceConfig::Replay { file, .. } = &pl.source
            && !file.is_file()
        {
            p.push(format!(
                "pipelines[{i}].source.file: {}: no such file",
                file.display()
            ));
        }
    }
    p
}

/// A model's manifest, file, checksum and ONNX header.
fn model_problems(cfg: &Config, name: &str) -> Vec<String> {
    let dir = cfg.model_dir.join(name);
    if !dir.is_dir() {
        return vec![format!(
            "not found in the model directory {} (`outpost models list` shows its models)",
            cfg.model_dir.display()
        )];
    }
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
    match crate::model::onnx::inspect_bytes(bytes::Bytes::from(bytes)) {
        Ok(info) => {
            // What the file declares, as the daemon will hold it before
            // allocating anything (a model file must not abort a reload).
            use crate::model::manifest::size_problems;
            let sizes = size_problems("input", &info.inputs)
                .into_iter()
                .chain(size_problems("output", &info.outputs));
            p.extend(sizes.map(|e| format!("{}: {e}", file.display())));
        }
        Err(e) => p.push(format!("{}: {e}", file.display())),
    }
    p
}
