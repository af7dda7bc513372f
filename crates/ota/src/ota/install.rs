//! The files OTA owns and how they change without ever being half-written.
//!
//! ```text
//! <data_dir>/ota/state.json              installed + previous version per model,
//!                                        refused bundles, the journal of the update
//! <data_dir>/ota/downloads/<sha256>      a bundle, partial until verified
//! <data_dir>/ota/staging/<name>@<ver>/   being unpacked (garbage after a crash)
//! <data_dir>/ota/models/<name>@<ver>/<name>/   complete versions only
//! <model_dir>/<name> -> <data_dir>/ota/models/<name>@<ver>/<name>   what a start loads
//! ```
//!
//! - state.json is written to a temp file, fsynced, renamed over, and the
//!   folder fsynced: it is the old or the new document, never a mix.
//! - A version folder appears in `ota/models/` by rename(2) of a complete,
//!   fsynced staging folder. (The model folder inside is named like the
//!   model because a manifest's name must equal its folder's.)
//! - `<model_dir>/<name>` changes by rename(2) of a new symlink over the old
//!   one. The first time it is a real folder (the model as installed with the
//!   package): its files are first copied to `ota/models/<name>@<old>`, then
//!   the new link and the folder trade places in one renameat2(RENAME_EXCHANGE),
//!   so no instant exists without a complete `<model_dir>/<name>`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fsio::{fsync_dir, write_atomic};
use crate::model::manifest::Manifest;

