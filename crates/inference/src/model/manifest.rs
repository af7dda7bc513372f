//! The manifest beside each model file (`<model_dir>/<name>/manifest.toml`):
//! what the model is, where it came from, the checksum its file must have,
//! the inputs and outputs it is fed and read by, and its default pre- and
//! postprocessing.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::backend::{DType, Dim, IoSpec};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Model name; equals its folder's name.
    pub name: String,
    /// Semantic version (`MAJOR.MINOR.PATCH`).
    pub version: String,
    /// The .onnx file, relative to the manifest's folder.
    pub file: String,
    /// sha256 of the file, lowercase hex.
    pub sha256: String,
    /// Where the file came from (package, version, path inside it).
    pub source: String,
    /// The model's license (SPDX identifier).
    pub license: String,
    #[serde(default)]
    pub description: String,
    pub inputs: Vec<ManifestIo>,
    pub outputs: Vec<ManifestIo>,
    /// Inputs fed back from outputs between calls of one stream.
    #[serde(default)]
    pub state: Vec<StatePair>,
    #[serde(default)]
    pub preprocess: Option<Preprocess>,
    #[serde(default)]
    pub postprocess: Option<Postprocess>,
    /// How the model runs as a later stage of a pipeline (`[stage]`).
    #[serde(default)]
    pub stage: StageDefaults,
}

/// `[stage]` in a manifest: defaults for a pipeline stage that runs this
/// model, each overridable in the stage's config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageDefaults {
    /// Each side of a box grows by this fraction of its height before the
    /// crop (a text line needs some margin: without it a recogniser reads
    /// the word gaps poorly).
    #[serde(default)]
    pub padding: Option<f32>,
}

/// A declared input or output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ManifestIo {
    pub name: String,
    pub dtype: DType,
    /// Integers are fixed dimensions, strings name free ones.
    pub shape: Vec<Dim>,
    /// A constant this input takes when nothing else feeds it (e.g. a sample
    /// rate); also used for warm-up and benchmarks.
    #[serde(default)]
    pub fill: Option<f64>,
}

impl ManifestIo {
    pub fn spec(&self) -> IoSpec {
        IoSpec {
            name: self.name.clone(),
            dtype: self.dtype,
            shape: self.shape.clone(),
        }
    }
}

/// A state input fed from an output of the previous call on the same stream
/// (silero VAD: `state` <- `stateN`). The first call of a stream gets zeros.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatePair {
    pub input: String,
    pub output: String,
}

/// Default postprocessing of the model's outputs (see `crate::postprocess`).
pub use crate::postprocess::PostprocessConfig as Postprocess;
/// Default preprocessing for the model's main input (see `crate::preprocess`).
pub use crate::preprocess::PreprocessConfig as Preprocess;
pub use crate::preprocess::{ChannelOrder, Layout};

#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
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
}

impl Manifest {
    pub fn load(path: &Path) -> Result<Manifest, ManifestError> {
        let p = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ManifestError::Io {
            path: p.clone(),
            source,
        })?;
        let m: Manifest = toml::from_str(&text).map_err(|e| ManifestError::Parse {
            path: p.clone(),
            source: Box::new(e),
        })?;
        let problems = m.validate(
            path.parent()
                .and_then(|d| d.file_name())
                .and_then(|n| n.to_str()),
        );
        if !problems.is_empty() {
            return Err(ManifestError::Invalid { path: p, problems });
        }
        Ok(m)
    }

    /// Every problem at once; `folder` is the name of the manifest's folder.
    pub fn validate(&self, folder: Option<&str>) -> Vec<String> {
        let mut p = Vec::new();
        if let Some(f) = folder
            && f != self.name
        {
            p.push(format!(
                "name `{}` differs from its folder `{f}`",
                self.name
            ));
        }
        if !is_semver(&self.version) {
            p.push(format!(
                "version `{}` is not MAJOR.MINOR.PATCH",
                self.version
            ));
        }
        if self.sha256.len() != 64 || !self.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            p.push("sha256 must be 64 hex digits".into());
        }
        if self.file.is_empty() || self.file.contains("..") || self.file.starts_with('/') {
            p.push(format!(
                "file `{}` must be a path inside the model's folder",
                self.file
            ));
        }
        if self.inputs.is_empty() {
            p.push("no inputs declared".into());
        }
        if self.outputs.is_empty() {
            p.push("no outputs declared".into());
        }
        for s in &self.state {
            let i = self.inputs.iter().find(|i| i.name == s.input);
            let o = self.outputs.iter().find(|o| o.name == s.output);
            match (i, o) {
                (None, _) => p.push(format!("state input `{}` is not a declared input", s.input)),
                (_, None) => p.push(format!(
                    "state output `{}` is not a declared output",
                    s.output
                )),
                (Some(i), Some(o)) if i.dtype != o.dtype || i.shape.len() != o.shape.len() => p
                    .push(format!(
                        "state `{}` <- `{}`: input is {} {}, output is {} {}",
                        s.input,
                        s.output,
                        i.dtype,
                        i.spec().shape_string(),
                        o.dtype,
                        o.spec().shape_string()
                    )),
                _ => {}
            }
        }
        p.extend(size_problems(
            "input",
            self.inputs.iter().map(ManifestIo::spec),
        ));
        p.extend(size_problems(
            "output",
            self.outputs.iter().map(ManifestIo::spec),
        ));
        if let Some(out) = self.postprocess.as_ref().and_then(Postprocess::output)
            && !self.outputs.iter().any(|o| o.name == out)
        {
            p.push(format!(
                "postprocess reads output `{out}`, which is not declared"
            ));
        }
        p
    }

    pub fn is_state_input(&self, name: &str) -> bool {
        self.state.iter().any(|s| s.input == name)
    }
}

