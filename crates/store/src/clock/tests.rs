use std::sync::{Arc, Mutex};

use super::*;

const S: i64 = 1_000_000;
/// A day after the build time (whole seconds).
const NOW: i64 = (BUILD_UNIX_S + 86_400) * S;

/// Readings a test sets.
struct Script(Mutex<Reading>);

impl Script {
    fn at(wall_us: i64, boot_s: u64) -> Script {
        Script(Mutex::new(Reading {
            wall_us,
            boot_us: boot_s * S as u64,
            kernel: KernelSync::Synced,
        }))
    }
}

impl Source for Arc<Script> {
    fn read(&self) -> Reading {
        *self.0.lock().unwrap()
    }
    fn wall_us(&self) -> i64 {
        self.read().wall_us
    }
    fn boot_us(&self) -> u64 {
        self.read().boot_us
    }
}

/// A clock on a script; `set` moves it.
struct Fixture {
    script: Arc<Script>,
    clock: Clock,
}

impl Fixture {
    fn new(wall_us: i64, boot_s: u64) -> Fixture {
        Self::of_boot(wall_us, boot_s, "b1")
    }

    fn of_boot(wall_us: i64, boot_s: u64, boot_id: &str) -> Fixture {
        let script = Arc::new(Script::at(wall_us, boot_s));
        Fixture {
            clock: Clock::new(Box::new(script.clone()), boot_id.into(), true),
            script,
        }
    }

    /// Moves the clocks without a reading.
    fn put(&self, wall_us: i64, boot_s: u64) {
        *self.script.0.lock().unwrap() = Reading {
            wall_us,
            boot_us: boot_s * S as u64,
            kernel: KernelSync::Synced,
        };
    }

    /// Moves the clocks and reads them.
    fn set(&self, wall_us: i64, boot_s: u64) -> Option<Change> {
        self.put(wall_us, boot_s);
        self.clock.observe()
    }
}

fn record(stamp: &Stamp) -> Vec<u8> {
    let r = crate::record::ResultRecord {
        id: "d/1/1".into(),
        device: "d".into(),
        pipeline: "p".into(),
        stream: "s".into(),
        seq: 1,
        ts: stamp.ts.clone(),
        model: "m@1".into(),
        ep: "cpu".into(),
        latency_us: 1,
        outputs: serde_json::json!({"x": 1.5}),
        captured: None,
        clock: stamp.mark.clone(),
    };
    serde_json::to_vec(&r).unwrap()
}

