//! The inference backend: the trait every engine implements, the tensor type
//! that crosses it, and the ONNX Runtime engine (`ort.rs`) with its execution
//! provider selection (TensorRT, CUDA, CPU).

pub mod binding;
pub mod ort;
pub mod tensor;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use self::tensor::{DType, NpyError, Tensor};

/// An execution provider, in the vocabulary of the config and the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    Tensorrt,
    Cuda,
    Cpu,
}

impl Provider {
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Tensorrt => "tensorrt",
            Provider::Cuda => "cuda",
            Provider::Cpu => "cpu",
        }
    }

    /// Parses a comma-separated preference list such as `tensorrt,cuda,cpu`.
    pub fn parse_list(s: &str) -> Result<Vec<Provider>, ProviderError> {
        let list: Vec<Provider> = s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(str::parse)
            .collect::<Result<_, _>>()?;
        if list.is_empty() {
            return Err(ProviderError::Empty);
        }
        Ok(list)
    }
}

/// A provider name or list that names no provider outpost has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    #[error("unknown execution provider `{0}` (expected tensorrt, cuda or cpu)")]
    Unknown(String),
    #[error("empty provider list (expected e.g. tensorrt,cuda,cpu)")]
    Empty,
}

impl FromStr for Provider {
    type Err = ProviderError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "tensorrt" | "trt" => Ok(Provider::Tensorrt),
            "cuda" => Ok(Provider::Cuda),
            "cpu" => Ok(Provider::Cpu),
            other => Err(ProviderError::Unknown(other.to_string())),
        }
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One dimension of a declared shape: a fixed size or a named free one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Dim {
    Fixed(u64),
    Symbolic(String),
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Symbolic(s) => f.write_str(s),
        }
    }
}

/// Name, element type and shape of one model input or output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IoSpec {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<Dim>,
}

impl IoSpec {
    pub fn shape_string(&self) -> String {
        format!(
            "[{}]",
            self.shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }

    /// A concrete shape for this spec: symbolic dims take `batch` when they
    /// name a batch axis, 1 otherwise. Refused, before anything is
    /// allocated, when a tensor of that shape would take more than
    /// [`MAX_DECLARED_BYTES`] (or its size does not even fit 64 bits): the
    /// shape comes from a model file or a manifest, not from outpost.
    pub fn concrete_shape(&self, batch: usize) -> Result<Vec<usize>, TooLarge> {
        let dims: Vec<u64> = self
            .shape
            .iter()
            .map(|d| match d {
                Dim::Fixed(n) => *n,
                Dim::Symbolic(s) if is_batch_name(s) => batch as u64,
                Dim::Symbolic(_) => 1,
            })
            .collect();
        check_allocation(&self.name, self.dtype, &dims, batch, || self.shape_string())?;
        // Each dimension is at most the bytes checked just above.
        Ok(dims.iter().map(|n| *n as usize).collect())
    }

    /// The bytes a tensor of this spec takes at batch 1, or why it is
    /// refused (see [`IoSpec::concrete_shape`]).
    pub fn check_size(&self) -> Result<u64, TooLarge> {
        let n: u64 = self.concrete_shape(1)?.iter().map(|d| *d as u64).product();
        Ok(n * self.dtype.bytes())
    }
}

/// The bytes of one tensor of `dtype` and `dims`, counted without overflow,
/// or a [`TooLarge`] (named `name`, its shape as `shown` writes it) past
/// [`MAX_DECLARED_BYTES`]: checked before such a tensor is allocated.
pub fn check_allocation(
    name: &str,
    dtype: DType,
    dims: &[u64],
    batch: usize,
    shown: impl FnOnce() -> String,
) -> Result<u64, TooLarge> {
    let bytes = dims
        .iter()
        .try_fold(dtype.bytes(), |b, n| b.checked_mul(*n));
    match bytes {
        Some(b) if b <= MAX_DECLARED_BYTES => Ok(b),
        bytes => Err(TooLarge {
            name: name.to_string(),
            shape: shown(),
            dtype,
            batch,
            bytes,
        }),
    }
}

/// The most bytes one tensor may take that outpost allocates from a
/// declared shape (a model's warm-up inputs, a stream's zero state, a
/// constant input): far above any real model's inputs (a 4096x4096 RGB
/// image in f32 is 192 MiB; silero's state 1 KiB), low enough that a model
/// file cannot make the daemon allocate gigabytes. The same bound as the
/// preprocessing's 2^26 elements of f32.
pub const MAX_DECLARED_BYTES: u64 = 256 << 20;

/// A declared tensor larger than [`MAX_DECLARED_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{name}` {dtype} {shape}{} takes {}: over the {} bytes (256 MiB) outpost allocates for one \
     declared tensor",
    if *.batch == 1 { String::new() } else { format!(" at batch {}", .batch) },
    match .bytes { Some(b) => format!("{b} bytes"), None => "more bytes than 64 bits can count".into() },
    MAX_DECLARED_BYTES
)]
pub struct TooLarge {
    pub name: String,
    pub shape: String,
    pub dtype: DType,
    pub batch: usize,
    /// None: the size overflows 64 bits.
    pub bytes: Option<u64>,
}

