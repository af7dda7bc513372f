//! A bundle's own acceptance test: run `check/in/<input>.npy` through the
//! loaded model and compare with `check/out/<output>.npy`.
//!
//! Tolerance: |got - want| <= tol * (1 + |want|) per element, so 1e-4 is
//! absolute near zero and relative for large values (ONNX Runtime on another
//! CPU or provider does not reproduce the last bits).

use std::path::Path;

use crate::backend::Tensor;
use crate::model::registry::LoadedModel;

fn npys(dir: &Path) -> Result<Vec<(String, Tensor)>, String> {
    let mut out = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
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
        let t = Tensor::read_npy(&p).map_err(|e| format!("{}: {e}", p.display()))?;
        out.push((name, t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// Ok(None) when the bundle has no check; Ok(Some(n)) = n values compared.
pub fn run(model: &LoadedModel, folder: &Path, tol: f64) -> Result<Option<usize>, String> {
    let dir = folder.join("check");
    if !dir.join("in").is_dir() {
        return Ok(None);
    }
    let inputs = npys(&dir.join("in"))?;
    let want = npys(&dir.join("out"))?;
    if want.is_empty() {
        return Err("check/out holds no .npy".into());
    }
    let refs: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let got = model.run(&refs).map_err(|e| format!("check run: {e}"))?;
    let mut compared = 0;
    for (name, w) in &want {
        let Some((_, g)) = got.iter().find(|(n, _)| n == name) else {
            return Err(format!("check: the model gives no output `{name}`"));
        };
        if g.shape() != w.shape() {
            return Err(format!(
                "check: output `{name}` has shape {:?}, expected {:?}",
                g.shape(),
                w.shape()
            ));
        }
        for (i, (a, b)) in g.to_f64_vec().iter().zip(w.to_f64_vec()).enumerate() {
            // NaN fails too: it is not within any tolerance.
            let within = (a - b).abs() <= tol * (1.0 + b.abs());
            if !within || a.is_nan() {
                return Err(format!(
                    "check: output `{name}`[{i}] is {a}, expected {b} (tolerance {tol})"
                ));
            }
            compared += 1;
        }
    }
    Ok(Some(compared))
}
