//! A record's fields as OPC UA values, with no I/O: which variables a
//! pipeline has, and what each one reads after a record.

use opcua::types::{DataTypeId, StatusCode, Variant};
use serde_json::Value;

use crate::config::{Kind, MAX_AUTO_VARIABLES, OpcuaConfig};

/// One variable of a pipeline.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Var {
    /// The NodeId string: `<pipeline>/<field without the leading />`.
    pub(crate) id: String,
    /// The JSON pointer into `outputs`.
    pub(crate) pointer: String,
    pub(crate) kind: Kind,
}

/// The NodeId string of a field.
pub(crate) fn node_name(pipeline: &str, pointer: &str) -> String {
    format!("{pipeline}/{}", pointer.trim_start_matches('/'))
}

/// The NodeId string of a pipeline's record variable.
pub(crate) fn record_name(pipeline: &str) -> String {
    format!("{pipeline}/record")
}

/// A pipeline's mapped variables (none: it shows its top-level fields).
pub(crate) fn mapped(cfg: &OpcuaConfig, pipeline: &str) -> Vec<Var> {
    cfg.variables_of(pipeline)
        .map(|v| Var {
            id: node_name(pipeline, &v.field),
            pointer: v.field.clone(),
            kind: v.kind,
        })
        .collect()
}

/// The top-level numbers and booleans of `outputs` that `known` lacks
/// (doubles and booleans), up to [`MAX_AUTO_VARIABLES`] in all.
pub(crate) fn new_top_level(pipeline: &str, outputs: &Value, known: &[Var]) -> Vec<Var> {
    let Value::Object(m) = outputs else {
        return Vec::new();
    };
    let room = MAX_AUTO_VARIABLES.saturating_sub(known.len());
    m.iter()
        .filter_map(|(k, v)| {
            let kind = match v {
                Value::Number(_) => Kind::Double,
                Value::Bool(_) => Kind::Boolean,
                _ => return None,
            };
            // A key with `/` or `~` is escaped in its pointer.
            let pointer = format!("/{}", k.replace('~', "~0").replace('/', "~1"));
            if known.iter().any(|v| v.pointer == pointer) {
                return None;
            }
            Some(Var {
                id: node_name(pipeline, &pointer),
                pointer,
                kind,
            })
        })
        .take(room)
        .collect()
}

/// The data type node of a kind.
pub(crate) fn data_type(kind: Kind) -> DataTypeId {
    match kind {
        Kind::Double => DataTypeId::Double,
        Kind::Float => DataTypeId::Float,
        Kind::Int16 => DataTypeId::Int16,
        Kind::Uint16 => DataTypeId::UInt16,
        Kind::Int32 => DataTypeId::Int32,
        Kind::Uint32 => DataTypeId::UInt32,
        Kind::Int64 => DataTypeId::Int64,
        Kind::Uint64 => DataTypeId::UInt64,
        Kind::Boolean => DataTypeId::Boolean,
        Kind::String => DataTypeId::String,
    }
}

/// The value a variable of `kind` starts with, before any record.
pub(crate) fn initial(kind: Kind) -> Variant {
    match kind {
        Kind::Double => Variant::Double(0.0),
        Kind::Float => Variant::Float(0.0),
        Kind::Int16 => Variant::Int16(0),
        Kind::Uint16 => Variant::UInt16(0),
        Kind::Int32 => Variant::Int32(0),
        Kind::Uint32 => Variant::UInt32(0),
        Kind::Int64 => Variant::Int64(0),
        Kind::Uint64 => Variant::UInt64(0),
        Kind::Boolean => Variant::Boolean(false),
        Kind::String => Variant::String("".into()),
    }
}

/// Why a field gave no value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoValue {
    /// The record has no such field (e.g. no box in this frame).
    Missing,
    /// The field is there but is not a `kind` (a string for a number, a
    /// number out of range, a fraction for an integer).
    Unfit,
}

impl NoValue {
    /// The status the variable reads with instead of a value.
    pub(crate) fn status(self) -> StatusCode {
        match self {
            NoValue::Missing => StatusCode::BadNoData,
            NoValue::Unfit => StatusCode::BadTypeMismatch,
        }
    }

    /// The `reason` label of its counter.
    pub(crate) fn label(self) -> &'static str {
        match self {
            NoValue::Missing => "missing",
            NoValue::Unfit => "unfit",
        }
    }
}

