//! The model registry: every model folder under the model directory, checked
//! and loaded. A model that fails any check (checksum, ONNX parse, manifest
//! against the model's real inputs, warm-up) is refused with an error naming
//! its file; the others still load.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use sha2::{Digest, Sha256};

use super::manifest::{Manifest, ManifestError, compare_io, size_problems};
use super::onnx::{OnnxInfo, inspect_bytes};
use crate::backend::ort::{Fallback, ModelKey, OrtSession, Runtime, SessionError, SessionOptions};
use crate::backend::{
    Dim, InferenceSession, ModelIo, Provider, RunError, Tensor, TooLarge, check_allocation,
    check_inputs, is_batch_name,
};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path}: sha256 is {actual}, the manifest says {expected} (corrupt or wrong file; run models/fetch)"
    )]
    Checksum {
        path: String,
        expected: String,
        actual: String,
    },
    #[error("{path}: {detail}")]
    NotOnnx { path: String, detail: String },
    #[error(transparent)]
    Session(#[from] SessionError),
    #[error("{path}: the manifest disagrees with the model: {}", .problems.join("; "))]
    Mismatch { path: String, problems: Vec<String> },
    /// A declared input or output larger than outpost allocates
    /// ([`crate::backend::MAX_DECLARED_BYTES`]): refused before anything
    /// is allocated for it.
    #[error("{path}: {}", .problems.join("; "))]
    TooLarge { path: String, problems: Vec<String> },
    #[error("{path}: warm-up failed: {detail}")]
    WarmUp { path: String, detail: String },
    #[error("model `{name}` not found in {dir} (models there: {available})")]
    NotFound {
        name: String,
        dir: String,
        available: String,
    },
}

/// A model ready to serve: its manifest, its session and what was learnt
/// while loading it.
pub struct LoadedModel {
    pub manifest: Manifest,
    pub path: PathBuf,
    pub info: OnnxInfo,
    pub provider: Provider,
    pub fallbacks: Vec<Fallback>,
    pub warmup: Duration,
    /// As the model reports them.
    pub io: ModelIo,
    /// As the manifest declares them: may fix free dimensions (silero's 576
    /// samples), so frames are checked against what the pipeline promises.
    pub declared: ModelIo,
    session: Mutex<Box<dyn InferenceSession>>,
}

impl LoadedModel {
    /// `name@version`, as result records name models.
    pub fn id(&self) -> String {
        format!("{}@{}", self.manifest.name, self.manifest.version)
    }

    /// Runs once. The session is shared by every pipeline using this model;
    /// callers on other threads wait for the lock.
    pub fn run(&self, inputs: &[(&str, &Tensor)]) -> Result<Vec<(String, Tensor)>, RunError> {
        check_inputs(&self.declared, inputs.iter().map(|(n, t)| (*n, *t)))?;
        let mut s = self.session.lock();
        // The declared inputs were held to the model's own at load (compare_io).
        s.run_prechecked(inputs)
    }

    /// Exclusive access to the underlying ONNX Runtime session, for the
    /// benchmarks' hot loops; None when another engine serves the model.
    pub fn with_session<R>(&self, f: impl FnOnce(&mut OrtSession) -> R) -> Option<R> {
        let mut s = self.session.lock();
        s.as_ort().map(f)
    }

    /// A model served by `engine` (an engine other than ONNX Runtime, or a
    /// test's fake): the manifest declares its inputs and outputs, and the
    /// engine's own must agree, as at a normal load.
    pub fn with_engine(
        manifest: Manifest,
        engine: Box<dyn InferenceSession>,
    ) -> Result<LoadedModel, ModelError> {
        let io = engine.io().clone();
        let mut problems = size_problems("input", manifest.inputs.iter().map(|d| d.spec()));
        problems.extend(size_problems(
            "output",
            manifest.outputs.iter().map(|d| d.spec()),
        ));
        problems.extend(compare_io("input", &manifest.inputs, &io.inputs));
        problems.extend(compare_io("output", &manifest.outputs, &io.outputs));
        if !problems.is_empty() {
            return Err(ModelError::Mismatch {
                path: manifest.name.clone(),
                problems,
            });
        }
        let declared = ModelIo {
            inputs: manifest.inputs.iter().map(|i| i.spec()).collect(),
            outputs: manifest.outputs.iter().map(|o| o.spec()).collect(),
        };
        Ok(LoadedModel {
            path: PathBuf::from(&manifest.file),
            info: OnnxInfo::default(),
            provider: engine.provider(),
            fallbacks: Vec::new(),
            warmup: Duration::ZERO,
            io,
            declared,
            manifest,
            session: Mutex::new(engine),
        })
    }

