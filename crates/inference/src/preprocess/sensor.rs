//! Sensor readings: a JSON array (flat, or nested exactly as the declared
//! shape) or raw little-endian f32 / i16 values, to an f32 tensor with a
//! leading batch axis of 1.

use ndarray::{ArrayD, IxDyn};
use serde::{Deserialize, Serialize};

use super::{DecodeError, Item, ItemMeta, MAX_ELEMENTS, Preprocessor};
use crate::backend::Tensor;

/// Encoding of a sensor payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SensorFormat {
    /// `[1.0, 2.0, ...]` or nested `[[..], [..]]` matching the shape.
    #[default]
    Json,
    /// Raw little-endian IEEE f32 values.
    F32le,
    /// Raw little-endian signed 16-bit values (e.g. ADC counts).
    I16le,
}

pub(super) fn default_scale() -> f32 {
    1.0
}

pub(super) fn validate(length: Option<usize>, shape: Option<&[usize]>, scale: f32) -> Vec<String> {
    let mut p = Vec::new();
    match (length, shape) {
        (Some(_), Some(_)) => p.push("sensor: give `length` or `shape`, not both".into()),
        (None, None) => p.push("sensor: `length` or `shape` is required".into()),
        (Some(0), None) => p.push("sensor: `length` must be at least 1".into()),
        (None, Some(s)) if s.is_empty() || s.contains(&0) => p.push(format!(
            "sensor: `shape` {s:?} must be non-empty with no zero dimension"
        )),
        _ => {}
    }
    let n = shape
        .map(|s| s.iter().try_fold(1usize, |a, d| a.checked_mul(*d)))
        .unwrap_or(length);
    if n.is_none_or(|n| n > MAX_ELEMENTS) {
        p.push(format!(
            "sensor: more than {MAX_ELEMENTS} values per reading"
        ));
    }
    if !scale.is_finite() || scale == 0.0 {
        p.push(format!(
            "sensor: `scale` {scale} must be finite and non-zero"
        ));
    }
    p
}

/// Decodes sensor readings of a fixed shape.
pub struct SensorPreprocessor {
    shape: Vec<usize>,
    len: usize,
    format: SensorFormat,
    scale: f32,
}

impl SensorPreprocessor {
    pub fn new(shape: Vec<usize>, format: SensorFormat, scale: f32) -> SensorPreprocessor {
        let len = shape
            .iter()
            .try_fold(1usize, |a, d| a.checked_mul(*d))
            .unwrap_or(0);
        SensorPreprocessor {
            shape,
            len,
            format,
            scale,
        }
    }

    fn values(&self, payload: &[u8]) -> Result<Vec<f32>, DecodeError> {
        match self.format {
            SensorFormat::Json => self.json_values(payload),
            SensorFormat::F32le => {
                self.check_bytes(payload, 4)?;
                payload
                    .chunks_exact(4)
                    .enumerate()
                    .map(|(index, c)| {
                        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * self.scale;
                        // NaN or infinite readings would poison every later
                        // output of the model: refuse the reading instead.
                        if v.is_finite() {
                            Ok(v)
                        } else {
                            Err(DecodeError::BadValue { index })
                        }
                    })
                    .collect()
            }
            SensorFormat::I16le => {
                self.check_bytes(payload, 2)?;
                Ok(payload
                    .chunks_exact(2)
                    .map(|c| i16::from_le_bytes([c[0], c[1]]) as f32 * self.scale)
                    .collect())
            }
        }
    }

    fn check_bytes(&self, payload: &[u8], width: usize) -> Result<(), DecodeError> {
        if payload.len() != self.len * width {
            return Err(DecodeError::BadSize {
                expected: format!(
                    "{} ({} values of {width} bytes)",
                    self.len * width,
                    self.len
                ),
                got: payload.len(),
            });
        }
        Ok(())
    }

    fn json_values(&self, payload: &[u8]) -> Result<Vec<f32>, DecodeError> {
        if payload.is_empty() {
            return Err(DecodeError::Empty);
        }
        let v: serde_json::Value =
            serde_json::from_slice(payload).map_err(|source| DecodeError::BadJson { source })?;
        let mut out = Vec::with_capacity(self.len);
        let flat = v
            .as_array()
            .is_some_and(|a| a.iter().all(|x| !x.is_array()));
        let ok = if flat {
            flatten(&v, &[], &mut out) && out.len() == self.len
        } else {
            flatten(&v, &self.shape, &mut out)
        };
        if !ok {
            return Err(DecodeError::BadShape {
                expected: self.shape.clone(),
                got: describe(&v),
                len: self.len,
            });
        }
        for (index, x) in out.iter_mut().enumerate() {
            *x *= self.scale;
            if !x.is_finite() {
                return Err(DecodeError::BadValue { index });
            }
        }
        Ok(out)
    }
}

/// Appends the numbers of `v` to `out` when `v` is nested exactly as
/// `shape` (an empty shape accepts one flat array of numbers). Returns false
/// on any mismatch or non-number.
fn flatten(v: &serde_json::Value, shape: &[usize], out: &mut Vec<f32>) -> bool {
    match (v, shape) {
        (serde_json::Value::Array(items), []) => items.iter().all(|x| match x.as_f64() {
            Some(f) => {
                out.push(f as f32);
                true
            }
            None => false,
        }),
        (serde_json::Value::Array(items), [d]) => {
            items.len() == *d
                && items.iter().all(|x| match x.as_f64() {
                    Some(f) => {
                        out.push(f as f32);
                        true
                    }
                    None => false,
                })
        }
        (serde_json::Value::Array(items), [d, rest @ ..]) => {
            items.len() == *d && items.iter().all(|x| flatten(x, rest, out))
        }
        _ => false,
    }
}

