//! I/O binding: the inputs and outputs of a CUDA or TensorRT session live in
//! buffers bound to the session once, not in values handed to each run.
//!
//! Invariants:
//! - Every input and output has one buffer per set of input shapes,
//!   allocated when that set is first seen and reused by every later run of
//!   it; a run with other shapes replaces them. The steady state allocates
//!   nothing per run.
//! - An input travels host tensor → pinned staging buffer (a memcpy) → its
//!   device buffer (one copy, finished before the run). An output is copied
//!   back once, into a pinned buffer the returned tensor is read from.
//! - With CUDA graphs, ONNX Runtime records the first runs of a shape set
//!   and from then on replays the recording, which reads and writes the
//!   device addresses it was recorded with. So outputs are bound to device
//!   buffers of their own (never to memory ONNX Runtime may move), each shape
//!   set gets its own graph id (`gpu_graph_id`), and the one run that
//!   discovers the output shapes of a new set runs outside any graph (-1).
//! - GPU preprocessing writes straight into an input's device buffer
//!   ([`DeviceBinding::input_buffer`]); such an input is then not uploaded.
//!
//! The same code binds CPU buffers for a CPU session ([`Placement::Cpu`]),
//! which is how it is tested on machines without a GPU.

use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::{IoBinding, RunOptions, Session};
use ort::value::{DynTensor, TensorElementType};

use super::{DType, Tensor};

/// Where the bound buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Host memory (CPU sessions; tests).
    Cpu,
    /// Memory of CUDA device `n`, with pinned host memory for the copies.
    Cuda(i32),
}

#[derive(Debug, thiserror::Error)]
pub enum BindingError {
    #[error("I/O binding: {0}")]
    Ort(#[from] ort::Error),
    #[error("I/O binding: input `{name}`: {detail}")]
    Input { name: String, detail: String },
    #[error("I/O binding: output `{name}`: {detail}")]
    Output { name: String, detail: String },
}

struct BoundInput {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    /// The buffer the session reads.
    device: DynTensor,
    /// Pinned host memory the input is staged in (None when `device` is host memory).
    staging: Option<DynTensor>,
}

struct BoundOutput {
    name: String,
    /// The buffer the session writes (device memory with CUDA graphs, pinned host memory otherwise).
    bound: DynTensor,
    /// Pinned host copy of `bound` when `bound` is device memory.
    host: Option<DynTensor>,
}

/// The bound buffers of one session.
pub struct DeviceBinding {
    placement: Placement,
    graph: bool,
    binding: IoBinding,
    device: Allocator,
    pinned_in: Option<Allocator>,
    pinned_out: Option<Allocator>,
    inputs: Vec<BoundInput>,
    outputs: Vec<BoundOutput>,
    output_names: Vec<String>,
    /// Input shape sets in the order first seen; the index is the graph id.
    shape_sets: Vec<Vec<Vec<usize>>>,
    run_options: RunOptions,
    /// Buffer allocations so far (a test checks runs of one shape add none).
    pub allocations: u64,
}

fn element_type(d: DType) -> TensorElementType {
    match d {
        DType::F32 => TensorElementType::Float32,
        DType::F16 => TensorElementType::Float16,
        DType::F64 => TensorElementType::Float64,
        DType::I64 => TensorElementType::Int64,
        DType::I32 => TensorElementType::Int32,
        DType::I8 => TensorElementType::Int8,
        DType::U8 => TensorElementType::Uint8,
        DType::Bool => TensorElementType::Bool,
    }
}

/// The elements of a standard-layout tensor as bytes.
fn tensor_bytes(t: &Tensor) -> Option<&[u8]> {
    fn bytes<T>(a: &ndarray::ArrayD<T>) -> Option<&[u8]> {
        let s = a.as_slice()?;
        // SAFETY: a slice of plain numeric elements (f32, f16, f64, i64, i32,
        // i8, u8, bool) read as the bytes that make it up; the length is the
        // slice's size in bytes and the lifetime is the array's.
        Some(unsafe {
            std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s))
        })
    }
    match t {
        Tensor::F32(a) => bytes(a),
        Tensor::F16(a) => bytes(a),
        Tensor::F64(a) => bytes(a),
        Tensor::I64(a) => bytes(a),
        Tensor::I32(a) => bytes(a),
        Tensor::I8(a) => bytes(a),
        Tensor::U8(a) => bytes(a),
        Tensor::Bool(a) => bytes(a),
    }
}

/// Why an input's bytes cannot be copied into its staging buffer.
#[derive(Debug, thiserror::Error)]
enum HostCopyError {
    #[error("staging buffer is not host memory")]
    NotHost,
    #[error("{given} bytes for a {buffer}-byte buffer")]
    Size { given: usize, buffer: usize },
}

