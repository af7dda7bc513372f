//! The session against a simulated rumqttc, broker and outbox (no I/O, no
//! clock): a few scenarios written out, and a model test where proptest
//! draws sequences of appends (good records and ones that can never be
//! sent), publishes put on the wire, PUBACKs in any order, disconnects,
//! reconnects, outbox faults, time passing and Sparkplug rebirth commands,
//! under random windows, page sizes, batch sizes and payload formats.
//!
//! The reference is a few lines of bookkeeping over what the simulated
//! outbox holds and what each publish carries (read back from the payload
//! as the fleet would: the record ids in the JSON, the `{stream}/id` metric
//! of a Sparkplug DDATA). After every command it checks:
//! - never more messages in flight than the window (two more for a
//!   Sparkplug record's DDEATH and DBIRTH), and the session's count is the
//!   simulated rumqttc's;
//! - an outbox ack names only records whose PUBACK came, and each record is
//!   acknowledged to the outbox successfully at most once;
//! - per stream, a connection publishes the records still to be delivered
//!   in key order with none skipped (so what was unacknowledged when the
//!   last connection dropped goes again);
//! - after every CONNACK the "online" status goes first, and with
//!   Sparkplug B the NBIRTH before any device message and a device's
//!   DBIRTH before its DDATA;
//! - only records that can never be sent are dead-lettered, and never
//!   published; an outbox fault leaves the connection up.
//!
//! At the end the faults stop, the simulation drains, and every record has
//! been acknowledged exactly once (or dead-lettered once): the outbox is empty.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use proptest::prelude::*;
use prost::Message as _;

use super::*;
use crate::uplink::PayloadFormat;
use crate::uplink::message::Template;

/// Outbox faults: a disk can fail writes (acks, dead letters) and still
/// serve reads, or fail everything.
const READ: u8 = 1;
const ACK: u8 = 2;
const DEAD: u8 = 4;
const ALL: u8 = READ | ACK | DEAD;

const STATUS: &str = "outpost/gw/status";
const DEVICE: &str = "gw";

fn settings(window: usize, page: usize, batch: usize, sparkplug: bool) -> Settings {
    Settings {
        max_inflight: window,
        page,
        batcher: Batcher {
            topic: Template::parse(
                "outpost/{device}/{pipeline}/{stream}",
                &["device", "pipeline", "stream"],
            )
            .unwrap(),
            device: DEVICE.into(),
            batch,
            format: if sparkplug {
                PayloadFormat::SparkplugB
            } else {
                PayloadFormat::Json
            },
            max_payload: 1 << 20,
        },
        status_topic: STATUS.into(),
        subscriptions: vec![],
        sparkplug: sparkplug.then(|| Topics {
            group: "plant".into(),
            node: DEVICE.into(),
        }),
        bounds: Bounds {
            max_metrics: 4096,
            max_payload: 1 << 20,
            rebirth_interval: Duration::from_millis(50),
        },
        max_bytes_per_s: 0,
        backoff_min: Duration::from_millis(10),
        backoff_max: Duration::from_millis(80),
    }
}

/// What a record appended to the simulated outbox is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Good,
    /// Not JSON: never sent, in any format.
    NotJson,
    /// A pipeline that cannot be a Sparkplug device id: fine as JSON.
    BadDevice,
}

/// One publish handed to the simulated rumqttc.
#[derive(Debug, Clone)]
struct Msg {
    topic: String,
    keys: Vec<Key>,
}

/// The simulated rumqttc and broker of one connection.
#[derive(Debug, Default)]
struct Link {
    /// CONNACK came.
    up: bool,
    /// Handed over, no packet id yet (oldest first).
    requested: VecDeque<Msg>,
    /// On the wire, by packet id.
    wire: BTreeMap<u16, Msg>,
    /// Publishes handed over on this connection.
    published: usize,
    /// Per stream: the last key published on this connection.
    last: HashMap<(u8, bool), Key>,
    nbirth: bool,
    born: HashSet<String>,
}