/// What survives a restart.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StateFile {
    /// By model name.
    pub models: BTreeMap<String, Installed>,
    /// sha256 of bundles never to be tried again.
    pub refused: BTreeSet<String>,
    /// The update in progress (for recovery after a crash).
    pub journal: Option<Journal>,
    /// `issued_ms` of the last update command accepted (older ones are replays).
    pub last_command: Option<u64>,
    /// `issued_ms` of the last signed manifest document accepted (older
    /// ones are replays; plain ones are refused from then on).
    pub last_manifest: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Installed {
    pub version: String,
    pub previous: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Journal {
    pub name: String,
    pub version: String,
    pub sha256: String,
    pub phase: String,
}

/// The OTA folders of one device.
#[derive(Debug, Clone)]
pub struct Layout {
    pub root: PathBuf,
    pub model_dir: PathBuf,
}

/// Why a version could not be staged, kept or linked.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Bundle(#[from] super::bundle::BundleError),
    #[error("the bundle holds no `{0}` binary")]
    NoBinary(&'static str),
}

/// An I/O error with what was being done to which path.
pub(crate) fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> InstallError {
    let path = path.display().to_string();
    move |source| InstallError::Io { what, path, source }
}

impl Layout {
    pub fn new(data_dir: &Path, model_dir: &Path) -> Layout {
        Layout {
            root: data_dir.join("ota"),
            model_dir: model_dir.to_path_buf(),
        }
    }

    pub fn state_path(&self) -> PathBuf {
        self.root.join("state.json")
    }

    pub fn download(&self, sha256: &str) -> PathBuf {
        self.root.join("downloads").join(sha256)
    }

    pub fn staging(&self, name: &str, version: &str) -> PathBuf {
        self.root.join("staging").join(format!("{name}@{version}"))
    }

    pub fn version_dir(&self, name: &str, version: &str) -> PathBuf {
        self.root.join("models").join(format!("{name}@{version}"))
    }

    /// The model folder of a version (its manifest.toml is loaded from here).
    pub fn model_path(&self, name: &str, version: &str) -> PathBuf {
        self.version_dir(name, version).join(name)
    }

    pub fn link(&self, name: &str) -> PathBuf {
        self.model_dir.join(name)
    }

    pub fn load_state(&self) -> std::io::Result<StateFile> {
        match std::fs::read(self.state_path()) {
            Ok(b) => serde_json::from_slice(&b).map_err(std::io::Error::other),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(StateFile::default()),
            Err(e) => Err(e),
        }
    }

    pub fn save_state(&self, s: &StateFile) -> std::io::Result<()> {
        let b = serde_json::to_vec_pretty(s).map_err(std::io::Error::other)?;
        write_atomic(&self.state_path(), &b)
    }

    /// The version `<model_dir>/<name>` holds now (from its manifest).
    pub fn linked_version(&self, name: &str) -> Option<String> {
        Manifest::load(&self.link(name).join("manifest.toml"))
            .ok()
            .map(|m| m.version)
    }

    /// Moves a complete, fsynced staging folder into `ota/models/`.
    pub fn stage(&self, bundle: &Path, name: &str, version: &str) -> Result<PathBuf, InstallError> {
        let staging = self.staging(name, version);
        let dest = self.version_dir(name, version);
        // Leftovers of an earlier attempt are incomplete or unverified.
        let _ = std::fs::remove_dir_all(&staging);
        if dest.exists() {
            // A previous attempt completed the folder: it is complete by
            // construction, but redo it so its files are this bundle's.
            std::fs::remove_dir_all(&dest).map_err(io("removing", &dest))?;
        }
        super::bundle::unpack(bundle, &staging.join(name))?;
        fsync_dir(&staging).map_err(io("syncing", &staging))?;
        let parent = dest.parent().unwrap_or(&self.root);
        std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
        std::fs::rename(&staging, &dest).map_err(io("renaming to", &dest))?;
        fsync_dir(parent).map_err(io("syncing", parent))?;
        Ok(dest)
    }

    /// Copies the folder `<model_dir>/<name>` holds now to
    /// `ota/models/<name>@<version>` (once), so the previous version is kept
    /// whatever `<model_dir>/<name>` was.
    fn keep_current(&self, name: &str) -> Result<Option<String>, InstallError> {
        let Some(version) = self.linked_version(name) else {
            return Ok(None);
        };
        let dest = self.version_dir(name, &version);
        if dest.exists() {
            return Ok(Some(version));
        }
        let src = self.link(name);
        let tmp = self.staging(name, &format!("{version}.keep"));
        let _ = std::fs::remove_dir_all(&tmp);
        copy_dir(&src, &tmp.join(name)).map_err(io("copying", &src))?;
        let parent = dest.parent().unwrap_or(&self.root);
        std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
        std::fs::rename(&tmp, &dest).map_err(io("renaming to", &dest))?;
        fsync_dir(parent).map_err(io("syncing", parent))?;
        Ok(Some(version))
    }

    /// Points `<model_dir>/<name>` at `ota/models/<name>@<version>`
    /// atomically. Returns the version it held before.
    pub fn switch(&self, name: &str, version: &str) -> Result<Option<String>, InstallError> {
        let previous = self.keep_current(name)?;
        let target = self.model_path(name, version);
        let target = std::fs::canonicalize(&target).map_err(io("resolving", &target))?;
        let link = self.link(name);
        let tmp = self.model_dir.join(format!(".{name}.ota-link"));
        let _ = std::fs::remove_file(&tmp);
        let _ = std::fs::remove_dir_all(&tmp);
        std::os::unix::fs::symlink(&target, &tmp).map_err(io("linking", &tmp))?;
        let is_real_dir = std::fs::symlink_metadata(&link).is_ok_and(|m| m.is_dir());
        if is_real_dir {
            // rename(2) cannot put a symlink over a folder; trade places.
            rustix::fs::renameat_with(
                rustix::fs::CWD,
                &tmp,
                rustix::fs::CWD,
                &link,
                rustix::fs::RenameFlags::EXCHANGE,
            )
            .map_err(|e| io("exchanging it with", &link)(e.into()))?;
            fsync_dir(&self.model_dir).map_err(io("syncing", &self.model_dir))?;
            // `tmp` is now the old folder, already kept under ota/models.
            let _ = std::fs::remove_dir_all(&tmp);
        } else {
            std::fs::rename(&tmp, &link).map_err(io("renaming to", &link))?;
        }
        fsync_dir(&self.model_dir).map_err(io("syncing", &self.model_dir))?;
        Ok(previous)
    }

    /// Removes versions of `name` other than these; leftovers of crashes.
    pub fn prune(&self, name: &str, keep: &[&str]) {
        let dir = self.root.join("models");
        let prefix = format!("{name}@");
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let f = e.file_name().to_string_lossy().into_owned();
            if let Some(v) = f.strip_prefix(&prefix)
                && !keep.contains(&v)
            {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Removes what a crash can leave half-made: staging folders and the
    /// temporary link of an interrupted switch.
    pub fn clean_leftovers(&self) {
        let _ = std::fs::remove_dir_all(self.root.join("staging"));
        for e in std::fs::read_dir(&self.model_dir)
            .into_iter()
            .flatten()
            .flatten()
        {
            let f = e.file_name().to_string_lossy().into_owned();
            if f.starts_with('.') && f.ends_with(".ota-link") {
                let p = e.path();
                let _ = std::fs::remove_file(&p).or_else(|_| std::fs::remove_dir_all(&p));
            }
        }
    }
}

fn copy_dir(src: &Path, dst: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dst)?;
    for e in std::fs::read_dir(src)? {
        let e = e?;
        let to = dst.join(e.file_name());
        let ty = std::fs::metadata(e.path())?;
        if ty.is_dir() {
            copy_dir(&e.path(), &to)?;
        } else {
            std::fs::copy(e.path(), &to)?;
            std::fs::File::open(&to)?.sync_all()?;
        }
    }
    fsync_dir(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(dir: &Path, version: &str) {
        std::fs::create_dir_all(dir).unwrap();
        let text = format!(
            "name = \"m\"\nversion = \"{version}\"\nfile = \"m.onnx\"\nsha256 = \"{}\"\nsource = \"\"\nlicense = \"\"\n[[inputs]]\nname = \"x\"\ndtype = \"f32\"\nshape = [1]\n[[outputs]]\nname = \"y\"\ndtype = \"f32\"\nshape = [1]\n",
            "0".repeat(64)
        );
        std::fs::write(dir.join("manifest.toml"), text).unwrap();
        std::fs::write(dir.join("m.onnx"), b"x").unwrap();
    }

    fn version_at(l: &Layout) -> String {
        let t = std::fs::read_to_string(l.link("m").join("manifest.toml")).unwrap();
        toml::from_str::<toml::Value>(&t).unwrap()["version"]
            .as_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn switch_replaces_a_real_folder_then_a_link_and_keeps_the_previous() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(&d.path().join("data"), &d.path().join("models"));
        model(&l.link("m"), "1.0.0");
        model(&l.model_path("m", "1.1.0"), "1.1.0");
        assert_eq!(l.switch("m", "1.1.0").unwrap().as_deref(), Some("1.0.0"));
        assert!(std::fs::symlink_metadata(l.link("m")).unwrap().is_symlink());
        assert_eq!(version_at(&l), "1.1.0");
        assert!(l.model_path("m", "1.0.0").join("m.onnx").exists());
        model(&l.model_path("m", "1.2.0"), "1.2.0");
        assert_eq!(l.switch("m", "1.1.0").unwrap().as_deref(), Some("1.1.0"));
        assert_eq!(l.switch("m", "1.2.0").unwrap().as_deref(), Some("1.1.0"));
        assert_eq!(version_at(&l), "1.2.0");
        l.prune("m", &["1.2.0", "1.1.0"]);
        assert!(!l.version_dir("m", "1.0.0").exists());
        assert!(l.version_dir("m", "1.1.0").exists());
        // No leftovers in the model dir.
        let names: Vec<_> = std::fs::read_dir(&l.model_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["m"]);
    }

    #[test]
    fn state_file_round_trips_and_defaults_when_absent() {
        let d = tempfile::tempdir().unwrap();
        let l = Layout::new(d.path(), d.path());
        assert_eq!(l.load_state().unwrap(), StateFile::default());
        let mut s = StateFile::default();
        s.refused.insert("ab".into());
        s.journal = Some(Journal {
            name: "m".into(),
            version: "1.1.0".into(),
            sha256: "ab".into(),
            phase: "probation".into(),
        });
        l.save_state(&s).unwrap();
        assert_eq!(l.load_state().unwrap(), s);
        assert!(!l.state_path().with_extension("tmp").exists());
    }
}
