//! The bound on what a camera sends before the RTSP client reads it. A
//! camera is untrusted input (broken firmware, or a device taken over):
//! the RTSP client (retina) parses messages with no size bound, reserves a
//! message's declared `Content-Length` before reading it, and gathers a
//! frame's RTP packets with no cap. One answer declaring 100 GB aborted
//! the whole daemon; an FU-A that started and never ended grew by 67 MB/s.
//!
//! So the camera's bytes pass through [`Inspector`] first, on their way
//! from the camera's socket to the client (a loopback connection of the
//! camera's own thread, [`relay`]). It follows the stream's framing
//! (RTSP messages, and RTP packets interleaved as `$`, channel, length)
//! and refuses, before any of it reaches the client:
//! - a message head longer than [`MAX_HEAD`] bytes, or a message whose
//!   declared body is over the camera's `max_frame_bytes` (or not a
//!   number);
//! - a frame (the RTP payloads of one channel from one timestamp up to
//!   the packet with the marker bit, which ends an access unit) over
//!   `max_frame_bytes`.
//!
//! The inspector is free of I/O: it is fed the bytes as they are read
//! and answers whether they may go on. An interleaved packet's length is
//! a 16-bit field, so what it buffers is at most one RTP header.

use std::fmt;

/// The longest message head (request or status line and headers) a camera
/// may send. Real answers are a few hundred bytes; a DESCRIBE's SDP is in
/// the body.
pub const MAX_HEAD: usize = 64 * 1024;

/// Bytes of an RTP header the inspector reads: flags, marker and payload
/// type, sequence number, timestamp.
const RTP_HEAD: usize = 8;

/// Why the camera's stream was cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Oversize {
    /// A message head that never ended within [`MAX_HEAD`] bytes.
    Head { bytes: usize },
    /// A message that declared a body over the limit (`None`: not a
    /// number, or beyond 64 bits).
    Message { declared: Option<u64>, max: u64 },
    /// A frame of one RTP channel that grew over the limit.
    Frame { channel: u8, bytes: u64, max: u64 },
}

impl Oversize {
    /// `message` or `frame`: the label of its counter.
    pub fn kind(&self) -> &'static str {
        match self {
            Oversize::Head { .. } | Oversize::Message { .. } => "message",
            Oversize::Frame { .. } => "frame",
        }
    }
}

impl fmt::Display for Oversize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Oversize::Head { bytes } => write!(
                f,
                "the camera sent an RTSP message head of over {bytes} bytes (at most {MAX_HEAD}); connection closed"
            ),
            Oversize::Message {
                declared: Some(n),
                max,
            } => write!(
                f,
                "the camera declared an RTSP message body of {n} bytes, over max_frame_bytes ({max}); connection closed"
            ),
            Oversize::Message {
                declared: None,
                max,
            } => write!(
                f,
                "the camera declared an RTSP message body whose Content-Length is not a size (max_frame_bytes {max}); connection closed"
            ),
            Oversize::Frame {
                channel,
                bytes,
                max,
            } => write!(
                f,
                "the camera sent a frame of over {bytes} bytes on channel {channel}, over max_frame_bytes ({max}); connection closed"
            ),
        }
    }
}

/// Where the inspector is in the camera's stream.
#[derive(Debug)]
enum At {
    /// Between messages (CR and LF between them are skipped, as the
    /// client does).
    Between,
    /// In an interleaved packet's 4-byte header.
    Interleaved { head: [u8; 4], have: usize },
    /// In an interleaved packet's payload: `left` bytes to go, the first
    /// `RTP_HEAD` of them read into `rtp`.
    Payload {
        channel: u8,
        len: usize,
        left: usize,
        rtp: [u8; RTP_HEAD],
    },
    /// In a message head (its bytes so far).
    Head(Vec<u8>),
    /// In a message body.
    Body { left: u64 },
}

/// One channel's frame so far.
#[derive(Debug, Clone, Copy, Default)]
struct Building {
    timestamp: u32,
    bytes: u64,
}

/// Follows a camera's byte stream and refuses what is over the limits.
#[derive(Debug)]
pub struct Inspector {
    max: u64,
    at: At,
    frames: Vec<Option<Building>>,
    /// Once refused, every later byte is.
    refused: Option<Oversize>,
}

impl Inspector {
    /// `max`: the camera's `max_frame_bytes`.
    pub fn new(max: u64) -> Inspector {
        Inspector {
            max,
            at: At::Between,
            frames: vec![None; 256],
            refused: None,
        }
    }

