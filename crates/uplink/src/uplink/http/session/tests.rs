//! The HTTP session against a simulated outbox and fleet endpoint, on
//! simulated clocks and a seeded jitter: no sockets, no real time.

use std::collections::BTreeMap;

use super::*;
use crate::backoff::SeededJitter;
use crate::clock::clocks::{Clocks, SimulatedClocks};
use crate::clock::model::Distrust;

const S: i64 = 1_000_000;
/// A day after the build.
const NOW: i64 = (crate::clock::BUILD_UNIX_S + 86_400) * S;
/// 2100-01-01T00:00:00Z.
const Y2100: i64 = 4_102_444_800 * S;
const MIN: Duration = Duration::from_millis(100);
const MAX: Duration = Duration::from_secs(5);

type Fleet<'a> = &'a mut dyn FnMut(&[Entry]) -> Result<Answer, Unreachable>;

fn ok(date: Option<i64>) -> Result<Answer, Unreachable> {
    Ok(Answer {
        status: 200,
        retry_after: None,
        date: date.map(|us| {
            httpdate::fmt_http_date(
                std::time::UNIX_EPOCH + Duration::from_micros(u64::try_from(us).unwrap()),
            )
        }),
        body: String::new(),
    })
}

fn status(code: u16, retry_after: Option<&str>) -> Result<Answer, Unreachable> {
    Ok(Answer {
        status: code,
        retry_after: retry_after.map(str::to_string),
        date: None,
        body: "no".into(),
    })
}

/// The session, its clocks, a simulated outbox and what was posted.
struct World {
    s: Session,
    stats: Arc<UplinkStats>,
    clocks: SimulatedClocks,
    outbox: BTreeMap<Key, Entry>,
    dead: Vec<Key>,
    /// Each POST: its records' keys and its idempotency key.
    posts: Vec<(Vec<Key>, String)>,
    /// Times the fleet confirmed.
    confirmed: Vec<i64>,
    fail_ack: bool,
}

impl World {
    fn new(clocks: SimulatedClocks, batch: usize, seed: u64) -> World {
        let stats = Arc::new(UplinkStats::new("http"));
        let set = Settings {
            device: "gw".into(),
            batch_records: batch,
            backoff_min: MIN,
            backoff_max: MAX,
            max_bytes_per_s: 0,
            date_is_evidence: true,
        };
        World {
            s: Session::new(
                set,
                stats.clone(),
                Box::new(SeededJitter::new(seed)),
                clocks.monotonic(),
            ),
            stats,
            clocks,
            outbox: BTreeMap::new(),
            dead: Vec::new(),
            posts: Vec::new(),
            confirmed: Vec::new(),
            fail_ack: false,
        }
    }

    fn append(&mut self, n: u64, record: impl Fn(u64) -> Vec<u8>) {
        let start = self.outbox.len() as u64;
        for i in start..start + n {
            let key = Key(1, i);
            self.outbox.insert(
                key,
                Entry {
                    key,
                    stream: "s".into(),
                    appended_at: std::time::UNIX_EPOCH,
                    record: record(i),
                },
            );
        }
        self.s.appended();
    }

    /// Carries out commands until the session says wait.
    fn run(&mut self, fleet: Fleet) -> Option<Duration> {
        for _ in 0..10_000 {
            let now = self.clocks.monotonic();
            match self.s.next(now) {
                Next::Do(Command::Read { limit }) => {
                    let page = self.outbox.values().take(limit).cloned().collect();
                    self.s.page(now, Ok(page));
                }
                Next::Do(Command::Post { batch, key }) => {
                    self.posts
                        .push((batch.iter().map(|e| e.key).collect(), key));
                    self.s.posting(now, 100);
                    let a = fleet(&batch);
                    if let Some(t) = self.s.answered(now, self.clocks.realtime(), a) {
                        self.confirmed.push(t);
                    }
                }
                Next::Do(Command::Ack(keys)) => {
                    if self.fail_ack {
                        self.s.ack_done(
                            now,
                            Err(crate::outbox::OutboxError::Unavailable("disk full".into())),
                        );
                    } else {
                        for k in &keys {
                            self.outbox.remove(k);
                        }
                        self.s.ack_done(now, Ok(()));
                    }
                }
                Next::Do(Command::DeadLetter { key, .. }) => {
                    self.outbox.remove(&key);
                    self.dead.push(key);
                    self.s.dead_letter_done(now, Ok(()));
                }
                Next::Wait(w) => return w,
            }
        }
        panic!("the session never waits");
    }
}

