//! Keys and stored values: pure encoding, no I/O.
//!
//! A key is 16 bytes, big-endian `(boot, seq)`, so sled's byte order is
//! append order. A value is a small header followed by the record bytes:
//!
//! ```text
//! records tree:  [version=1][appended_at: u64 BE unix ns][stream_len: u16 BE][stream][record]
//! dead tree:     [version=1][appended_at][dead_at: u64 BE unix ns][stream_len][stream]
//!                [reason_len: u16 BE][reason][record]
//! ```

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where a record sits in the outbox: `(boot, seq)`, ordered by append order.
///
/// `boot` is the outbox's boot number when the record was appended (persisted
/// before any append of that boot), `seq` counts from 0 within a boot, so a
/// key never repeats, also across restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Key(pub u64, pub u64);

/// Length of an encoded key.
pub const KEY_LEN: usize = 16;

impl Key {
    pub fn boot(self) -> u64 {
        self.0
    }

    pub fn seq(self) -> u64 {
        self.1
    }

    pub fn to_bytes(self) -> [u8; KEY_LEN] {
        let mut b = [0u8; KEY_LEN];
        b[..8].copy_from_slice(&self.0.to_be_bytes());
        b[8..].copy_from_slice(&self.1.to_be_bytes());
        b
    }

    /// `None` for anything but exactly 16 bytes.
    pub fn from_bytes(b: &[u8]) -> Option<Key> {
        let b: &[u8; KEY_LEN] = b.try_into().ok()?;
        let (hi, lo) = b.split_at(8);
        Some(Key(u64_be(hi)?, u64_be(lo)?))
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.0, self.1)
    }
}

/// Text that is not an outbox key `BOOT/SEQ`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadKey {
    #[error("`{0}` is not a key BOOT/SEQ")]
    NoSlash(String),
    #[error("`{text}` is not a key BOOT/SEQ: {source}")]
    Number {
        text: String,
        source: std::num::ParseIntError,
    },
}

impl std::str::FromStr for Key {
    type Err = BadKey;

    fn from_str(s: &str) -> Result<Key, BadKey> {
        let (b, q) = s
            .split_once('/')
            .ok_or_else(|| BadKey::NoSlash(s.to_string()))?;
        let num = |x: &str| {
            x.parse::<u64>().map_err(|source| BadKey::Number {
                text: s.to_string(),
                source,
            })
        };
        Ok(Key(num(b)?, num(q)?))
    }
}

/// One unacknowledged record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: Key,
    pub stream: String,
    pub appended_at: SystemTime,
    pub record: Vec<u8>,
}

/// One record moved aside because the fleet refused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub key: Key,
    pub stream: String,
    pub appended_at: SystemTime,
    pub dead_at: SystemTime,
    pub reason: String,
    pub record: Vec<u8>,
}

const VERSION: u8 = 1;

/// Why a stored value could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("value too short ({0} bytes)")]
    Short(usize),
    #[error("unknown value version {0}")]
    Version(u8),
    #[error("stream name is not UTF-8")]
    Utf8,
}

/// Longest stream name or dead-letter reason a header can hold.
pub const MAX_NAME: usize = u16::MAX as usize;

fn u64_be(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.try_into().ok()?))
}

/// Nanoseconds since the epoch; clocks before 1970 or after 2554 clamp, and
/// a clamped append time only skews `oldest_age`, never the order (keys do that).
pub fn to_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

pub fn from_nanos(n: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_nanos(n)
}

/// Reads values front to back.
struct Reader<'a> {
    buf: &'a [u8],
    len: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Short(self.len));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        u64_be(b).ok_or(DecodeError::Short(self.len))
    }

    fn name(&mut self) -> Result<String, DecodeError> {
        let l = self.take(2)?;
        let n = usize::from(u16::from_be_bytes([l[0], l[1]]));
        let s = self.take(n)?;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::Utf8)
    }

    fn version(&mut self) -> Result<(), DecodeError> {
        match self.take(1)?[0] {
            VERSION => Ok(()),
            v => Err(DecodeError::Version(v)),
        }
    }
}

fn put_name(out: &mut Vec<u8>, s: &str) {
    // Callers check MAX_NAME; a longer name would be cut, never overflow.
    let b = &s.as_bytes()[..s.len().min(MAX_NAME)];
    out.extend_from_slice(&(b.len() as u16).to_be_bytes());
    out.extend_from_slice(b);
}

/// Encodes a record value; `stream` must be at most [`MAX_NAME`] bytes.
pub fn encode(stream: &str, appended_at: SystemTime, record: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + 8 + 2 + stream.len() + record.len());
    v.push(VERSION);
    v.extend_from_slice(&to_nanos(appended_at).to_be_bytes());
    put_name(&mut v, stream);
    v.extend_from_slice(record);
    v
}

