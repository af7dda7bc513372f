//! Every output as `{dtype, shape, data}`, with data capped so one huge
//! tensor cannot fill the outbox.

use serde_json::{Value, json};

use super::{PostError, Postprocessor};
use crate::backend::Tensor;
use crate::preprocess::ItemMeta;

pub(super) fn default_max_values() -> usize {
    4096
}

/// Raw outputs, at most `max_values` elements of each.
pub struct RawPostprocessor {
    pub max_values: usize,
}

/// The first `n` elements of a tensor as JSON numbers (integers stay integers).
fn head(t: &Tensor, n: usize) -> Value {
    match t {
        Tensor::F32(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
        Tensor::F16(a) => json!(a.iter().take(n).map(|x| x.to_f32()).collect::<Vec<_>>()),
        Tensor::F64(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
        Tensor::I64(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
        Tensor::I32(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
        Tensor::I8(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
        Tensor::U8(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
        Tensor::Bool(a) => json!(a.iter().take(n).collect::<Vec<_>>()),
    }
}

impl Postprocessor for RawPostprocessor {
    fn process(
        &mut self,
        _stream: &str,
        _meta: &ItemMeta,
        outputs: &[(String, Tensor)],
    ) -> Result<Option<Value>, PostError> {
        let mut obj = serde_json::Map::new();
        for (name, t) in outputs {
            let mut v = json!({
                "dtype": t.dtype().as_str(),
                "shape": t.shape(),
                "data": head(t, self.max_values),
            });
            if t.len() > self.max_values {
                v["truncated"] = json!(true);
            }
            obj.insert(name.clone(), v);
        }
        Ok(Some(Value::Object(obj)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::DType;

    #[test]
    fn caps_and_keeps_types() {
        let outs = vec![
            ("a".to_string(), Tensor::filled(DType::I64, &[2, 3], 7.0)),
            ("b".to_string(), Tensor::filled(DType::F32, &[10], 0.5)),
        ];
        let v = RawPostprocessor { max_values: 6 }
            .process("s", &ItemMeta::default(), &outs)
            .unwrap()
            .unwrap();
        assert_eq!(
            v["a"],
            json!({"dtype": "i64", "shape": [2, 3], "data": [7, 7, 7, 7, 7, 7]})
        );
        assert_eq!(v["b"]["data"].as_array().unwrap().len(), 6);
        assert_eq!(v["b"]["truncated"], true);
        assert_eq!(v["b"]["shape"], json!([10]));
    }
}
