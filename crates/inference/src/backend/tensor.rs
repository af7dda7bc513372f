//! A tensor of any element type the daemon feeds or reads: what crosses the
//! boundary between decoders, `.npy` files, JSON and the inference backend.

use std::fmt;
use std::io::Read;
use std::path::Path;

use half::f16;
use ndarray::{ArrayD, IxDyn};
use serde::{Deserialize, Serialize};

/// Element types a model input or output may have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    #[default]
    F32,
    F16,
    F64,
    I64,
    I32,
    I8,
    U8,
    Bool,
}

impl DType {
    pub const ALL: [DType; 8] = [
        DType::F32,
        DType::F16,
        DType::F64,
        DType::I64,
        DType::I32,
        DType::I8,
        DType::U8,
        DType::Bool,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::F64 => "f64",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::Bool => "bool",
        }
    }

    /// Bytes one element takes.
    pub fn bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Maps ONNX Runtime's element type; `None` for types the daemon does not handle (strings, complex, fp8).
    pub fn from_ort(t: ort::value::TensorElementType) -> Option<DType> {
        use ort::value::TensorElementType as T;
        Some(match t {
            T::Float32 => DType::F32,
            T::Float16 => DType::F16,
            T::Float64 => DType::F64,
            T::Int64 => DType::I64,
            T::Int32 => DType::I32,
            T::Int8 => DType::I8,
            T::Uint8 => DType::U8,
            T::Bool => DType::Bool,
            _ => return None,
        })
    }

    /// Maps an ONNX `TensorProto.DataType` number.
    pub fn from_onnx(code: i32) -> Option<DType> {
        Some(match code {
            1 => DType::F32,
            2 => DType::U8,
            3 => DType::I8,
            6 => DType::I32,
            7 => DType::I64,
            9 => DType::Bool,
            10 => DType::F16,
            11 => DType::F64,
            _ => return None,
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An owned n-dimensional array of one of the supported element types.
#[derive(Debug, Clone, PartialEq)]
pub enum Tensor {
    F32(ArrayD<f32>),
    F16(ArrayD<f16>),
    F64(ArrayD<f64>),
    I64(ArrayD<i64>),
    I32(ArrayD<i32>),
    I8(ArrayD<i8>),
    U8(ArrayD<u8>),
    Bool(ArrayD<bool>),
}

/// Applies the same expression to whichever array a tensor holds.
macro_rules! each {
    ($t:expr, $a:ident => $e:expr) => {
        match $t {
            Tensor::F32($a) => $e,
            Tensor::F16($a) => $e,
            Tensor::F64($a) => $e,
            Tensor::I64($a) => $e,
            Tensor::I32($a) => $e,
            Tensor::I8($a) => $e,
            Tensor::U8($a) => $e,
            Tensor::Bool($a) => $e,
        }
    };
}

#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("{path}: cannot read: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: not a NumPy .npy file: {source}")]
    Format {
        path: String,
        source: std::io::Error,
    },
    #[error(
        "{path}: unsupported .npy dtype {descr} (supported: f2 f4 f8 i1 i4 i8 u1 b1, little-endian)"
    )]
    DType { path: String, descr: String },
    #[error("{path}: Fortran-ordered arrays are not supported; save with np.ascontiguousarray")]
    FortranOrder { path: String },
    #[error("{path}: shape {shape:?} does not match its {len} elements")]
    Shape {
        path: String,
        shape: Vec<usize>,
        len: usize,
    },
}

/// Why tensors could not be put into one batch.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConcatError {
    #[error("nothing to concatenate")]
    Empty,
    #[error("cannot batch {first} with {other}")]
    Types {
        first: &'static str,
        other: &'static str,
    },
    #[error("axis {axis} is beyond a tensor of {ndim} dimensions")]
    Axis { axis: usize, ndim: usize },
    /// Shapes that differ off the batch axis (images of other sizes).
    #[error("{0}")]
    Shapes(#[from] ndarray::ShapeError),
}

impl Tensor {
    pub fn dtype(&self) -> DType {
        match self {
            Tensor::F32(_) => DType::F32,
            Tensor::F16(_) => DType::F16,
            Tensor::F64(_) => DType::F64,
            Tensor::I64(_) => DType::I64,
            Tensor::I32(_) => DType::I32,
            Tensor::I8(_) => DType::I8,
            Tensor::U8(_) => DType::U8,
            Tensor::Bool(_) => DType::Bool,
        }
    }