struct World {
    s: Session,
    stats: Arc<UplinkStats>,
    sparkplug: bool,
    window: usize,
    now: Instant,
    // The simulated outbox.
    records: BTreeMap<Key, (u8, Kind, Vec<u8>)>,
    dead_letters: BTreeMap<Key, usize>,
    seq: u64,
    /// Outbox operations that fail now ([`READ`], [`ACK`], [`DEAD`]).
    fault: u8,
    link: Option<Link>,
    // The reference.
    /// Records whose PUBACK came (on any connection).
    pubacked: BTreeSet<Key>,
    /// Successful outbox acks per record.
    acked: BTreeMap<Key, usize>,
    /// Every record appended: its stream and kind.
    all: BTreeMap<Key, (u8, Kind)>,
    last_wait: Option<Duration>,
}

fn key_of_id(id: &str) -> Key {
    let mut it = id.rsplitn(3, '/');
    let seq = it.next().unwrap().parse().unwrap();
    let boot = it.next().unwrap().parse().unwrap();
    Key(boot, seq)
}

impl World {
    fn new(window: usize, page: usize, batch: usize, sparkplug: bool) -> World {
        let stats = Arc::new(UplinkStats::new("mqtt"));
        let now = Instant::now();
        World {
            s: Session::new(
                settings(window, page, batch, sparkplug),
                stats.clone(),
                Box::new(crate::backoff::SeededJitter::new(window as u64)),
                now,
            ),
            stats,
            sparkplug,
            window,
            now,
            records: BTreeMap::new(),
            dead_letters: BTreeMap::new(),
            seq: 0,
            fault: 0,
            link: None,
            pubacked: BTreeSet::new(),
            acked: BTreeMap::new(),
            all: BTreeMap::new(),
            last_wait: None,
        }
    }

    fn ms(&self) -> u64 {
        1_800_000_000_000
    }

    fn dead_kind(&self, kind: Kind) -> bool {
        match kind {
            Kind::Good => false,
            Kind::NotJson => true,
            Kind::BadDevice => self.sparkplug,
        }
    }

    fn append(&mut self, stream: u8, kind: Kind) -> Key {
        let key = Key(1, self.seq);
        self.seq += 1;
        let body = match kind {
            Kind::NotJson => b"not json".to_vec(),
            _ => serde_json::to_vec(&serde_json::json!({
                "id": format!("{DEVICE}/{}/{}", key.0, key.1),
                "pipeline": if kind == Kind::BadDevice { "a/b".to_string() } else { format!("p{}", stream % 2) },
                "stream": format!("s{stream}"),
                "seq": key.1,
                "outputs": {"x": 1.5, "n": stream},
            }))
            .unwrap(),
        };
        self.records.insert(key, (stream, kind, body));
        self.all.insert(key, (stream, kind));
        self.s.appended();
        key
    }

    fn connect(&mut self) {
        if self.link.as_ref().is_some_and(|l| l.up) {
            return;
        }
        self.s.connecting();
        self.link = Some(Link::default());
        self.drive();
        self.link.as_mut().unwrap().up = true;
        let (now, ms) = (self.now, self.ms());
        self.s.connected(now, ms);
        assert!(self.s.is_connected());
        self.drive();
    }

    fn disconnect(&mut self) {
        if self.link.take().is_some() {
            self.s.disconnected();
            assert!(!self.s.is_connected());
            assert_eq!(self.s.in_flight(), 0);
            self.drive();
        }
    }

    /// The keys a publish carries, read from its payload as the fleet would.
    fn keys_of(&self, p: &Publish) -> Vec<Key> {
        if p.topic == STATUS || p.topic.starts_with("spBv1.0/") && !p.topic.contains("/DDATA/") {
            return vec![];
        }
        if self.sparkplug {
            let pl = sp::Payload::decode(&p.payload[..]).unwrap();
            return pl
                .metrics
                .iter()
                .filter(|m| m.name.as_deref().is_some_and(|n| n.ends_with("/id")))
                .map(|m| match &m.value {
                    Some(sp::Value::String(id)) => key_of_id(id),
                    v => panic!("id metric {v:?}"),
                })
                .collect();
        }
        let v: serde_json::Value = serde_json::from_slice(&p.payload).unwrap();
        let items = match v {
            serde_json::Value::Array(a) => a,
            v => vec![v],
        };
        items
            .iter()
            .map(|r| key_of_id(r["id"].as_str().unwrap()))
            .collect()
    }

