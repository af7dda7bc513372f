//! Byte sizes in the config as people write them: `max_bytes = "1 GiB"`,
//! `"512 MiB"`, `"20kB"`, `"1.5 GB"`, or a plain number of bytes.
//!
//! A leaf room (it imports nothing from the crate), used by the config
//! structs of every component as `#[serde(with = "crate::bytesize")]` on a
//! `u64` (`crate::bytesize::usize`, `crate::bytesize::option` for the other
//! shapes). Sizes are written back as plain numbers, so what serializes a
//! config (JSON status, `config example`) reads the same as before.
//!
//! Units: `B`; decimal `kB` `MB` `GB` `TB` (also `k` `M` `G` `T`, powers of
//! 1000); binary `KiB` `MiB` `GiB` `TiB` (also `Ki` `Mi` `Gi` `Ti`, powers
//! of 1024). Case does not matter; a space between number and unit may be
//! left out.

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serializer};

/// Why a size does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error(
        "`{0}` is not a byte size (a number, optionally with a unit: \"512 MiB\", \"20kB\", \"1 GiB\")"
    )]
    Malformed(String),
    #[error("`{0}`: unknown unit `{1}` (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")]
    Unit(String, String),
    #[error("`{0}` is too large")]
    TooLarge(String),
}

/// Parses "1 GiB", "512MiB", "20kB", "1.5 GB", "4096".
pub fn parse(text: &str) -> Result<u64, SizeError> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: String = num.chars().filter(|c| *c != '_').collect();
    if num.is_empty() {
        return Err(SizeError::Malformed(text.to_string()));
    }
    let unit = unit.trim();
    let factor: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "t" | "tb" => 1_000_000_000_000,
        "ki" | "kib" => 1 << 10,
        "mi" | "mib" => 1 << 20,
        "gi" | "gib" => 1 << 30,
        "ti" | "tib" => 1 << 40,
        _ => return Err(SizeError::Unit(text.to_string(), unit.to_string())),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n
            .checked_mul(factor)
            .ok_or_else(|| SizeError::TooLarge(text.to_string()));
    }
    let f: f64 = num
        .parse()
        .map_err(|_| SizeError::Malformed(text.to_string()))?;
    let bytes = (f * factor as f64).round();
    if !bytes.is_finite() || bytes < 0.0 || bytes >= u64::MAX as f64 {
        return Err(SizeError::TooLarge(text.to_string()));
    }
    Ok(bytes as u64)
}

struct SizeVisitor;

impl Visitor<'_> for SizeVisitor {
    type Value = u64;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a byte size: a number of bytes or a string such as \"512 MiB\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
        Ok(v)
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
        u64::try_from(v).map_err(|_| E::custom(format!("byte size {v} is negative")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
        parse(v).map_err(E::custom)
    }
}

/// Serializes a size as its number of bytes.
pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u64(*v)
}

/// Reads a number of bytes or a string with a unit.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    d.deserialize_any(SizeVisitor)
}

/// The same for `usize` fields.
pub mod usize {
    use serde::{Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(v: &usize, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(*v as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
        let v = super::deserialize(d)?;
        usize::try_from(v).map_err(|_| D::Error::custom(format!("byte size {v} is too large")))
    }
}

/// The same for `Option<u64>` fields (absent: `None`).
pub mod option {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(v) => s.serialize_some(v),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Option::<super::Size>::deserialize(d).map(|o| o.map(|s| s.0))
    }
}

/// A size as a type, for `Option` and collections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Size, D::Error> {
        deserialize(d).map(Size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_plain_numbers() {
        assert_eq!(parse("4096"), Ok(4096));
        assert_eq!(parse("1 GiB"), Ok(1 << 30));
        assert_eq!(parse("512 MiB"), Ok(512 << 20));
        assert_eq!(parse("512MiB"), Ok(512 << 20));
        assert_eq!(parse("20kB"), Ok(20_000));
        assert_eq!(parse("20 KiB"), Ok(20 << 10));
        assert_eq!(parse("1.5 GB"), Ok(1_500_000_000));
        assert_eq!(parse("0.5 KiB"), Ok(512));
        assert_eq!(parse("64 b"), Ok(64));
        assert_eq!(parse("1_000_000"), Ok(1_000_000));
    }

    #[test]
    fn refuses_what_is_not_a_size() {
        assert!(matches!(parse(""), Err(SizeError::Malformed(_))));
        assert!(matches!(parse("GiB"), Err(SizeError::Malformed(_))));
        assert!(matches!(parse("12 parsecs"), Err(SizeError::Unit(..))));
        assert!(matches!(parse("1.2.3 MB"), Err(SizeError::Malformed(_))));
        assert!(matches!(
            parse("99999999999 TiB"),
            Err(SizeError::TooLarge(_))
        ));
    }

    #[derive(Debug, serde::Deserialize, serde::Serialize)]
    struct C {
        #[serde(with = "crate::bytesize")]
        a: u64,
        #[serde(with = "crate::bytesize::usize")]
        b: usize,
        #[serde(default, with = "crate::bytesize::option")]
        c: Option<u64>,
    }

    #[test]
    fn toml_accepts_strings_and_numbers_and_writes_numbers() {
        let c: C = toml::from_str("a = \"1 GiB\"\nb = 65536\nc = \"2 MB\"").unwrap();
        assert_eq!((c.a, c.b, c.c), (1 << 30, 65536, Some(2_000_000)));
        let c: C = toml::from_str("a = 1\nb = \"1KiB\"").unwrap();
        assert_eq!((c.a, c.b, c.c), (1, 1024, None));
        let back = serde_json::to_value(&c).unwrap();
        assert_eq!(back, serde_json::json!({"a": 1, "b": 1024, "c": null}));
        let e = toml::from_str::<C>("a = \"lots\"\nb = 1").unwrap_err();
        assert!(e.to_string().contains("not a byte size"), "{e}");
        let e = toml::from_str::<C>("a = -1\nb = 1").unwrap_err();
        assert!(e.to_string().contains("negative"), "{e}");
    }
}