    pub fn shape(&self) -> &[usize] {
        each!(self, a => a.shape())
    }

    pub fn len(&self) -> usize {
        each!(self, a => a.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A tensor of the given type and shape whose every element is `value`
    /// (converted; `0` gives zeros, any non-zero gives `true` for bool).
    pub fn filled(dtype: DType, shape: &[usize], value: f64) -> Tensor {
        let d = IxDyn(shape);
        match dtype {
            DType::F32 => Tensor::F32(ArrayD::from_elem(d, value as f32)),
            DType::F16 => Tensor::F16(ArrayD::from_elem(d, f16::from_f64(value))),
            DType::F64 => Tensor::F64(ArrayD::from_elem(d, value)),
            DType::I64 => Tensor::I64(ArrayD::from_elem(d, value as i64)),
            DType::I32 => Tensor::I32(ArrayD::from_elem(d, value as i32)),
            DType::I8 => Tensor::I8(ArrayD::from_elem(d, value as i8)),
            DType::U8 => Tensor::U8(ArrayD::from_elem(d, value as u8)),
            DType::Bool => Tensor::Bool(ArrayD::from_elem(d, value != 0.0)),
        }
    }

    /// A deterministic pseudo-random tensor (floats in [-1, 1), integers in
    /// [0, 16)), for benchmarks and warm-up where the values do not matter but
    /// must not be all zeros (some kernels take shortcuts on zeros).
    pub fn pseudo_random(dtype: DType, shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        // SplitMix64: tiny, well-distributed, and reproducible across platforms.
        let mut s = seed;
        let mut next = move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        // Generated straight into the tensor's own type: no intermediate
        // buffer of f64 twice the tensor's size.
        let mut unit = move || (next() >> 11) as f64 / (1u64 << 53) as f64;
        let d = IxDyn(shape);
        // Shapes and lengths agree by construction, so from_shape_vec cannot fail.
        macro_rules! fill {
            ($variant:ident, $f:expr) => {
                Tensor::$variant(
                    ArrayD::from_shape_vec(d, (0..n).map($f).collect()).unwrap_or_default(),
                )
            };
        }
        match dtype {
            DType::F32 => fill!(F32, |_| (unit() * 2.0 - 1.0) as f32),
            DType::F16 => fill!(F16, |_| f16::from_f64(unit() * 2.0 - 1.0)),
            DType::F64 => fill!(F64, |_| unit() * 2.0 - 1.0),
            DType::I64 => fill!(I64, |_| (unit() * 16.0) as i64),
            DType::I32 => fill!(I32, |_| (unit() * 16.0) as i64 as i32),
            DType::I8 => fill!(I8, |_| (unit() * 16.0) as i64 as i8),
            DType::U8 => fill!(U8, |_| (unit() * 16.0) as i64 as u8),
            DType::Bool => fill!(Bool, |_| (unit() * 16.0) as i64 % 2 == 1),
        }
    }

    /// Every element widened to f64 (row-major), for comparisons and JSON.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match self {
            Tensor::F32(a) => a.iter().map(|x| *x as f64).collect(),
            Tensor::F16(a) => a.iter().map(|x| x.to_f64()).collect(),
            Tensor::F64(a) => a.iter().copied().collect(),
            Tensor::I64(a) => a.iter().map(|x| *x as f64).collect(),
            Tensor::I32(a) => a.iter().map(|x| *x as f64).collect(),
            Tensor::I8(a) => a.iter().map(|x| *x as f64).collect(),
            Tensor::U8(a) => a.iter().map(|x| *x as f64).collect(),
            Tensor::Bool(a) => a.iter().map(|x| if *x { 1.0 } else { 0.0 }).collect(),
        }
    }