    /// One run's outputs handed to its `n` items: the one rule for every
    /// batched path. An output the manifest declares with a batch axis first
    /// is split along it (each item its row); one declared without (a
    /// table, a constant) is the same for every item, whatever its first
    /// dimension happens to be. A declared batch axis that did not come back
    /// as `n` long is also given whole to every item.
    pub fn split_outputs(
        &self,
        outputs: Vec<(String, Tensor)>,
        n: usize,
    ) -> Vec<Vec<(String, Tensor)>> {
        let mut per_item: Vec<Vec<(String, Tensor)>> = vec![Vec::with_capacity(outputs.len()); n];
        for (name, t) in outputs {
            let batched = self
                .manifest
                .outputs
                .iter()
                .find(|o| o.name == name)
                .and_then(|o| o.shape.first())
                // Not declared: judged by what came back, as before.
                .is_none_or(|d| matches!(d, Dim::Symbolic(s) if is_batch_name(s)));
            match t.split0(n) {
                Some(pieces) if batched && t.shape().first() == Some(&n) => {
                    for (item, piece) in per_item.iter_mut().zip(pieces) {
                        item.push((name.clone(), piece));
                    }
                }
                _ => {
                    for item in per_item.iter_mut() {
                        item.push((name.clone(), t.clone()));
                    }
                }
            }
        }
        per_item
    }

    /// Inputs for one call built from the manifest: `fill` values where
    /// declared, zeros for state inputs, seeded pseudo-random data otherwise.
    /// Each input's size is held to the limit on declared tensors before
    /// anything is allocated.
    pub fn synthetic_inputs(&self, batch: usize) -> Result<Vec<(String, Tensor)>, TooLarge> {
        self.manifest
            .inputs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let mut shape = d.spec().concrete_shape(batch)?;
                // A sliding-window net (pyramid preprocessing) needs at least its window.
                if let Some(crate::preprocess::PreprocessConfig::Pyramid { window, .. }) =
                    &self.manifest.preprocess
                {
                    for (k, dim) in d.shape.iter().enumerate() {
                        if matches!(dim, crate::backend::Dim::Symbolic(s) if !crate::backend::is_batch_name(s))
                        {
                            shape[k] = *window as usize;
                        }
                    }
                }
                // The pyramid's window set a free size: held to the same limit.
                let dims: Vec<u64> = shape.iter().map(|n| *n as u64).collect();
                check_allocation(&d.name, d.dtype, &dims, batch, || format!("{dims:?}"))?;
                let t = match d.fill {
                    Some(v) => Tensor::filled(d.dtype, &shape, v),
                    None if self.manifest.is_state_input(&d.name) => {
                        Tensor::filled(d.dtype, &shape, 0.0)
                    }
                    None => Tensor::pseudo_random(d.dtype, &shape, 0x5EED + i as u64),
                };
                Ok((d.name.clone(), t))
            })
            .collect()
    }
}

/// A manifest for a bare .onnx file: its inputs and outputs as the model
/// declares them, no checksum to hold it to.
fn manifest_for_bare_file(path: &Path, io: &ModelIo, sha256: String) -> Manifest {
    let name = path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("model")
        .to_string();
    let conv = |v: &[crate::backend::IoSpec]| {
        v.iter()
            .map(|s| super::manifest::ManifestIo {
                name: s.name.clone(),
                dtype: s.dtype,
                shape: s.shape.clone(),
                fill: None,
            })
            .collect()
    };
    Manifest {
        name,
        version: "0.0.0".into(),
        file: path
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string(),
        sha256,
        source: path.display().to_string(),
        license: "unknown".into(),
        description: String::new(),
        inputs: conv(&io.inputs),
        outputs: conv(&io.outputs),
        state: Vec::new(),
        preprocess: None,
        postprocess: None,
        stage: Default::default(),
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Opens one model from its manifest: checksum, parse, session, manifest
/// against the real model, warm-up.
pub fn load_manifest(
    rt: &Runtime,
    manifest_path: &Path,
    opts: &SessionOptions,
) -> Result<LoadedModel, ModelError> {
    let manifest = Manifest::load(manifest_path)?;
    let dir = manifest_path.parent().unwrap_or(Path::new("."));
    let path = dir.join(&manifest.file);
    load_file(rt, &path, Some(manifest), opts)
}

/// Opens a model file; with a manifest, holds it to the manifest.
pub fn load_file(
    rt: &Runtime,
    path: &Path,
    manifest: Option<Manifest>,
    opts: &SessionOptions,
) -> Result<LoadedModel, ModelError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        path: shown.clone(),
        source,
    })?;
    let actual = sha256_hex(&bytes);
    if let Some(m) = &manifest
        && !m.sha256.eq_ignore_ascii_case(&actual)
    {
        return Err(ModelError::Checksum {
            path: shown,
            expected: m.sha256.clone(),
            actual,
        });
    }
    let info = inspect_bytes(bytes.into()).map_err(|e| ModelError::NotOnnx {
        path: shown.clone(),
        detail: e.to_string(),
    })?;
    // What the file declares, before ONNX Runtime or the warm-up allocates
    // anything for it (the manifest's own were held to it when it loaded).
    let mut problems = size_problems("input", &info.inputs);
    problems.extend(size_problems("output", &info.outputs));
    if !problems.is_empty() {
        return Err(ModelError::TooLarge {
            path: shown,
            problems,
        });
    }
    let (name, version) = match &manifest {
        Some(m) => (m.name.clone(), m.version.clone()),
        None => (
            path.file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("model")
                .to_string(),
            "0.0.0".to_string(),
        ),
    };
    let key = ModelKey {
        name: &name,
        version: &version,
    };
    let session = OrtSession::open(rt, path, &key, opts)?;
    let io = session.io().clone();
    let manifest = match manifest {
        Some(m) => {
            let mut problems = compare_io("input", &m.inputs, &io.inputs);
            problems.extend(compare_io("output", &m.outputs, &io.outputs));
            if !problems.is_empty() {
                return Err(ModelError::Mismatch {
                    path: shown,
                    problems,
                });
            }
            m
        }
        None => manifest_for_bare_file(path, &io, actual),
    };
    let declared = ModelIo {
        inputs: manifest.inputs.iter().map(|i| i.spec()).collect(),
        outputs: manifest.outputs.iter().map(|o| o.spec()).collect(),
    };
    let provider = session.provider();
    let fallbacks = session.fallbacks.clone();
    let mut model = LoadedModel {
        manifest,
        path: path.to_path_buf(),
        info,
        provider,
        fallbacks,
        warmup: Duration::ZERO,
        io,
        declared,
        session: Mutex::new(Box::new(session)),
    };
    // Warm-up: the first run allocates arenas and (on TensorRT) builds the
    // engine; do it at load so the first real frame does not pay for it.
    let inputs = model
        .synthetic_inputs(1)
        .map_err(|e| ModelError::TooLarge {
            path: shown.clone(),
            problems: vec![format!("input {e}")],
        })?;
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let t0 = Instant::now();
    model.run(&refs).map_err(|e| ModelError::WarmUp {
        path: shown.clone(),
        detail: e.to_string(),
    })?;
    model.warmup = t0.elapsed();
    tracing::info!(model = %model.id(), provider = %model.provider, warmup_ms = model.warmup.as_secs_f64() * 1e3, "model loaded");
    Ok(model)
}

