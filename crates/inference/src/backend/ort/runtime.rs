//! Finding and loading `libonnxruntime` (the search order is in `mod.rs`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use ort::ep::{self, ExecutionProvider};
use parking_lot::Mutex;

use crate::backend::Provider;

/// The ONNX Runtime API version this build needs: the crate feature
/// `ort-api-N` it was built with (31 by default, see Cargo.toml).
pub const REQUIRED_API: u32 = ort::MINOR_VERSION;
const LIB_NAME: &str = "libonnxruntime.so";

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "ONNX Runtime 1.{api} or newer not found. Looked for {LIB_NAME} in this order:\n{searched}\n\
         To get one: run `models/fetch --lib-only` (it puts the CPU build in models/lib/<arch>/), then either\n\
         set ORT_DYLIB_PATH=models/lib/$(uname -m)/{LIB_NAME}, set `onnxruntime = \"PATH\"` under [runtime] in the config,\n\
         or copy it into a lib/ folder beside the outpost binary. On Jetson, JetPack's onnxruntime-gpu\n\
         (with the CUDA and TensorRT providers) serves as well.",
        api = REQUIRED_API
    )]
    NotFound { searched: String },
    #[error(
        "ONNX Runtime at {path} ({source_name}) cannot be used: {detail}\n\
         This build needs ONNX Runtime 1.{api} or newer; `models/fetch --lib-only` fetches 1.31.1.",
        api = REQUIRED_API
    )]
    Unusable {
        path: String,
        source_name: String,
        detail: String,
    },
    #[error("ONNX Runtime environment: {0}")]
    Environment(String),
}

/// Where a loaded runtime came from, for `models inspect` and logs.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RuntimeInfo {
    pub path: String,
    pub found_by: String,
    pub version: String,
}

/// The process-wide ONNX Runtime: the loaded library and its environment.
pub struct Runtime {
    pub(super) env: ort::environment::Environment,
    pub info: RuntimeInfo,
}

static RUNTIME: OnceLock<Arc<Runtime>> = OnceLock::new();
static LOAD_LOCK: Mutex<()> = Mutex::new(());

/// One place the library may be.
struct Candidate {
    found_by: String,
    path: PathBuf,
    /// Explicitly chosen by the user: failure is an error, not a skip.
    explicit: bool,
    /// Resolved by the dynamic loader, so existence cannot be checked first.
    system: bool,
}

fn candidates(configured: Option<&Path>) -> Vec<Candidate> {
    let mut c = Vec::new();
    if let Some(p) = configured {
        c.push(Candidate {
            found_by: "config [runtime] onnxruntime".into(),
            path: p.into(),
            explicit: true,
            system: false,
        });
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        c.push(Candidate {
            found_by: "$ORT_DYLIB_PATH".into(),
            path: p.into(),
            explicit: true,
            system: false,
        });
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        c.push(Candidate {
            found_by: "lib/ beside the binary".into(),
            path: dir.join("lib").join(LIB_NAME),
            explicit: false,
            system: false,
        });
        c.push(Candidate {
            found_by: "../lib/outpost/ beside the binary".into(),
            path: dir.join("../lib/outpost").join(LIB_NAME),
            explicit: false,
            system: false,
        });
    }
    c.push(Candidate {
        found_by: "the system library path".into(),
        path: PathBuf::from(LIB_NAME),
        explicit: false,
        system: true,
    });
    c
}

