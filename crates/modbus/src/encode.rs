//! Values to register words and back: the kinds a map names, their word
//! order, and `scale` / `offset`. Free of I/O.
//!
//! On the wire a register is `value * scale + offset`, rounded to the
//! nearest integer for the integer kinds; reading applies the inverse, so
//! the same map entry reads back what it wrote. A value that does not fit
//! its kind is refused (`OutOfRange`), never clamped or wrapped: a PLC acting
//! on a wrapped number is worse than one keeping the last good value.

use serde::{Deserialize, Serialize};

/// What one map entry holds on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    U16,
    I16,
    /// Two registers.
    U32,
    /// Two registers.
    I32,
    /// Two registers, IEEE 754 single precision.
    F32,
    /// A coil (or discrete input): on when the value is non-zero or `true`.
    Bool,
}

impl Kind {
    /// Registers (or coils) the kind takes.
    pub fn width(self) -> u16 {
        match self {
            Kind::U32 | Kind::I32 | Kind::F32 => 2,
            Kind::U16 | Kind::I16 | Kind::Bool => 1,
        }
    }

    pub fn is_bool(self) -> bool {
        self == Kind::Bool
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::U16 => "u16",
            Kind::I16 => "i16",
            Kind::U32 => "u32",
            Kind::I32 => "i32",
            Kind::F32 => "f32",
            Kind::Bool => "bool",
        }
    }
}

/// Which register of a two-register value comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WordOrder {
    /// High word at the lower address (the Modbus convention, most PLCs).
    #[default]
    Big,
    /// Low word at the lower address ("word swapped").
    Little,
}

/// Up to two register words of one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Words {
    w: [u16; 2],
    n: u8,
}

impl Words {
    pub fn one(w: u16) -> Words {
        Words { w: [w, 0], n: 1 }
    }

    pub fn two(a: u16, b: u16) -> Words {
        Words { w: [a, b], n: 2 }
    }

    pub fn as_slice(&self) -> &[u16] {
        &self.w[..usize::from(self.n)]
    }
}

/// Why a value could not be put into registers.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum EncodeError {
    #[error("{0} is not a finite number")]
    NotFinite(f64),
    #[error("{value} does not fit {kind} (after scale and offset)")]
    OutOfRange { value: f64, kind: &'static str },
}

impl EncodeError {
    /// The counter label of the reason.
    pub fn reason(&self) -> &'static str {
        match self {
            EncodeError::NotFinite(_) => "not_finite",
            EncodeError::OutOfRange { .. } => "out_of_range",
        }
    }
}

fn split(v: u32, order: WordOrder) -> Words {
    let (hi, lo) = ((v >> 16) as u16, v as u16);
    match order {
        WordOrder::Big => Words::two(hi, lo),
        WordOrder::Little => Words::two(lo, hi),
    }
}

fn join(w: &[u16], order: WordOrder) -> u32 {
    let (a, b) = (u32::from(w[0]), u32::from(w.get(1).copied().unwrap_or(0)));
    match order {
        WordOrder::Big => (a << 16) | b,
        WordOrder::Little => (b << 16) | a,
    }
}

/// `value * scale + offset` in the words of `kind`.
pub fn encode(
    kind: Kind,
    order: WordOrder,
    value: f64,
    scale: f64,
    offset: f64,
) -> Result<Words, EncodeError> {
    let raw = value * scale + offset;
    if !raw.is_finite() {
        return Err(EncodeError::NotFinite(raw));
    }
    let range = |lo: f64, hi: f64| {
        let r = raw.round();
        if r < lo || r > hi {
            Err(EncodeError::OutOfRange {
                value: raw,
                kind: kind.as_str(),
            })
        } else {
            Ok(r)
        }
    };
    Ok(match kind {
        Kind::Bool => Words::one(u16::from(raw != 0.0)),
        Kind::U16 => Words::one(range(0.0, f64::from(u16::MAX))? as u16),
        Kind::I16 => Words::one(range(f64::from(i16::MIN), f64::from(i16::MAX))? as i16 as u16),
        Kind::U32 => split(range(0.0, f64::from(u32::MAX))? as u32, order),
        Kind::I32 => split(
            range(f64::from(i32::MIN), f64::from(i32::MAX))? as i32 as u32,
            order,
        ),
        Kind::F32 => {
            let f = raw as f32;
            if !f.is_finite() {
                return Err(EncodeError::OutOfRange {
                    value: raw,
                    kind: "f32",
                });
            }
            split(f.to_bits(), order)
        }
    })
}

