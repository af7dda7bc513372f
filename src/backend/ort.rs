//! ONNX Runtime, loaded at run time, and execution provider selection.
//!
//! The binary links no ONNX Runtime: `libonnxruntime` is dlopen'ed once per
//! process, so one build serves CPU gateways (the CPU wheel's library), GPU
//! servers and Jetson (JetPack's GPU build with the CUDA and TensorRT EPs).
//!
//! Search order for the library (first one that exists is used; an explicit
//! choice that fails is an error, never silently replaced):
//! 1. the config's `[runtime] onnxruntime` path (or `--onnxruntime`),
//! 2. `$ORT_DYLIB_PATH`,
//! 3. `lib/` beside the binary, then `../lib/outpost/` (the .deb layout),
//! 4. the system's library path (`libonnxruntime.so` through the dynamic loader).
//!
//! Provider selection: each model tries the configured providers in order in
//! a fresh session builder; the first that registers *and* commits serves it.
//! Every skipped provider is logged with the runtime's own reason.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use ort::ep::{self, ExecutionProvider};
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::session::{Session, SessionInputValue};

use super::binding::{DeviceBinding, Placement};
use super::{
    DType, Dim, InferenceSession, IoSpec, ModelIo, Provider, RunError, Tensor, check_inputs,
};

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
    env: ort::environment::Environment,
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
        let _g = LOAD_LOCK.lock().unwrap_or_else(|p| p.into_inner());
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

/// How the TensorRT provider builds and keeps its engines.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct TensorRtOptions {
    /// Allow fp16 kernels.
    pub fp16: bool,
    /// Allow int8 kernels; non-QDQ models need `int8_calibration_table`.
    pub int8: bool,
    /// Calibration table for int8 (TensorRT's or ONNX Runtime's format).
    pub int8_calibration_table: Option<PathBuf>,
    /// The table is TensorRT's own calibration cache format.
    pub int8_native_calibration_table: bool,
    /// Keep built engines under `<data_dir>/tensorrt/<model>@<version>/`, so a
    /// restart reuses them instead of spending minutes building again.
    pub engine_cache: bool,
    /// Keep TensorRT's timing cache beside the engines (faster rebuilds).
    pub timing_cache: bool,
    /// EPContext models: `off`; `dump` writes `<model>_ctx.onnx` with the engine
    /// beside it after the first build, and later starts load that precompiled
    /// model instead of rebuilding.
    pub ep_context: EpContextMode,
    /// Builder workspace limit in bytes (0: TensorRT's default).
    pub max_workspace_bytes: u64,
    /// CUDA device ordinal.
    pub device_id: i32,
}

impl Default for TensorRtOptions {
    fn default() -> Self {
        TensorRtOptions {
            fp16: false,
            int8: false,
            int8_calibration_table: None,
            int8_native_calibration_table: false,
            engine_cache: true,
            timing_cache: true,
            ep_context: EpContextMode::Dump,
            max_workspace_bytes: 0,
            device_id: 0,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EpContextMode {
    Off,
    Dump,
}

/// How sessions on the CUDA or TensorRT provider move data (`[runtime.cuda]`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CudaOptions {
    /// Bind inputs and outputs to buffers allocated once per session and
    /// input shape (device memory; pinned host memory for the copies), so a
    /// run allocates nothing and each output is copied back once.
    pub io_binding: bool,
    /// Record each input shape's run as a CUDA graph and replay it (ONNX
    /// Runtime's CUDA graph capture; the TensorRT provider's
    /// `trt_cuda_graph_enable`). For models with static shapes and no
    /// control flow (If, Loop); a model ONNX Runtime cannot capture is served
    /// without, the reason logged. Needs `io_binding`.
    pub cuda_graph: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            io_binding: true,
            cuda_graph: false,
        }
    }
}

