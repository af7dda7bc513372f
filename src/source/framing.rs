//! Frame bodies on byte transports (UDP datagrams, Unix-socket frames).
//!
//! Named framing: `[k: u8][k bytes: stream name, UTF-8][payload]`. Unix
//! sockets wrap each body as `[n: u32 little-endian][n bytes]`.

/// Largest frame accepted on a stream socket; a longer length prefix is a
/// protocol error (the connection is closed: it cannot be resynchronised).
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FramingError {
    #[error("empty frame")]
    Empty,
    #[error("stream name of {0} bytes runs past the end of the frame")]
    Truncated(usize),
    #[error("stream name is not UTF-8")]
    NotUtf8,
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge(usize),
}

impl FramingError {
    pub fn reason(&self) -> &'static str {
        match self {
            FramingError::Empty => "empty_frame",
            FramingError::Truncated(_) | FramingError::NotUtf8 => "bad_framing",
            FramingError::TooLarge(_) => "frame_too_large",
        }
    }
}

/// Splits a named-framing body into (stream name, payload). An empty name
/// means "the transport's default stream".
pub fn split_named(body: &[u8]) -> Result<(Option<&str>, &[u8]), FramingError> {
    let Some((&k, rest)) = body.split_first() else {
        return Err(FramingError::Empty);
    };
    let k = k as usize;
    if rest.len() < k {
        return Err(FramingError::Truncated(k));
    }
    let (name, payload) = rest.split_at(k);
    let name = std::str::from_utf8(name).map_err(|_| FramingError::NotUtf8)?;
    Ok(((!name.is_empty()).then_some(name), payload))
}

/// Builds a named-framing body (for clients and tests).
pub fn named(stream: &str, payload: &[u8]) -> Vec<u8> {
    let name = &stream.as_bytes()[..stream.len().min(255)];
    let mut v = Vec::with_capacity(1 + name.len() + payload.len());
    v.push(name.len() as u8);
    v.extend_from_slice(name);
    v.extend_from_slice(payload);
    v
}

/// Prefixes a body with its u32 little-endian length (Unix-socket frames).
pub fn length_prefixed(body: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + body.len());
    v.extend_from_slice(&(body.len() as u32).to_le_bytes());
    v.extend_from_slice(body);
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn named_round_trip() {
        let b = named("mic-3", b"\x01\x02");
        assert_eq!(split_named(&b).unwrap(), (Some("mic-3"), &b"\x01\x02"[..]));
        assert_eq!(split_named(&named("", b"x")).unwrap(), (None, &b"x"[..]));
        assert_eq!(split_named(b""), Err(FramingError::Empty));
        assert_eq!(split_named(b"\x05ab"), Err(FramingError::Truncated(5)));
        assert_eq!(split_named(b"\x02\xff\xfe"), Err(FramingError::NotUtf8));
    }

    proptest! {
        #[test]
        fn split_named_never_panics(body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let _ = split_named(&body);
        }
    }
}