#[test]
fn delivers_batches_oldest_first_and_acks_each_once() {
    let mut w = World::new(SimulatedClocks::new(NOW), 4, 1);
    assert_eq!(w.run(&mut |_| ok(None)), None);
    w.append(10, |i| format!("{{\"i\":{i}}}").into_bytes());
    assert_eq!(w.run(&mut |_| ok(None)), None);
    assert!(w.outbox.is_empty());
    let sizes: Vec<usize> = w.posts.iter().map(|p| p.0.len()).collect();
    assert_eq!(sizes, [4, 4, 2]);
    let order: Vec<u64> = w
        .posts
        .iter()
        .flat_map(|p| p.0.iter().map(|k| k.1))
        .collect();
    assert_eq!(order, (0..10).collect::<Vec<_>>());
    assert_eq!(UplinkStats::get(&w.stats.acked_total), 10);
    assert_eq!(UplinkStats::get(&w.stats.sent_total), 10);
    assert!(w.stats.is_connected());
    // Idle: nothing posted until an append.
    assert_eq!(w.run(&mut |_| ok(None)), None);
    assert_eq!(w.posts.len(), 3);
}

#[test]
fn retries_wait_for_the_seeded_backoff_or_the_servers_retry_after() {
    let delays = |seed| {
        let mut w = World::new(SimulatedClocks::new(NOW), 8, seed);
        w.append(3, |_| b"{}".to_vec());
        let mut out = Vec::new();
        for _ in 0..4 {
            let d = w.run(&mut |_| status(503, None)).unwrap();
            // Not a moment early: the same batch waits for the whole delay.
            w.clocks.advance(d - Duration::from_millis(1));
            assert_eq!(
                w.s.next(w.clocks.monotonic()),
                Next::Wait(Some(Duration::from_millis(1)))
            );
            w.clocks.advance(Duration::from_millis(1));
            out.push(d);
        }
        // The same batch each time, under the same idempotency key.
        assert!(w.posts.windows(2).all(|p| p[0] == p[1]), "{:?}", w.posts);
        assert_eq!(UplinkStats::get(&w.stats.retries_total), 12);
        assert_eq!(w.run(&mut |_| ok(None)), None);
        assert!(w.outbox.is_empty());
        out
    };
    let a = delays(7);
    assert_eq!(a, delays(7));
    assert_ne!(a, delays(8));
    for (i, d) in a.iter().enumerate() {
        let ceil = crate::backoff::doubled(MIN, MAX, i as u32 + 1);
        assert!(*d >= MIN && *d <= ceil, "attempt {i}: {d:?}");
    }
    // The server's Retry-After, at least backoff_min.
    let mut w = World::new(SimulatedClocks::new(NOW), 8, 1);
    w.append(1, |_| b"{}".to_vec());
    assert_eq!(
        w.run(&mut |_| status(429, Some("7"))),
        Some(Duration::from_secs(7))
    );
    w.clocks.advance(Duration::from_secs(7));
    assert_eq!(w.run(&mut |_| status(503, Some("0"))), Some(MIN));
    // A connection error is a retry, and the endpoint is down.
    w.clocks.advance(MIN);
    assert!(
        w.run(&mut |_| Err(Unreachable::Send("connection refused".into())))
            .is_some()
    );
    assert!(!w.stats.is_connected());
    assert_eq!(UplinkStats::get(&w.stats.disconnects_total), 1);
}

#[test]
fn a_refused_record_is_split_out_and_dead_lettered_alone() {
    let mut w = World::new(SimulatedClocks::new(NOW), 8, 1);
    w.append(8, |i| {
        if i == 5 {
            b"bad".to_vec()
        } else {
            b"{}".to_vec()
        }
    });
    let mut fleet = |b: &[Entry]| {
        if b.iter().any(|e| e.record == b"bad") {
            status(400, None)
        } else {
            ok(None)
        }
    };
    assert_eq!(w.run(&mut fleet), None);
    assert_eq!(w.dead, [Key(1, 5)]);
    assert!(w.outbox.is_empty());
    assert_eq!(UplinkStats::get(&w.stats.acked_total), 7);
    assert_eq!(UplinkStats::get(&w.stats.dead_letters_total), 1);
    // 8 → 4+4 → 2+2 → 1+1: about 2·log2(8) requests.
    assert!(w.posts.len() <= 7, "{:?}", w.posts);
}

#[test]
fn a_failed_outbox_ack_reads_the_outbox_again_and_loses_nothing() {
    let mut w = World::new(SimulatedClocks::new(NOW), 4, 3);
    w.append(6, |_| b"{}".to_vec());
    w.fail_ack = true;
    let d = w.run(&mut |_| ok(None)).unwrap();
    assert!(d >= MIN);
    assert_eq!(w.outbox.len(), 6);
    assert_eq!(UplinkStats::get(&w.stats.outbox_errors_total), 1);
    assert!(w.stats.last_error().unwrap().1.starts_with("outbox ack: "));
    w.fail_ack = false;
    w.clocks.advance(d);
    assert_eq!(w.run(&mut |_| ok(None)), None);
    assert!(w.outbox.is_empty());
    // The first batch went twice (the fleet drops the duplicate by key).
    assert_eq!(w.posts[0], w.posts[1]);
    assert_eq!(UplinkStats::get(&w.stats.acked_total), 6);
}

