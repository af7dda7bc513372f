//! Session options (threads, CUDA, TensorRT and its caches) and registering
//! the configured execution providers on a session builder.

use std::path::{Path, PathBuf};

use ort::ep::{self, ExecutionProvider};
use ort::session::Session;
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};

use super::*;
use crate::backend::Provider;

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

pub(super) fn base_builder(rt: &Runtime, o: &SessionOptions) -> ort::Result<SessionBuilder> {
    Ok(Session::builder(&rt.env)?
        .with_optimization_level(GraphOptimizationLevel::All)?
        .with_intra_threads(o.intra_threads.max(1))?
        .with_inter_threads(1)?
        .with_parallel_execution(false)?)
}

/// Why an execution provider cannot serve here.
#[derive(Debug, thiserror::Error)]
pub(super) enum RegisterError {
    #[error("this ONNX Runtime build ({version} at {path}) has no {provider} execution provider")]
    Unavailable {
        version: String,
        path: String,
        provider: &'static str,
    },
    #[error("engine cache {dir}: {source}")]
    EngineCache { dir: String, source: std::io::Error },
    #[error("{0}")]
    Ort(#[from] ort::Error),
}

/// Registers one provider on a builder, or says why it cannot serve here.
pub(super) fn register(
    rt: &Runtime,
    p: Provider,
    b: &mut SessionBuilder,
    o: &SessionOptions,
    key: &ModelKey<'_>,
    graph: bool,
) -> Result<(), RegisterError> {
    if !rt.provider_available(p) {
        return Err(RegisterError::Unavailable {
            version: rt.info.version.clone(),
            path: rt.info.path.clone(),
            provider: match p {
                Provider::Tensorrt => "TensorRT",
                Provider::Cuda => "CUDA",
                Provider::Cpu => "CPU",
            },
        });
    }
    match p {
        Provider::Cpu => Ok(()),
        Provider::Cuda => ep::CUDA::default()
            .with_device_id(o.cuda_device_id)
            .with_cuda_graph(graph)
            .register(b)
            .map_err(RegisterError::from),
        Provider::Tensorrt => {
            if o.tensorrt.engine_cache {
                let dir = engine_cache_dir(&o.cache_dir, key.name, key.version);
                std::fs::create_dir_all(&dir).map_err(|source| RegisterError::EngineCache {
                    dir: dir.display().to_string(),
                    source,
                })?;
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
            trt.register(b)?;
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
}