#[test]
fn records_of_an_untrusted_clock_are_marked_and_sent_with_their_time_once_it_syncs() {
    let f = Fixture::new(86_400 * S, 10);
    assert!(!f.clock.status().synced);
    let st = f.clock.stamp();
    assert_eq!(st.ts, "1970-01-02T00:00:00.000000Z");
    let mark = st.mark.clone().unwrap();
    assert_eq!(mark.clock, ClockLabel::Unsynced);
    assert_eq!(mark.boot_id, "b1");
    assert_eq!(mark.since_boot_us, 10 * S as u64);
    let stored = record(&st);
    let text = String::from_utf8(stored.clone()).unwrap();
    assert!(
        text.contains(r#""clock":"unsynced","boot_id":"b1","since_boot_us":10000000"#),
        "{text}"
    );
    // No offset known yet: sent as stored.
    assert!(matches!(f.clock.for_sending(&stored), Cow::Borrowed(_)));

    // Set to the real time 20 s after boot: the record made at 10 s gets
    // the real time of 10 s after boot.
    let c = f.set(NOW, 20);
    assert!(matches!(c, Some(Change::Synced { .. })), "{c:?}");
    assert!(f.clock.status().synced);
    let sent = f.clock.for_sending(&stored);
    let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    assert_eq!(v["ts"], rfc3339_us(NOW - 10 * S));
    assert_eq!(v["clock"], "corrected");
    assert_eq!(v["id"], "d/1/1");
    // What is stored is not touched, and new records carry no mark.
    assert!(String::from_utf8_lossy(&stored).contains("unsynced"));
    let fresh = f.clock.stamp();
    assert!(fresh.mark.is_none());
    assert!(!String::from_utf8_lossy(&record(&fresh)).contains("clock"));
    let st = f.clock.status();
    assert_eq!(st.syncs_total, 1);
    assert_eq!(st.unsynced_records_total, 1);
    assert_eq!(st.corrected_records_total, 1);
    assert!(st.last_sync.is_some());
}

#[test]
fn a_record_still_round_trips_through_serde() {
    let f = Fixture::new(86_400 * S, 10);
    let bytes = record(&f.clock.stamp());
    let r: crate::record::ResultRecord = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(r.clock.unwrap().since_boot_us, 10 * S as u64);
    let trusted = Fixture::new(NOW, 10);
    let bytes = record(&trusted.clock.stamp());
    let r: crate::record::ResultRecord = serde_json::from_slice(&bytes).unwrap();
    assert!(r.clock.is_none());
}

#[test]
fn a_clock_behind_the_floor_is_caught_by_the_next_stamp() {
    let f = Fixture::new(NOW, 10);
    assert!(f.clock.stamp().mark.is_none());
    // Stepped back an hour; no reading since.
    f.put(NOW - 3600 * S, 10);
    assert!(f.clock.stamp().mark.is_some());
    // TLS and commands see the later of the two.
    assert!(f.clock.trusted_now_us() >= NOW);
}

#[test]
fn the_state_carries_the_floor_across_restarts_and_never_moves_back() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    let cfg = ClockConfig::default();
    let f = Fixture::new(NOW, 100);
    assert!(f.clock.configure(&cfg, &path).is_none());
    f.clock.save();
    let saved = SavedClock::load(&path).unwrap().unwrap();
    assert_eq!(saved.last_good_us, NOW);
    assert_eq!(saved.boot_id, "b1");
    assert_eq!(saved.offset_of("b1"), Some(NOW - 100 * S));

    // The same boot, 1000 s later, the clock back in 1970: the floor is
    // the saved one carried forward, and the clock is not trusted.
    let g = Fixture::new(86_400 * S, 1100);
    let c = g.clock.configure(&cfg, &path);
    assert!(
        matches!(
            c,
            Some(Change::Lost {
                why: Distrust::Behind,
                ..
            })
        ),
        "{c:?}"
    );
    let now = g.clock.trusted_now_us();
    assert!(now > NOW + 998 * S && now <= NOW + 1000 * S, "{now}");
    // This boot's offset is known from the earlier daemon: a record made
    // now is corrected at once.
    let stored = record(&g.clock.stamp());
    let v: serde_json::Value = serde_json::from_slice(&g.clock.for_sending(&stored)).unwrap();
    assert_eq!(v["ts"], rfc3339_us(NOW + 1000 * S));
    g.clock.save();
    let again = SavedClock::load(&path).unwrap().unwrap();
    assert!(again.last_good_us >= saved.last_good_us);
    assert!(again.pending);

    // Another boot: the floor holds, not carried by this boot's uptime.
    let h = Fixture::of_boot(86_400 * S, 5, "b2");
    h.clock.configure(&cfg, &path);
    let now = h.clock.trusted_now_us();
    assert_eq!(now, again.last_good_us);
    // And a record of boot b1 still waiting is corrected with b1's offset.
    let v: serde_json::Value = serde_json::from_slice(&h.clock.for_sending(&stored)).unwrap();
    assert_eq!(v["clock"], "corrected");
}

#[test]
fn a_daemon_restarted_after_the_sync_reports_it_for_the_records_before() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    let cfg = ClockConfig::default();
    // First daemon: 1970, a record made, stopped.
    let f = Fixture::new(86_400 * S, 10);
    f.clock.configure(&cfg, &path);
    let _ = f.clock.stamp();
    f.clock.save();
    // Second daemon of the same boot: the clock was set meanwhile.
    let g = Fixture::new(NOW, 60);
    let c = g.clock.configure(&cfg, &path);
    assert!(matches!(c, Some(Change::Synced { .. })), "{c:?}");
    let ids = IdGen::new("gw".into(), 2);
    let ev = g.clock.event_record(&ids, &c.unwrap()).unwrap();
    assert_eq!(ev["event"], "clock_sync");
    assert_eq!(ev["pipeline"], "clock");
    assert_eq!(ev["boot_id"], "b1");
    assert_eq!(ev["offset_us"], NOW - 60 * S);
    assert_eq!(ev["id"], "gw/2/1");
    assert!(ev.get("clock").is_none(), "{ev}");
}