/// Every model of a model directory that passed its checks.
#[derive(Default)]
pub struct Registry {
    pub dir: PathBuf,
    models: BTreeMap<String, Arc<LoadedModel>>,
}

impl Registry {
    /// Loads every `<dir>/<name>/manifest.toml`. Models that fail are returned
    /// as errors beside the registry of those that loaded.
    pub fn load_dir(
        rt: &Runtime,
        dir: &Path,
        opts: &SessionOptions,
    ) -> (Registry, Vec<ModelError>) {
        let mut reg = Registry {
            dir: dir.to_path_buf(),
            models: BTreeMap::new(),
        };
        let mut errors = Vec::new();
        for manifest in manifests_in(dir) {
            match load_manifest(rt, &manifest, opts) {
                Ok(m) => {
                    reg.models.insert(m.manifest.name.clone(), Arc::new(m));
                }
                Err(e) => {
                    tracing::error!(error = %e, "model refused");
                    errors.push(e);
                }
            }
        }
        (reg, errors)
    }

    pub fn get(&self, name: &str) -> Option<Arc<LoadedModel>> {
        self.models.get(name).cloned()
    }

    pub fn models(&self) -> impl Iterator<Item = &Arc<LoadedModel>> {
        self.models.values()
    }

    pub fn len(&self) -> usize {
        self.models.len()
    }

    pub fn is_empty(&self) -> bool {
        self.models.is_empty()
    }
}

/// The manifests of a model directory, sorted by folder name.
pub fn manifests_in(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("manifest.toml"))
        .filter(|p| p.is_file())
        .collect();
    v.sort();
    v
}

/// Resolves a MODEL argument: a path to an .onnx file (held to the manifest
/// beside it when that manifest names the file) or a model name in `dir`.
pub fn open_model_arg(
    rt: &Runtime,
    arg: &str,
    dir: &Path,
    opts: &SessionOptions,
) -> Result<LoadedModel, ModelError> {
    let as_path = Path::new(arg);
    if as_path.is_file() {
        let beside = as_path
            .parent()
            .unwrap_or(Path::new("."))
            .join("manifest.toml");
        if beside.is_file()
            && let Ok(m) = Manifest::load(&beside)
            && Path::new(&m.file).file_name() == as_path.file_name()
        {
            return load_file(rt, as_path, Some(m), opts);
        }
        return load_file(rt, as_path, None, opts);
    }
    let manifest = dir.join(arg).join("manifest.toml");
    if manifest.is_file() {
        return load_manifest(rt, &manifest, opts);
    }
    let available: Vec<String> = manifests_in(dir)
        .iter()
        .filter_map(|p| {
            p.parent()
                .and_then(|d| d.file_name())
                .map(|n| n.to_string_lossy().into_owned())
        })
        .collect();
    Err(ModelError::NotFound {
        name: arg.to_string(),
        dir: dir.display().to_string(),
        available: if available.is_empty() {
            "none; run models/fetch and models/build".into()
        } else {
            available.join(", ")
        },
    })
}
