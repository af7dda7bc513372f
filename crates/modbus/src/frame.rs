//! Modbus TCP requests as the server reads them, and its answers: free of
//! I/O, so every malformed input is tested without a socket.
//!
//! An ADU is the MBAP header (transaction id, protocol id 0, length of what
//! follows, unit id) and a PDU (function code and data), 260 bytes at most.
//! What cannot be framed (a protocol id other than 0, a length outside
//! 2..=254) ends the connection: nothing after it can be trusted to start a
//! frame. A framed request that is wrong (an unknown or write function,
//! a quantity out of range, data of the wrong size) is answered with an
//! exception and the connection goes on. Every such case has its reason.

/// Bytes of the MBAP header.
pub const MBAP: usize = 7;
/// The largest ADU (MBAP + 253-byte PDU).
pub const MAX_ADU: usize = 260;

/// Exception codes the server answers with.
pub mod code {
    pub const ILLEGAL_FUNCTION: u8 = 0x01;
    pub const ILLEGAL_ADDRESS: u8 = 0x02;
    pub const ILLEGAL_VALUE: u8 = 0x03;
    pub const DEVICE_FAILURE: u8 = 0x04;
}

/// What a request asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdu {
    /// FC 1 (coils) or 2 (discrete inputs).
    ReadBits {
        function: u8,
        address: u16,
        count: u16,
    },
    /// FC 3 (holding) or 4 (input registers).
    ReadWords {
        function: u8,
        address: u16,
        count: u16,
    },
    /// FC 5, 6, 15, 16, well formed: this server is read-only.
    Write { function: u8 },
    /// Anything else, or a known function with data of the wrong size.
    Refused {
        function: u8,
        code: u8,
        reason: &'static str,
    },
}

/// One framed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub transaction: u16,
    pub unit: u8,
    pub pdu: Pdu,
}

/// A stream that cannot be framed: the connection ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unframed {
    #[error("protocol id {0} (Modbus is 0)")]
    ProtocolId(u16),
    #[error("length {0} (2 to 254)")]
    Length(u16),
}

impl Unframed {
    pub fn reason(&self) -> &'static str {
        match self {
            Unframed::ProtocolId(_) => "protocol_id",
            Unframed::Length(_) => "bad_length",
        }
    }
}