impl Runtime {
    /// Loads ONNX Runtime once per process; later calls return the same one.
    pub fn load(configured: Option<&Path>) -> Result<Arc<Runtime>, RuntimeError> {
        if let Some(rt) = RUNTIME.get() {
            return Ok(rt.clone());
        }
        // Serialise first loads: ort keeps one library per process.
        let _g = LOAD_LOCK.lock();
        if let Some(rt) = RUNTIME.get() {
            return Ok(rt.clone());
        }
        let mut searched = Vec::new();
        for (i, c) in candidates(configured).into_iter().enumerate() {
            let shown = c.path.display().to_string();
            if !c.system && !c.path.exists() {
                searched.push(format!(
                    "  {}. {} ({}): no such file",
                    i + 1,
                    shown,
                    c.found_by
                ));
                if c.explicit {
                    return Err(RuntimeError::Unusable {
                        path: shown,
                        source_name: c.found_by,
                        detail: "no such file".into(),
                    });
                }
                continue;
            }
            // ort resolves a relative path against the binary's folder first;
            // make paths from the user absolute against the working directory.
            let path = if c.system || c.path.is_absolute() {
                c.path.clone()
            } else {
                std::env::current_dir()
                    .map(|d| d.join(&c.path))
                    .unwrap_or(c.path.clone())
            };
            match ort::init_from(&path) {
                Ok(builder) => {
                    let env = builder
                        .with_name("outpost")
                        .with_telemetry(false)
                        .build()
                        .map_err(|e| RuntimeError::Environment(e.to_string()))?;
                    let version = library_version(&path)
                        .unwrap_or_else(|| version_from_build_info(ort::info()));
                    let info = RuntimeInfo {
                        path: path.display().to_string(),
                        found_by: c.found_by,
                        version,
                    };
                    tracing::info!(path = %info.path, version = %info.version, found_by = %info.found_by, "ONNX Runtime loaded");
                    let rt = Arc::new(Runtime { env, info });
                    let _ = RUNTIME.set(rt.clone());
                    return Ok(rt);
                }
                Err(e) => {
                    let detail = e.to_string();
                    let bad_version = matches!(e, ort::LoadDynamicError::BadVersion { .. });
                    if c.explicit || bad_version {
                        return Err(RuntimeError::Unusable {
                            path: shown,
                            source_name: c.found_by,
                            detail,
                        });
                    }
                    searched.push(format!(
                        "  {}. {} ({}): {}",
                        i + 1,
                        shown,
                        c.found_by,
                        detail
                    ));
                }
            }
        }
        Err(RuntimeError::NotFound {
            searched: searched.join("\n"),
        })
    }

    /// The ONNX Runtime environment sessions are created in.
    pub fn env(&self) -> &ort::environment::Environment {
        &self.env
    }

    /// Providers compiled into this ONNX Runtime build.
    pub fn provider_available(&self, p: Provider) -> bool {
        match p {
            Provider::Cpu => true,
            Provider::Cuda => ep::CUDA::is_available().unwrap_or(false),
            Provider::Tensorrt => ep::TensorRT::is_available().unwrap_or(false),
        }
    }
}

/// The library's own version string (`OrtGetApiBase()->GetVersionString()`).
/// The library is already loaded by ort; opening it again only bumps the
/// loader's reference count.
fn library_version(path: &Path) -> Option<String> {
    // SAFETY: the library was just loaded successfully by ort from this same
    // path, so its initialisers have run; OrtGetApiBase is a plain C function
    // returning a pointer to a static struct whose GetVersionString returns a
    // static NUL-terminated string.
    unsafe {
        let lib = libloading::Library::new(path).ok()?;
        let get: libloading::Symbol<unsafe extern "C" fn() -> *const ort::sys::OrtApiBase> =
            lib.get(b"OrtGetApiBase").ok()?;
        let base = get();
        if base.is_null() {
            return None;
        }
        let s = ((*base).GetVersionString)();
        if s.is_null() {
            return None;
        }
        Some(std::ffi::CStr::from_ptr(s).to_string_lossy().into_owned())
    }
}

/// `ort::info()` reads like "ORT Build Info: git-branch=rel-1.31.1, git-commit-id=...".
fn version_from_build_info(info: &str) -> String {
    info.split(|c: char| c == ',' || c.is_whitespace())
        .find_map(|part| part.strip_prefix("git-branch=rel-"))
        .map(str::to_string)
        .unwrap_or_else(|| format!("1.{}+", REQUIRED_API))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_parsed_from_build_info() {
        assert_eq!(
            version_from_build_info(
                "ORT Build Info: git-branch=rel-1.31.1, git-commit-id=abc, build type=Release"
            ),
            "1.31.1"
        );
    }
}
