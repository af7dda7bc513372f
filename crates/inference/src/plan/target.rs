//! Hardware targets: one TOML file per target under `targets/` (installed at
//! `/usr/share/outpost/targets`). The structs mirror the files field for
//! field with `deny_unknown_fields`, so a typo in a target is an error, not a
//! silently ignored number.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::backend::Provider;

/// Where `--target NAME` is looked up when `--targets-dir` is not given:
/// a checkout's `targets/` first, then the package's copy.
pub const DEFAULT_TARGET_DIRS: [&str; 2] = ["targets", "/usr/share/outpost/targets"];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// Equals the file's stem.
    pub name: String,
    pub description: String,
    /// Rust target triple the binary is built for.
    pub triple: String,
    /// Newest glibc symbol version the binary may reference (`MAJOR.MINOR`).
    pub glibc_floor: String,
    pub os: String,
    pub memory: Memory,
    pub cpu: Cpu,
    /// Absent on CPU-only targets.
    #[serde(default)]
    pub gpu: Option<Gpu>,
    pub runtime: TargetRuntime,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Memory {
    pub total_bytes: u64,
    /// What outpost may plan for: models, engines, runtime libraries, queues.
    pub usable_bytes: u64,
    /// One pool for CPU and GPU (Jetson).
    pub shared_with_gpu: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cpu {
    pub cores: u32,
    /// Core name (Cortex-A78AE) or x86-64 psABI level (x86-64-v2).
    pub arch: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    pub name: String,
    pub compute_capability: String,
    pub dla_cores: u32,
    /// Dedicated device memory; 0 when shared with the CPU.
    pub memory_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetRuntime {
    pub providers: Vec<Provider>,
    pub precisions: Vec<Precision>,
    pub default_precision: Precision,
    pub intra_threads: u32,
    pub workers: u32,
    #[serde(default)]
    pub cuda: Option<String>,
    #[serde(default)]
    pub tensorrt: Option<String>,
    /// Which libonnxruntime serves on this target, in words.
    pub onnxruntime: String,
    /// The oldest ONNX Runtime (1.N) the target's binary must load: its
    /// build uses the crate feature `ort-api-N` (see Cargo.toml). Absent: the
    /// default build's level, [`DEFAULT_ONNXRUNTIME_API`].
    #[serde(default)]
    pub onnxruntime_api: Option<u32>,
}

/// ONNX Runtime API levels the crate has an `ort-api-N` feature for.
pub const ONNXRUNTIME_API_LEVELS: std::ops::RangeInclusive<u32> = 17..=31;
/// The API level of a default build (`default = ["ort-api-31"]`).
pub const DEFAULT_ONNXRUNTIME_API: u32 = 31;

impl TargetRuntime {
    /// The API level the target's binary is built for.
    pub fn onnxruntime_api(&self) -> u32 {
        self.onnxruntime_api.unwrap_or(DEFAULT_ONNXRUNTIME_API)
    }
}

/// Numeric precision weights are held at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Fp16,
    Bf16,
    Int8,
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
            Precision::Int8 => "int8",
        }
    }

    pub fn bytes_per_param(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
            Precision::Int8 => 1,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A precision name outpost does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown precision `{0}` (expected fp32, fp16, bf16 or int8)")]
pub struct UnknownPrecision(pub String);

impl FromStr for Precision {
    type Err = UnknownPrecision;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" => Ok(Precision::Fp32),
            "fp16" => Ok(Precision::Fp16),
            "bf16" => Ok(Precision::Bf16),
            "int8" => Ok(Precision::Int8),
            other => Err(UnknownPrecision(other.to_string())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: Box<toml::de::Error>,
    },
    #[error("{path}: {}", .problems.join("; "))]
    Invalid { path: String, problems: Vec<String> },
    #[error("target `{name}` not found (looked in {looked}; targets there: {available})")]
    NotFound {
        name: String,
        looked: String,
        available: String,
    },
}

impl Target {
    pub fn load(path: &Path) -> Result<Target, TargetError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TargetError::Io {
            path: shown.clone(),
            source,
        })?;
        Target::parse(&text, path.file_stem().and_then(|s| s.to_str()), &shown)
    }

    /// Parses and validates; `stem` is the file's name without `.toml`.
    pub fn parse(text: &str, stem: Option<&str>, shown: &str) -> Result<Target, TargetError> {
        let t: Target = toml::from_str(text).map_err(|e| TargetError::Parse {
            path: shown.to_string(),
            source: Box::new(e),
        })?;
        let problems = t.validate(stem);
        if !problems.is_empty() {
            return Err(TargetError::Invalid {
                path: shown.to_string(),
                problems,
            });
        }
        Ok(t)
    }

    /// Every problem at once.
    pub fn validate(&self, stem: Option<&str>) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(s) = stem
            && s != self.name
        {
            p.push(format!(
                "name `{}` differs from the file name `{s}`",
                self.name
            ));
        }
        if self.glibc_version().is_none() {
            p.push(format!(
                "glibc_floor `{}` is not MAJOR.MINOR",
                self.glibc_floor
            ));
        }
        if self.memory.usable_bytes == 0 || self.memory.usable_bytes > self.memory.total_bytes {
            p.push(format!(
                "memory.usable_bytes {} must be above 0 and at most total_bytes {}",
                self.memory.usable_bytes, self.memory.total_bytes
            ));
        }
        if self.runtime.providers.is_empty() {
            p.push("runtime.providers is empty".into());
        }
        if !self
            .runtime
            .precisions
            .contains(&self.runtime.default_precision)
        {
            p.push(format!(
                "runtime.default_precision {} is not among runtime.precisions",
                self.runtime.default_precision
            ));
        }
        if let Some(api) = self.runtime.onnxruntime_api
            && !ONNXRUNTIME_API_LEVELS.contains(&api)
        {
            p.push(format!(
                "runtime.onnxruntime_api {api} is outside {}..={} (the levels ort 2.0.0-rc.15 builds for)",
                ONNXRUNTIME_API_LEVELS.start(),
                ONNXRUNTIME_API_LEVELS.end()
            ));
        }
        let gpu_providers = self
            .runtime
            .providers
            .iter()
            .any(|p| matches!(p, Provider::Tensorrt | Provider::Cuda));
        match &self.gpu {
            None if gpu_providers => {
                p.push("runtime.providers names tensorrt or cuda but there is no [gpu]".into())
            }
            Some(g) if self.memory.shared_with_gpu && g.memory_bytes != 0 => {
                p.push("gpu.memory_bytes must be 0 when memory.shared_with_gpu".into())
            }
            Some(g) if !self.memory.shared_with_gpu && g.memory_bytes == 0 => {
                p.push("gpu.memory_bytes is 0 but memory.shared_with_gpu is false".into())
            }
            _ => {}
        }
        p
    }

    /// `glibc_floor` as (major, minor).
    pub fn glibc_version(&self) -> Option<(u32, u32)> {
        let (a, b) = self.glibc_floor.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    }

    /// True when the target runs models on a GPU (its first provider is one).
    pub fn gpu_first(&self) -> bool {
        self.gpu.is_some()
            && matches!(
                self.runtime.providers.first(),
                Some(Provider::Tensorrt | Provider::Cuda)
            )
    }
}

