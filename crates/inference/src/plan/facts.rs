//! What the planner knows about a model, read without ONNX Runtime: the
//! manifest (inputs, outputs, preprocessing that fixes free dimensions) and
//! the .onnx file (parameter count, and for a bare file its declared inputs
//! and outputs). Kept apart from the estimate (`plan/mod.rs`), which only
//! does arithmetic on these facts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use prost::Message;
use serde::Serialize;

use super::graph::{self, GraphFacts};
use crate::backend::{DType, Dim, IoSpec};
use crate::model::manifest::{Layout, Manifest, Preprocess, size_problems};
use crate::model::registry::{ModelError, manifests_in};
use crate::onnx_proto::{ModelProto, ValueInfoProto};

/// What the plan needs to know about a model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelFacts {
    pub name: String,
    pub path: PathBuf,
    pub file_bytes: u64,
    pub parameters: u64,
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
    /// "manifest" or "onnx" (a bare file: the graph's declared inputs/outputs).
    pub io_from: &'static str,
    /// Sizes for free (non-batch) dimensions, by name: from the manifest's
    /// preprocessing (image height/width, audio window, sensor shape).
    pub dim_sizes: BTreeMap<String, u64>,
    /// The model file, for the graph walk (absent: IO heuristics only).
    #[serde(skip)]
    pub onnx: Option<Bytes>,
}

/// Free dimension sizes a manifest's preprocessing fixes for its first input.
fn dim_sizes_from(manifest: &Manifest) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    let (Some(p), Some(input)) = (&manifest.preprocess, manifest.inputs.first()) else {
        return out;
    };
    let shape = &input.shape;
    let mut bind = |i: usize, v: u64| {
        if let Some(Dim::Symbolic(n)) = shape.get(i)
            && !crate::backend::is_batch_name(n)
        {
            out.insert(n.clone(), v);
        }
    };
    match p {
        Preprocess::Image {
            width,
            height,
            crop,
            layout,
            ..
        } if shape.len() == 4 => {
            let (w, h) = crop.map(|[w, h]| (w, h)).unwrap_or((*width, *height));
            let (hi, wi) = match layout {
                Layout::Nchw => (2, 3),
                Layout::Nhwc => (1, 2),
                Layout::Nwhc => (2, 1),
            };
            bind(hi, h as u64);
            bind(wi, w as u64);
        }
        Preprocess::Audio { window, .. } => {
            if let Some(last) = shape.len().checked_sub(1) {
                bind(last, *window as u64);
            }
        }
        Preprocess::Sensor {
            length, shape: s, ..
        } => {
            let dims: Vec<usize> = s.clone().or(length.map(|l| vec![l])).unwrap_or_default();
            // The reading's dimensions are the input's last ones.
            let off = shape.len().saturating_sub(dims.len());
            for (k, d) in dims.iter().enumerate() {
                bind(off + k, *d as u64);
            }
        }
        _ => {}
    }
    out
}

/// ONNX element type code of a dtype (TensorProto.DataType).
fn onnx_type(d: DType) -> i32 {
    match d {
        DType::F32 => 1,
        DType::U8 => 2,
        DType::I8 => 3,
        DType::I32 => 6,
        DType::I64 => 7,
        DType::Bool => 9,
        DType::F16 => 10,
        DType::F64 => 11,
    }
}

impl ModelFacts {
    /// A tensor's dimensions at this batch, free ones from `dim_sizes` (1
    /// when unknown).
    pub fn dims(&self, s: &IoSpec, batch: u64) -> Vec<u64> {
        s.shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => *n,
                Dim::Symbolic(n) if crate::backend::is_batch_name(n) => batch,
                Dim::Symbolic(n) => self.dim_sizes.get(n).copied().unwrap_or(1),
            })
            .collect()
    }

    /// Bytes of a tensor at this batch.
    pub fn tensor_bytes(&self, s: &IoSpec, batch: u64) -> u64 {
        self.dims(s, batch).iter().product::<u64>() * dtype_bytes(s.dtype)
    }

    /// The graph walk at this batch, when the file is at hand and parses.
    pub fn graph(&self, batch: u64) -> Option<GraphFacts> {
        let inputs = self
            .inputs
            .iter()
            .map(|s| (s.name.clone(), (self.dims(s, batch), onnx_type(s.dtype))))
            .collect();
        graph::analyse(self.onnx.clone()?, &inputs).ok()
    }
}