#[test]
fn steps_while_trusted_are_events_and_losses_are_not() {
    let f = Fixture::new(NOW, 10);
    let ids = IdGen::new("gw".into(), 1);
    let c = f.set(NOW + S + 2 * 365 * 86_400 * S, 11).unwrap();
    let ev = f.clock.event_record(&ids, &c).unwrap();
    assert_eq!(ev["event"], "clock_step");
    assert_eq!(ev["step_us"], 2 * 365 * 86_400 * S);
    let c = f.set(NOW - 3600 * S, 12).unwrap();
    assert!(matches!(c, Change::Lost { .. }));
    assert!(f.clock.event_record(&ids, &c).is_none());
    assert_eq!(f.clock.status().steps_total, 1);
}

#[test]
fn stamp_json_sets_the_time_and_the_mark() {
    let f = Fixture::new(86_400 * S, 10);
    let mut v = serde_json::json!({"id": "x", "ts": "old"});
    f.clock.stamp_json(&mut v);
    assert_eq!(v["ts"], "1970-01-02T00:00:00.000000Z");
    assert_eq!(v["clock"], "unsynced");
    assert_eq!(v["boot_id"], "b1");
    assert_eq!(v["since_boot_us"], 10 * S);
}

#[test]
fn config_defaults_and_checks() {
    let c: ClockConfig = toml::from_str("").unwrap();
    assert_eq!(c, ClockConfig::default());
    assert!(!c.require_sync);
    let c: ClockConfig = toml::from_str("require_sync = true\nsave_interval = \"1m\"").unwrap();
    assert!(c.require_sync);
    assert_eq!(c.save_interval, Duration::from_secs(60));
    assert!(toml::from_str::<ClockConfig>("nope = 1").is_err());
    let c: ClockConfig = toml::from_str("save_interval = \"10ms\"").unwrap();
    assert_eq!(c.validate().len(), 1);
    // The build time is compiled in and recent.
    const { assert!(BUILD_UNIX_S > 1_700_000_000) };
    assert_eq!(parse_unix("1796083200"), 1_796_083_200);
}

#[test]
fn configuring_after_an_untrusted_default_reading_is_no_sync_without_records() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    // The default settings require a kernel sync, which this script's
    // kernel does not report: untrusted before the daemon configures it.
    let script = Arc::new(Script::at(NOW, 10));
    script.0.lock().unwrap().kernel = KernelSync::Unsynced;
    let clock = Clock::new(Box::new(script.clone()), "b1".into(), true);
    assert!(!clock.status().synced);
    let cfg = ClockConfig {
        require_sync: false,
        ..ClockConfig::default()
    };
    assert_eq!(clock.configure(&cfg, &path), None);
    assert!(clock.status().synced);
    // With a record stamped before, the sync is reported.
    let clock = Clock::new(Box::new(script), "b1".into(), true);
    assert!(clock.stamp().mark.is_some());
    assert!(matches!(
        clock.configure(&cfg, &path),
        Some(Change::Synced { .. })
    ));
}

/// 2100-01-01T00:00:00Z.
const Y2100: i64 = 4_102_444_800 * S;

fn trust_not_behind() -> ClockConfig {
    ClockConfig {
        require_sync: false,
        ..ClockConfig::default()
    }
}