/// Options every session gets.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    pub providers: Vec<Provider>,
    pub intra_threads: usize,
    pub tensorrt: TensorRtOptions,
    pub cuda_device_id: i32,
    pub cuda: CudaOptions,
    /// Root for engine caches (`<data_dir>/tensorrt`).
    pub cache_dir: PathBuf,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            providers: vec![Provider::Tensorrt, Provider::Cuda, Provider::Cpu],
            intra_threads: 1,
            tensorrt: TensorRtOptions::default(),
            cuda_device_id: 0,
            cuda: CudaOptions::default(),
            cache_dir: PathBuf::from("/var/lib/outpost/tensorrt"),
        }
    }
}

/// The engine cache folder of one model version.
pub fn engine_cache_dir(cache_dir: &Path, model: &str, version: &str) -> PathBuf {
    cache_dir.join(format!("{model}@{version}"))
}

/// The EPContext model the TensorRT provider dumps for a model version.
pub fn ep_context_path(cache_dir: &Path, model: &str, version: &str) -> PathBuf {
    engine_cache_dir(cache_dir, model, version).join(format!("{model}_ctx.onnx"))
}

/// TensorRT provider options as ONNX Runtime's key/value pairs. Kept free of
/// I/O so the mapping is tested on machines without a GPU.
pub fn tensorrt_provider_options(
    o: &TensorRtOptions,
    cache_dir: &Path,
    model: &str,
    version: &str,
) -> Vec<(String, String)> {
    let b = |v: bool| if v { "1" } else { "0" }.to_string();
    let dir = engine_cache_dir(cache_dir, model, version);
    let mut kv = vec![
        ("device_id".to_string(), o.device_id.to_string()),
        ("trt_fp16_enable".into(), b(o.fp16)),
        ("trt_int8_enable".into(), b(o.int8)),
        ("trt_engine_cache_enable".into(), b(o.engine_cache)),
    ];
    if o.int8 {
        if let Some(t) = &o.int8_calibration_table {
            // An absolute name is used as is; ONNX Runtime joins relative ones to the cache path.
            kv.push((
                "trt_int8_calibration_table_name".into(),
                t.display().to_string(),
            ));
        }
        kv.push((
            "trt_int8_use_native_calibration_table".into(),
            b(o.int8_native_calibration_table),
        ));
    }
    if o.engine_cache {
        kv.push(("trt_engine_cache_path".into(), dir.display().to_string()));
    }
    if o.timing_cache {
        kv.push(("trt_timing_cache_enable".into(), "1".into()));
        kv.push((
            "trt_timing_cache_path".into(),
            cache_dir.display().to_string(),
        ));
    }
    if o.ep_context == EpContextMode::Dump {
        kv.push(("trt_dump_ep_context_model".into(), "1".into()));
        kv.push((
            "trt_ep_context_file_path".into(),
            ep_context_path(cache_dir, model, version)
                .display()
                .to_string(),
        ));
        // 0: the engine lives in its own file beside the context model, not inside it.
        kv.push(("trt_ep_context_embed_mode".into(), "0".into()));
    }
    if o.max_workspace_bytes > 0 {
        kv.push((
            "trt_max_workspace_size".into(),
            o.max_workspace_bytes.to_string(),
        ));
    }
    kv
}

/// A provider that was tried and skipped, with the reason.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fallback {
    pub provider: Provider,
    pub reason: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("{path}: ONNX Runtime refused the model: {detail}")]
    Load { path: String, detail: String },
    #[error("{path}: no provider in [{tried}] could serve it")]
    NoProvider { path: String, tried: String },
    #[error("{path}: {detail}")]
    Unsupported { path: String, detail: String },
}

/// A model opened in ONNX Runtime with the provider that serves it.
pub struct OrtSession {
    session: Session,
    io: ModelIo,
    provider: Provider,
    pub fallbacks: Vec<Fallback>,
    /// Where runs go through I/O binding, and whether with CUDA graphs.
    bind: Option<(Placement, bool)>,
    /// The bound buffers, made at the first run.
    binding: Option<DeviceBinding>,
}

/// What identifies a model for caches and logs.
#[derive(Debug, Clone)]
pub struct ModelKey<'a> {
    pub name: &'a str,
    pub version: &'a str,
}