/// Resolves MODEL as the other commands do (a path to an .onnx file, held to
/// the manifest beside it when that names it, or a name in `dir`), without
/// loading ONNX Runtime.
pub fn model_facts(arg: &str, dir: &Path) -> Result<ModelFacts, ModelError> {
    let as_path = Path::new(arg);
    let (path, manifest) = if as_path.is_file() {
        let beside = as_path
            .parent()
            .unwrap_or(Path::new("."))
            .join("manifest.toml");
        let m = if beside.is_file() {
            Manifest::load(&beside)
                .ok()
                .filter(|m| Path::new(&m.file).file_name() == as_path.file_name())
        } else {
            None
        };
        (as_path.to_path_buf(), m)
    } else {
        let mpath = dir.join(arg).join("manifest.toml");
        if !mpath.is_file() {
            let available: Vec<String> = manifests_in(dir)
                .iter()
                .filter_map(|p| {
                    p.parent()
                        .and_then(|d| d.file_name())
                        .map(|n| n.to_string_lossy().into_owned())
                })
                .collect();
            return Err(ModelError::NotFound {
                name: arg.to_string(),
                dir: dir.display().to_string(),
                available: if available.is_empty() {
                    "none; run models/fetch and models/build".into()
                } else {
                    available.join(", ")
                },
            });
        }
        let m = Manifest::load(&mpath)?;
        (dir.join(arg).join(&m.file), Some(m))
    };
    let shown = path.display().to_string();
    let bytes: Bytes = std::fs::read(&path)
        .map_err(|source| ModelError::Io {
            path: shown.clone(),
            source,
        })?
        .into();
    let not_onnx = |detail: String| ModelError::NotOnnx {
        path: shown.clone(),
        detail,
    };
    let info =
        crate::model::onnx::inspect_bytes(bytes.clone()).map_err(|e| not_onnx(e.to_string()))?;
    // A model the daemon would refuse for its declared sizes is refused
    // here too, with the same reason (its figures would not fit 64 bits).
    let mut too_large = size_problems("input", &info.inputs);
    too_large.extend(size_problems("output", &info.outputs));
    if !too_large.is_empty() {
        return Err(ModelError::TooLarge {
            path: shown,
            problems: too_large,
        });
    }
    let dim_sizes = manifest.as_ref().map(dim_sizes_from).unwrap_or_default();
    let (name, inputs, outputs, io_from) = match manifest {
        Some(m) => (
            m.name.clone(),
            m.inputs.iter().map(|i| i.spec()).collect(),
            m.outputs.iter().map(|o| o.spec()).collect(),
            "manifest",
        ),
        None => {
            let (i, o) = graph_io(bytes.clone()).map_err(|e| not_onnx(e.to_string()))?;
            let name = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("model")
                .to_string();
            (name, i, o, "onnx")
        }
    };
    Ok(ModelFacts {
        name,
        path,
        file_bytes: bytes.len() as u64,
        parameters: info.parameters,
        inputs,
        outputs,
        io_from,
        dim_sizes,
        onnx: Some(bytes),
    })
}

// The graph's declared inputs and outputs, for a bare .onnx file without a
// manifest.
type GraphIo = (Vec<IoSpec>, Vec<IoSpec>);

fn graph_io(bytes: Bytes) -> Result<GraphIo, prost::DecodeError> {
    let m = ModelProto::decode(bytes)?;
    let g = m.graph.unwrap_or_default();
    // Before IR 4, initializers were also listed as graph inputs.
    let inits: std::collections::HashSet<&str> =
        g.initializer.iter().map(|t| t.name.as_str()).collect();
    let conv = |v: &[ValueInfoProto]| -> Vec<IoSpec> {
        v.iter()
            .filter(|vi| !inits.contains(vi.name.as_str()))
            .map(|vi| {
                let tt = vi.r#type.as_ref().and_then(|t| t.tensor_type.as_ref());
                let dtype = tt
                    .and_then(|t| DType::from_onnx(t.elem_type))
                    .unwrap_or(DType::F32);
                let shape = tt
                    .and_then(|t| t.shape.as_ref())
                    .map(|s| {
                        s.dim
                            .iter()
                            .enumerate()
                            .map(|(i, d)| match (d.dim_value, &d.dim_param) {
                                (Some(v), _) if v > 0 => Dim::Fixed(v as u64),
                                (_, Some(p)) if !p.is_empty() => Dim::Symbolic(p.clone()),
                                _ => Dim::Symbolic(format!("d{i}")),
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                IoSpec {
                    name: vi.name.clone(),
                    dtype,
                    shape,
                }
            })
            .collect()
    };
    Ok((conv(&g.input), conv(&g.output)))
}

/// Bytes of one element.
pub fn dtype_bytes(d: DType) -> u64 {
    match d {
        DType::F64 | DType::I64 => 8,
        DType::F32 | DType::I32 => 4,
        DType::F16 => 2,
        DType::I8 | DType::U8 | DType::Bool => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_preprocessing_names_free_dimensions() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .join("models/ppocr_det/manifest.toml");
        let m = Manifest::load(&path).unwrap();
        // ["batch", 3, "height", "width"], image preprocess 736 x 736.
        assert_eq!(
            dim_sizes_from(&m),
            BTreeMap::from([("height".into(), 736), ("width".into(), 736)])
        );
    }

    #[test]
    fn bare_onnx_io_is_read_from_the_graph() {
        let path = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .join("models/sensor_mlp/sensor_mlp.onnx");
        let Ok(bytes) = std::fs::read(&path) else {
            return; // models/build has not run in this checkout
        };
        let (i, o) = graph_io(bytes.into()).unwrap();
        assert!(!i.is_empty() && !o.is_empty());
        assert!(i.iter().all(|s| !s.shape.is_empty()));
    }
}