    /// The next bytes from the camera: whether they may go on to the client.
    pub fn feed(&mut self, mut data: &[u8]) -> Result<(), Oversize> {
        if let Some(r) = &self.refused {
            return Err(r.clone());
        }
        while !data.is_empty() {
            let used = match self.step(data) {
                Ok(n) => n,
                Err(e) => {
                    self.refused = Some(e.clone());
                    return Err(e);
                }
            };
            data = &data[used..];
        }
        Ok(())
    }

    /// Takes what it can of `data` in the current state; how much it took.
    fn step(&mut self, data: &[u8]) -> Result<usize, Oversize> {
        match &mut self.at {
            At::Between => match data[0] {
                b'\r' | b'\n' => Ok(1),
                b'$' => {
                    self.at = At::Interleaved {
                        head: [b'$', 0, 0, 0],
                        have: 1,
                    };
                    Ok(1)
                }
                // A message's first byte is taken by `Head`.
                _ => {
                    self.at = At::Head(Vec::with_capacity(512));
                    Ok(0)
                }
            },
            At::Interleaved { head, have } => {
                let n = (4 - *have).min(data.len());
                head[*have..*have + n].copy_from_slice(&data[..n]);
                *have += n;
                if *have == 4 {
                    let len = usize::from(u16::from_be_bytes([head[2], head[3]]));
                    let channel = head[1];
                    self.at = if len == 0 {
                        At::Between
                    } else {
                        At::Payload {
                            channel,
                            len,
                            left: len,
                            rtp: [0; RTP_HEAD],
                        }
                    };
                }
                Ok(n)
            }
            At::Payload {
                channel,
                len,
                left,
                rtp,
            } => {
                let read = *len - *left;
                let n = (*left).min(data.len());
                if read < RTP_HEAD {
                    let k = (RTP_HEAD - read).min(n);
                    rtp[read..read + k].copy_from_slice(&data[..k]);
                }
                *left -= n;
                if *left == 0 {
                    let (channel, len, rtp) = (*channel, *len, *rtp);
                    self.at = At::Between;
                    self.packet(channel, len, &rtp)?;
                }
                Ok(n)
            }
            At::Head(head) => {
                // Up to and including the blank line that ends the head.
                let mut taken = data.len();
                let mut done = false;
                for (i, b) in data.iter().enumerate() {
                    head.push(*b);
                    if *b == b'\n' && (head.ends_with(b"\r\n\r\n") || head.ends_with(b"\n\n")) {
                        taken = i + 1;
                        done = true;
                        break;
                    }
                    if head.len() > MAX_HEAD {
                        return Err(Oversize::Head { bytes: MAX_HEAD });
                    }
                }
                if done {
                    let left = content_length(head).map_err(|declared| Oversize::Message {
                        declared,
                        max: self.max,
                    })?;
                    if left > self.max {
                        return Err(Oversize::Message {
                            declared: Some(left),
                            max: self.max,
                        });
                    }
                    self.at = if left == 0 {
                        At::Between
                    } else {
                        At::Body { left }
                    };
                }
                Ok(taken)
            }
            At::Body { left } => {
                let n = (*left).min(data.len() as u64);
                *left -= n;
                if *left == 0 {
                    self.at = At::Between;
                }
                // n <= data.len(), a usize.
                Ok(n as usize)
            }
        }
    }

    /// A whole interleaved packet of `len` bytes on `channel`, whose first
    /// bytes are `rtp`: adds its payload to the channel's frame.
    fn packet(&mut self, channel: u8, len: usize, rtp: &[u8; RTP_HEAD]) -> Result<(), Oversize> {
        // RTCP (payload types 200-207 in the second byte) and anything too
        // short for an RTP header carry no frame.
        if len < 12 || (200..=207).contains(&rtp[1]) {
            return Ok(());
        }
        let marker = rtp[1] & 0x80 != 0;
        let timestamp = u32::from_be_bytes([rtp[4], rtp[5], rtp[6], rtp[7]]);
        let slot = &mut self.frames[usize::from(channel)];
        let mut b = match slot {
            // A new timestamp is a new frame, marker or not (cameras that
            // never set it).
            Some(b) if b.timestamp == timestamp => *b,
            _ => Building {
                timestamp,
                bytes: 0,
            },
        };
        b.bytes += len as u64;
        if b.bytes > self.max {
            return Err(Oversize::Frame {
                channel,
                bytes: self.max,
                max: self.max,
            });
        }
        *slot = if marker { None } else { Some(b) };
        Ok(())
    }
}