/// Resolves a TARGET argument: a path to a .toml file, or a name looked up
/// as `<dir>/<name>.toml` in each of `dirs`.
pub fn find_target(arg: &str, dirs: &[PathBuf]) -> Result<Target, TargetError> {
    let as_path = Path::new(arg);
    if as_path.is_file() {
        return Target::load(as_path);
    }
    for d in dirs {
        let p = d.join(format!("{arg}.toml"));
        if p.is_file() {
            return Target::load(&p);
        }
    }
    let mut available: Vec<String> = dirs
        .iter()
        .flat_map(|d| targets_in(d))
        .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .collect();
    available.sort();
    available.dedup();
    Err(TargetError::NotFound {
        name: arg.to_string(),
        looked: dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        available: if available.is_empty() {
            "none".into()
        } else {
            available.join(", ")
        },
    })
}

/// The `*.toml` files of a directory, sorted.
pub fn targets_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml") && p.is_file())
        .collect();
    v.sort();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU: &str = r#"
name = "t"
description = "d"
triple = "x86_64-unknown-linux-gnu"
glibc_floor = "2.31"
os = "Debian"
[memory]
total_bytes = 1000
usable_bytes = 800
shared_with_gpu = false
[cpu]
cores = 4
arch = "x86-64-v2"
[runtime]
providers = ["cpu"]
precisions = ["fp32", "int8"]
default_precision = "fp32"
intra_threads = 2
workers = 1
onnxruntime = "cpu wheel"
"#;

    #[test]
    fn parses_a_cpu_target() {
        let t = Target::parse(CPU, Some("t"), "t.toml").unwrap();
        assert_eq!(t.glibc_version(), Some((2, 31)));
        assert!(t.gpu.is_none());
        assert!(!t.gpu_first());
        assert_eq!(t.runtime.precisions, vec![Precision::Fp32, Precision::Int8]);
    }

    #[test]
    fn unknown_keys_are_errors() {
        let text = CPU.replace("workers = 1", "workers = 1\nworkerz = 2");
        let e = Target::parse(&text, Some("t"), "t.toml").unwrap_err();
        assert!(e.to_string().contains("workerz"), "{e}");
    }

    #[test]
    fn every_problem_at_once() {
        let text = CPU
            .replace("glibc_floor = \"2.31\"", "glibc_floor = \"2\"")
            .replace(
                "default_precision = \"fp32\"",
                "default_precision = \"fp16\"",
            )
            .replace("providers = [\"cpu\"]", "providers = [\"cuda\", \"cpu\"]");
        let TargetError::Invalid { problems, .. } =
            Target::parse(&text, Some("other"), "t.toml").unwrap_err()
        else {
            panic!("expected Invalid");
        };
        assert_eq!(problems.len(), 4, "{problems:?}");
    }

    #[test]
    fn checkout_targets_all_parse() {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join("targets");
        let files = targets_in(&dir);
        assert!(files.len() >= 6, "{files:?}");
        for f in files {
            Target::load(&f).unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn api_levels_have_cargo_features() {
        // This crate's features set ort's level; the outpost crate forwards
        // its own to them and names the default.
        let own = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .unwrap();
        let cargo = std::fs::read_to_string(
            Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join("Cargo.toml"),
        )
        .unwrap();
        for n in ONNXRUNTIME_API_LEVELS {
            assert!(
                own.contains(&format!("ort-api-{n} = [\"ort/api-{n}\"]")),
                "crates/inference/Cargo.toml lacks the feature ort-api-{n}"
            );
            assert!(
                cargo.contains(&format!("\"outpost-inference/ort-api-{n}\"]")),
                "Cargo.toml does not forward ort-api-{n}"
            );
        }
        let default = cargo
            .lines()
            .find(|l| l.starts_with("default = ["))
            .unwrap_or_default();
        assert!(
            default.contains(&format!("\"ort-api-{DEFAULT_ONNXRUNTIME_API}\"")),
            "the default features lack ort-api-{DEFAULT_ONNXRUNTIME_API}: {default}"
        );
        let text = CPU.replace("workers = 1", "workers = 1\nonnxruntime_api = 12");
        let e = Target::parse(&text, Some("t"), "t.toml").unwrap_err();
        assert!(e.to_string().contains("onnxruntime_api 12"), "{e}");
        let text = CPU.replace("workers = 1", "workers = 1\nonnxruntime_api = 20");
        let t = Target::parse(&text, Some("t"), "t.toml").unwrap();
        assert_eq!(t.runtime.onnxruntime_api(), 20);
        let t = Target::parse(CPU, Some("t"), "t.toml").unwrap();
        assert_eq!(t.runtime.onnxruntime_api(), DEFAULT_ONNXRUNTIME_API);
        // A default build is at the default level.
        if cfg!(feature = "ort-api-31") {
            assert_eq!(crate::backend::ort::REQUIRED_API, DEFAULT_ONNXRUNTIME_API);
        }
    }

    #[test]
    fn not_found_lists_what_is_there() {
        let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join("targets");
        let e = find_target("nope", &[dir]).unwrap_err().to_string();
        assert!(e.contains("x86_64-cpu"), "{e}");
    }
}
