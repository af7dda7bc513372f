//! Bundles: a plain tar whose first entry is `manifest.json` (kind, name,
//! version, target, minimum daemon version, sha256 of every other file),
//! followed by the files. Model bundles hold the model folder's
//! `manifest.toml` and model file, and optionally `check/in/*.npy` and
//! `check/out/*.npy`; daemon bundles hold the `outpost` binary.
//!
//! Unpacking trusts nothing in the archive beyond what the signature
//! already covered: only regular files listed in manifest.json, at plain
//! relative paths, each checked against its sha256; a missing, extra or
//! altered file fails the whole bundle.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::model::manifest::Manifest;

pub const MANIFEST: &str = "manifest.json";
/// manifest.json larger than this is not a manifest.
const MANIFEST_MAX: u64 = 1 << 20;
const MAX_FILES: usize = 1000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BundleKind {
    Model,
    Daemon,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleManifest {
    /// Bundle format, 1.
    pub format: u32,
    pub kind: BundleKind,
    pub name: String,
    pub version: String,
    /// Target triple (daemon bundles).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    pub min_daemon_version: String,
    /// Signed permission to replace a newer version with this one.
    #[serde(default)]
    pub rollback: bool,
    /// Relative path -> sha256 (lowercase hex).
    pub files: BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Manifest(#[from] crate::model::manifest::ManifestError),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BundleError + '_ {
    move |source| BundleError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn invalid(s: impl Into<String>) -> BundleError {
    BundleError::Invalid(s.into())
}

/// This build's target triple, as daemon bundles name it.
pub fn this_target() -> String {
    let env = if cfg!(target_env = "musl") {
        "musl"
    } else {
        "gnu"
    };
    format!(
        "{}-unknown-{}-{env}",
        std::env::consts::ARCH,
        std::env::consts::OS
    )
}

/// A relative path of plain components only (no `..`, no root).
fn safe_rel(p: &str) -> bool {
    let path = Path::new(p);
    !p.is_empty() && path.components().all(|c| matches!(c, Component::Normal(_)))
}

fn sha256_of(path: &Path) -> Result<String, BundleError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

/// Adds the `.npy` files of `dir/in` and `dir/out` as `check/in/..`, `check/out/..`.
fn check_files(dir: &Path, files: &mut Vec<(String, PathBuf)>) -> Result<(), BundleError> {
    for side in ["in", "out"] {
        let d = dir.join(side);
        let mut names: Vec<_> = std::fs::read_dir(&d)
            .map_err(io(&d))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "npy") && p.is_file())
            .collect();
        names.sort();
        if names.is_empty() {
            return Err(invalid(format!("{}: no .npy files", d.display())));
        }
        for p in names {
            let n = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            files.push((format!("check/{side}/{n}"), p.clone()));
        }
    }
    Ok(())
}

/// Where `bundle build` finds check data by default: `check/`, else the
/// reference data `models/build` writes (`ref/`).
pub fn default_check_dir(model_dir: &Path) -> Option<PathBuf> {
    ["check", "ref"]
        .iter()
        .map(|d| model_dir.join(d))
        .find(|d| d.join("in").is_dir() && d.join("out").is_dir())
}

/// Builds a model bundle from a model folder.
pub fn build_model(
    model_dir: &Path,
    check: Option<&Path>,
    rollback: bool,
    min_daemon_version: &str,
    out: &Path,
) -> Result<BundleManifest, BundleError> {
    let m = Manifest::load(&model_dir.join("manifest.toml"))?;
    let mut files = vec![
        ("manifest.toml".to_string(), model_dir.join("manifest.toml")),
        (m.file.clone(), model_dir.join(&m.file)),
    ];
    if let Some(c) = check {
        check_files(c, &mut files)?;
    }
    write(
        BundleKind::Model,
        &m.name,
        &m.version,
        None,
        min_daemon_version,
        rollback,
        files,
        out,
    )
}

/// Builds a daemon bundle from a binary.
pub fn build_daemon(
    bin: &Path,
    target: &str,
    version: &str,
    min_daemon_version: &str,
    out: &Path,
) -> Result<BundleManifest, BundleError> {
    write(
        BundleKind::Daemon,
        "outpost",
        version,
        Some(target.to_string()),
        min_daemon_version,
        false,
        vec![("outpost".into(), bin.to_path_buf())],
        out,
    )
}

#[allow(clippy::too_many_arguments)]
fn write(
    kind: BundleKind,
    name: &str,
    version: &str,
    target: Option<String>,
    min_daemon_version: &str,
    rollback: bool,
    files: Vec<(String, PathBuf)>,
    out: &Path,
) -> Result<BundleManifest, BundleError> {
    if semver::Version::parse(version).is_err() {
        return Err(invalid(format!("version `{version}` is not semver")));
    }
    let mut listed = BTreeMap::new();
    for (rel, p) in &files {
        if !safe_rel(rel) || rel == MANIFEST {
            return Err(invalid(format!("bad file name in bundle: {rel}")));
        }
        listed.insert(rel.clone(), sha256_of(p)?);
    }
    let manifest = BundleManifest {
        format: 1,
        kind,
        name: name.to_string(),
        version: version.to_string(),
        target,
        min_daemon_version: min_daemon_version.to_string(),
        rollback,
        files: listed,
    };
    let json = serde_json::to_vec_pretty(&manifest).map_err(|e| invalid(e.to_string()))?;
    let tmp = out.with_extension("tar.tmp");
    let f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    let mut b = tar::Builder::new(f);
    b.mode(tar::HeaderMode::Deterministic);
    let mut h = tar::Header::new_gnu();
    h.set_size(json.len() as u64);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, MANIFEST, json.as_slice())
        .map_err(io(&tmp))?;
    for (rel, p) in &files {
        let mut f = std::fs::File::open(p).map_err(io(p))?;
        b.append_file(rel, &mut f).map_err(io(p))?;
    }
    let f = b.into_inner().map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    std::fs::rename(&tmp, out).map_err(io(out))?;
    Ok(manifest)
}