    /// A publish handed over: the invariants of its place in the connection.
    fn check_publish(&mut self, p: &Publish) {
        let keys = self.keys_of(p);
        let Some(link) = self.link.as_ref() else {
            panic!("a publish with no connection: {}", p.topic)
        };
        assert!(link.up, "a publish before CONNACK: {}", p.topic);
        if link.published == 0 {
            assert_eq!(
                (p.topic.as_str(), &p.payload[..], p.retain),
                (STATUS, &b"online"[..], true),
                "the first publish of a connection is the online status"
            );
        }
        let kind = p.topic.split('/').nth(2).unwrap_or_default().to_string();
        let device = p.topic.split('/').nth(4).unwrap_or_default().to_string();
        if self.sparkplug && p.topic.starts_with("spBv1.0/") && kind != "NDEATH" {
            match kind.as_str() {
                "NBIRTH" => {}
                _ => assert!(link.nbirth, "{} before the NBIRTH", p.topic),
            }
            if kind == "DDATA" {
                assert!(
                    link.born.contains(&device),
                    "DDATA of {device} before its DBIRTH"
                );
            }
        }
        for k in &keys {
            let (stream, kind) = self.all[k];
            assert!(
                !self.dead_kind(kind),
                "{k} can never be sent, yet was published"
            );
            // A stream is a pipeline's: the odd pipeline's records of the
            // same stream name are a stream of their own.
            let id = (stream, kind == Kind::BadDevice);
            // The next record of its stream still to be delivered.
            let after = self.link.as_ref().unwrap().last.get(&id).copied();
            let want = self
                .records
                .iter()
                .filter(|(rk, (s, kd, _))| {
                    (*s, *kd == Kind::BadDevice) == id
                        && after.is_none_or(|a| **rk > a)
                        && !self.pubacked.contains(rk)
                        && !self.dead_kind(*kd)
                })
                .map(|(rk, _)| *rk)
                .next();
            assert_eq!(
                Some(*k),
                want,
                "stream s{stream}: {k} published after {after:?}"
            );
            self.link.as_mut().unwrap().last.insert(id, *k);
        }
        let link = self.link.as_mut().unwrap();
        if kind == "NBIRTH" {
            link.nbirth = true;
            link.born.clear();
        }
        if kind == "DBIRTH" {
            link.born.insert(device.clone());
        }
        if kind == "DDEATH" {
            link.born.remove(&device);
        }
        link.published += 1;
        link.requested.push_back(Msg {
            topic: p.topic.clone(),
            keys,
        });
        let n = link.requested.len() + link.wire.len();
        let max = self.window + if self.sparkplug { 2 } else { 0 };
        assert!(n <= max, "{n} messages in flight, window {}", self.window);
    }

    /// Carries out the session's commands until it waits.
    fn drive(&mut self) {
        for _ in 0..100_000 {
            let (now, ms) = (self.now, self.ms());
            match self.s.next(now, ms) {
                Next::Wait(w) => {
                    // Everything booked is handed over now.
                    let n = self
                        .link
                        .as_ref()
                        .map_or(0, |l| l.requested.len() + l.wire.len());
                    assert_eq!(n, self.s.in_flight(), "the session's in-flight count");
                    self.last_wait = w;
                    return;
                }
                Next::Do(Command::Publish(p)) => self.check_publish(&p),
                Next::Do(Command::Subscribe(_)) => {}
                Next::Do(Command::Read { after, limit }) => {
                    let r = if self.fault & READ != 0 {
                        Err(OutboxError::Unavailable("disk full".into()))
                    } else {
                        Ok(self
                            .records
                            .range(after.map_or(Key(0, 0), |a| Key(a.0, a.1 + 1))..)
                            .take(limit)
                            .map(|(k, (s, _, body))| Entry {
                                key: *k,
                                stream: format!("s{s}"),
                                appended_at: std::time::UNIX_EPOCH,
                                record: body.clone(),
                            })
                            .collect())
                    };
                    self.s.page(now, r);
                }
                Next::Do(Command::Ack(keys)) => {
                    for k in &keys {
                        assert!(self.pubacked.contains(k), "{k} acked before its PUBACK");
                    }
                    let r = if self.fault & ACK != 0 {
                        Err(OutboxError::Unavailable("disk full".into()))
                    } else {
                        for k in &keys {
                            self.records.remove(k);
                            let n = self.acked.entry(*k).or_default();
                            *n += 1;
                            assert_eq!(*n, 1, "{k} acknowledged twice");
                        }
                        Ok(())
                    };
                    self.s.ack_done(now, &keys, r);
                }
                Next::Do(Command::DeadLetter { key, reason }) => {
                    let (_, kind) = self.all[&key];
                    assert!(self.dead_kind(kind), "{key} dead-lettered: {reason}");
                    let r = if self.fault & DEAD != 0 {
                        Err(OutboxError::Unavailable("disk full".into()))
                    } else {
                        if self.records.remove(&key).is_some() {
                            *self.dead_letters.entry(key).or_default() += 1;
                        }
                        Ok(())
                    };
                    self.s.dead_letter_done(now, key, r);
                }
            }
        }
        panic!("the session never waits");
    }

