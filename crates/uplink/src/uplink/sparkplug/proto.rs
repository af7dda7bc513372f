//! The protobuf messages of Sparkplug B, following the field numbers of the
//! published `sparkplug_b.proto` (package `org.eclipse.tahu.protobuf`);
//! only the parts outpost writes are declared (DataSet, Template, MetaData
//! and properties are never sent).

/// Sparkplug B data types (the `DataType` enum of sparkplug_b.proto).
pub mod datatype {
    pub const UINT64: u32 = 8;
    pub const DOUBLE: u32 = 10;
    pub const BOOLEAN: u32 = 11;
    pub const STRING: u32 = 12;
}

/// `Payload` of sparkplug_b.proto (proto2).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payload {
    #[prost(uint64, optional, tag = "1")]
    pub timestamp: Option<u64>,
    #[prost(message, repeated, tag = "2")]
    pub metrics: Vec<Metric>,
    #[prost(uint64, optional, tag = "3")]
    pub seq: Option<u64>,
    #[prost(string, optional, tag = "4")]
    pub uuid: Option<String>,
    #[prost(bytes = "vec", optional, tag = "5")]
    pub body: Option<Vec<u8>>,
}

/// `Payload.Metric` of sparkplug_b.proto.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metric {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(uint64, optional, tag = "2")]
    pub alias: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "4")]
    pub datatype: Option<u32>,
    #[prost(bool, optional, tag = "5")]
    pub is_historical: Option<bool>,
    #[prost(bool, optional, tag = "6")]
    pub is_transient: Option<bool>,
    #[prost(bool, optional, tag = "7")]
    pub is_null: Option<bool>,
    #[prost(oneof = "Value", tags = "10, 11, 12, 13, 14, 15, 16")]
    pub value: Option<Value>,
}

/// The `value` oneof of `Payload.Metric` (the scalar members).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    #[prost(uint32, tag = "10")]
    Int(u32),
    #[prost(uint64, tag = "11")]
    Long(u64),
    #[prost(float, tag = "12")]
    Float(f32),
    #[prost(double, tag = "13")]
    Double(f64),
    #[prost(bool, tag = "14")]
    Boolean(bool),
    #[prost(string, tag = "15")]
    String(String),
    #[prost(bytes = "vec", tag = "16")]
    Bytes(Vec<u8>),
}

pub fn datatype_of(v: &Value) -> u32 {
    match v {
        Value::Long(_) => datatype::UINT64,
        Value::Boolean(_) => datatype::BOOLEAN,
        Value::String(_) => datatype::STRING,
        _ => datatype::DOUBLE,
    }
}

pub fn metric(name: &str, ts: u64, v: Value) -> Metric {
    Metric {
        name: Some(name.to_string()),
        timestamp: Some(ts),
        datatype: Some(datatype_of(&v)),
        value: Some(v),
        ..Metric::default()
    }
}

/// A metric declared by a birth before it has a value (`is_null`).
pub fn null_metric(name: &str, ts: u64, datatype: u32) -> Metric {
    Metric {
        name: Some(name.to_string()),
        timestamp: Some(ts),
        datatype: Some(datatype),
        is_null: Some(true),
        ..Metric::default()
    }
}

/// Bytes a metric takes inside a payload (its field key and length
/// included) at most: the timestamp is counted at its widest (10 bytes).
/// Computed without building the message, so the bounded metric set can
/// keep its birth's size up to date on every record.
pub fn metric_len_max(name: &str, datatype: u32, value: Option<&Value>) -> usize {
    use prost::encoding::{encoded_len_varint, key_len};
    let v = match value {
        None => key_len(7) + 1,
        Some(Value::Int(n)) => key_len(10) + encoded_len_varint(u64::from(*n)),
        Some(Value::Long(n)) => key_len(11) + encoded_len_varint(*n),
        Some(Value::Float(_)) => key_len(12) + 4,
        Some(Value::Double(_)) => key_len(13) + 8,
        Some(Value::Boolean(_)) => key_len(14) + 1,
        Some(Value::String(s)) => key_len(15) + encoded_len_varint(s.len() as u64) + s.len(),
        Some(Value::Bytes(b)) => key_len(16) + encoded_len_varint(b.len() as u64) + b.len(),
    };
    let body = key_len(1)
        + encoded_len_varint(name.len() as u64)
        + name.len()
        + key_len(3)
        + 10
        + key_len(4)
        + encoded_len_varint(u64::from(datatype))
        + v;
    key_len(2) + encoded_len_varint(body as u64) + body
}

/// A payload's own fields (timestamp and seq) at their widest.
pub const PAYLOAD_HEAD_MAX: usize = 2 * (1 + 10);

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    #[test]
    fn metric_len_max_bounds_the_encoding_and_is_exact_at_the_widest_timestamp() {
        let values = [
            None,
            Some(Value::Long(0)),
            Some(Value::Long(u64::MAX)),
            Some(Value::Double(0.5)),
            Some(Value::Boolean(true)),
            Some(Value::String(String::new())),
            Some(Value::String("x".repeat(300))),
            Some(Value::Int(7)),
            Some(Value::Float(1.5)),
            Some(Value::Bytes(vec![1; 200])),
        ];
        for name in ["", "s0/id", &"n".repeat(200)] {
            for v in &values {
                let dt = v.as_ref().map_or(datatype::DOUBLE, datatype_of);
                let mut m = match v {
                    Some(v) => metric(name, 0, v.clone()),
                    None => null_metric(name, 0, dt),
                };
                let est = metric_len_max(name, dt, v.as_ref());
                let one = |m: &Metric| {
                    Payload {
                        metrics: vec![m.clone()],
                        ..Payload::default()
                    }
                    .encoded_len()
                };
                assert!(one(&m) <= est, "{name:?} {v:?}");
                m.timestamp = Some(u64::MAX);
                assert_eq!(one(&m), est, "{name:?} {v:?}");
            }
        }
        let head = Payload {
            timestamp: Some(u64::MAX),
            seq: Some(u64::MAX),
            ..Payload::default()
        };
        assert_eq!(head.encoded_len(), PAYLOAD_HEAD_MAX);
    }
}
