//! The Modbus source's reads: one block of registers (or coils) per poll,
//! decoded into values for a sensor frame. Sources on one PLC (the same
//! `target`) share one connection through the [`Hub`]; their reads take
//! turns on it.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::config::SourceConfig;
use crate::encode::decode;
use crate::link::{Link, LinkError, LinkStats, LinkStatus, Op, Reply};

/// Why a poll gave no values.
#[derive(Debug, thiserror::Error)]
pub enum PollError {
    /// The PLC answered with an exception (retrying may help for 05/06).
    #[error("exception {0:#04x} from the PLC")]
    Exception(u8),
    #[error(transparent)]
    Link(#[from] LinkError),
    /// The answer had another size than asked (a PLC's bug).
    #[error("answer of {got} values, {want} asked")]
    Size { got: usize, want: usize },
}

impl PollError {
    /// The drop reason a failed poll is counted under.
    pub fn reason(&self) -> &'static str {
        match self {
            PollError::Exception(c) => exception_reason(*c),
            PollError::Link(LinkError::Backoff { .. } | LinkError::Connect { .. }) => {
                "modbus_unreachable"
            }
            PollError::Link(LinkError::Timeout { .. }) => "modbus_timeout",
            PollError::Link(LinkError::Lost { .. }) => "modbus_lost",
            PollError::Size { .. } => "modbus_bad_answer",
        }
    }
}

/// The counter label of an exception code.
pub fn exception_reason(code: u8) -> &'static str {
    match code {
        0x01 => "modbus_exception_01",
        0x02 => "modbus_exception_02",
        0x03 => "modbus_exception_03",
        0x04 => "modbus_exception_04",
        0x05 => "modbus_exception_05",
        0x06 => "modbus_exception_06",
        0x08 => "modbus_exception_08",
        0x0A => "modbus_exception_0a",
        0x0B => "modbus_exception_0b",
        _ => "modbus_exception_other",
    }
}

/// One source's reads.
#[derive(Debug, Clone)]
pub struct Poller {
    cfg: SourceConfig,
}

impl Poller {
    pub fn new(cfg: &SourceConfig) -> Poller {
        Poller { cfg: cfg.clone() }
    }

    pub fn op(&self) -> Op<'static> {
        Op::Read(self.cfg.table, self.cfg.address, self.cfg.count)
    }

    /// The values an answer holds.
    pub fn values(&self, reply: &Reply) -> Result<Vec<f64>, PollError> {
        let c = &self.cfg;
        let want = usize::from(c.count);
        let (scale, offset) = (c.scale, c.offset);
        match reply {
            Reply::Bits(b) => {
                // Coils come in whole bytes: the PLC pads the last one.
                if b.len() < want {
                    return Err(PollError::Size { got: b.len(), want });
                }
                Ok(b[..want]
                    .iter()
                    .map(|on| (f64::from(u8::from(*on)) - offset) / scale)
                    .collect())
            }
            Reply::Words(w) => {
                if w.len() != want {
                    return Err(PollError::Size { got: w.len(), want });
                }
                Ok(w.chunks_exact(usize::from(c.kind.width()))
                    .map(|words| decode(c.kind, c.word_order, words, scale, offset))
                    .collect())
            }
            Reply::Written => Err(PollError::Size { got: 0, want }),
        }
    }

    /// One read on `link`.
    pub async fn poll(&self, link: &mut Link) -> Result<Vec<f64>, PollError> {
        match link.call(self.cfg.unit, self.op()).await? {
            Ok(reply) => self.values(&reply),
            Err(code) => Err(PollError::Exception(code)),
        }
    }
}

/// A sensor frame of values: a JSON array (what a sensor model's `json`
/// format reads).
pub fn json_frame(values: &[f64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() * 8 + 2);
    out.push(b'[');
    for (i, v) in values.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // Values decoded from registers are finite but for an f32 NaN or
        // infinity a PLC may hold: JSON has no such number, write null
        // (the model's preprocessing refuses the frame, counted).
        if v.is_finite() {
            out.extend_from_slice(v.to_string().as_bytes());
        } else {
            out.extend_from_slice(b"null");
        }
    }
    out.push(b']');
    out
}

type Shared = Arc<tokio::sync::Mutex<Link>>;

/// The connections of a generation's sources, one per target.
#[derive(Default)]
pub struct Hub {
    links: Mutex<BTreeMap<String, (Shared, Arc<LinkStats>)>>,
}

impl Hub {
    /// The connection to `target` (made on first use; the first source's
    /// `timeout` holds for it).
    pub fn link(&self, target: &str, timeout: Duration) -> Shared {
        let mut links = self.links.lock();
        links
            .entry(target.to_string())
            .or_insert_with(|| {
                let l = Link::new(target, timeout);
                let stats = l.stats.clone();
                (Arc::new(tokio::sync::Mutex::new(l)), stats)
            })
            .0
            .clone()
    }

    pub fn status(&self) -> Vec<LinkStatus> {
        self.links
            .lock()
            .iter()
            .map(|(t, (_, s))| s.status(t))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn src(extra: &str) -> Poller {
        Poller::new(
            &toml::from_str(&format!(
                "target = \"plc:502\"\naddress = 200\ninterval = \"1s\"\n{extra}"
            ))
            .unwrap(),
        )
    }

    #[test]
    fn registers_decode_by_kind_and_scale() {
        let p = src("count = 4\nkind = \"f32\"");
        let v = p.values(&Reply::Words(vec![0x3F80, 0, 0xC000, 0])).unwrap();
        assert_eq!(v, [1.0, -2.0]);
        let p = src("count = 2\nkind = \"i16\"\nscale = 10");
        assert_eq!(
            p.values(&Reply::Words(vec![0xFFF6, 25])).unwrap(),
            [-1.0, 2.5]
        );
        assert!(matches!(
            p.values(&Reply::Words(vec![1])),
            Err(PollError::Size { got: 1, want: 2 })
        ));
        let p = src("count = 3\ntable = \"coils\"\nkind = \"bool\"");
        let v = p
            .values(&Reply::Bits(vec![
                true, false, true, false, false, false, false, false,
            ]))
            .unwrap();
        assert_eq!(v, [1.0, 0.0, 1.0]);
    }

    #[test]
    fn frames_are_json_arrays() {
        assert_eq!(json_frame(&[1.0, 2.5, -3.0]), b"[1,2.5,-3]");
        assert_eq!(json_frame(&[f64::NAN]), b"[null]");
        assert_eq!(json_frame(&[]), b"[]");
    }

    #[test]
    fn exception_codes_have_their_own_reason() {
        assert_eq!(PollError::Exception(2).reason(), "modbus_exception_02");
        assert_eq!(
            PollError::Exception(0x42).reason(),
            "modbus_exception_other"
        );
    }

    #[tokio::test]
    async fn sources_on_one_plc_share_its_connection() {
        let hub = Hub::default();
        let a = hub.link("plc:502", Duration::from_secs(1));
        let b = hub.link("plc:502", Duration::from_secs(2));
        let c = hub.link("other:502", Duration::from_secs(1));
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(hub.status().len(), 2);
    }
}