    /// rumqttc puts up to `n` requested publishes on the wire.
    fn send(&mut self, n: usize) {
        let Some(link) = self.link.as_mut() else {
            return;
        };
        for _ in 0..n {
            let Some(m) = link.requested.pop_front() else {
                break;
            };
            let pkid = (1..=u16::MAX).find(|p| !link.wire.contains_key(p)).unwrap();
            link.wire.insert(pkid, m);
            self.s
                .sent(pkid)
                .expect("the bookkeeping matches rumqttc's");
        }
        self.drive();
    }

    /// The broker acknowledges the `i`th message on the wire (any order).
    fn puback(&mut self, i: usize) {
        let Some(link) = self.link.as_mut() else {
            return;
        };
        if link.wire.is_empty() {
            return;
        }
        let pkid = *link.wire.keys().nth(i % link.wire.len()).unwrap();
        let m = link.wire.remove(&pkid).unwrap();
        self.pubacked.extend(m.keys);
        self.s.puback(pkid);
        self.drive();
    }

    fn tick(&mut self, d: Duration) {
        self.now += d;
        self.drive();
    }

    fn rebirth(&mut self) {
        let cmd = sp::Payload {
            timestamp: Some(1),
            metrics: vec![sp::Metric {
                name: Some(sp::REBIRTH.into()),
                value: Some(sp::Value::Boolean(true)),
                ..sp::Metric::default()
            }],
            ..sp::Payload::default()
        }
        .encode_to_vec();
        self.s.node_command("spBv1.0/plant/NCMD/gw", &cmd);
        self.drive();
    }

    /// No faults, connected, everything sent and acknowledged.
    fn drain(&mut self) {
        self.fault = 0;
        self.connect();
        for _ in 0..10_000 {
            let link = self.link.as_ref().unwrap();
            if link.requested.is_empty()
                && link.wire.is_empty()
                && self.s.waits_for_records()
                && self.s.unflushed.is_empty()
                && self.s.dead.is_empty()
            {
                break;
            }
            if !link.requested.is_empty() {
                self.send(usize::MAX);
            } else if !link.wire.is_empty() {
                // Newest first: out of order.
                let n = link.wire.len();
                self.puback(n - 1);
            } else {
                self.tick(self.last_wait.unwrap_or(Duration::from_millis(10)));
            }
        }
        assert!(
            self.records.is_empty(),
            "left in the outbox: {:?}",
            self.records.keys()
        );
        for (k, (_, kind)) in &self.all {
            if self.dead_kind(*kind) {
                assert_eq!(self.dead_letters.get(k), Some(&1), "{k} dead-lettered once");
                assert!(!self.acked.contains_key(k));
            } else {
                assert_eq!(self.acked.get(k), Some(&1), "{k} acknowledged once");
                assert!(self.pubacked.contains(k));
            }
        }
    }
}

// ---- scenarios -------------------------------------------------------------------