/// The `Content-Length` of a message head: 0 without one; `Err(None)`
/// when it is not a number that fits 64 bits.
fn content_length(head: &[u8]) -> Result<u64, Option<u64>> {
    let text = String::from_utf8_lossy(head);
    for line in text.lines() {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("content-length") {
            return value.trim().parse::<u64>().map_err(|_| None);
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rtp(channel: u8, payload_len: usize, marker: bool, ts: u32) -> Vec<u8> {
        let len = 12 + payload_len;
        let mut v = vec![b'$', channel];
        v.extend_from_slice(&(len as u16).to_be_bytes());
        v.push(0x80);
        v.push(if marker { 0x80 | 96 } else { 96 });
        v.extend_from_slice(&[0, 1]);
        v.extend_from_slice(&ts.to_be_bytes());
        v.extend_from_slice(&[0, 0, 0, 1]);
        v.extend(std::iter::repeat_n(0x5a, payload_len));
        v
    }

    fn answer(body: &str) -> Vec<u8> {
        format!(
            "RTSP/1.0 200 OK\r\nCSeq: 2\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    }

    #[test]
    fn a_real_session_passes_whole_and_byte_by_byte() {
        let mut stream = answer("v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\n");
        stream.extend(b"RTSP/1.0 200 OK\r\nCSeq: 3\r\nSession: 1\r\n\r\n");
        stream.extend(b"\r\n");
        for i in 0..50u32 {
            stream.extend(rtp(0, 1400, i % 5 == 4, i / 5));
            stream.extend(rtp(1, 40, false, 0).iter().enumerate().map(|(k, b)| {
                // An RTCP sender report on the odd channel.
                if k == 5 { 200 } else { *b }
            }));
        }
        stream.extend(answer("")); // a keepalive's answer among the packets
        stream.extend(rtp(0, 100, true, 99));
        assert_eq!(Inspector::new(8 << 20).feed(&stream), Ok(()));
        let mut one = Inspector::new(8 << 20);
        for b in &stream {
            assert_eq!(one.feed(std::slice::from_ref(b)), Ok(()));
        }
        assert!(matches!(one.at, At::Between));
    }

    #[test]
    fn a_declared_body_over_the_limit_is_refused_before_any_of_it_arrives() {
        let head = b"RTSP/1.0 200 OK\r\nCSeq: 2\r\nContent-Length: 100000000000\r\n\r\n";
        let mut i = Inspector::new(8 << 20);
        assert_eq!(
            i.feed(head),
            Err(Oversize::Message {
                declared: Some(100_000_000_000),
                max: 8 << 20
            })
        );
        // And stays refused.
        assert!(i.feed(b"v=0").is_err());
        let max = b"RTSP/1.0 200 OK\r\ncontent-length:18446744073709551615\r\n\r\n";
        assert!(matches!(
            Inspector::new(1 << 20).feed(max),
            Err(Oversize::Message { .. })
        ));
        let beyond = b"RTSP/1.0 200 OK\r\nContent-Length: 18446744073709551616\r\n\r\n";
        assert_eq!(
            Inspector::new(1 << 20).feed(beyond),
            Err(Oversize::Message {
                declared: None,
                max: 1 << 20
            })
        );
        let e = Inspector::new(8 << 20).feed(head).unwrap_err();
        assert!(e.to_string().contains("max_frame_bytes"), "{e}");
        assert_eq!(e.kind(), "message");
    }

    #[test]
    fn a_head_that_never_ends_is_refused() {
        let mut i = Inspector::new(8 << 20);
        let line = b"X-Filler: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
        assert_eq!(i.feed(b"RTSP/1.0 200 OK\r\n"), Ok(()));
        let mut r = Ok(());
        for _ in 0..2000 {
            r = i.feed(line);
            if r.is_err() {
                break;
            }
        }
        assert_eq!(r, Err(Oversize::Head { bytes: MAX_HEAD }));
    }

    #[test]
    fn a_frame_that_never_ends_is_cut_at_the_limit() {
        let max = 100_000;
        let mut i = Inspector::new(max);
        let mut sent = 0u64;
        let r = loop {
            let p = rtp(0, 1400, false, 7);
            sent += p.len() as u64;
            if let Err(e) = i.feed(&p) {
                break e;
            }
            assert!(sent < 2 * max, "never cut");
        };
        assert_eq!(
            r,
            Oversize::Frame {
                channel: 0,
                bytes: max,
                max
            }
        );
        assert_eq!(r.kind(), "frame");
        // Whole frames each under the limit pass, however many.
        let mut i = Inspector::new(max);
        for ts in 0..1000 {
            for k in 0..10 {
                assert_eq!(i.feed(&rtp(0, 1400, k == 9, ts)), Ok(()));
            }
        }
        // Without marker bits, a new timestamp starts a new frame.
        let mut i = Inspector::new(max);
        for ts in 0..1000 {
            for _ in 0..10 {
                assert_eq!(i.feed(&rtp(2, 1400, false, ts)), Ok(()));
            }
        }
    }
}
