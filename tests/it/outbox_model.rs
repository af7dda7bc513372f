//! The outbox against an in-memory model (as Vector's disk buffer is
//! tested): proptest draws a sequence of appends, acks, dead letters and
//! reopens under either full policy, runs it on a real outbox on disk and on
//! a few lines of `VecDeque` bookkeeping, and after every step compares what
//! is pending, the dead letters, the keys and the byte accounting.
//!
//! A failure prints the shrunk sequence of operations, and proptest keeps
//! its seed in `tests/proptest-regressions/outbox_model.txt` so the next run
//! tries it first (commit that file with the fix).

use std::collections::VecDeque;

use outpost::outbox::{Key, Outbox, OutboxConfig, OutboxError, WhenFull};
use proptest::prelude::*;

/// The smallest budget the config accepts: a few dozen records fill it.
const MAX_BYTES: u64 = 65536;
/// Key (16) + version (1) + append time (8) + stream length (2).
const RECORD_OVERHEAD: u64 = 16 + 1 + 8 + 2;
/// Key (16) + version (1) + append and death times (16) + two lengths (4).
const DEAD_OVERHEAD: u64 = 16 + 1 + 16 + 2 + 2;
const STREAMS: [&str; 3] = ["a", "cam-2", "vad/long-stream-name"];

#[derive(Debug, Clone)]
enum Op {
    /// A record of this many bytes on stream `STREAMS[s]`.
    Append { stream: usize, len: usize },
    /// Acknowledge the pending records at these positions (mod the count).
    Ack(Vec<usize>),
    /// Move the pending record at this position (mod the count) aside.
    DeadLetter(usize, String),
    /// Close and open again (a clean restart).
    Reopen,
    /// Wait for durability (changes nothing visible).
    Sync,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..STREAMS.len(), 0usize..6000).prop_map(|(stream, len)| Op::Append { stream, len }),
        3 => prop::collection::vec(0usize..64, 1..6).prop_map(Op::Ack),
        1 => (0usize..64, "[a-z ]{0,40}").prop_map(|(i, r)| Op::DeadLetter(i, r)),
        1 => Just(Op::Reopen),
        1 => Just(Op::Sync),
    ]
}

#[derive(Debug, Clone, PartialEq)]
struct Rec {
    key: Key,
    stream: String,
    body: Vec<u8>,
}