#[test]
fn a_first_start_at_2100_leaves_no_trace_for_the_next_start() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    let f = Fixture::new(Y2100, 10);
    let c = f.clock.configure(&trust_not_behind(), &path);
    assert!(
        matches!(
            c,
            Some(Change::Lost {
                why: Distrust::Ahead,
                ..
            })
        ),
        "{c:?}"
    );
    let st = f.clock.status();
    assert_eq!(st.reason, Some(Distrust::Ahead));
    assert!(
        st.trusted_time
            .starts_with(&rfc3339_us(BUILD_UNIX_S * S)[..10])
    );
    assert!(f.clock.trusted_now_us() < NOW);
    let stamp = f.clock.stamp();
    assert!(stamp.ts.starts_with("2100-"));
    let stored = record(&stamp);
    f.clock.save();
    let saved = SavedClock::load(&path).unwrap().unwrap();
    assert!(saved.last_good_us < NOW, "{saved:?}");
    assert!(saved.boots.is_empty(), "{saved:?}");
    assert!(saved.pending && saved.bounded);

    // The same boot 50 s later, the real time: trusted at once, and the
    // record made at 2100 goes with its real time.
    let g = Fixture::new(NOW, 60);
    let c = g.clock.configure(&trust_not_behind(), &path);
    assert!(matches!(c, Some(Change::Synced { .. })), "{c:?}");
    assert!(g.clock.stamp().mark.is_none());
    let v: serde_json::Value = serde_json::from_slice(&g.clock.for_sending(&stored)).unwrap();
    assert_eq!(v["ts"], rfc3339_us(NOW - 50 * S));
    assert_eq!(v["clock"], "corrected");
}

#[test]
fn a_state_saved_at_2100_by_an_earlier_version_is_not_taken() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    let mut poisoned = SavedClock {
        last_good_us: Y2100,
        boot_id: "b1".into(),
        since_boot_us: 10 * S as u64,
        pending: false,
        boots: Vec::new(),
        confirmed_us: None,
        bounded: false,
        confirmed_agreed: false,
    };
    poisoned.set_offset("b1", Y2100 - 10 * S);
    poisoned.set_offset("b0", NOW - 86_400 * S);
    poisoned.save(&path).unwrap();
    let g = Fixture::new(NOW, 60);
    assert_eq!(g.clock.configure(&trust_not_behind(), &path), None);
    let st = g.clock.status();
    assert!(st.synced, "{st:?}");
    assert!(g.clock.stamp().mark.is_none());
    assert_eq!(g.clock.trusted_now_us(), NOW);
    assert_eq!(g.clock.offset_of("b1"), Some(NOW - 60 * S));
    assert_eq!(g.clock.offset_of("b0"), Some(NOW - 86_400 * S));
    g.clock.save();
    let saved = SavedClock::load(&path).unwrap().unwrap();
    assert_eq!(saved.last_good_us, NOW);
    assert!(saved.bounded);

    // A file of this version is taken as it is: its bound was checked.
    let mut far = SavedClock::load(&path).unwrap().unwrap();
    far.last_good_us = Y2100;
    far.boot_id = "b9".into();
    far.save(&path).unwrap();
    let h = Fixture::of_boot(NOW, 5, "b2");
    h.clock.configure(&trust_not_behind(), &path);
    assert_eq!(h.clock.status().reason, Some(Distrust::Behind));
}

#[test]
fn a_time_the_fleet_confirmed_is_kept_across_restarts() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    // Five years past the build: ahead, until the fleet confirms the time.
    let later = NOW + 5 * 365 * 86_400 * S;
    let f = Fixture::new(later, 10);
    f.clock.configure(&trust_not_behind(), &path);
    assert_eq!(f.clock.status().reason, Some(Distrust::Ahead));
    assert!(f.clock.stamp().mark.is_some());
    // Taken up to the ceiling in force (three years past the build).
    let ceiling = BUILD_UNIX_S * S + model::MAX_AHEAD_US;
    assert_eq!(f.clock.confirm(later - 60 * S), Confirmation::Taken);
    // The next reading decides: synced.
    let c = f.set(later + S, 11);
    assert!(matches!(c, Some(Change::Synced { .. })), "{c:?}");
    assert!(f.clock.stamp().mark.is_none());
    let st = f.clock.status();
    assert_eq!(st.confirmed.as_deref(), Some(&*rfc3339_us(ceiling)));
    f.clock.save();
    assert_eq!(
        SavedClock::load(&path).unwrap().unwrap().confirmed_us,
        Some(ceiling)
    );
    // Another boot, a day later: trusted at once.
    let g = Fixture::of_boot(later + 86_400 * S, 5, "b2");
    assert_eq!(g.clock.configure(&trust_not_behind(), &path), None);
    assert!(g.clock.status().synced);
}

