//! A stored record's `ts`, recomputed for the wire once its boot's offset
//! is known. The stored bytes are never touched; only the copy sent.

use std::borrow::Cow;

use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What every unsynced record holds: serde_json writes no spaces, and the
/// check is a byte search, so the records of a trusted clock cost nothing.
const MARK: &[u8] = br#""clock":"unsynced""#;

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.len() >= needle.len()
        && (0..=hay.len() - needle.len())
            .any(|i| hay[i] == needle[0] && &hay[i..i + needle.len()] == needle)
}

/// A JSON value with every object's keys in their order (serde_json's map
/// sorts them), so a corrected record differs from the stored one only in
/// `ts` and `clock`.
enum Ordered {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Ordered>),
    Object(Vec<(String, Ordered)>),
}

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Ordered, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E>(self) -> Result<Ordered, E> {
                Ok(Ordered::Null)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Ordered, E> {
                Ok(Ordered::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Ordered, E> {
                Ok(Ordered::Number(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Ordered, E> {
                Ok(Ordered::Number(v.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Ordered, E> {
                serde_json::Number::from_f64(v)
                    .map(Ordered::Number)
                    .ok_or_else(|| E::custom("not a JSON number"))
            }
            fn visit_str<E>(self, v: &str) -> Result<Ordered, E> {
                Ok(Ordered::String(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Ordered, E> {
                Ok(Ordered::String(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Ordered, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = a.next_element()? {
                    v.push(e);
                }
                Ok(Ordered::Array(v))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Ordered, A::Error> {
                let mut v = Vec::new();
                while let Some(e) = m.next_entry::<String, Ordered>()? {
                    v.push(e);
                }
                Ok(Ordered::Object(v))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Ordered {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Ordered::Null => s.serialize_unit(),
            Ordered::Bool(b) => s.serialize_bool(*b),
            Ordered::Number(n) => n.serialize(s),
            Ordered::String(t) => s.serialize_str(t),
            Ordered::Array(v) => {
                let mut q = s.serialize_seq(Some(v.len()))?;
                for e in v {
                    q.serialize_element(e)?;
                }
                q.end()
            }
            Ordered::Object(v) => {
                let mut m = s.serialize_map(Some(v.len()))?;
                for (k, e) in v {
                    m.serialize_entry(k, e)?;
                }
                m.end()
            }
        }
    }
}

impl Ordered {
    fn get(&self, k: &str) -> Option<&Ordered> {
        match self {
            Ordered::Object(v) => v.iter().find(|(key, _)| key == k).map(|(_, e)| e),
            _ => None,
        }
    }

    fn str(&self) -> Option<&str> {
        match self {
            Ordered::String(s) => Some(s),
            _ => None,
        }
    }

    fn u64(&self) -> Option<u64> {
        match self {
            Ordered::Number(n) => n.as_u64(),
            _ => None,
        }
    }

    fn set(&mut self, k: &str, e: Ordered) {
        if let Ordered::Object(v) = self {
            match v.iter_mut().find(|(key, _)| key == k) {
                Some(slot) => slot.1 = e,
                None => v.push((k.to_string(), e)),
            }
        }
    }
}

/// The record to send: `ts` = its boot's offset + `since_boot_us` and
/// `clock = "corrected"` when it is marked unsynced and `offset_of` knows
/// its boot; otherwise the stored bytes as they are.
pub fn for_sending<'a>(record: &'a [u8], offset_of: impl Fn(&str) -> Option<i64>) -> Cow<'a, [u8]> {
    if !contains(record, MARK) {
        return Cow::Borrowed(record);
    }
    match corrected(record, offset_of) {
        Some(v) => Cow::Owned(v),
        None => Cow::Borrowed(record),
    }
}

fn corrected(record: &[u8], offset_of: impl Fn(&str) -> Option<i64>) -> Option<Vec<u8>> {
    let mut r: Ordered = serde_json::from_slice(record).ok()?;
    if r.get("clock")?.str()? != "unsynced" {
        return None;
    }
    let boot = r.get("boot_id")?.str()?;
    let since = i64::try_from(r.get("since_boot_us")?.u64()?).ok()?;
    let us = offset_of(boot)?.checked_add(since)?;
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_micros(u64::try_from(us).ok()?);
    r.set("ts", Ordered::String(crate::record::rfc3339(t)));
    r.set("clock", Ordered::String("corrected".into()));
    serde_json::to_vec(&r).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const OFFSET: i64 = 1_796_083_200_000_000 - 5_000_000;

    fn offsets(b: &str) -> Option<i64> {
        (b == "b1").then_some(OFFSET)
    }

    #[test]
    fn an_unsynced_record_of_a_known_boot_gets_its_time_and_keeps_its_order() {
        let rec = br#"{"id":"d/1/1","seq":1,"ts":"1970-01-01T00:00:05.000000Z","outputs":{"ts":1,"clock":"x","top":[{"score":0.2573285400867462,"label":"1"},-3,null,true]},"clock":"unsynced","boot_id":"b1","since_boot_us":5250000}"#;
        let out = for_sending(rec, offsets);
        assert_eq!(
            std::str::from_utf8(&out).unwrap(),
            r#"{"id":"d/1/1","seq":1,"ts":"2026-12-01T00:00:00.250000Z","outputs":{"ts":1,"clock":"x","top":[{"score":0.2573285400867462,"label":"1"},-3,null,true]},"clock":"corrected","boot_id":"b1","since_boot_us":5250000}"#
        );
    }

    #[test]
    fn other_records_go_as_they_are() {
        let trusted = br#"{"id":"d/1/1","ts":"2026-12-01T00:00:00.000000Z"}"#;
        assert!(matches!(for_sending(trusted, offsets), Cow::Borrowed(_)));
        // Another boot's, whose offset is not known.
        let other = br#"{"ts":"x","clock":"unsynced","boot_id":"b0","since_boot_us":1}"#;
        assert!(matches!(for_sending(other, offsets), Cow::Borrowed(_)));
        // The mark inside the outputs only.
        let nested =
            br#"{"ts":"x","outputs":{"clock":"unsynced"},"boot_id":"b1","since_boot_us":1}"#;
        assert!(matches!(for_sending(nested, offsets), Cow::Borrowed(_)));
        // Not JSON, or a time before 1970.
        assert!(matches!(
            for_sending(br#"{"clock":"unsynced""#, offsets),
            Cow::Borrowed(_)
        ));
        let early = |_: &str| Some(-10_000_000);
        let rec = br#"{"ts":"x","clock":"unsynced","boot_id":"b1","since_boot_us":1}"#;
        assert!(matches!(for_sending(rec, early), Cow::Borrowed(_)));
    }
}