impl Rec {
    fn bytes(&self) -> u64 {
        RECORD_OVERHEAD + self.stream.len() as u64 + self.body.len() as u64
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Dead {
    rec: Rec,
    reason: String,
}

impl Dead {
    fn bytes(&self) -> u64 {
        DEAD_OVERHEAD
            + self.rec.stream.len() as u64
            + self.reason.len() as u64
            + self.rec.body.len() as u64
    }
}

/// What the outbox should hold: oldest first.
#[derive(Debug, Default)]
struct Model {
    boot: u64,
    seq: u64,
    records: VecDeque<Rec>,
    dead: VecDeque<Dead>,
    /// Since the last open.
    dropped_oldest: u64,
    rejected: u64,
    dropped_dead: u64,
}

/// What an append should give.
#[derive(Debug, PartialEq)]
enum AppendOutcome {
    Stored(Key),
    TooLarge,
    Full,
}

impl Model {
    fn used(&self) -> u64 {
        self.records.iter().map(Rec::bytes).sum::<u64>()
            + self.dead.iter().map(Dead::bytes).sum::<u64>()
    }

    fn append(&mut self, when_full: WhenFull, stream: &str, body: Vec<u8>) -> AppendOutcome {
        let rec = Rec {
            key: Key(self.boot, self.seq),
            stream: stream.to_string(),
            body,
        };
        let size = rec.bytes();
        if size > MAX_BYTES {
            return AppendOutcome::TooLarge;
        }
        // Dead letters go first, oldest first; then the policy.
        while self.used() + size > MAX_BYTES {
            if self.dead.pop_front().is_some() {
                self.dropped_dead += 1;
                continue;
            }
            match when_full {
                WhenFull::DropOldest if self.records.pop_front().is_some() => {
                    self.dropped_oldest += 1
                }
                _ => {
                    self.rejected += 1;
                    return AppendOutcome::Full;
                }
            }
        }
        self.seq += 1;
        let key = rec.key;
        self.records.push_back(rec);
        AppendOutcome::Stored(key)
    }

    fn reopen(&mut self) {
        self.boot += 1;
        self.seq = 0;
        self.dropped_oldest = 0;
        self.rejected = 0;
        self.dropped_dead = 0;
    }
}

/// Record bodies that tell one record from another (and are not all zeros).
fn body(n: u64, len: usize) -> Vec<u8> {
    let mut b = format!("{n}:").into_bytes();
    b.resize(len, b'a' + (n % 26) as u8);
    b.truncate(len);
    b
}

fn check(ob: &Outbox, m: &Model, step: usize, op: &Op) -> Result<(), TestCaseError> {
    let ctx = format!("after step {step} ({op:?})");
    let pending = ob.pending(None, 10_000).unwrap();
    let got: Vec<Rec> = pending
        .into_iter()
        .map(|e| Rec {
            key: e.key,
            stream: e.stream,
            body: e.record,
        })
        .collect();
    let want: Vec<Rec> = m.records.iter().cloned().collect();
    prop_assert_eq!(
        got.iter().map(|r| r.key).collect::<Vec<_>>(),
        want.iter().map(|r| r.key).collect::<Vec<_>>(),
        "pending keys {}",
        ctx
    );
    prop_assert!(got == want, "pending records differ {}", ctx);
    let dead: Vec<Dead> = ob
        .dead_letters(None, 10_000)
        .unwrap()
        .into_iter()
        .map(|d| Dead {
            rec: Rec {
                key: d.key,
                stream: d.stream,
                body: d.record,
            },
            reason: d.reason,
        })
        .collect();
    prop_assert!(
        dead == m.dead.iter().cloned().collect::<Vec<_>>(),
        "dead letters differ {}: {:?} vs {:?}",
        ctx,
        dead.iter().map(|d| d.rec.key).collect::<Vec<_>>(),
        m.dead.iter().map(|d| d.rec.key).collect::<Vec<_>>()
    );
    let s = ob.stats();
    prop_assert_eq!(s.boot, m.boot, "boot {}", &ctx);
    prop_assert_eq!(s.records, m.records.len() as u64, "records {}", &ctx);
    prop_assert_eq!(
        s.bytes,
        m.records.iter().map(Rec::bytes).sum::<u64>(),
        "bytes {}",
        &ctx
    );
    prop_assert_eq!(s.dead_letters, m.dead.len() as u64, "dead letters {}", &ctx);
    prop_assert_eq!(
        s.dead_letter_bytes,
        m.dead.iter().map(Dead::bytes).sum::<u64>(),
        "dead letter bytes {}",
        &ctx
    );
    prop_assert!(
        s.bytes + s.dead_letter_bytes <= MAX_BYTES,
        "over budget {}",
        &ctx
    );
    prop_assert_eq!(
        s.dropped.full_drop_oldest,
        m.dropped_oldest,
        "drop_oldest {}",
        &ctx
    );
    prop_assert_eq!(s.dropped.full_reject_new, m.rejected, "reject_new {}", &ctx);
    prop_assert_eq!(
        s.dropped.full_drop_dead_letter,
        m.dropped_dead,
        "dead letters dropped {}",
        &ctx
    );
    Ok(())
}

fn run(when_full: WhenFull, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("outbox");
    let cfg = OutboxConfig {
        max_bytes: MAX_BYTES,
        when_full,
        ..OutboxConfig::default()
    };
    let mut ob = Outbox::open(&dir, cfg.clone()).unwrap();
    let mut m = Model {
        boot: ob.boot(),
        ..Model::default()
    };
    let mut n = 0u64;
    for (step, op) in ops.iter().enumerate() {
        match op {
            Op::Append { stream, len } => {
                n += 1;
                let b = body(n, *len);
                let want = m.append(when_full, STREAMS[*stream], b.clone());
                let got = match ob.append(STREAMS[*stream], &b) {
                    Ok(k) => AppendOutcome::Stored(k),
                    Err(OutboxError::TooLarge { .. }) => AppendOutcome::TooLarge,
                    Err(OutboxError::Full { .. }) => AppendOutcome::Full,
                    Err(e) => panic!("step {step}: append: {e}"),
                };
                prop_assert_eq!(got, want, "append at step {}", step);
            }
            Op::Ack(picks) => {
                if m.records.is_empty() {
                    continue;
                }
                let len = m.records.len();
                let keys: Vec<Key> = picks.iter().map(|i| m.records[i % len].key).collect();
                m.records.retain(|r| !keys.contains(&r.key));
                ob.ack(&keys).unwrap();
            }
            Op::DeadLetter(i, reason) => {
                if m.records.is_empty() {
                    continue;
                }
                let at = i % m.records.len();
                let Some(rec) = m.records.remove(at) else {
                    continue;
                };
                ob.dead_letter(rec.key, reason).unwrap();
                // Dead letters keep key order (sled sorts them by key).
                let pos = m
                    .dead
                    .iter()
                    .position(|d| d.rec.key > rec.key)
                    .unwrap_or(m.dead.len());
                m.dead.insert(
                    pos,
                    Dead {
                        rec,
                        reason: reason.clone(),
                    },
                );
                // A dead letter is larger than its record: over budget, the
                // oldest dead letters go (never a record to be sent).
                while m.used() > MAX_BYTES && m.dead.pop_front().is_some() {
                    m.dropped_dead += 1;
                }
            }
            Op::Reopen => {
                ob.close().unwrap();
                ob = Outbox::open(&dir, cfg.clone()).unwrap();
                m.reopen();
            }
            Op::Sync => ob.sync().unwrap(),
        }
        check(&ob, &m, step, op)?;
    }
    ob.close().unwrap();
    Ok(())
}

proptest! {
    // Each case opens a real sled database (and reopens it): few cases, many
    // steps each.
    #![proptest_config(ProptestConfig {
        cases: 24,
        ..ProptestConfig::default()
    })]

    #[test]
    fn outbox_matches_the_model_drop_oldest(ops in prop::collection::vec(op(), 1..80)) {
        run(WhenFull::DropOldest, ops)?;
    }

    #[test]
    fn outbox_matches_the_model_reject_new(ops in prop::collection::vec(op(), 1..80)) {
        run(WhenFull::RejectNew, ops)?;
    }
}