/// Issue 50, item 9: a plain-HTTP fleet's `Date` of 2100 was taken as
/// confirmed, a clock at 2100 was then trusted and saved as the last known
/// good time, and back on the real clock every record was `unsynced`
/// (`behind`). A file an earlier version wrote that way heals at start.
#[test]
fn a_state_poisoned_by_a_fleets_date_of_2100_heals_at_start() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    let mut poisoned = SavedClock {
        last_good_us: Y2100,
        boot_id: "b1".into(),
        since_boot_us: 10 * S as u64,
        pending: false,
        boots: Vec::new(),
        confirmed_us: Some(Y2100),
        bounded: true,
        confirmed_agreed: false,
    };
    poisoned.set_offset("b1", Y2100 - 10 * S);
    poisoned.save(&path).unwrap();
    let g = Fixture::of_boot(NOW, 60, "b2");
    assert_eq!(g.clock.configure(&trust_not_behind(), &path), None);
    let st = g.clock.status();
    assert!(st.synced, "{st:?}");
    assert_eq!(st.confirmed, None, "{st:?}");
    assert!(g.clock.stamp().mark.is_none());
    assert_eq!(g.clock.offset_of("b1"), None);
    g.clock.save();
    let saved = SavedClock::load(&path).unwrap().unwrap();
    assert_eq!(saved.last_good_us, NOW);
    assert_eq!(saved.confirmed_us, None);
    assert!(saved.confirmed_agreed);
}

/// Issue 50, item 9: a fleet's `Date` of 9999-12-31 made every later
/// start exit 101 (formatting the clock's ceiling, past year 9999,
/// panicked) until clock.json was removed by hand. Absurd saved times are
/// not taken, whoever wrote them, and the status formats whatever it holds.
#[test]
fn a_state_holding_year_9999_is_not_taken_and_nothing_panics() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("clock.json");
    let y9999 = 253_402_300_799 * S;
    for agreed in [false, true] {
        let absurd = SavedClock {
            last_good_us: y9999,
            boot_id: "b1".into(),
            since_boot_us: 10 * S as u64,
            pending: false,
            boots: vec![state::BootOffset {
                boot_id: "b1".into(),
                offset_us: i64::MAX,
            }],
            confirmed_us: Some(y9999),
            bounded: true,
            confirmed_agreed: agreed,
        };
        absurd.save(&path).unwrap();
        let g = Fixture::of_boot(NOW, 60, "b2");
        assert_eq!(g.clock.configure(&trust_not_behind(), &path), None);
        let st = g.clock.status();
        assert!(st.synced, "{st:?}");
        assert_eq!(st.confirmed, None, "{st:?}");
        assert!(
            st.ceiling
                .starts_with(&rfc3339_us(NOW + model::MAX_AHEAD_US)[..4])
        );
        assert_eq!(g.clock.offset_of("b1"), None);
    }
    // A clock at the end of time, a fleet that says so: nothing panics.
    let f = Fixture::new(y9999, 10);
    assert!(matches!(
        f.clock.confirm(i64::MAX),
        Confirmation::Disagrees { .. }
    ));
    assert!(matches!(
        f.clock.confirm(y9999),
        Confirmation::Disagrees { .. }
    ));
    let st = f.clock.status();
    assert_eq!(st.system, "9999-12-31T23:59:59.000000Z");
    assert_eq!(st.reason, Some(Distrust::Ahead));
    assert_eq!(st.confirmations_refused_total, 2);
    assert!(f.clock.stamp().ts.starts_with("9999-12-31"));
}

/// A time the fleet confirmed is taken only where the system clock agrees
/// with it; a refusal is counted.
#[test]
fn a_fleets_time_the_clock_disagrees_with_is_refused_and_counted() {
    let f = Fixture::new(NOW, 10);
    f.clock.observe();
    assert!(matches!(
        f.clock.confirm(Y2100),
        Confirmation::Disagrees { .. }
    ));
    assert_eq!(f.clock.confirm(NOW + 30 * S), Confirmation::Taken);
    let st = f.clock.status();
    assert_eq!(st.confirmed.as_deref(), Some(&*rfc3339_us(NOW + 30 * S)));
    assert_eq!(st.confirmations_refused_total, 1);
    assert_eq!(st.ceiling, rfc3339_us(NOW + 30 * S + model::MAX_AHEAD_US));
}