#[test]
fn an_outbox_fault_is_retried_with_backoff_and_never_ends_the_connection() {
    let mut w = World::new(4, 8, 1, false);
    w.connect();
    for i in 0..3 {
        w.append(i, Kind::Good);
    }
    w.drive();
    w.send(usize::MAX);
    // The disk fills: the ack of the first PUBACK fails, and nothing
    // touches the outbox again before the backoff.
    w.fault = ALL;
    for i in (0..4).rev() {
        w.puback(i);
    }
    assert!(w.s.is_connected());
    assert_eq!(UplinkStats::get(&w.stats.outbox_errors_total), 1);
    assert_eq!(w.s.unflushed(), 3);
    assert_eq!(w.records.len(), 3, "nothing deleted yet");
    let last = w.stats.last_error().unwrap().1;
    assert!(last.starts_with("outbox ack: "), "{last}");
    // Nothing is tried again before the backoff, then it is (and fails).
    let wait = w.last_wait.expect("a retry is due");
    assert!(
        wait >= Duration::from_millis(10) && wait <= Duration::from_millis(20),
        "{wait:?}"
    );
    w.tick(Duration::from_millis(1));
    assert_eq!(UplinkStats::get(&w.stats.outbox_errors_total), 1);
    w.tick(wait);
    assert_eq!(UplinkStats::get(&w.stats.outbox_errors_total), 2);
    // New records cannot be read either: counted, retried, still connected.
    w.append(0, Kind::Good);
    w.tick(Duration::from_millis(200));
    assert!(UplinkStats::get(&w.stats.outbox_errors_total) >= 3);
    assert!(w.s.is_connected());
    // The disk has room again: the next retry acks and reads.
    w.fault = 0;
    w.tick(Duration::from_millis(200));
    assert_eq!(w.s.unflushed(), 0);
    assert_eq!(UplinkStats::get(&w.stats.acked_total), 3);
    w.drain();
    assert_eq!(UplinkStats::get(&w.stats.acked_total), 4);
}

#[test]
fn records_acknowledged_by_the_broker_are_not_sent_again_while_their_outbox_ack_fails() {
    let mut w = World::new(8, 8, 1, false);
    w.connect();
    for i in 0..4 {
        w.append(i % 2, Kind::Good);
    }
    w.drive();
    w.send(usize::MAX);
    // Deletes fail, reads would work.
    w.fault = ACK;
    w.puback(1);
    w.puback(1);
    assert_eq!(w.s.unflushed(), 2);
    // Two PUBACKs missing when the connection drops.
    w.disconnect();
    w.connect();
    // The ack is retried first and fails again: nothing is read meanwhile.
    w.tick(Duration::from_millis(100));
    assert_eq!(w.s.unflushed(), 2);
    assert_eq!(w.records.len(), 4);
    assert!(UplinkStats::get(&w.stats.outbox_errors_total) >= 2);
    assert_eq!(w.link.as_ref().unwrap().requested.len(), 1, "online only");
    // Once it works: the two acknowledged leave the outbox, the two that
    // were not go again.
    w.fault = 0;
    w.tick(Duration::from_millis(100));
    assert_eq!(w.s.unflushed(), 0);
    let link = w.link.as_ref().unwrap();
    let again: Vec<Key> = link.requested.iter().flat_map(|m| m.keys.clone()).collect();
    assert_eq!(again.len(), 2, "{again:?}");
    assert!(again.iter().all(|k| !w.pubacked.contains(k)));
    assert_eq!(UplinkStats::get(&w.stats.retries_total), 2);
    w.drain();
}

#[test]
fn the_window_holds_and_every_publish_is_booked_in_order() {
    let mut w = World::new(3, 2, 2, false);
    w.connect();
    for i in 0..20 {
        w.append(i % 3, Kind::Good);
    }
    w.drive();
    // online + two messages: the window is full.
    assert_eq!(w.s.in_flight(), 3);
    w.send(2);
    w.puback(0);
    assert_eq!(w.s.in_flight(), 3);
    w.drain();
}