fn base_builder(rt: &Runtime, o: &SessionOptions) -> ort::Result<SessionBuilder> {
    Ok(Session::builder(&rt.env)?
        .with_optimization_level(GraphOptimizationLevel::All)?
        .with_intra_threads(o.intra_threads.max(1))?
        .with_inter_threads(1)?
        .with_parallel_execution(false)?)
}

/// Registers one provider on a builder, or says why it cannot serve here.
fn register(
    rt: &Runtime,
    p: Provider,
    b: &mut SessionBuilder,
    o: &SessionOptions,
    key: &ModelKey<'_>,
    graph: bool,
) -> Result<(), String> {
    if !rt.provider_available(p) {
        return Err(format!(
            "this ONNX Runtime build ({} at {}) has no {} execution provider",
            rt.info.version,
            rt.info.path,
            match p {
                Provider::Tensorrt => "TensorRT",
                Provider::Cuda => "CUDA",
                Provider::Cpu => "CPU",
            }
        ));
    }
    match p {
        Provider::Cpu => Ok(()),
        Provider::Cuda => ep::CUDA::default()
            .with_device_id(o.cuda_device_id)
            .with_cuda_graph(graph)
            .register(b)
            .map_err(|e| e.to_string()),
        Provider::Tensorrt => {
            if o.tensorrt.engine_cache {
                let dir = engine_cache_dir(&o.cache_dir, key.name, key.version);
                std::fs::create_dir_all(&dir)
                    .map_err(|e| format!("engine cache {}: {e}", dir.display()))?;
            }
            let mut trt = ep::TensorRT::default();
            for (k, v) in
                tensorrt_provider_options(&o.tensorrt, &o.cache_dir, key.name, key.version)
            {
                trt =
                    ep::ArbitrarilyConfigurableExecutionProvider::with_arbitrary_config(trt, k, v);
            }
            if graph {
                trt = trt.with_cuda_graph(true);
            }
            trt.register(b).map_err(|e| e.to_string())?;
            // Nodes TensorRT cannot take go to CUDA rather than the CPU when CUDA is there.
            if rt.provider_available(Provider::Cuda) {
                let _ = ep::CUDA::default()
                    .with_device_id(o.cuda_device_id)
                    .register(b);
            }
            Ok(())
        }
    }
}