/// Names conventionally used for the batch axis by exporters.
pub fn is_batch_name(s: &str) -> bool {
    let s = s.to_ascii_lowercase();
    s == "batch"
        || s == "batch_size"
        || s == "n"
        || s == "b"
        || s.starts_with("batch")
        || s == "unk__batch"
}

/// The inputs and outputs of a loaded model as the engine reports them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelIo {
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
}

#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("missing input `{name}` (the model needs: {expected})")]
    Missing { name: String, expected: String },
    #[error("unknown input `{name}` (the model's inputs are: {expected})")]
    Unknown { name: String, expected: String },
    #[error("input `{name}`: the model expects {expected}, got {got}")]
    DType {
        name: String,
        expected: DType,
        got: DType,
    },
    #[error("input `{name}`: the model expects shape {expected}, got {got:?}")]
    Shape {
        name: String,
        expected: String,
        got: Vec<usize>,
    },
}

/// Checks named tensors against a model's inputs before they reach the
/// engine, so a bad frame gets an error that names what is wrong with it.
pub fn check_inputs<'a>(
    io: &ModelIo,
    given: impl IntoIterator<Item = (&'a str, &'a Tensor)> + Clone,
) -> Result<(), InputError> {
    let expected = || {
        io.inputs
            .iter()
            .map(|i| i.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (name, t) in given.clone() {
        let Some(spec) = io.inputs.iter().find(|i| i.name == name) else {
            return Err(InputError::Unknown {
                name: name.to_string(),
                expected: expected(),
            });
        };
        if spec.dtype != t.dtype() {
            return Err(InputError::DType {
                name: name.to_string(),
                expected: spec.dtype,
                got: t.dtype(),
            });
        }
        let shape_ok = spec.shape.len() == t.shape().len()
            && spec.shape.iter().zip(t.shape()).all(|(d, g)| match d {
                Dim::Fixed(n) => *n as usize == *g,
                Dim::Symbolic(_) => true,
            });
        if !shape_ok {
            return Err(InputError::Shape {
                name: name.to_string(),
                expected: spec.shape_string(),
                got: t.shape().to_vec(),
            });
        }
    }
    for spec in &io.inputs {
        if !given.clone().into_iter().any(|(n, _)| n == spec.name) {
            return Err(InputError::Missing {
                name: spec.name.clone(),
                expected: expected(),
            });
        }
    }
    Ok(())
}

/// What every inference engine offers the rest of the daemon: the seam
/// between the pipelines and ONNX Runtime. A loaded model holds one behind
/// a lock; tests put a fake engine there (`backend::fake`), so the worker,
/// the scheduler and the cascade are tested without ONNX Runtime.
pub trait InferenceSession: Send {
    /// Inputs and outputs as the engine sees them.
    fn io(&self) -> &ModelIo;
    /// The execution provider that serves this session.
    fn provider(&self) -> Provider;
    /// Runs once. Inputs are checked first; outputs come back in the model's order.
    fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<(String, Tensor)>, RunError>;
    /// Runs inputs the caller already checked against a spec at least as
    /// strict as the engine's (a model's manifest, held to the model at
    /// load), so the per-frame path checks once.
    fn run_prechecked(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, RunError> {
        self.run(inputs)
    }
    /// The ONNX Runtime session behind this engine, for the benchmarks' hot
    /// loops and I/O binding; None for other engines.
    fn as_ort(&mut self) -> Option<&mut ort::OrtSession> {
        None
    }
}

/// A fake engine for tests: it answers each run with a closure of the
/// test's, so every batching mode, state layout and failure can be made to
/// happen without a model file or ONNX Runtime. Compiled in every build
/// (the daemon's own tests use it from another crate); nothing in the
/// daemon makes one.
#[doc(hidden)]
pub mod fake {
    use super::{InferenceSession, ModelIo, Provider, RunError, Tensor, check_inputs};

    pub type Answer =
        Box<dyn FnMut(&[(&str, &Tensor)]) -> Result<Vec<(String, Tensor)>, RunError> + Send>;

    pub struct FakeEngine {
        pub io: ModelIo,
        pub answer: Answer,
        /// The batch size (axis 0 of the first input) of every run so far.
        pub runs: std::sync::Arc<parking_lot::Mutex<Vec<usize>>>,
    }

    impl InferenceSession for FakeEngine {
        fn io(&self) -> &ModelIo {
            &self.io
        }

        fn provider(&self) -> Provider {
            Provider::Cpu
        }

        fn run(&mut self, inputs: &[(&str, &Tensor)]) -> Result<Vec<(String, Tensor)>, RunError> {
            check_inputs(&self.io, inputs.iter().map(|(n, t)| (*n, *t)))?;
            let batch = inputs
                .first()
                .and_then(|(_, t)| t.shape().first().copied())
                .unwrap_or(1);
            self.runs.lock().push(batch);
            (self.answer)(inputs)
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Input(#[from] InputError),
    /// A tensor outpost would allocate from a declared shape is too large.
    #[error(transparent)]
    TooLarge(#[from] TooLarge),
    #[error("inference failed: {0}")]
    Engine(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io() -> ModelIo {
        ModelIo {
            inputs: vec![
                IoSpec {
                    name: "x".into(),
                    dtype: DType::F32,
                    shape: vec![Dim::Symbolic("batch".into()), Dim::Fixed(16)],
                },
                IoSpec {
                    name: "sr".into(),
                    dtype: DType::I64,
                    shape: vec![],
                },
            ],
            outputs: vec![],
        }
    }

    #[test]
    fn input_checks_name_every_problem_kind() {
        let io = io();
        let x = Tensor::filled(DType::F32, &[3, 16], 0.0);
        let sr = Tensor::filled(DType::I64, &[], 16000.0);
        assert!(check_inputs(&io, [("x", &x), ("sr", &sr)]).is_ok());
        assert!(
            matches!(check_inputs(&io, [("x", &x)]), Err(InputError::Missing { name, .. }) if name == "sr")
        );
        let bad = Tensor::filled(DType::F32, &[1, 15], 0.0);
        assert!(matches!(
            check_inputs(&io, [("x", &bad), ("sr", &sr)]),
            Err(InputError::Shape { .. })
        ));
        let bad = Tensor::filled(DType::F64, &[1, 16], 0.0);
        assert!(matches!(
            check_inputs(&io, [("x", &bad), ("sr", &sr)]),
            Err(InputError::DType { .. })
        ));
        let bad = Tensor::filled(DType::F32, &[16], 0.0);
        assert!(matches!(
            check_inputs(&io, [("x", &bad), ("sr", &sr)]),
            Err(InputError::Shape { .. })
        ));
        assert!(matches!(
            check_inputs(&io, [("x", &x), ("sr", &sr), ("y", &x)]),
            Err(InputError::Unknown { name, .. }) if name == "y"
        ));
    }

    #[test]
    fn provider_lists_parse() {
        assert_eq!(
            Provider::parse_list("tensorrt, cuda,cpu").unwrap(),
            vec![Provider::Tensorrt, Provider::Cuda, Provider::Cpu]
        );
        assert!(Provider::parse_list("cpu,tpu").is_err());
        assert!(Provider::parse_list("").is_err());
    }

    #[test]
    fn concrete_shapes_use_batch_for_batch_axes() {
        let s = IoSpec {
            name: "s".into(),
            dtype: DType::F32,
            shape: vec![
                Dim::Fixed(2),
                Dim::Symbolic("batch".into()),
                Dim::Symbolic("t".into()),
            ],
        };
        assert_eq!(s.concrete_shape(4).unwrap(), vec![2, 4, 1]);
    }

    #[test]
    fn declared_shapes_over_the_limit_are_refused_before_any_allocation() {
        let spec = |shape: Vec<Dim>| IoSpec {
            name: "state".into(),
            dtype: DType::F32,
            shape,
        };
        // silero's state at 2^40 streams: 1125899906842624 bytes.
        let big = spec(vec![Dim::Fixed(2), Dim::Fixed(1 << 40), Dim::Fixed(128)]);
        let e = big.concrete_shape(1).unwrap_err();
        assert_eq!(e.bytes, Some(1_125_899_906_842_624));
        assert!(e.to_string().contains("1125899906842624 bytes"), "{e}");
        // 2 * 2^62 * 2 elements overflow 64 bits: refused, no panic.
        let e = spec(vec![Dim::Fixed(2), Dim::Fixed(1 << 62), Dim::Fixed(2)])
            .check_size()
            .unwrap_err();
        assert_eq!(e.bytes, None);
        assert!(e.to_string().contains("than 64 bits can count"), "{e}");
        // 2 GiB: over; the limit itself: fine.
        assert!(spec(vec![Dim::Fixed(1 << 29)]).check_size().is_err());
        assert_eq!(
            spec(vec![Dim::Fixed(MAX_DECLARED_BYTES / 4)]).check_size(),
            Ok(MAX_DECLARED_BYTES)
        );
        // A batch axis counts at the batch asked for.
        let batched = spec(vec![Dim::Symbolic("batch".into()), Dim::Fixed(1 << 20)]);
        assert!(batched.concrete_shape(64).is_ok());
        let e = batched.concrete_shape(65).unwrap_err();
        assert!(e.to_string().contains("at batch 65"), "{e}");
    }
}