/// Copies `src` into the host-accessible tensor `dst` of the same byte size.
fn write_host(dst: &mut DynTensor, src: &[u8]) -> Result<(), HostCopyError> {
    let n = dst.memory_info().is_cpu_accessible();
    if !n {
        return Err(HostCopyError::NotHost);
    }
    let len = tensor_byte_len(dst);
    if len != src.len() {
        return Err(HostCopyError::Size {
            given: src.len(),
            buffer: len,
        });
    }
    // SAFETY: `dst` is host-accessible memory of exactly `len` bytes owned by
    // the tensor, which nothing else reads while this copy runs.
    unsafe {
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst.data_ptr_mut().cast::<u8>(), len);
    }
    Ok(())
}

fn tensor_byte_len(t: &DynTensor) -> usize {
    let n: i64 = t.shape().iter().product();
    let size = match t.data_type() {
        TensorElementType::Float64 | TensorElementType::Int64 => 8,
        TensorElementType::Float32 | TensorElementType::Int32 => 4,
        TensorElementType::Float16 => 2,
        _ => 1,
    };
    n.max(0) as usize * size
}

impl DeviceBinding {
    /// Binds nothing yet: buffers come with the first run.
    pub fn new(session: &Session, placement: Placement, graph: bool) -> Result<Self, BindingError> {
        let (device, pinned_in, pinned_out) = match placement {
            Placement::Cpu => (
                Allocator::new(
                    session,
                    MemoryInfo::new(
                        AllocationDevice::CPU,
                        0,
                        AllocatorType::Device,
                        MemoryType::Default,
                    )?,
                )?,
                None,
                None,
            ),
            Placement::Cuda(id) => (
                Allocator::new(
                    session,
                    MemoryInfo::new(
                        AllocationDevice::CUDA,
                        id,
                        AllocatorType::Device,
                        MemoryType::Default,
                    )?,
                )?,
                Some(Allocator::new(
                    session,
                    MemoryInfo::new(
                        AllocationDevice::CUDA_PINNED,
                        id,
                        AllocatorType::Device,
                        MemoryType::CPUInput,
                    )?,
                )?),
                Some(Allocator::new(
                    session,
                    MemoryInfo::new(
                        AllocationDevice::CUDA_PINNED,
                        id,
                        AllocatorType::Device,
                        MemoryType::CPUOutput,
                    )?,
                )?),
            ),
        };
        Ok(DeviceBinding {
            placement,
            graph: graph && placement != Placement::Cpu,
            binding: session.create_binding()?,
            device,
            pinned_in,
            pinned_out,
            inputs: Vec::new(),
            outputs: Vec::new(),
            output_names: session
                .outputs()
                .iter()
                .map(|o| o.name().to_string())
                .collect(),
            shape_sets: Vec::new(),
            run_options: RunOptions::new()?,
            allocations: 0,
        })
    }

    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Makes sure the inputs have buffers of these shapes; returns the
    /// graph id of the shape set and whether it is new.
    fn prepare(
        &mut self,
        inputs: &[(&str, DType, &[usize])],
    ) -> Result<(usize, bool), BindingError> {
        let same = self.inputs.len() == inputs.len()
            && self
                .inputs
                .iter()
                .zip(inputs)
                .all(|(b, (n, d, s))| b.name == *n && b.dtype == *d && b.shape == *s);
        let set: Vec<Vec<usize>> = inputs.iter().map(|(_, _, s)| s.to_vec()).collect();
        let id = match self.shape_sets.iter().position(|s| *s == set) {
            Some(i) => i,
            None => {
                self.shape_sets.push(set);
                self.shape_sets.len() - 1
            }
        };
        if same {
            return Ok((id, false));
        }
        self.binding.clear();
        self.inputs.clear();
        self.outputs.clear();
        for (name, dtype, shape) in inputs {
            let et = element_type(*dtype);
            let device = DynTensor::new(&self.device, et, shape.to_vec())?;
            let staging = match &self.pinned_in {
                Some(p) => Some(DynTensor::new(p, et, shape.to_vec())?),
                None => None,
            };
            self.allocations += 1 + staging.is_some() as u64;
            self.binding.bind_input(*name, &device)?;
            self.inputs.push(BoundInput {
                name: name.to_string(),
                dtype: *dtype,
                shape: shape.to_vec(),
                device,
                staging,
            });
        }
        Ok((id, true))
    }

    /// The device buffer of input `name` for these input shapes (allocated
    /// if new), for GPU preprocessing to write into: its address and size in
    /// bytes. The next [`run`](Self::run) must not be given that input.
    pub fn input_buffer(
        &mut self,
        inputs: &[(&str, DType, &[usize])],
        name: &str,
    ) -> Result<(*mut std::ffi::c_void, usize), BindingError> {
        let (_, fresh) = self.prepare(inputs)?;
        if fresh {
            self.outputs.clear();
        }
        let b = self
            .inputs
            .iter_mut()
            .find(|b| b.name == name)
            .ok_or_else(|| BindingError::Input {
                name: name.to_string(),
                detail: "not an input of this binding".into(),
            })?;
        let len = tensor_byte_len(&b.device);
        Ok((b.device.data_ptr_mut(), len))
    }