/// Decodes a record value.
pub fn decode(key: Key, v: &[u8]) -> Result<Entry, DecodeError> {
    let mut r = Reader {
        buf: v,
        len: v.len(),
    };
    r.version()?;
    let appended_at = from_nanos(r.u64()?);
    let stream = r.name()?;
    Ok(Entry {
        key,
        stream,
        appended_at,
        record: r.buf.to_vec(),
    })
}

/// The append time alone (for `oldest_age`), without copying the record.
pub fn appended_at(v: &[u8]) -> Result<SystemTime, DecodeError> {
    let mut r = Reader {
        buf: v,
        len: v.len(),
    };
    r.version()?;
    Ok(from_nanos(r.u64()?))
}

/// Encodes a dead letter; `reason` is cut to [`MAX_NAME`] bytes.
pub fn encode_dead(e: &Entry, dead_at: SystemTime, reason: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(1 + 16 + 4 + e.stream.len() + reason.len() + e.record.len());
    v.push(VERSION);
    v.extend_from_slice(&to_nanos(e.appended_at).to_be_bytes());
    v.extend_from_slice(&to_nanos(dead_at).to_be_bytes());
    put_name(&mut v, &e.stream);
    put_name(&mut v, cut(reason, MAX_NAME));
    v.extend_from_slice(&e.record);
    v
}

/// Decodes a dead letter.
pub fn decode_dead(key: Key, v: &[u8]) -> Result<DeadLetter, DecodeError> {
    let mut r = Reader {
        buf: v,
        len: v.len(),
    };
    r.version()?;
    let appended_at = from_nanos(r.u64()?);
    let dead_at = from_nanos(r.u64()?);
    let stream = r.name()?;
    let reason = r.name()?;
    Ok(DeadLetter {
        key,
        stream,
        appended_at,
        dead_at,
        reason,
        record: r.buf.to_vec(),
    })
}

/// `s` cut to at most `max` bytes at a character boundary.
pub fn cut(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_bytes_sort_like_keys() {
        let keys = [
            Key(1, 0),
            Key(1, 1),
            Key(1, 255),
            Key(1, 256),
            Key(2, 0),
            Key(256, 3),
            Key(u64::MAX, u64::MAX),
        ];
        for w in keys.windows(2) {
            assert!(w[0] < w[1]);
            assert!(w[0].to_bytes() < w[1].to_bytes(), "{} vs {}", w[0], w[1]);
        }
        for k in keys {
            assert_eq!(Key::from_bytes(&k.to_bytes()), Some(k));
            assert_eq!(k.to_string().parse::<Key>(), Ok(k));
        }
        assert_eq!(Key::from_bytes(&[0; 15]), None);
        assert!("3".parse::<Key>().is_err());
    }

    #[test]
    fn value_round_trip() {
        let t = from_nanos(1_764_000_000_123_456_789);
        let v = encode("cam-1", t, b"{\"x\":1}");
        let e = decode(Key(3, 4), &v).unwrap();
        assert_eq!(e.stream, "cam-1");
        assert_eq!(e.appended_at, t);
        assert_eq!(e.record, b"{\"x\":1}");
        assert_eq!(appended_at(&v).unwrap(), t);

        let d = encode_dead(&e, from_nanos(5), "http 422: bad schema");
        let dl = decode_dead(Key(3, 4), &d).unwrap();
        assert_eq!(dl.reason, "http 422: bad schema");
        assert_eq!(dl.record, e.record);
        assert_eq!(dl.stream, e.stream);
        assert_eq!(dl.appended_at, t);
        assert_eq!(dl.dead_at, from_nanos(5));
    }

    #[test]
    fn empty_record_and_stream() {
        let v = encode("", UNIX_EPOCH, b"");
        let e = decode(Key(0, 0), &v).unwrap();
        assert!(e.stream.is_empty() && e.record.is_empty());
    }

    #[test]
    fn bad_values_are_errors() {
        assert_eq!(decode(Key(0, 0), &[]), Err(DecodeError::Short(0)));
        assert_eq!(decode(Key(0, 0), &[9; 20]), Err(DecodeError::Version(9)));
        let mut v = encode("abc", UNIX_EPOCH, b"r");
        v.truncate(12);
        assert!(matches!(decode(Key(0, 0), &v), Err(DecodeError::Short(12))));
        let mut v = encode("ab", UNIX_EPOCH, b"");
        v[11] = 0xff;
        assert_eq!(decode(Key(0, 0), &v), Err(DecodeError::Utf8));
    }

    #[test]
    fn cut_keeps_char_boundaries() {
        assert_eq!(cut("héllo", 2), "h");
        assert_eq!(cut("héllo", 3), "hé");
        assert_eq!(cut("abc", 10), "abc");
    }
}
