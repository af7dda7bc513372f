//! A bundle's own acceptance test: run `check/in/<input>.npy` through the
//! loaded model and compare with `check/out/<output>.npy`.
//!
//! Tolerance: |got - want| <= tol * (1 + |want|) per element, so 1e-4 is
//! absolute near zero and relative for large values (ONNX Runtime on another
//! CPU or provider does not reproduce the last bits).

use std::path::Path;

use crate::backend::Tensor;
use crate::model::registry::LoadedModel;

/// Why a bundle's check did not pass.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("{path}: {source}")]
    Dir {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Npy(#[from] crate::backend::NpyError),
    #[error("check/out holds no .npy")]
    NoOutputs,
    #[error("check run: {0}")]
    Run(#[from] crate::backend::RunError),
    #[error("check: the model gives no output `{0}`")]
    Missing(String),
    #[error("check: output `{name}` has shape {got:?}, expected {want:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("check: output `{name}`[{index}] is {got}, expected {want} (tolerance {tol})")]
    Value {
        name: String,
        index: usize,
        got: f64,
        want: f64,
        tol: f64,
    },
}

fn npys(dir: &Path) -> Result<Vec<(String, Tensor)>, CheckError> {
    let mut out = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|source| CheckError::Dir {
        path: dir.display().to_string(),
        source,
    })?;
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_none_or(|x| x != "npy") {
            continue;
        }
        let name = p
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        let t = Tensor::read_npy(&p)?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Ok(None) when the bundle has no check; Ok(Some(n)) = n values compared.
pub fn run(model: &LoadedModel, folder: &Path, tol: f64) -> Result<Option<usize>, CheckError> {
    let dir = folder.join("check");
    if !dir.join("in").is_dir() {
        return Ok(None);
    }
    let inputs = npys(&dir.join("in"))?;
    let want = npys(&dir.join("out"))?;
    if want.is_empty() {
        return Err(CheckError::NoOutputs);
    }
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let got = model.run(&refs)?;
    let mut compared = 0;
    for (name, w) in &want {
        let Some((_, g)) = got.iter().find(|(n, _)| n == name) else {
            return Err(CheckError::Missing(name.clone()));
        };
        if g.shape() != w.shape() {
            return Err(CheckError::Shape {
                name: name.clone(),
                got: g.shape().to_vec(),
                want: w.shape().to_vec(),
            });
        }
        for (i, (a, b)) in g.to_f64_vec().iter().zip(w.to_f64_vec()).enumerate() {
            // NaN fails too: it is not within any tolerance.
            let within = (a - b).abs() <= tol * (1.0 + b.abs());
            if !within || a.is_nan() {
                return Err(CheckError::Value {
                    name: name.clone(),
                    index: i,
                    got: *a,
                    want: b,
                    tol,
                });
            }
            compared += 1;
        }
    }
    Ok(Some(compared))
}