#[test]
fn sparkplug_births_go_first_on_every_connection_and_bad_records_are_dead_lettered() {
    let mut w = World::new(2, 4, 1, true);
    w.connect();
    w.append(0, Kind::Good);
    w.append(1, Kind::BadDevice);
    w.append(2, Kind::NotJson);
    w.append(3, Kind::Good);
    w.drain();
    w.disconnect();
    w.append(0, Kind::Good);
    w.connect();
    let topics: Vec<String> = w
        .link
        .as_ref()
        .unwrap()
        .requested
        .iter()
        .map(|m| m.topic.clone())
        .collect();
    assert_eq!(topics, [STATUS, "spBv1.0/plant/NBIRTH/gw"]);
    w.rebirth();
    w.drain();
    assert_eq!(UplinkStats::get(&w.stats.dead_letters_total), 2);
}

#[test]
fn a_stop_says_offline_and_ndeath_and_flushes_the_acks_once_more() {
    let mut w = World::new(4, 8, 1, true);
    w.connect();
    w.append(0, Kind::Good);
    w.drive();
    w.send(usize::MAX);
    w.fault = ALL;
    let n = w.link.as_ref().unwrap().wire.len();
    for _ in 0..n {
        w.puback(0);
    }
    assert_eq!(w.s.unflushed(), 1);
    w.fault = 0;
    // Still inside the outbox backoff: the stop tries once more anyway.
    w.s.close(w.ms());
    w.drive();
    assert_eq!(w.s.unflushed(), 0);
    let topics: Vec<String> = w
        .link
        .as_ref()
        .unwrap()
        .requested
        .iter()
        .map(|m| m.topic.clone())
        .collect();
    assert_eq!(topics, [STATUS, "spBv1.0/plant/NDEATH/gw"]);
    w.append(0, Kind::Good);
    w.drive();
    assert!(
        w.link.as_ref().unwrap().requested.len() == 2,
        "no data after a stop"
    );
}

// ---- the model -------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Op {
    Append {
        stream: u8,
        kind: Kind,
    },
    /// rumqttc puts up to this many requested publishes on the wire.
    Send(usize),
    /// The broker acknowledges the message at this position (mod the count).
    PubAck(usize),
    Disconnect,
    Connect,
    /// These outbox operations fail from now on (a mask of [`READ`],
    /// [`ACK`], [`DEAD`]; 0: all work again).
    Fault(u8),
    Tick(u64),
    /// A Sparkplug NCMD rebirth.
    Rebirth,
}

fn op() -> impl Strategy<Value = Op> {
    let kind = prop_oneof![
        8 => Just(Kind::Good),
        1 => Just(Kind::NotJson),
        1 => Just(Kind::BadDevice),
    ];
    prop_oneof![
        8 => (0u8..4, kind).prop_map(|(stream, kind)| Op::Append { stream, kind }),
        6 => (1usize..5).prop_map(Op::Send),
        8 => (0usize..16).prop_map(Op::PubAck),
        1 => Just(Op::Disconnect),
        2 => Just(Op::Connect),
        2 => (0u8..8).prop_map(Op::Fault),
        2 => (0u64..120).prop_map(Op::Tick),
        1 => Just(Op::Rebirth),
    ]
}

fn run(window: usize, page: usize, batch: usize, sparkplug: bool, ops: &[Op]) {
    let mut w = World::new(window, page, if sparkplug { 1 } else { batch }, sparkplug);
    w.connect();
    for op in ops {
        match op {
            Op::Append { stream, kind } => {
                w.append(*stream, *kind);
                w.drive();
            }
            Op::Send(n) => w.send(*n),
            Op::PubAck(i) => w.puback(*i),
            Op::Disconnect => w.disconnect(),
            Op::Connect => w.connect(),
            Op::Fault(f) => {
                w.fault = *f;
                w.drive();
            }
            Op::Tick(ms) => w.tick(Duration::from_millis(*ms)),
            Op::Rebirth if sparkplug => w.rebirth(),
            Op::Rebirth => {}
        }
        if w.link.as_ref().is_some_and(|l| l.up) {
            assert!(
                w.s.is_connected(),
                "the connection stays up through outbox faults"
            );
        }
    }
    w.drain();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn the_session_against_its_reference(
        window in 1usize..6,
        page in 1usize..5,
        batch in 1usize..4,
        sparkplug in any::<bool>(),
        ops in prop::collection::vec(op(), 0..120),
    ) {
        run(window, page, batch, sparkplug, &ops);
    }
}