/// Issue 43, item 6, without a real clock: a device whose clock says 2100
/// stamps its records unsynced and the fleet's `Date` (the real time)
/// does not make 2100 trusted; once the clock is set, its records go with
/// their real time. A clock five years past the build is trusted once the
/// fleet confirms a time near it.
#[test]
fn a_clock_at_2100_is_not_trusted_and_the_fleets_date_confirms_only_a_near_clock() {
    let clocks = SimulatedClocks::new(Y2100);
    let clock = crate::clock::Clock::new(Box::new(clocks.clone()), "b1".into(), false);
    let st = clock.status();
    assert_eq!(st.reason, Some(Distrust::Ahead), "{st:?}");
    let mut w = World::new(clocks.clone(), 8, 1);
    let stamp = clock.stamp();
    assert!(stamp.ts.starts_with("2100-"), "{stamp:?}");
    let mark = stamp.mark.clone().unwrap();
    let record = serde_json::to_vec(&serde_json::json!({
        "id": "gw/1/1", "ts": stamp.ts, "clock": "unsynced",
        "boot_id": mark.boot_id, "since_boot_us": mark.since_boot_us,
    }))
    .unwrap();
    w.append(1, |_| record.clone());
    // Sent as made (no offset known): the fleet answers with the real time.
    assert_eq!(
        w.run(&mut |b| {
            assert!(matches!(
                clock.for_sending(&b[0].record),
                std::borrow::Cow::Borrowed(_)
            ));
            ok(Some(NOW))
        }),
        None
    );
    assert_eq!(w.confirmed, [NOW]);
    clock.confirm(NOW);
    clocks.advance(Duration::from_secs(1));
    clock.observe();
    let st = clock.status();
    assert_eq!(st.reason, Some(Distrust::Ahead), "{st:?}");
    assert!(!st.last_good.starts_with("2100"), "{st:?}");
    assert!(!st.trusted_time.starts_with("2100"), "{st:?}");
    assert!(clock.stamp().mark.is_some());

    // NTP sets the clock: trusted, and a record made at 2100 goes with
    // the real time it was made at.
    clocks.set_realtime(NOW + 2 * S);
    assert!(matches!(
        clock.observe(),
        Some(crate::clock::model::Change::Synced { .. })
    ));
    let sent: serde_json::Value = serde_json::from_slice(&clock.for_sending(&record)).unwrap();
    assert_eq!(sent["clock"], "corrected");
    // This boot's offset: NOW + 2 s at 1 s after boot.
    let made = (NOW + S) as u64 + mark.since_boot_us;
    assert_eq!(
        sent["ts"],
        crate::record::rfc3339(std::time::UNIX_EPOCH + Duration::from_micros(made))
    );

    // Five years past the build (a device kept off): ahead until the
    // fleet's Date says the time is near.
    let later = (crate::clock::BUILD_UNIX_S + 5 * 365 * 86_400) * S;
    let clocks = SimulatedClocks::new(later);
    let clock = crate::clock::Clock::new(Box::new(clocks.clone()), "b2".into(), false);
    assert_eq!(clock.status().reason, Some(Distrust::Ahead));
    let mut w = World::new(clocks.clone(), 8, 1);
    w.append(1, |_| b"{}".to_vec());
    w.run(&mut |_| ok(Some(later)));
    for t in &w.confirmed {
        clock.confirm(*t);
    }
    clocks.advance(Duration::from_secs(1));
    assert!(matches!(
        clock.observe(),
        Some(crate::clock::model::Change::Synced { .. })
    ));
    assert!(clock.stamp().mark.is_none());
}

/// Issue 50, item 9: a plain-HTTP fleet's `Date` (2100, 9999-12-31) was
/// taken as a confirmed time. Over a connection that does not
/// authenticate the fleet, a delivery's `Date` is no evidence: nothing
/// goes to the clock, whatever it says.
#[test]
fn a_date_over_plain_http_is_not_the_fleets_time() {
    let y9999 = 253_402_300_799 * S;
    for date in [NOW, Y2100, y9999] {
        let mut w = World::new(SimulatedClocks::new(NOW), 8, 1);
        w.s.set.date_is_evidence = false;
        w.append(3, |_| b"{}".to_vec());
        assert_eq!(w.run(&mut |_| ok(Some(date))), None);
        assert!(w.confirmed.is_empty(), "{:?}", w.confirmed);
        assert_eq!(UplinkStats::get(&w.stats.acked_total), 3);
    }
    // Over verified TLS the same answer is handed to the clock (which
    // decides whether it agrees).
    let mut w = World::new(SimulatedClocks::new(NOW), 8, 1);
    w.append(1, |_| b"{}".to_vec());
    w.run(&mut |_| ok(Some(y9999)));
    assert_eq!(w.confirmed, [y9999]);
}