fn check_manifest(m: &BundleManifest) -> Result<(), BundleError> {
    if m.format != 1 {
        return Err(invalid(format!("bundle format {} unknown", m.format)));
    }
    if m.files.len() > MAX_FILES {
        return Err(invalid("too many files"));
    }
    for (rel, sha) in &m.files {
        if !safe_rel(rel) || rel == MANIFEST {
            return Err(invalid(format!("bad file name in bundle: {rel}")));
        }
        if sha.len() != 64 || !sha.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(invalid(format!("{rel}: bad sha256")));
        }
    }
    if m.kind == BundleKind::Model && !m.files.contains_key("manifest.toml") {
        return Err(invalid("model bundle without manifest.toml"));
    }
    Ok(())
}

fn read_json<R: Read>(e: &mut tar::Entry<R>) -> Result<BundleManifest, BundleError> {
    if e.size() > MANIFEST_MAX {
        return Err(invalid("manifest.json too large"));
    }
    let mut s = Vec::new();
    e.read_to_end(&mut s)
        .map_err(|e| invalid(format!("manifest.json: {e}")))?;
    let m: BundleManifest =
        serde_json::from_slice(&s).map_err(|e| invalid(format!("manifest.json: {e}")))?;
    check_manifest(&m)?;
    Ok(m)
}

/// Reads manifest.json (the first entry) without unpacking anything.
pub fn read_manifest(bundle: &Path) -> Result<BundleManifest, BundleError> {
    let f = std::fs::File::open(bundle).map_err(io(bundle))?;
    let mut a = tar::Archive::new(f);
    let mut entries = a.entries().map_err(io(bundle))?;
    let mut e = entries
        .next()
        .ok_or_else(|| invalid("empty bundle"))?
        .map_err(io(bundle))?;
    let path = e.path().map_err(io(bundle))?.to_string_lossy().into_owned();
    if path != MANIFEST {
        return Err(invalid(format!("first entry is `{path}`, not {MANIFEST}")));
    }
    read_json(&mut e)
}