    /// JSON form: `{"dtype": "f32", "shape": [..], "data": [..]}` with data flattened row-major.
    pub fn to_json(&self) -> serde_json::Value {
        let data = match self {
            Tensor::F32(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
            Tensor::F16(a) => serde_json::json!(a.iter().map(|x| x.to_f32()).collect::<Vec<_>>()),
            Tensor::F64(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
            Tensor::I64(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
            Tensor::I32(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
            Tensor::I8(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
            Tensor::U8(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
            Tensor::Bool(a) => serde_json::json!(a.iter().collect::<Vec<_>>()),
        };
        serde_json::json!({"dtype": self.dtype().as_str(), "shape": self.shape(), "data": data})
    }

    /// Concatenates tensors of one type along axis 0 (micro-batching: items
    /// with a batch axis of 1 become one batch).
    pub fn concat0(parts: &[&Tensor]) -> Result<Tensor, ConcatError> {
        Self::concat(parts, 0)
    }

    /// Concatenates tensors of one type along `axis` (stateful batching:
    /// silero's state is [2, batch, 128], batched on axis 1).
    pub fn concat(parts: &[&Tensor], axis: usize) -> Result<Tensor, ConcatError> {
        fn cat<T: Clone>(v: Vec<&ArrayD<T>>, axis: usize) -> Result<ArrayD<T>, ConcatError> {
            if let Some(a) = v.iter().find(|a| axis >= a.ndim()) {
                return Err(ConcatError::Axis {
                    axis,
                    ndim: a.ndim(),
                });
            }
            let views: Vec<_> = v.iter().map(|a| a.view()).collect();
            Ok(ndarray::concatenate(ndarray::Axis(axis), &views)?)
        }
        let Some(first) = parts.first() else {
            return Err(ConcatError::Empty);
        };
        macro_rules! all {
            ($variant:ident) => {{
                let mut v = Vec::with_capacity(parts.len());
                for p in parts {
                    match p {
                        Tensor::$variant(a) => v.push(a),
                        other => {
                            return Err(ConcatError::Types {
                                first: first.dtype().as_str(),
                                other: other.dtype().as_str(),
                            });
                        }
                    }
                }
                Tensor::$variant(cat(v, axis)?)
            }};
        }
        Ok(match first {
            Tensor::F32(_) => all!(F32),
            Tensor::F16(_) => all!(F16),
            Tensor::F64(_) => all!(F64),
            Tensor::I64(_) => all!(I64),
            Tensor::I32(_) => all!(I32),
            Tensor::I8(_) => all!(I8),
            Tensor::U8(_) => all!(U8),
            Tensor::Bool(_) => all!(Bool),
        })
    }

    /// Splits along axis 0 into `n` equal parts (each keeps the axis, of
    /// size len/n). `None` when axis 0 is not a multiple of n.
    pub fn split0(&self, n: usize) -> Option<Vec<Tensor>> {
        self.split(0, n)
    }

    /// Splits along `axis` into `n` equal parts (each keeps the axis).
    /// `None` when there is no such axis or it is not a multiple of n.
    pub fn split(&self, axis: usize, n: usize) -> Option<Vec<Tensor>> {
        let len = *self.shape().get(axis)?;
        if n == 0 || len % n != 0 {
            return None;
        }
        let step = len / n;
        let ax = ndarray::Axis(axis);
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let s = ndarray::Slice::from(i * step..(i + 1) * step);
            out.push(match self {
                Tensor::F32(a) => Tensor::F32(a.slice_axis(ax, s).to_owned()),
                Tensor::F16(a) => Tensor::F16(a.slice_axis(ax, s).to_owned()),
                Tensor::F64(a) => Tensor::F64(a.slice_axis(ax, s).to_owned()),
                Tensor::I64(a) => Tensor::I64(a.slice_axis(ax, s).to_owned()),
                Tensor::I32(a) => Tensor::I32(a.slice_axis(ax, s).to_owned()),
                Tensor::I8(a) => Tensor::I8(a.slice_axis(ax, s).to_owned()),
                Tensor::U8(a) => Tensor::U8(a.slice_axis(ax, s).to_owned()),
                Tensor::Bool(a) => Tensor::Bool(a.slice_axis(ax, s).to_owned()),
            });
        }
        Some(out)
    }

    /// Reads a NumPy `.npy` file (C order, little-endian or byte-order-free types).
    pub fn read_npy(path: &Path) -> Result<Tensor, NpyError> {
        let p = path.display().to_string();
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|mut f| f.read_to_end(&mut bytes))
            .map_err(|source| NpyError::Io {
                path: p.clone(),
                source,
            })?;
        Self::parse_npy(&bytes, &p)
    }

    /// Parses the bytes of a `.npy` file; `name` is used in errors.
    pub fn parse_npy(bytes: &[u8], name: &str) -> Result<Tensor, NpyError> {
        let format = |source| NpyError::Format {
            path: name.to_string(),
            source,
        };
        let npy = npyz::NpyFile::new(bytes).map_err(format)?;
        if npy.order() == npyz::Order::Fortran && npy.shape().len() > 1 {
            return Err(NpyError::FortranOrder {
                path: name.to_string(),
            });
        }
        let shape: Vec<usize> = npy.shape().iter().map(|d| *d as usize).collect();
        let npyz::DType::Plain(ts) = npy.dtype() else {
            return Err(NpyError::DType {
                path: name.to_string(),
                descr: npy.dtype().descr(),
            });
        };
        use npyz::{Endianness, TypeChar};
        let descr = ts.to_string();
        if ts.endianness() == Endianness::Big && ts.size_field() > 1 {
            return Err(NpyError::DType {
                path: name.to_string(),
                descr,
            });
        }
        let t = match (ts.type_char(), ts.size_field()) {
            (TypeChar::Float, 4) => {
                Tensor::F32(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Float, 2) => {
                Tensor::F16(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Float, 8) => {
                Tensor::F64(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Int, 8) => {
                Tensor::I64(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Int, 4) => {
                Tensor::I32(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Int, 1) => {
                Tensor::I8(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Uint, 1) => {
                Tensor::U8(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            (TypeChar::Bool, 1) => {
                Tensor::Bool(vec_to_array(npy.into_vec().map_err(format)?, &shape, name)?)
            }
            _ => {
                return Err(NpyError::DType {
                    path: name.to_string(),
                    descr,
                });
            }
        };
        Ok(t)
    }

    /// Converts into an ONNX Runtime value (copies the data once).
    pub fn to_ort(&self) -> ort::Result<ort::value::DynValue> {
        fn conv<T: ort::value::PrimitiveTensorElementType + Clone + std::fmt::Debug + 'static>(
            a: &ArrayD<T>,
        ) -> ort::Result<ort::value::DynValue> {
            let shape: Vec<i64> = a.shape().iter().map(|d| *d as i64).collect();
            let data: Vec<T> = a.iter().cloned().collect();
            Ok(ort::value::Tensor::from_array((shape, data))?.into_dyn())
        }
        each!(self, a => conv(a))
    }

    /// Copies an ONNX Runtime output value into an owned tensor.
    pub fn from_ort<V: ort::value::TensorValueTypeMarker + ?Sized>(
        v: &ort::value::Value<V>,
    ) -> Result<Tensor, OutputValueError> {
        let Some(ty) = v.dtype().tensor_type() else {
            return Err(OutputValueError::NotATensor(format!("{:?}", v.dtype())));
        };
        let dtype =
            DType::from_ort(ty).ok_or_else(|| OutputValueError::ElementType(format!("{ty:?}")))?;
        let e = OutputValueError::Extract;
        Ok(match dtype {
            DType::F32 => Tensor::F32(v.try_extract_array::<f32>().map_err(e)?.to_owned()),
            DType::F16 => Tensor::F16(v.try_extract_array::<f16>().map_err(e)?.to_owned()),
            DType::F64 => Tensor::F64(v.try_extract_array::<f64>().map_err(e)?.to_owned()),
            DType::I64 => Tensor::I64(v.try_extract_array::<i64>().map_err(e)?.to_owned()),
            DType::I32 => Tensor::I32(v.try_extract_array::<i32>().map_err(e)?.to_owned()),
            DType::I8 => Tensor::I8(v.try_extract_array::<i8>().map_err(e)?.to_owned()),
            DType::U8 => Tensor::U8(v.try_extract_array::<u8>().map_err(e)?.to_owned()),
            DType::Bool => Tensor::Bool(v.try_extract_array::<bool>().map_err(e)?.to_owned()),
        })
    }
}

fn vec_to_array<T>(v: Vec<T>, shape: &[usize], name: &str) -> Result<ArrayD<T>, NpyError> {
    let len = v.len();
    ArrayD::from_shape_vec(IxDyn(shape), v).map_err(|_| NpyError::Shape {
        path: name.to_string(),
        shape: shape.to_vec(),
        len,
    })
}

/// Why an ONNX Runtime output value is not a tensor outpost can hold.
#[derive(Debug, thiserror::Error)]
pub enum OutputValueError {
    #[error("output is a {0}, not a tensor")]
    NotATensor(String),
    #[error("unsupported output element type {0}")]
    ElementType(String),
    #[error("{0}")]
    Extract(ort::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concat_and_split_on_an_inner_axis_round_trip() {
        // Two streams' silero-like states [2, 1, 3] become [2, 2, 3] and back.
        let a = Tensor::F32(
            ArrayD::from_shape_vec(IxDyn(&[2, 1, 3]), (0..6).map(|x| x as f32).collect()).unwrap(),
        );
        let b = Tensor::F32(
            ArrayD::from_shape_vec(IxDyn(&[2, 1, 3]), (10..16).map(|x| x as f32).collect())
                .unwrap(),
        );
        let ab = Tensor::concat(&[&a, &b], 1).unwrap();
        assert_eq!(ab.shape(), &[2, 2, 3]);
        assert_eq!(ab.to_f64_vec()[..6], [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]);
        let parts = ab.split(1, 2).unwrap();
        assert_eq!(parts, vec![a.clone(), b]);
        assert!(ab.split(3, 2).is_none());
        assert!(Tensor::concat(&[&a], 3).is_err());
    }

    /// A minimal version-1.0 .npy writer for tests (numpy's format is documented and tiny).
    fn npy_bytes(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
        let shape_s = match shape.len() {
            0 => "()".to_string(),
            1 => format!("({},)", shape[0]),
            _ => format!(
                "({})",
                shape
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_s}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn reads_f32_and_i64_scalar() {
        let data: Vec<u8> = [1.5f32, -2.0, 3.25, 4.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = Tensor::parse_npy(&npy_bytes("<f4", &[2, 2], &data), "a.npy").unwrap();
        assert_eq!(t.dtype(), DType::F32);
        assert_eq!(t.shape(), &[2, 2]);
        assert_eq!(t.to_f64_vec(), vec![1.5, -2.0, 3.25, 4.0]);

        let t =
            Tensor::parse_npy(&npy_bytes("<i8", &[], &16000i64.to_le_bytes()), "sr.npy").unwrap();
        assert_eq!(t.dtype(), DType::I64);
        assert!(t.shape().is_empty());
        assert_eq!(t.to_f64_vec(), vec![16000.0]);
    }

    #[test]
    fn refuses_garbage_truncation_and_strings() {
        assert!(matches!(
            Tensor::parse_npy(b"not numpy at all", "x"),
            Err(NpyError::Format { .. })
        ));
        assert!(matches!(
            Tensor::parse_npy(b"", "x"),
            Err(NpyError::Format { .. })
        ));
        let full = npy_bytes("<f4", &[4], &[0u8; 16]);
        assert!(Tensor::parse_npy(&full[..full.len() - 3], "x").is_err());
        assert!(matches!(
            Tensor::parse_npy(&npy_bytes("|S4", &[1], b"abcd"), "x"),
            Err(NpyError::DType { .. })
        ));
        assert!(matches!(
            Tensor::parse_npy(&npy_bytes(">f4", &[1], &[0, 0, 0, 0]), "x"),
            Err(NpyError::DType { .. })
        ));
    }

    #[test]
    fn concat_and_split_along_the_batch_axis() {
        let a = Tensor::filled(DType::F32, &[1, 3], 1.0);
        let b = Tensor::filled(DType::F32, &[1, 3], 2.0);
        let c = Tensor::concat0(&[&a, &b]).unwrap();
        assert_eq!(c.shape(), &[2, 3]);
        let parts = c.split0(2).unwrap();
        assert_eq!(parts, vec![a.clone(), b]);
        assert!(c.split0(3).is_none());
        assert!(Tensor::concat0(&[&a, &Tensor::filled(DType::I64, &[1, 3], 0.0)]).is_err());
    }

    #[test]
    fn pseudo_random_is_deterministic_and_bounded() {
        let a = Tensor::pseudo_random(DType::F32, &[3, 5], 7);
        let b = Tensor::pseudo_random(DType::F32, &[3, 5], 7);
        assert_eq!(a, b);
        assert!(a.to_f64_vec().iter().all(|x| (-1.0..1.0).contains(x)));
        assert_ne!(a, Tensor::pseudo_random(DType::F32, &[3, 5], 8));
    }
}