    /// One run. `shapes` names every input with its type and shape; `data`
    /// gives the tensors to upload (an input written by GPU preprocessing is
    /// left out). Outputs come back in the model's order.
    pub fn run(
        &mut self,
        session: &mut Session,
        shapes: &[(&str, DType, &[usize])],
        data: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, BindingError> {
        let (graph_id, fresh) = self.prepare(shapes)?;
        if fresh {
            self.outputs.clear();
        }
        for (name, t) in data {
            let b = self
                .inputs
                .iter_mut()
                .find(|b| b.name == *name)
                .ok_or_else(|| BindingError::Input {
                    name: name.to_string(),
                    detail: "not among the bound inputs".into(),
                })?;
            let bytes = tensor_bytes(t).ok_or_else(|| BindingError::Input {
                name: name.to_string(),
                detail: "not in standard layout".into(),
            })?;
            let e = |detail| BindingError::Input {
                name: name.to_string(),
                detail,
            };
            match &mut b.staging {
                Some(staging) => {
                    write_host(staging, bytes).map_err(|x| e(x.to_string()))?;
                    // Synchronous: the upload is done before the run reads it.
                    staging.copy_into(&mut b.device)?;
                }
                None => write_host(&mut b.device, bytes).map_err(|x| e(x.to_string()))?,
            }
        }
        if self.outputs.is_empty() {
            self.discover_outputs(session)?;
        }
        if self.graph {
            self.run_options.set("gpu_graph_id", graph_id.to_string())?;
            session.run_binding_with_options(&self.binding, &self.run_options)?;
        } else {
            session.run_binding(&self.binding)?;
        }
        self.collect()
    }

    /// A run with outputs ONNX Runtime allocates, outside any CUDA graph,
    /// to learn the output shapes; then each output gets its own buffer.
    fn discover_outputs(&mut self, session: &mut Session) -> Result<(), BindingError> {
        let info = match self.placement {
            Placement::Cpu => MemoryInfo::new(
                AllocationDevice::CPU,
                0,
                AllocatorType::Device,
                MemoryType::Default,
            )?,
            Placement::Cuda(id) => MemoryInfo::new(
                AllocationDevice::CUDA,
                id,
                AllocatorType::Device,
                MemoryType::Default,
            )?,
        };
        for n in &self.output_names {
            self.binding.bind_output_to_device(n.as_str(), &info)?;
        }
        let mut shapes = Vec::new();
        {
            let outs = if self.graph {
                self.run_options.set("gpu_graph_id", "-1")?;
                session.run_binding_with_options(&self.binding, &self.run_options)?
            } else {
                session.run_binding(&self.binding)?
            };
            for n in &self.output_names {
                let v = outs.get(n.as_str()).ok_or_else(|| BindingError::Output {
                    name: n.clone(),
                    detail: "missing from the run's outputs".into(),
                })?;
                let Some(ty) = v.dtype().tensor_type() else {
                    return Err(BindingError::Output {
                        name: n.clone(),
                        detail: "not a tensor".into(),
                    });
                };
                let shape: Vec<i64> = match v.dtype() {
                    ort::value::ValueType::Tensor { shape, .. } => shape.iter().copied().collect(),
                    _ => Vec::new(),
                };
                shapes.push((n.clone(), ty, shape));
            }
        }
        self.binding.clear_outputs();
        for (name, ty, shape) in shapes {
            let dims: Vec<usize> = shape.iter().map(|d| (*d).max(0) as usize).collect();
            let (mut bound, host) = match (&self.pinned_out, self.graph) {
                // Graph replays write device memory: bind device buffers and copy back.
                (Some(p), true) => (
                    DynTensor::new(&self.device, ty, dims.clone())?,
                    Some(DynTensor::new(p, ty, dims)?),
                ),
                // Otherwise ONNX Runtime copies the result into pinned host memory itself.
                (Some(p), false) => (DynTensor::new(p, ty, dims)?, None),
                (None, _) => (DynTensor::new(&self.device, ty, dims)?, None),
            };
            self.allocations += 1 + host.is_some() as u64;
            self.binding.bind_output(name.as_str(), &mut bound)?;
            self.outputs.push(BoundOutput { name, bound, host });
        }
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<(String, Tensor)>, BindingError> {
        let mut out = Vec::with_capacity(self.outputs.len());
        for o in &mut self.outputs {
            let src = match &mut o.host {
                Some(h) => {
                    o.bound.copy_into(&mut *h)?;
                    &*h
                }
                None => &o.bound,
            };
            let t = Tensor::from_ort(src).map_err(|x| BindingError::Output {
                name: o.name.clone(),
                detail: x.to_string(),
            })?;
            out.push((o.name.clone(), t));
        }
        Ok(out)
    }
}