/// The value of `v`'s field in `outputs`.
pub(crate) fn value_of(v: &Var, outputs: &Value) -> Result<Variant, NoValue> {
    let x = outputs.pointer(&v.pointer).ok_or(NoValue::Missing)?;
    convert(x, v.kind).ok_or(NoValue::Unfit)
}

fn int<T: TryFrom<i64> + TryFrom<u64>>(x: &Value) -> Option<T> {
    if let Some(i) = x.as_i64() {
        return T::try_from(i).ok();
    }
    if let Some(u) = x.as_u64() {
        return T::try_from(u).ok();
    }
    // A whole float (3.0) is the integer it is.
    let f = x.as_f64()?;
    if f.fract() != 0.0 || !f.is_finite() || f.abs() > 9.0e15 {
        return None;
    }
    T::try_from(f as i64).ok()
}

fn convert(x: &Value, kind: Kind) -> Option<Variant> {
    Some(match kind {
        Kind::Double => Variant::Double(match x {
            Value::Bool(b) => f64::from(u8::from(*b)),
            _ => x.as_f64()?,
        }),
        Kind::Float => {
            let f = x.as_f64()?;
            if f.is_finite() && f.abs() > f64::from(f32::MAX) {
                return None;
            }
            Variant::Float(f as f32)
        }
        Kind::Int16 => Variant::Int16(int(x)?),
        Kind::Uint16 => Variant::UInt16(int(x)?),
        Kind::Int32 => Variant::Int32(int(x)?),
        Kind::Uint32 => Variant::UInt32(int(x)?),
        Kind::Int64 => Variant::Int64(int(x)?),
        Kind::Uint64 => Variant::UInt64(int(x)?),
        Kind::Boolean => Variant::Boolean(match x {
            Value::Bool(b) => *b,
            Value::Number(n) => n.as_f64()? != 0.0,
            _ => return None,
        }),
        Kind::String => Variant::String(
            match x {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            }
            .into(),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn var(pointer: &str, kind: Kind) -> Var {
        Var {
            id: node_name("line3", pointer),
            pointer: pointer.into(),
            kind,
        }
    }

    #[test]
    fn node_names_drop_the_leading_slash() {
        assert_eq!(node_name("line3", "/top/0/index"), "line3/top/0/index");
        assert_eq!(record_name("line3"), "line3/record");
    }

    #[test]
    fn fields_convert_to_their_kind_or_say_why_not() {
        let out = json!({"top": [{"index": 3, "score": 0.75, "label": "b"}], "alarm": true});
        assert_eq!(
            value_of(&var("/top/0/index", Kind::Int32), &out),
            Ok(Variant::Int32(3))
        );
        assert_eq!(
            value_of(&var("/top/0/index", Kind::Double), &out),
            Ok(Variant::Double(3.0))
        );
        assert_eq!(
            value_of(&var("/top/0/score", Kind::Float), &out),
            Ok(Variant::Float(0.75))
        );
        assert_eq!(
            value_of(&var("/top/0/label", Kind::String), &out),
            Ok(Variant::String("b".into()))
        );
        assert_eq!(
            value_of(&var("/alarm", Kind::Boolean), &out),
            Ok(Variant::Boolean(true))
        );
        assert_eq!(
            value_of(&var("/top/1/index", Kind::Int32), &out),
            Err(NoValue::Missing)
        );
        assert_eq!(
            value_of(&var("/top/0/score", Kind::Int32), &out),
            Err(NoValue::Unfit)
        );
        assert_eq!(
            value_of(&var("/top/0/label", Kind::Double), &out),
            Err(NoValue::Unfit)
        );
        let big = json!({"n": 70000});
        assert_eq!(
            value_of(&var("/n", Kind::Uint16), &big),
            Err(NoValue::Unfit)
        );
        assert_eq!(
            value_of(&var("/n", Kind::Uint32), &big),
            Ok(Variant::UInt32(70000))
        );
    }

    #[test]
    fn top_level_numbers_become_variables_once() {
        let out = json!({"score": 0.5, "speech": true, "top": [], "a/b": 1});
        let first = new_top_level("vad", &out, &[]);
        let ids: Vec<&str> = first.iter().map(|v| v.id.as_str()).collect();
        assert_eq!(ids, ["vad/a~1b", "vad/score", "vad/speech"]);
        assert_eq!(first[2].kind, Kind::Boolean);
        assert!(new_top_level("vad", &out, &first).is_empty());
        assert_eq!(value_of(&first[0], &out), Ok(Variant::Double(1.0)));
    }
}
