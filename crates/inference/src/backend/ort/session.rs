//! A loaded model's ONNX Runtime session: built with the first provider
//! that registers and commits, its inputs and outputs, and its runs.

use std::path::Path;

use ort::session::{Session, SessionInputValue};

use super::providers::{base_builder, register};
use super::*;
use crate::backend::binding::{DeviceBinding, Placement};
use crate::backend::{
    DType, Dim, InferenceSession, IoSpec, ModelIo, Provider, RunError, Tensor, check_inputs,
};

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
                    reason: reason.to_string(),
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
                                reason: reason.to_string(),
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
                    Err(reason) => Err(ort::Error::new(reason.to_string())),
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
        fill: &mut dyn FnMut(u64, usize) -> Result<(), Box<dyn std::error::Error + Send + Sync>>,
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
        fill(ptr as u64, len).map_err(|e| RunError::Engine(e.to_string()))?;
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
    pub(super) fn raw(&mut self) -> &mut Session {
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
        OrtSession::run_prechecked(self, inputs)
    }

    fn run_prechecked(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        OrtSession::run_prechecked(self, inputs)
    }

    fn as_ort(&mut self) -> Option<&mut OrtSession> {
        Some(self)
    }
}