fn is_semver(v: &str) -> bool {
    let core = v.split(['-', '+']).next().unwrap_or("");
    let parts: Vec<&str> = core.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|x| !x.is_empty() && x.bytes().all(|b| b.is_ascii_digit()))
}

/// Every declared tensor (`kind`: input or output) larger than outpost
/// allocates from a declaration ([`crate::backend::MAX_DECLARED_BYTES`],
/// at batch 1): a model file or manifest must not make anyone allocate
/// gigabytes, or overflow counting them.
pub fn size_problems<S: std::borrow::Borrow<IoSpec>>(
    kind: &str,
    specs: impl IntoIterator<Item = S>,
) -> Vec<String> {
    specs
        .into_iter()
        .filter_map(|s| s.borrow().check_size().err())
        .map(|e| format!("{kind} {e}"))
        .collect()
}

/// Compares what a manifest declares with what the model really has. Free
/// dimensions may be fixed by the manifest; names, element types, ranks and
/// fixed sizes must agree.
pub fn compare_io(kind: &str, declared: &[ManifestIo], real: &[IoSpec]) -> Vec<String> {
    let mut p = Vec::new();
    for d in declared {
        let Some(r) = real.iter().find(|r| r.name == d.name) else {
            p.push(format!(
                "manifest declares {kind} `{}`, the model has no such {kind} (it has: {})",
                d.name,
                real.iter()
                    .map(|r| r.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            continue;
        };
        if r.dtype != d.dtype {
            p.push(format!(
                "{kind} `{}`: manifest says {}, the model says {}",
                d.name, d.dtype, r.dtype
            ));
        }
        let dims_ok = r.shape.len() == d.shape.len()
            && r.shape.iter().zip(&d.shape).all(|(rd, dd)| match (rd, dd) {
                (Dim::Fixed(a), Dim::Fixed(b)) => a == b,
                _ => true,
            });
        if !dims_ok {
            p.push(format!(
                "{kind} `{}`: manifest says shape {}, the model says {}",
                d.name,
                d.spec().shape_string(),
                r.shape_string()
            ));
        }
    }
    for r in real {
        if !declared.iter().any(|d| d.name == r.name) {
            p.push(format!(
                "the model's {kind} `{}` is not declared in the manifest",
                r.name
            ));
        }
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    const SILERO: &str = r#"
name = "silero_vad"
version = "6.2.3"
file = "silero_vad.onnx"
sha256 = "1111111111111111111111111111111111111111111111111111111111111111"
source = "test"
license = "MIT"
[[inputs]]
name = "input"
dtype = "f32"
shape = ["batch", 576]
[[inputs]]
name = "state"
dtype = "f32"
shape = [2, "batch", 128]
[[inputs]]
name = "sr"
dtype = "i64"
shape = []
fill = 16000
[[outputs]]
name = "output"
dtype = "f32"
shape = ["batch", 1]
[[outputs]]
name = "stateN"
dtype = "f32"
shape = [2, "batch", 128]
[[state]]
input = "state"
output = "stateN"
[preprocess]
type = "audio"
sample_rate = 16000
window = 576
hop = 512
[postprocess]
type = "threshold"
output = "output"
on = 0.5
off = 0.35
"#;

    #[test]
    fn parses_and_validates_a_stateful_manifest() {
        let m: Manifest = toml::from_str(SILERO).unwrap();
        assert!(m.validate(Some("silero_vad")).is_empty());
        assert!(m.is_state_input("state"));
        assert_eq!(
            m.inputs[0].shape,
            vec![Dim::Symbolic("batch".into()), Dim::Fixed(576)]
        );
        assert_eq!(m.inputs[2].fill, Some(16000.0));
    }

    #[test]
    fn reports_every_problem() {
        let mut m: Manifest = toml::from_str(SILERO).unwrap();
        m.version = "6.2".into();
        m.sha256 = "xyz".into();
        m.state[0].output = "nope".into();
        let p = m.validate(Some("other"));
        assert_eq!(p.len(), 4, "{p:?}");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let text = SILERO.replace("license = \"MIT\"", "license = \"MIT\"\nlicence = \"typo\"");
        assert!(toml::from_str::<Manifest>(&text).is_err());
    }

    #[test]
    fn io_comparison_allows_fixing_free_dims_only() {
        let m: Manifest = toml::from_str(SILERO).unwrap();
        let real = vec![
            IoSpec {
                name: "input".into(),
                dtype: DType::F32,
                shape: vec![Dim::Symbolic("a".into()), Dim::Symbolic("b".into())],
            },
            IoSpec {
                name: "state".into(),
                dtype: DType::F32,
                shape: vec![Dim::Fixed(2), Dim::Symbolic("b".into()), Dim::Fixed(128)],
            },
            IoSpec {
                name: "sr".into(),
                dtype: DType::I64,
                shape: vec![],
            },
        ];
        assert!(compare_io("input", &m.inputs, &real).is_empty());
        let mut wrong = real.clone();
        wrong[1].shape[2] = Dim::Fixed(64);
        wrong[2].dtype = DType::I32;
        assert_eq!(compare_io("input", &m.inputs, &wrong).len(), 2);
        let mut extra = real;
        extra.push(IoSpec {
            name: "h".into(),
            dtype: DType::F32,
            shape: vec![],
        });
        assert_eq!(compare_io("input", &m.inputs, &extra).len(), 1);
    }
}