fn be(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Reads one request from the start of `buf`: `Ok(None)` while it is not
/// all there, else the request and the bytes it took.
pub fn parse(buf: &[u8]) -> Result<Option<(Request, usize)>, Unframed> {
    if buf.len() < MBAP {
        // A wrong protocol id is known from the fourth byte on.
        if buf.len() >= 4 && be(buf, 2) != 0 {
            return Err(Unframed::ProtocolId(be(buf, 2)));
        }
        return Ok(None);
    }
    let (transaction, protocol, length, unit) = (be(buf, 0), be(buf, 2), be(buf, 4), buf[6]);
    if protocol != 0 {
        return Err(Unframed::ProtocolId(protocol));
    }
    if !(2..=254).contains(&length) {
        return Err(Unframed::Length(length));
    }
    let total = 6 + usize::from(length);
    if buf.len() < total {
        return Ok(None);
    }
    let pdu = &buf[MBAP..total];
    Ok(Some((
        Request {
            transaction,
            unit,
            pdu: parse_pdu(pdu),
        },
        total,
    )))
}

fn refused(function: u8, code: u8, reason: &'static str) -> Pdu {
    Pdu::Refused {
        function,
        code,
        reason,
    }
}

fn parse_pdu(pdu: &[u8]) -> Pdu {
    let function = pdu[0];
    let data = &pdu[1..];
    let bad_size = || refused(function, code::ILLEGAL_VALUE, "bad_pdu");
    match function {
        1..=4 => {
            if data.len() != 4 {
                return bad_size();
            }
            let (address, count) = (be(data, 0), be(data, 2));
            let (max, bits) = if function <= 2 {
                (2000, true)
            } else {
                (125, false)
            };
            if count == 0 || count > max {
                return refused(function, code::ILLEGAL_VALUE, "bad_quantity");
            }
            if u32::from(address) + u32::from(count) > 65_536 {
                return refused(function, code::ILLEGAL_ADDRESS, "illegal_address");
            }
            if bits {
                Pdu::ReadBits {
                    function,
                    address,
                    count,
                }
            } else {
                Pdu::ReadWords {
                    function,
                    address,
                    count,
                }
            }
        }
        5 | 6 => {
            if data.len() != 4 {
                return bad_size();
            }
            Pdu::Write { function }
        }
        15 | 16 => {
            if data.len() < 5 {
                return bad_size();
            }
            let count = usize::from(be(data, 2));
            let bytes = usize::from(data[4]);
            let (max, want) = if function == 15 {
                (1968, count.div_ceil(8))
            } else {
                (123, count * 2)
            };
            if count == 0 || count > max || bytes != want {
                return refused(function, code::ILLEGAL_VALUE, "bad_quantity");
            }
            if data.len() != 5 + bytes {
                return bad_size();
            }
            Pdu::Write { function }
        }
        _ => refused(function, code::ILLEGAL_FUNCTION, "illegal_function"),
    }
}

/// Appends an answer's MBAP header and `pdu` to `out`.
fn frame(out: &mut Vec<u8>, req: &Request, pdu: &[u8]) {
    out.extend_from_slice(&req.transaction.to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    // At most 1 + 253: fits.
    out.extend_from_slice(&((pdu.len() + 1) as u16).to_be_bytes());
    out.push(req.unit);
    out.extend_from_slice(pdu);
}

/// Appends an exception answer to `req`.
pub fn exception(out: &mut Vec<u8>, req: &Request, function: u8, code: u8) {
    frame(out, req, &[function | 0x80, code]);
}

/// Appends the answer to a read of registers.
pub fn words(out: &mut Vec<u8>, req: &Request, function: u8, values: &[u16]) {
    let mut pdu = Vec::with_capacity(2 + values.len() * 2);
    pdu.push(function);
    pdu.push((values.len() * 2) as u8);
    for v in values {
        pdu.extend_from_slice(&v.to_be_bytes());
    }
    frame(out, req, &pdu);
}

/// Appends the answer to a read of coils (LSB first, as the spec packs them).
pub fn bits(out: &mut Vec<u8>, req: &Request, function: u8, values: &[bool]) {
    let n = values.len().div_ceil(8);
    let mut pdu = vec![0u8; 2 + n];
    pdu[0] = function;
    pdu[1] = n as u8;
    for (i, on) in values.iter().enumerate() {
        if *on {
            pdu[2 + i / 8] |= 1 << (i % 8);
        }
    }
    frame(out, req, &pdu);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adu(tid: u16, unit: u8, pdu: &[u8]) -> Vec<u8> {
        let mut v = tid.to_be_bytes().to_vec();
        v.extend_from_slice(&[0, 0]);
        v.extend_from_slice(&((pdu.len() + 1) as u16).to_be_bytes());
        v.push(unit);
        v.extend_from_slice(pdu);
        v
    }

    #[test]
    fn a_read_is_framed_whole_and_only_when_all_there() {
        let a = adu(7, 1, &[3, 0, 100, 0, 3]);
        for cut in 0..a.len() {
            assert_eq!(parse(&a[..cut]), Ok(None), "cut at {cut}");
        }
        let mut two = a.clone();
        two.extend_from_slice(&adu(8, 1, &[1, 0, 0, 0, 9]));
        let (r, used) = parse(&two).unwrap().unwrap();
        assert_eq!(used, a.len());
        assert_eq!(
            r,
            Request {
                transaction: 7,
                unit: 1,
                pdu: Pdu::ReadWords {
                    function: 3,
                    address: 100,
                    count: 3
                }
            }
        );
        let (r, _) = parse(&two[used..]).unwrap().unwrap();
        assert!(matches!(r.pdu, Pdu::ReadBits { count: 9, .. }));
    }

    #[test]
    fn what_cannot_be_framed_ends_the_connection() {
        let mut a = adu(1, 1, &[3, 0, 0, 0, 1]);
        a[3] = 1;
        assert_eq!(parse(&a), Err(Unframed::ProtocolId(1)));
        assert_eq!(parse(&a[..4]), Err(Unframed::ProtocolId(1)), "known early");
        let mut a = adu(1, 1, &[3, 0, 0, 0, 1]);
        a[5] = 1;
        assert_eq!(parse(&a), Err(Unframed::Length(1)));
        a[4] = 1;
        a[5] = 0;
        assert_eq!(parse(&a), Err(Unframed::Length(256)));
        assert_eq!(Unframed::Length(256).reason(), "bad_length");
    }

    #[test]
    fn wrong_requests_are_answered_with_their_exception() {
        let pdu = |p: &[u8]| parse(&adu(1, 1, p)).unwrap().unwrap().0.pdu;
        let reason = |p: &[u8]| match pdu(p) {
            Pdu::Refused { code, reason, .. } => (code, reason),
            other => panic!("{other:?}"),
        };
        assert_eq!(reason(&[3, 0, 0, 0, 126]), (3, "bad_quantity"));
        assert_eq!(reason(&[3, 0, 0, 0, 0]), (3, "bad_quantity"));
        assert_eq!(reason(&[1, 0, 0, 0x07, 0xD1]), (3, "bad_quantity"));
        assert_eq!(reason(&[4, 0xFF, 0xFF, 0, 2]), (2, "illegal_address"));
        assert_eq!(reason(&[3, 0, 0, 0]), (3, "bad_pdu"));
        assert_eq!(reason(&[0x2B, 0x0E, 1, 0]), (1, "illegal_function"));
        assert_eq!(reason(&[16, 0, 0, 0, 2, 3, 0, 0, 0]), (3, "bad_quantity"));
        assert_eq!(reason(&[16, 0, 0, 0, 2, 4, 0, 0, 0]), (3, "bad_pdu"));
        assert_eq!(
            pdu(&[16, 0, 0, 0, 2, 4, 0, 0, 0, 0]),
            Pdu::Write { function: 16 }
        );
        assert_eq!(
            pdu(&[15, 0, 0, 0, 9, 2, 0xFF, 1]),
            Pdu::Write { function: 15 }
        );
        assert_eq!(pdu(&[5, 0, 0, 0xFF, 0]), Pdu::Write { function: 5 });
        assert_eq!(reason(&[6, 0, 0]), (3, "bad_pdu"));
    }

    #[test]
    fn answers_carry_the_request_header() {
        let req = Request {
            transaction: 0x1234,
            unit: 9,
            pdu: Pdu::Write { function: 6 },
        };
        let mut out = Vec::new();
        exception(&mut out, &req, 6, code::ILLEGAL_FUNCTION);
        assert_eq!(out, [0x12, 0x34, 0, 0, 0, 3, 9, 0x86, 1]);
        out.clear();
        words(&mut out, &req, 3, &[1, 0xABCD]);
        assert_eq!(out, [0x12, 0x34, 0, 0, 0, 7, 9, 3, 4, 0, 1, 0xAB, 0xCD]);
        out.clear();
        bits(
            &mut out,
            &req,
            1,
            &[true, false, true, false, false, false, false, false, true],
        );
        assert_eq!(out, [0x12, 0x34, 0, 0, 0, 5, 9, 1, 2, 0b101, 1]);
    }

    #[test]
    fn random_bytes_never_panic_and_always_progress_or_stop() {
        // A small xorshift: the same bytes every run.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let n = (next() % 300) as usize;
            let mut b: Vec<u8> = (0..n).map(|_| next() as u8).collect();
            if next() % 2 == 0 && b.len() >= 4 {
                // Half with a right protocol id, to reach the PDU parser.
                b[2] = 0;
                b[3] = 0;
            }
            match parse(&b) {
                Ok(Some((_, used))) => assert!(used > 0 && used <= b.len() && used <= MAX_ADU),
                Ok(None) => assert!(b.len() < MAX_ADU),
                Err(_) => {}
            }
        }
    }
}