/// A short description of a JSON value's nesting for error messages.
fn describe(v: &serde_json::Value) -> String {
    let mut dims = Vec::new();
    let mut cur = v;
    while let serde_json::Value::Array(a) = cur {
        dims.push(a.len());
        match a.first() {
            Some(first) => cur = first,
            None => break,
        }
    }
    if dims.is_empty() {
        "not an array".into()
    } else {
        format!("{dims:?}")
    }
}

impl Preprocessor for SensorPreprocessor {
    fn process(&mut self, _stream: &str, payload: &[u8]) -> Result<Vec<Item>, DecodeError> {
        if self.len == 0 {
            return Err(DecodeError::Config {
                message: "sensor shape is empty or overflows".into(),
            });
        }
        let values = self.values(payload)?;
        let mut shape = Vec::with_capacity(self.shape.len() + 1);
        shape.push(1);
        shape.extend_from_slice(&self.shape);
        let len = values.len();
        let array =
            ArrayD::from_shape_vec(IxDyn(&shape), values).map_err(|_| DecodeError::BadSize {
                expected: self.len.to_string(),
                got: len,
            })?;
        Ok(vec![Item {
            tensor: Tensor::F32(array),
            meta: ItemMeta::default(),
        }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dec(shape: &[usize], format: SensorFormat, scale: f32) -> SensorPreprocessor {
        SensorPreprocessor::new(shape.to_vec(), format, scale)
    }

    #[test]
    fn json_flat_and_nested() {
        let mut d = dec(&[2, 3], SensorFormat::Json, 1.0);
        let items = d.process("s", b"[1,2,3,4,5,6]").unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].tensor.shape(), &[1, 2, 3]);
        assert_eq!(
            items[0].tensor.to_f64_vec(),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        let nested = d.process("s", b"[[1,2,3],[4,5,6.5]]").unwrap();
        assert_eq!(nested[0].tensor.to_f64_vec()[5], 6.5);
    }

    #[test]
    fn json_wrong_sizes_are_errors() {
        let mut d = dec(&[2, 3], SensorFormat::Json, 1.0);
        for bad in [
            &b"[1,2,3]"[..],
            b"[[1,2],[3,4],[5,6]]",
            b"[[1,2,3],[4,5]]",
            b"[1,2,3,4,5,\"x\"]",
            b"{\"a\":1}",
        ] {
            let e = d.process("s", bad).unwrap_err();
            assert_eq!(e.reason(), "bad_shape", "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(d.process("s", b"[1,2").unwrap_err().reason(), "bad_json");
        assert_eq!(d.process("s", b"").unwrap_err().reason(), "empty");
    }

    #[test]
    fn f32_and_i16_raw() {
        let mut d = dec(&[3], SensorFormat::F32le, 1.0);
        let bytes: Vec<u8> = [1.5f32, -2.0, 0.25]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = &d.process("s", &bytes).unwrap()[0].tensor;
        assert_eq!(t.shape(), &[1, 3]);
        assert_eq!(t.to_f64_vec(), vec![1.5, -2.0, 0.25]);
        assert_eq!(
            d.process("s", &bytes[..11]).unwrap_err().reason(),
            "bad_size"
        );
        let nan: Vec<u8> = [1.0f32, f32::NAN, 0.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(d.process("s", &nan).unwrap_err().reason(), "bad_value");

        let mut d = dec(&[2], SensorFormat::I16le, 0.5);
        let bytes: Vec<u8> = [100i16, -32768]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let t = &d.process("s", &bytes).unwrap()[0].tensor;
        assert_eq!(t.to_f64_vec(), vec![50.0, -16384.0]);
        assert_eq!(
            d.process("s", &bytes[..3]).unwrap_err().reason(),
            "bad_size"
        );
    }

    #[test]
    fn validate_catches_shape_problems() {
        assert!(validate(Some(16), None, 1.0).is_empty());
        assert!(validate(None, Some(&[4, 4]), 1.0).is_empty());
        assert_eq!(validate(Some(4), Some(&[4]), 1.0).len(), 1);
        assert_eq!(validate(None, None, 0.0).len(), 3);
        assert_eq!(validate(None, Some(&[4, 0]), 1.0).len(), 1);
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            for format in [SensorFormat::Json, SensorFormat::F32le, SensorFormat::I16le] {
                let mut d = dec(&[2, 4], format, 1.0);
                if let Ok(items) = d.process("s", &bytes) {
                    prop_assert_eq!(items[0].tensor.shape(), &[1, 2, 4]);
                }
            }
        }

        #[test]
        fn arbitrary_json_arrays_never_panic(v in proptest::collection::vec(-1e6f64..1e6, 0..20)) {
            let mut d = dec(&[8], SensorFormat::Json, 1.0);
            let text = serde_json::to_vec(&v).unwrap();
            let r = d.process("s", &text);
            prop_assert_eq!(r.is_ok(), v.len() == 8);
        }
    }
}