impl OrtSession {
    /// Opens a model with the first provider in `o.providers` that serves it
    /// on this machine. A TensorRT EPContext model dumped by an earlier start
    /// is preferred when present (the engine is then not rebuilt).
    pub fn open(
        rt: &Runtime,
        path: &Path,
        key: &ModelKey<'_>,
        o: &SessionOptions,
    ) -> Result<OrtSession, SessionError> {
        let shown = path.display().to_string();
        let mut fallbacks = Vec::new();
        let mut last_load_error = None;
        for &p in &o.providers {
            let mut b = base_builder(rt, o).map_err(|e| SessionError::Load {
                path: shown.clone(),
                detail: e.to_string(),
            })?;
            // CUDA graphs where asked for; a model ONNX Runtime cannot
            // capture (control flow, nodes off the GPU) is served without.
            let mut graph = o.cuda.cuda_graph && o.cuda.io_binding && p != Provider::Cpu;
            if let Err(reason) = register(rt, p, &mut b, o, key, graph) {
                // A provider missing from the build is expected on CPU gateways (info);
                // one that is there but fails to register is worth a warning.
                if rt.provider_available(p) {
                    tracing::warn!(model = key.name, provider = %p, %reason, "execution provider failed to register, falling back");
                } else {
                    tracing::info!(model = key.name, provider = %p, %reason, "execution provider unavailable, falling back");
                }
                fallbacks.push(Fallback {
                    provider: p,
                    reason,
                });
                continue;
            }
            let ctx = ep_context_path(&o.cache_dir, key.name, key.version);
            if p == Provider::Tensorrt
                && o.tensorrt.ep_context == EpContextMode::Dump
                && ctx.exists()
            {
                match b.commit_from_file(&ctx) {
                    Ok(s) => {
                        let mut session = Self::finish(s, p, fallbacks, &shown)?;
                        session.configure_binding(o, graph, key.name);
                        return Ok(session);
                    }
                    Err(e) => {
                        tracing::warn!(model = key.name, context = %ctx.display(), error = %e, "precompiled EPContext model unusable, building from the source model");
                        b = base_builder(rt, o).map_err(|e| SessionError::Load {
                            path: shown.clone(),
                            detail: e.to_string(),
                        })?;
                        if let Err(reason) = register(rt, p, &mut b, o, key, graph) {
                            fallbacks.push(Fallback {
                                provider: p,
                                reason,
                            });
                            continue;
                        }
                    }
                }
            }
            let mut committed = b.commit_from_file(path);
            if graph && let Err(e) = &committed {
                tracing::warn!(model = key.name, provider = %p, reason = %e, "CUDA graph capture refused for this model; serving it without CUDA graphs");
                graph = false;
                let mut b = base_builder(rt, o).map_err(|e| SessionError::Load {
                    path: shown.clone(),
                    detail: e.to_string(),
                })?;
                committed = match register(rt, p, &mut b, o, key, false) {
                    Ok(()) => b.commit_from_file(path),
                    Err(reason) => Err(ort::Error::new(reason)),
                };
            }
            match committed {
                Ok(s) => {
                    let mut session = Self::finish(s, p, fallbacks, &shown)?;
                    session.configure_binding(o, graph, key.name);
                    return Ok(session);
                }
                Err(e) => {
                    let detail = e.to_string();
                    if p == Provider::Cpu {
                        // The CPU provider runs every standard operator: a failure here is the model's.
                        return Err(SessionError::Load {
                            path: shown,
                            detail,
                        });
                    }
                    tracing::warn!(model = key.name, provider = %p, reason = %detail, "execution provider could not take the model, falling back");
                    fallbacks.push(Fallback {
                        provider: p,
                        reason: detail.clone(),
                    });
                    last_load_error = Some(detail);
                }
            }
        }
        match last_load_error {
            Some(detail) => Err(SessionError::Load {
                path: shown,
                detail,
            }),
            None => Err(SessionError::NoProvider {
                path: shown,
                tried: o
                    .providers
                    .iter()
                    .map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    fn finish(
        session: Session,
        provider: Provider,
        fallbacks: Vec<Fallback>,
        shown: &str,
    ) -> Result<OrtSession, SessionError> {
        let conv = |outlets: &[ort::value::Outlet]| -> Result<Vec<IoSpec>, SessionError> {
            outlets
                .iter()
                .map(|o| {
                    let ort::value::ValueType::Tensor {
                        ty,
                        shape,
                        dimension_symbols,
                    } = o.dtype()
                    else {
                        return Err(SessionError::Unsupported {
                            path: shown.to_string(),
                            detail: format!("`{}` is not a tensor ({:?})", o.name(), o.dtype()),
                        });
                    };
                    let dtype = DType::from_ort(*ty).ok_or_else(|| SessionError::Unsupported {
                        path: shown.to_string(),
                        detail: format!(
                            "`{}` has element type {ty:?}, which outpost does not handle",
                            o.name()
                        ),
                    })?;
                    let shape = shape
                        .iter()
                        .zip(dimension_symbols.iter())
                        .enumerate()
                        .map(|(i, (d, sym))| {
                            if *d >= 0 {
                                Dim::Fixed(*d as u64)
                            } else if sym.is_empty() {
                                Dim::Symbolic(format!("d{i}"))
                            } else {
                                Dim::Symbolic(sym.clone())
                            }
                        })
                        .collect();
                    Ok(IoSpec {
                        name: o.name().to_string(),
                        dtype,
                        shape,
                    })
                })
                .collect()
        };
        let io = ModelIo {
            inputs: conv(session.inputs())?,
            outputs: conv(session.outputs())?,
        };
        if !fallbacks.is_empty() {
            tracing::info!(model = shown, provider = %provider, "served by fallback provider");
        }
        Ok(OrtSession {
            session,
            io,
            provider,
            fallbacks,
            bind: None,
            binding: None,
        })
    }

    /// GPU sessions run through I/O binding unless `[runtime.cuda]
    /// io_binding = false`.
    fn configure_binding(&mut self, o: &SessionOptions, graph: bool, model: &str) {
        if self.provider == Provider::Cpu || !o.cuda.io_binding {
            return;
        }
        tracing::info!(model, provider = %self.provider, cuda_graph = graph, "inputs and outputs bound to device buffers");
        self.bind = Some((Placement::Cuda(o.cuda_device_id), graph));
    }

    /// Runs this session through I/O binding with buffers at `placement`
    /// from the next run on (CPU sessions use host buffers: the same code
    /// path, testable without a GPU).
    pub fn bind_buffers(&mut self, placement: Placement) {
        self.bind = Some((placement, false));
        self.binding = None;
    }

    /// Whether runs go through I/O binding, and with CUDA graphs.
    pub fn binding_mode(&self) -> Option<(Placement, bool)> {
        self.bind
    }

    /// The bound buffers, made if needed (None when runs are not bound).
    pub fn binding(&mut self) -> Result<Option<&mut DeviceBinding>, RunError> {
        let Some((placement, graph)) = self.bind else {
            return Ok(None);
        };
        if self.binding.is_none() {
            let b = DeviceBinding::new(&self.session, placement, graph)
                .map_err(|e| RunError::Engine(e.to_string()))?;
            self.binding = Some(b);
        }
        Ok(self.binding.as_mut())
    }

    /// A bound run whose input `device_input` is written on the device by
    /// `fill` (given the buffer's device address and size in bytes), the
    /// others uploaded from `data`. `shapes` names every input.
    pub fn run_bound_filled(
        &mut self,
        shapes: &[(&str, DType, &[usize])],
        data: &[(&str, &Tensor)],
        device_input: &str,
        fill: &mut dyn FnMut(u64, usize) -> Result<(), String>,
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        let Some((placement, graph)) = self.bind else {
            return Err(RunError::Engine("session is not bound".into()));
        };
        if self.binding.is_none() {
            let b = DeviceBinding::new(&self.session, placement, graph)
                .map_err(|e| RunError::Engine(e.to_string()))?;
            self.binding = Some(b);
        }
        let (Some(binding), session) = (self.binding.as_mut(), &mut self.session) else {
            return Err(RunError::Engine("session is not bound".into()));
        };
        let (ptr, len) = binding
            .input_buffer(shapes, device_input)
            .map_err(|e| RunError::Engine(e.to_string()))?;
        fill(ptr as u64, len).map_err(RunError::Engine)?;
        binding
            .run(session, shapes, data)
            .map_err(|e| RunError::Engine(e.to_string()))
    }

    /// A bound run: uploads `inputs`, runs, copies the outputs back.
    fn run_bound(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<(String, Tensor)>, RunError> {
        let shapes: Vec<(&str, DType, &[usize])> = inputs
            .iter()
            .map(|(n, t)| (*n, t.dtype(), t.shape()))
            .collect();
        let Some((placement, graph)) = self.bind else {
            return Err(RunError::Engine("session is not bound".into()));
        };
        if self.binding.is_none() {
            let b = DeviceBinding::new(&self.session, placement, graph)
                .map_err(|e| RunError::Engine(e.to_string()))?;
            self.binding = Some(b);
        }
        let (Some(binding), session) = (self.binding.as_mut(), &mut self.session) else {
            return Err(RunError::Engine("session is not bound".into()));
        };
        binding
            .run(session, &shapes, inputs)
            .map_err(|e| RunError::Engine(e.to_string()))
    }

    /// Runs inputs the caller has already checked against a spec at least as
    /// strict as this session's (a model's manifest, held to the model at
    /// load), so the per-frame path checks once.
    pub fn run_prechecked(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        if self.bind.is_some() {
            return self.run_bound(inputs);
        }
        let mut values: Vec<(std::borrow::Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(inputs.len());
        for (n, t) in inputs {
            values.push((
                (*n).into(),
                input_view(t).map_err(|e| RunError::Engine(e.to_string()))?,
            ));
        }
        let outputs = self
            .session
            .run(values)
            .map_err(|e| RunError::Engine(e.to_string()))?;
        let mut out = Vec::with_capacity(outputs.len());
        for (name, v) in outputs.iter() {
            let t = Tensor::from_ort(&v)
                .map_err(|e| RunError::Engine(format!("output `{name}`: {e}")))?;
            out.push((name.to_string(), t));
        }
        Ok(out)
    }

    /// The raw session, for hot loops that prepare their own values.
    pub fn raw(&mut self) -> &mut Session {
        &mut self.session
    }
}

/// Borrows a tensor as an ONNX Runtime input without copying it.
pub fn input_view(t: &Tensor) -> ort::Result<SessionInputValue<'_>> {
    fn view<T: ort::value::PrimitiveTensorElementType + Clone + std::fmt::Debug + 'static>(
        a: &ndarray::ArrayD<T>,
    ) -> ort::Result<SessionInputValue<'_>> {
        if a.is_standard_layout() {
            Ok(ort::value::TensorRef::from_array_view(a.view())?.into())
        } else {
            Ok(ort::value::Tensor::from_array(a.as_standard_layout().into_owned())?.into())
        }
    }
    match t {
        Tensor::F32(a) => view(a),
        Tensor::F16(a) => view(a),
        Tensor::F64(a) => view(a),
        Tensor::I64(a) => view(a),
        Tensor::I32(a) => view(a),
        Tensor::I8(a) => view(a),
        Tensor::U8(a) => view(a),
        Tensor::Bool(a) => view(a),
    }
}

impl InferenceSession for OrtSession {
    fn io(&self) -> &ModelIo {
        &self.io
    }

    fn provider(&self) -> Provider {
        self.provider
    }

    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<(String, Tensor)>, RunError> {
        check_inputs(&self.io, inputs.iter().map(|(n, t)| (*n, *t)))?;
        self.run_prechecked(inputs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensorrt_options_cover_precision_caches_and_ep_context() {
        let o = TensorRtOptions {
            fp16: true,
            int8: true,
            int8_calibration_table: Some(PathBuf::from("/etc/outpost/calib.table")),
            ..Default::default()
        };
        let kv =
            tensorrt_provider_options(&o, Path::new("/var/lib/outpost/tensorrt"), "det", "1.2.0");
        let get = |k: &str| kv.iter().find(|(kk, _)| kk == k).map(|(_, v)| v.as_str());
        assert_eq!(get("trt_fp16_enable"), Some("1"));
        assert_eq!(get("trt_int8_enable"), Some("1"));
        assert_eq!(
            get("trt_int8_calibration_table_name"),
            Some("/etc/outpost/calib.table")
        );
        assert_eq!(get("trt_engine_cache_enable"), Some("1"));
        assert_eq!(
            get("trt_engine_cache_path"),
            Some("/var/lib/outpost/tensorrt/det@1.2.0")
        );
        assert_eq!(get("trt_dump_ep_context_model"), Some("1"));
        assert_eq!(
            get("trt_ep_context_file_path"),
            Some("/var/lib/outpost/tensorrt/det@1.2.0/det_ctx.onnx")
        );
        assert_eq!(get("trt_ep_context_embed_mode"), Some("0"));

        let off = TensorRtOptions {
            engine_cache: false,
            ep_context: EpContextMode::Off,
            timing_cache: false,
            ..Default::default()
        };
        let kv = tensorrt_provider_options(&off, Path::new("/c"), "m", "1");
        assert!(
            kv.iter()
                .all(|(k, _)| k != "trt_engine_cache_path" && k != "trt_dump_ep_context_model")
        );
        assert!(
            kv.iter()
                .all(|(k, _)| k != "trt_int8_calibration_table_name")
        );
    }

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