/// Unpacks a (verified) bundle into `dest` (created; must not exist),
/// checking every file against manifest.json; fsyncs files and folders.
pub fn unpack(bundle: &Path, dest: &Path) -> Result<BundleManifest, BundleError> {
    let f = std::fs::File::open(bundle).map_err(io(bundle))?;
    let mut a = tar::Archive::new(f);
    let mut manifest: Option<BundleManifest> = None;
    let mut seen = BTreeMap::new();
    std::fs::create_dir_all(dest).map_err(io(dest))?;
    let mut dirs = vec![dest.to_path_buf()];
    for e in a.entries().map_err(io(bundle))? {
        let mut e = e.map_err(io(bundle))?;
        let rel = e.path().map_err(io(bundle))?.to_string_lossy().into_owned();
        let Some(m) = &manifest else {
            if rel != MANIFEST {
                return Err(invalid(format!("first entry is `{rel}`, not {MANIFEST}")));
            }
            manifest = Some(read_json(&mut e)?);
            continue;
        };
        if e.header().entry_type() != tar::EntryType::Regular {
            return Err(invalid(format!("{rel}: not a regular file")));
        }
        let Some(want) = m.files.get(&rel) else {
            return Err(invalid(format!("{rel}: not listed in manifest.json")));
        };
        if seen.contains_key(&rel) {
            return Err(invalid(format!("{rel}: twice in the bundle")));
        }
        let to = dest.join(&rel);
        if let Some(parent) = to.parent()
            && !dirs.iter().any(|d| d == parent)
        {
            std::fs::create_dir_all(parent).map_err(io(parent))?;
            dirs.push(parent.to_path_buf());
        }
        let mut out = std::fs::File::create(&to).map_err(io(&to))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let k = e.read(&mut buf).map_err(io(bundle))?;
            if k == 0 {
                break;
            }
            h.update(&buf[..k]);
            out.write_all(&buf[..k]).map_err(io(&to))?;
        }
        out.sync_all().map_err(io(&to))?;
        let got = hex::encode(h.finalize());
        if !got.eq_ignore_ascii_case(want) {
            return Err(invalid(format!(
                "{rel}: sha256 {got}, manifest.json says {want}"
            )));
        }
        seen.insert(rel, ());
    }
    let m = manifest.ok_or_else(|| invalid("empty bundle"))?;
    if let Some(missing) = m.files.keys().find(|k| !seen.contains_key(*k)) {
        return Err(invalid(format!("{missing}: listed but not in the bundle")));
    }
    for d in dirs.iter().rev() {
        crate::fsio::fsync_dir(d).map_err(io(d))?;
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_paths_only() {
        assert!(safe_rel("a/b.npy"));
        assert!(!safe_rel("../x"));
        assert!(!safe_rel("/etc/passwd"));
        assert!(!safe_rel("a/../../x"));
        assert!(!safe_rel(""));
    }

    fn daemon_bundle(dir: &Path) -> PathBuf {
        let bin = dir.join("bin");
        std::fs::write(&bin, b"\x7fELF not really").unwrap();
        let out = dir.join("d.tar");
        build_daemon(&bin, "x86_64-unknown-linux-gnu", "0.2.0", "0.1.0", &out).unwrap();
        out
    }

    #[test]
    fn build_read_and_unpack_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let out = daemon_bundle(dir.path());
        let m = read_manifest(&out).unwrap();
        assert_eq!(m.kind, BundleKind::Daemon);
        assert_eq!(m.target.as_deref(), Some("x86_64-unknown-linux-gnu"));
        let dest = dir.path().join("u");
        unpack(&out, &dest).unwrap();
        assert_eq!(
            std::fs::read(dest.join("outpost")).unwrap(),
            b"\x7fELF not really"
        );
    }

    #[test]
    fn unpack_refuses_an_altered_file() {
        let dir = tempfile::tempdir().unwrap();
        let out = daemon_bundle(dir.path());
        let mut bytes = std::fs::read(&out).unwrap();
        let at = bytes
            .windows(4)
            .position(|w| w == b"ELF ")
            .expect("payload in the tar");
        bytes[at] = b'X';
        std::fs::write(&out, bytes).unwrap();
        let err = unpack(&out, &dir.path().join("u")).unwrap_err();
        assert!(err.to_string().contains("sha256"), "{err}");
    }
}