/// The value `words` of `kind` hold: `(register - offset) / scale`.
/// `words` has the kind's width (a bool: 0 or 1).
pub fn decode(kind: Kind, order: WordOrder, words: &[u16], scale: f64, offset: f64) -> f64 {
    let raw = match kind {
        Kind::Bool => f64::from(u8::from(words.first().is_some_and(|w| *w != 0))),
        Kind::U16 => f64::from(words.first().copied().unwrap_or(0)),
        Kind::I16 => f64::from(words.first().copied().unwrap_or(0) as i16),
        Kind::U32 => f64::from(join(words, order)),
        Kind::I32 => f64::from(join(words, order) as i32),
        Kind::F32 => f64::from(f32::from_bits(join(words, order))),
    };
    (raw - offset) / scale
}

/// A JSON value as a number: numbers as they are, `true`/`false` as 1/0.
pub fn as_number(v: &serde_json::Value) -> Option<f64> {
    match v {
        serde_json::Value::Number(n) => n.as_f64(),
        serde_json::Value::Bool(b) => Some(f64::from(u8::from(*b))),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_round_trips_in_both_word_orders() {
        for order in [WordOrder::Big, WordOrder::Little] {
            for (kind, v) in [
                (Kind::U16, 65535.0),
                (Kind::I16, -32768.0),
                (Kind::U32, 4_000_000_000.0),
                (Kind::I32, -2_000_000_000.0),
                (Kind::F32, 0.15625),
                (Kind::Bool, 1.0),
            ] {
                let w = encode(kind, order, v, 1.0, 0.0).unwrap();
                assert_eq!(w.as_slice().len(), usize::from(kind.width()));
                assert_eq!(decode(kind, order, w.as_slice(), 1.0, 0.0), v, "{kind:?}");
            }
        }
    }

    #[test]
    fn big_word_order_puts_the_high_word_first() {
        // 1.0f32 = 0x3F80_0000
        assert_eq!(
            encode(Kind::F32, WordOrder::Big, 1.0, 1.0, 0.0)
                .unwrap()
                .as_slice(),
            [0x3F80, 0x0000]
        );
        assert_eq!(
            encode(Kind::F32, WordOrder::Little, 1.0, 1.0, 0.0)
                .unwrap()
                .as_slice(),
            [0x0000, 0x3F80]
        );
        assert_eq!(
            encode(Kind::U32, WordOrder::Big, 65536.0 + 2.0, 1.0, 0.0)
                .unwrap()
                .as_slice(),
            [1, 2]
        );
    }

    #[test]
    fn scale_and_offset_apply_on_write_and_invert_on_read() {
        // A score of 0.934 as per-mille, offset 10.
        let w = encode(Kind::U16, WordOrder::Big, 0.934, 1000.0, 10.0).unwrap();
        assert_eq!(w.as_slice(), [944]);
        assert!((decode(Kind::U16, WordOrder::Big, &[944], 1000.0, 10.0) - 0.934).abs() < 1e-9);
    }

    #[test]
    fn values_that_do_not_fit_are_refused_not_wrapped() {
        assert!(matches!(
            encode(Kind::U16, WordOrder::Big, 65536.0, 1.0, 0.0),
            Err(EncodeError::OutOfRange { .. })
        ));
        assert!(matches!(
            encode(Kind::U16, WordOrder::Big, -1.0, 1.0, 0.0),
            Err(EncodeError::OutOfRange { .. })
        ));
        assert!(matches!(
            encode(Kind::I16, WordOrder::Big, 40000.0, 1.0, 0.0),
            Err(EncodeError::OutOfRange { .. })
        ));
        assert!(matches!(
            encode(Kind::F32, WordOrder::Big, 1e300, 1.0, 0.0),
            Err(EncodeError::OutOfRange { .. })
        ));
        assert!(matches!(
            encode(Kind::U16, WordOrder::Big, f64::NAN, 1.0, 0.0),
            Err(EncodeError::NotFinite(_))
        ));
        // Rounding, not truncation: 2.6 is 3.
        assert_eq!(
            encode(Kind::U16, WordOrder::Big, 2.6, 1.0, 0.0)
                .unwrap()
                .as_slice(),
            [3]
        );
    }

    #[test]
    fn json_booleans_are_numbers() {
        assert_eq!(as_number(&serde_json::json!(true)), Some(1.0));
        assert_eq!(as_number(&serde_json::json!(2.5)), Some(2.5));
        assert_eq!(as_number(&serde_json::json!("3")), None);
    }
}
