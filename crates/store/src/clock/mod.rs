//! The clock, as far as it can be trusted.
//!
//! Devices without a working real-time clock boot in 1970, or at the time
//! of their last shutdown, and get the real time when a time service
//! reaches them, which on an isolated site may be never. This room knows
//! whether the system clock can be trusted, keeps a *last known good time*,
//! and gives every part of the daemon the time it should use:
//!
//! - records are stamped with the system clock; while it is not trusted
//!   they also carry `clock = "unsynced"`, the boot id and the time since
//!   boot ([`stamp`]), and once this boot's offset (system clock − time
//!   since boot, from a trusted reading) is known, the uplink sends them
//!   with `ts` recomputed from it and `clock = "corrected"`
//!   ([`for_sending`]); a `clock_sync` event record gives the fleet the
//!   offset for the records sent before;
//! - TLS certificate checks ([`TrustedTime`]) and signed commands
//!   ([`trusted_unix_ms`]) use the later of the system clock and the last
//!   known good time, so a device in 1970 still connects to a broker whose
//!   certificate is current, and a clock stepped back does not make an
//!   expired command valid again.
//!
//! # Invariants
//!
//! - The last known good time is a lower bound of the real time: the build
//!   time, a trusted reading, or one of those carried forward by the time
//!   since boot at 0.1% below its rate. It never moves backwards, and it is
//!   kept in `<data_dir>/clock.json` (replaced atomically: at a sync, every
//!   `save_interval` and at stop).
//! - The clock is trusted when it is not behind the last known good time
//!   (by more than 2 s), not more than [`model::MAX_AHEAD_US`] (three
//!   years) past the newest trusted reference (the last known good time or
//!   a time the fleet confirmed: [`confirm`]) and, with `require_sync` (off
//!   by default), the kernel says a time service keeps it synchronised
//!   (adjtimex: `STA_UNSYNC` clear). The last known good time and the
//!   boots' offsets are only ever taken from a trusted clock. A trusted clock that jumps far ahead is not followed by the
//!   last known good time until it lost trust once or the machine
//!   rebooted, so a bad step taken back later does not leave the device
//!   behind its own bound.
//! - Stored records are never rewritten: only the copy sent is corrected,
//!   and only with the offset of the boot that made it (the boot id).
//!
//! One clock per process, as the kernel has one per machine: a process-wide
//! instance that the daemon configures at start ([`start`]); before that
//! (and in the CLI) it has the build time as its last known good time and
//! keeps no state. The logic is [`model`], free of I/O.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::outbox::Outbox;
use crate::record::{ClockLabel, ClockMark, IdGen};
use crate::telemetry::metrics::{MetricSource, counter, gauge};

pub mod clocks;
mod correct;
pub mod model;
mod state;
pub mod system;

use model::{Change, Confirmation, Distrust, KernelSync, Model, Reading};
use state::SavedClock;
use system::Source;

/// When this binary was built (unix seconds): `SOURCE_DATE_EPOCH` when the
/// build sets it (packages), else the build's own time (build.rs). No
/// device can be earlier than this.
pub const BUILD_UNIX_S: i64 = parse_unix(env!("OUTPOST_BUILD_UNIX"));

const fn parse_unix(s: &str) -> i64 {
    let b = s.as_bytes();
    let mut i = 0;
    let mut n: i64 = 0;
    while i < b.len() {
        if b[i] >= b'0' && b[i] <= b'9' {
            n = n * 10 + (b[i] - b'0') as i64;
        }
        i += 1;
    }
    n
}

/// `[clock]` settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClockConfig {
    /// Trust the system clock only while the kernel says a time service
    /// (NTP, PTP, chrony, systemd-timesyncd) keeps it synchronised. false:
    /// trust it whenever it is not behind the last known good time (a
    /// battery-backed clock and no time service).
    pub require_sync: bool,
    /// How often the last known good time is saved while nothing else
    /// saves it (a sync does, and a stop).
    #[serde(with = "humantime_serde")]
    pub save_interval: Duration,
}

/// Default `save_interval`: 10 minutes (about 150 small writes a day).
pub const DEFAULT_SAVE_INTERVAL: Duration = Duration::from_secs(600);

impl Default for ClockConfig {
    fn default() -> Self {
        ClockConfig {
            require_sync: false,
            save_interval: DEFAULT_SAVE_INTERVAL,
        }
    }
}

impl ClockConfig {
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.save_interval < Duration::from_secs(1) {
            p.push("clock.save_interval: must be at least 1s".into());
        }
        p
    }
}

/// A record's time: `ts`, and the mark while the clock is not trusted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub ts: String,
    pub mark: Option<ClockMark>,
}

#[derive(Debug, Default)]
struct ClockStats {
    syncs: AtomicU64,
    steps: AtomicU64,
    unsynced_records: AtomicU64,
    corrected_records: AtomicU64,
    save_errors: AtomicU64,
    /// Times the fleet confirmed that the system clock did not agree with.
    confirmations_refused: AtomicU64,
}

/// The last time the clock became trusted.
#[derive(Debug, Clone, Serialize)]
pub struct SyncStatus {
    /// When (the trusted time then).
    pub at: String,
    /// How far the system clock moved, seconds.
    pub step_s: Option<f64>,
}

struct Inner {
    model: Model,
    saved: SavedClock,
    path: Option<PathBuf>,
    save_interval: Duration,
    saved_at_boot_us: u64,
    last: Reading,
    last_sync: Option<SyncStatus>,
}

/// The clock: readings through a [`Source`], the state in [`Model`].
pub struct Clock {
    source: Box<dyn Source>,
    boot_id: String,
    inner: Mutex<Inner>,
    /// For the stamps' hot path: trusted at the last reading, and the last
    /// known good time then (a clock behind it is caught before the next
    /// reading).
    trusted: AtomicBool,
    floor_us: AtomicI64,
    /// The latest system clock trusted at the last reading.
    ceiling_us: AtomicI64,
    /// Some boot's offset is known: until then no record is parsed for a
    /// correction (a device that never syncs pays a byte search only).
    offsets_known: AtomicBool,
    stats: ClockStats,
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clock")
            .field("boot_id", &self.boot_id)
            .finish()
    }
}

fn build_us() -> i64 {
    BUILD_UNIX_S.saturating_mul(1_000_000)
}

fn rfc3339_us(us: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_micros(u64::try_from(us).unwrap_or(0));
    crate::record::rfc3339(t)
}

fn s(us: i64) -> f64 {
    us as f64 / 1e6
}

impl Clock {
    /// A clock with the build time as its last known good time, no state
    /// file, after its first reading.
    pub fn new(source: Box<dyn Source>, boot_id: String, require_sync: bool) -> Clock {
        let first = source.read();
        let c = Clock {
            source,
            boot_id,
            inner: Mutex::new(Inner {
                model: Model::new(require_sync, build_us(), None, false, None),
                saved: SavedClock::default(),
                path: None,
                save_interval: DEFAULT_SAVE_INTERVAL,
                saved_at_boot_us: first.boot_us,
                last: first,
                last_sync: None,
            }),
            trusted: AtomicBool::new(false),
            floor_us: AtomicI64::new(build_us()),
            ceiling_us: AtomicI64::new(build_us().saturating_add(model::MAX_AHEAD_US)),
            offsets_known: AtomicBool::new(false),
            stats: ClockStats::default(),
        };
        c.apply(first);
        c
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Takes the settings and the saved state (`path`), then a reading.
    pub fn configure(&self, cfg: &ClockConfig, path: &Path) -> Option<Change> {
        let saved = match SavedClock::load(path) {
            Ok(s) => s.map(heal),
            Err(e) => {
                // Replaced at the next save; the build time stands in.
                tracing::warn!(error = %e, "clock: saved state unreadable; starting from the build time");
                None
            }
        };
        {
            let mut g = self.lock();
            // Records this process stamped unsynced before (not merely an
            // untrusted reading under the default settings).
            let pending_here = self.stats.unsynced_records.load(Ordering::Relaxed) > 0;
            let build = build_us();
            let (good, anchor, pending, offset) = match &saved {
                Some(s) if s.boot_id == self.boot_id && s.last_good_us >= build => (
                    s.last_good_us,
                    Some(s.since_boot_us),
                    s.pending,
                    s.offset_of(&self.boot_id),
                ),
                // Another boot's (or a healed) state: its bound holds from
                // now on; this boot's unsynced records are still pending.
                Some(s) => (
                    s.last_good_us.max(build),
                    None,
                    s.boot_id == self.boot_id && s.pending,
                    s.offset_of(&self.boot_id),
                ),
                None => (build, None, false, None),
            };
            let confirmed = g.model.confirmed_us();
            g.model = Model::new(
                cfg.require_sync,
                good,
                anchor,
                pending || pending_here,
                offset,
            );
            for c in [confirmed, saved.as_ref().and_then(|s| s.confirmed_us)]
                .into_iter()
                .flatten()
            {
                g.model.restore_confirmed(c);
            }
            g.saved = saved.unwrap_or_default();
            g.path = Some(path.to_path_buf());
            g.save_interval = cfg.save_interval;
        }
        self.observe()
    }

    /// One reading of the clocks; what changed.
    pub fn observe(&self) -> Option<Change> {
        let r = self.source.read();
        self.apply(r)
    }

    fn apply(&self, r: Reading) -> Option<Change> {
        let mut g = self.lock();
        let change = g.model.observe(r);
        g.last = r;
        if let Some(o) = g.model.offset_us()
            && g.saved.offset_of(&self.boot_id) != Some(o)
        {
            g.saved.set_offset(&self.boot_id, o);
        }
        match change {
            Some(Change::Synced { step_us, .. }) => {
                self.stats.syncs.fetch_add(1, Ordering::Relaxed);
                g.last_sync = Some(SyncStatus {
                    at: rfc3339_us(g.model.trusted_now_us(&r)),
                    step_s: step_us.map(s),
                });
            }
            Some(Change::Stepped { .. }) => {
                self.stats.steps.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        self.floor_us
            .store(g.model.floor_at(r.boot_us), Ordering::Relaxed);
        self.ceiling_us
            .store(g.model.ceiling_at(r.boot_us), Ordering::Relaxed);
        self.trusted.store(g.model.trusted(), Ordering::Relaxed);
        self.offsets_known
            .store(!g.saved.boots.is_empty(), Ordering::Relaxed);
        change
    }

    /// Reads, and saves the state when it changed or `save_interval` passed.
    pub fn tick(&self) -> Option<Change> {
        let change = self.observe();
        let due = {
            let g = self.lock();
            let since = g.last.boot_us.saturating_sub(g.saved_at_boot_us);
            since >= g.save_interval.as_micros() as u64
        };
        if matches!(change, Some(Change::Synced { .. } | Change::Lost { .. })) || due {
            self.save();
        }
        change
    }

    /// Writes the state file now (nothing without one).
    pub fn save(&self) {
        let (path, state) = {
            let mut g = self.lock();
            let Some(path) = g.path.clone() else {
                return;
            };
            let boot = self.source.boot_us();
            let (good, at) = g.model.anchor(boot);
            g.saved.last_good_us = good.max(g.saved.last_good_us);
            g.saved.since_boot_us = at;
            g.saved.boot_id = self.boot_id.clone();
            g.saved.pending = g.model.pending();
            g.saved.confirmed_us = g.model.confirmed_us();
            g.saved.bounded = true;
            g.saved.confirmed_agreed = true;
            g.saved_at_boot_us = boot;
            (path, g.saved.clone())
        };
        // Logged once: a read-only disk would otherwise log every tick.
        if let Err(e) = state.save(&path)
            && self.stats.save_errors.fetch_add(1, Ordering::Relaxed) == 0
        {
            tracing::warn!(error = %e, "clock: cannot save the last known good time");
        }
    }

    /// A time the fleet confirmed (unix µs): an answer's `Date` from the
    /// HTTP uplink over verified TLS, a verified signed command's issue
    /// time. Taken only when the system clock agrees with it (within
    /// [`model::AGREE_US`]); then a clock up to three years past it is not
    /// "ahead", and the next reading (within a second) decides the trust.
    /// A refusal is counted and logged (the first at WARN).
    pub fn confirm(&self, unix_us: i64) -> Confirmation {
        let r = Reading {
            wall_us: self.source.wall_us(),
            boot_us: self.source.boot_us(),
            kernel: KernelSync::Unknown,
        };
        let mut g = self.lock();
        let c = if model::absurd(unix_us, build_us()) {
            Confirmation::Disagrees {
                by_us: unix_us.saturating_sub(r.wall_us),
            }
        } else {
            g.model.confirm(unix_us, &r)
        };
        match c {
            Confirmation::Taken => {
                self.ceiling_us
                    .store(g.model.ceiling_at(r.boot_us), Ordering::Relaxed);
            }
            Confirmation::NotNewer => {}
            Confirmation::Disagrees { by_us } => {
                drop(g);
                let n = self
                    .stats
                    .confirmations_refused
                    .fetch_add(1, Ordering::Relaxed);
                let (at, system) = (rfc3339_us(unix_us), rfc3339_us(r.wall_us));
                if n == 0 {
                    tracing::warn!(confirmed = %at, %system, off_s = s(by_us), "clock: the fleet's time does not agree with the system clock; not taken");
                } else {
                    tracing::debug!(confirmed = %at, %system, off_s = s(by_us), "clock: the fleet's time does not agree with the system clock; not taken");
                }
            }
        }
        c
    }

    /// The time of a record made now.
    pub fn stamp(&self) -> Stamp {
        let wall = self.source.wall_us();
        let ts = rfc3339_us(wall);
        let trusted = self.trusted.load(Ordering::Relaxed)
            && wall.saturating_add(model::TOLERANCE_US) >= self.floor_us.load(Ordering::Relaxed)
            && wall <= self.ceiling_us.load(Ordering::Relaxed);
        if trusted {
            return Stamp { ts, mark: None };
        }
        self.stats.unsynced_records.fetch_add(1, Ordering::Relaxed);
        Stamp {
            ts,
            mark: Some(ClockMark {
                clock: ClockLabel::Unsynced,
                boot_id: self.boot_id.clone(),
                since_boot_us: self.source.boot_us(),
            }),
        }
    }

    /// [`Stamp`] into a JSON record (event records built with `json!`).
    pub fn stamp_json(&self, record: &mut serde_json::Value) {
        let st = self.stamp();
        let Some(o) = record.as_object_mut() else {
            return;
        };
        o.insert("ts".into(), st.ts.into());
        if let Some(m) = st.mark
            && let Ok(serde_json::Value::Object(fields)) = serde_json::to_value(m)
        {
            o.extend(fields);
        }
    }

    /// The offset of a boot: this one's, or a saved one's.
    fn offset_of(&self, boot_id: &str) -> Option<i64> {
        let g = self.lock();
        if boot_id == self.boot_id
            && let Some(o) = g.model.offset_us()
        {
            return Some(o);
        }
        g.saved.offset_of(boot_id)
    }

    /// A stored record as it should be sent (see [`for_sending`]).
    pub fn for_sending<'a>(&self, record: &'a [u8]) -> Cow<'a, [u8]> {
        if !self.offsets_known.load(Ordering::Relaxed) {
            return Cow::Borrowed(record);
        }
        let out = correct::for_sending(record, |b| self.offset_of(b));
        if matches!(out, Cow::Owned(_)) {
            self.stats.corrected_records.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    /// The later of the system clock and the last known good time (unix µs).
    pub fn trusted_now_us(&self) -> i64 {
        let r = Reading {
            wall_us: self.source.wall_us(),
            boot_us: self.source.boot_us(),
            kernel: KernelSync::Unknown,
        };
        self.lock().model.trusted_now_us(&r)
    }

    pub fn status(&self) -> ClockStatus {
        let wall = self.source.wall_us();
        let boot = self.source.boot_us();
        let g = self.lock();
        let floor = g.model.floor_at(boot);
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ClockStatus {
            synced: g.model.trusted(),
            reason: g.model.why(),
            kernel: g.last.kernel,
            require_sync: g.model.require_sync,
            system: rfc3339_us(wall),
            last_good: rfc3339_us(floor),
            offset_s: s(wall.saturating_sub(floor)),
            trusted_time: rfc3339_us(g.model.trusted_now_us(&Reading {
                wall_us: wall,
                boot_us: boot,
                kernel: KernelSync::Unknown,
            })),
            confirmed: g.model.confirmed_us().map(rfc3339_us),
            ceiling: rfc3339_us(g.model.ceiling_at(boot)),
            boot_id: self.boot_id.clone(),
            since_boot_s: boot as f64 / 1e6,
            last_sync: g.last_sync.clone(),
            syncs_total: get(&self.stats.syncs),
            steps_total: get(&self.stats.steps),
            unsynced_records_total: get(&self.stats.unsynced_records),
            corrected_records_total: get(&self.stats.corrected_records),
            confirmations_refused_total: get(&self.stats.confirmations_refused),
        }
    }

    /// The event record of a change worth the fleet's knowing, if any.
    fn event_record(&self, ids: &IdGen, change: &Change) -> Option<serde_json::Value> {
        let (event, fields) = match *change {
            Change::Synced { offset_us, step_us } => (
                "clock_sync",
                serde_json::json!({
                    "boot_id": self.boot_id,
                    "offset_us": offset_us,
                    "step_us": step_us,
                }),
            ),
            Change::Stepped { step_us } => (
                "clock_step",
                serde_json::json!({"boot_id": self.boot_id, "step_us": step_us}),
            ),
            Change::Lost { .. } => return None,
        };
        let (id, seq) = ids.next();
        let mut rec = serde_json::json!({
            "id": id,
            "device": ids.device,
            "pipeline": "clock",
            "stream": "clock",
            "seq": seq,
            "event": event,
        });
        if let (Some(o), serde_json::Value::Object(f)) = (rec.as_object_mut(), fields) {
            o.extend(f);
        }
        self.stamp_json(&mut rec);
        Some(rec)
    }

    /// Logs a change and stores its event record.
    fn report(&self, change: &Change, ids: &IdGen, outbox: &Outbox) {
        match *change {
            Change::Synced { offset_us, step_us } => tracing::info!(
                offset_us,
                step_s = step_us.map(s),
                "clock: synchronised; records made before get their time from this boot's offset"
            ),
            Change::Lost { why, step_us } => tracing::warn!(
                reason = ?why,
                step_s = step_us.map(s),
                last_good = %rfc3339_us(self.floor_us.load(Ordering::Relaxed)),
                "clock: not trusted; records carry the boot id and the time since boot until it is"
            ),
            Change::Stepped { step_us } => {
                tracing::warn!(step_s = s(step_us), "clock: stepped while trusted")
            }
        }
        let Some(rec) = self.event_record(ids, change) else {
            return;
        };
        let stored = serde_json::to_vec(&rec)
            .map_err(|e| e.to_string())
            .and_then(|b| outbox.append("clock", &b).map_err(|e| e.to_string()));
        if let Err(e) = stored {
            tracing::warn!(error = %e, "clock: event record not stored");
        }
    }
}

/// What a state file holds is checked before it is taken, so no file can
/// poison the clock or stop a start:
///
/// - a time past what any device built now can see ([`model::absurd`]: a
///   century past the build, or past year 9999) is not taken, whatever
///   wrote it (a hand edit, a fleet's `Date` of 9999-12-31);
/// - a file written before confirmations had to agree with the clock
///   (`confirmed_agreed` false) may hold a fleet's `Date` taken as it came
///   (2100 over plain HTTP) and a last known good time that followed it: a
///   confirmed time more than [`model::MAX_AHEAD_US`] past the build time
///   is dropped;
/// - a file written before the "ahead" rule or the check above may hold
///   a last known good time (and offsets) taken from a clock at 2100:
///   what lies more than [`model::MAX_AHEAD_US`] past the build time and
///   the confirmed time kept is dropped.
///
/// So a device poisoned by an earlier version heals at its next start.
fn heal(mut s: SavedClock) -> SavedClock {
    let build = build_us();
    if model::absurd(s.last_good_us, build) {
        tracing::warn!(
            last_good = %rfc3339_us(s.last_good_us),
            "clock: the saved last known good time is absurd; not taken, starting from the build time"
        );
        s.last_good_us = 0;
    }
    let limit = build.saturating_add(model::MAX_AHEAD_US);
    if let Some(c) = s.confirmed_us
        && (model::absurd(c, build) || (!s.confirmed_agreed && c > limit))
    {
        tracing::warn!(
            confirmed = %rfc3339_us(c),
            "clock: the saved time the fleet confirmed is absurd or was taken unchecked; not taken"
        );
        s.confirmed_us = None;
    }
    s.boots.retain(|b| !model::absurd(b.offset_us, build));
    if s.bounded && s.confirmed_agreed {
        return s;
    }
    let limit = build
        .max(s.confirmed_us.unwrap_or(i64::MIN))
        .saturating_add(model::MAX_AHEAD_US);
    if s.last_good_us > limit {
        tracing::warn!(
            last_good = %rfc3339_us(s.last_good_us),
            "clock: the saved last known good time is far ahead of the build time; not taken"
        );
        s.last_good_us = 0;
    }
    s.boots.retain(|b| b.offset_us <= limit);
    s
}

/// `/v1/status` `clock`.
#[derive(Debug, Clone, Serialize)]
pub struct ClockStatus {
    /// The system clock is trusted (records carry no `clock` mark).
    pub synced: bool,
    /// Why not: `behind` (the last known good time), `ahead` (more than
    /// three years past the newest trusted reference) or `kernel_unsynced`.
    pub reason: Option<Distrust>,
    /// The kernel's sync state: `synced`, `unsynced`, `unknown`.
    pub kernel: KernelSync,
    pub require_sync: bool,
    /// The system clock now.
    pub system: String,
    /// The last known good time now.
    pub last_good: String,
    /// System clock − last known good time, seconds (negative: behind it).
    pub offset_s: f64,
    /// What TLS checks and signed commands use: the later of the two (the
    /// newest trusted reference while the clock is far ahead of it).
    pub trusted_time: String,
    /// The newest time the fleet confirmed (an HTTP uplink `Date` over
    /// verified https, a signed command) that the system clock agreed
    /// with, if any.
    pub confirmed: Option<String>,
    /// The latest system clock trusted now: three years past the later of
    /// the last known good time and `confirmed`.
    pub ceiling: String,
    pub boot_id: String,
    pub since_boot_s: f64,
    pub last_sync: Option<SyncStatus>,
    pub syncs_total: u64,
    pub steps_total: u64,
    pub unsynced_records_total: u64,
    pub corrected_records_total: u64,
    /// Times the fleet confirmed that the system clock did not agree with
    /// (not taken).
    pub confirmations_refused_total: u64,
}

static CLOCK: LazyLock<Clock> = LazyLock::new(|| {
    Clock::new(
        Box::new(system::System::default()),
        system::boot_id(),
        ClockConfig::default().require_sync,
    )
});

/// The process's clock.
pub fn global() -> &'static Clock {
    &CLOCK
}

/// The time of a record made now.
pub fn stamp() -> Stamp {
    global().stamp()
}

/// [`stamp`] as the event records take it.
pub fn stamp_parts() -> (String, Option<ClockMark>) {
    let s = global().stamp();
    (s.ts, s.mark)
}

/// Sets `ts` (and the mark, while untrusted) of a `json!` record.
pub fn stamp_json(record: &mut serde_json::Value) {
    global().stamp_json(record)
}

/// A stored record as the uplink sends it: with `ts` recomputed from its
/// boot's offset when it was made while the clock was not trusted and
/// that offset is known now; otherwise the stored bytes.
pub fn for_sending(record: &[u8]) -> Cow<'_, [u8]> {
    global().for_sending(record)
}

/// A time the fleet confirmed, unix µs (see [`Clock::confirm`]).
pub fn confirm(unix_us: i64) -> Confirmation {
    global().confirm(unix_us)
}

/// The later of the system clock and the last known good time, unix ms.
pub fn trusted_unix_ms() -> u64 {
    u64::try_from(global().trusted_now_us() / 1000).unwrap_or(0)
}

pub fn status() -> ClockStatus {
    global().status()
}

/// rustls' clock: the later of the system clock and the last known good
/// time, so a certificate that is current is current on a device in 1970.
#[derive(Debug, Default)]
pub struct TrustedTime;

impl rustls::time_provider::TimeProvider for TrustedTime {
    fn current_time(&self) -> Option<rustls::pki_types::UnixTime> {
        let us = u64::try_from(global().trusted_now_us()).ok()?;
        Some(rustls::pki_types::UnixTime::since_unix_epoch(
            Duration::from_micros(us),
        ))
    }
}

/// The clock's metrics (registered by the API's collector).
#[derive(Debug, Default)]
pub struct ClockMetrics;

impl MetricSource for ClockMetrics {
    fn encode(
        &self,
        enc: &mut prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        let c = global();
        let st = c.status();
        let (wall, floor) = {
            let boot = c.source.boot_us();
            (c.source.wall_us(), c.lock().model.floor_at(boot))
        };
        gauge(
            enc,
            "outpost_clock_synced",
            "1 while the system clock is trusted (synchronised and not behind the last known good time)",
            &[(vec![], if st.synced { 1.0 } else { 0.0 })],
        )?;
        gauge(
            enc,
            "outpost_clock_offset_seconds",
            "System clock minus the last known good time (negative: behind it)",
            &[(vec![], s(wall - floor))],
        )?;
        gauge(
            enc,
            "outpost_clock_last_good_timestamp_seconds",
            "The last known good time, unix seconds",
            &[(vec![], s(floor))],
        )?;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (name, help, v) in [
            (
                "outpost_clock_syncs",
                "Times the clock became trusted after it was not",
                &c.stats.syncs,
            ),
            (
                "outpost_clock_steps",
                "Steps of a trusted clock (over 1 s)",
                &c.stats.steps,
            ),
            (
                "outpost_clock_unsynced_records",
                "Records stamped while the clock was not trusted",
                &c.stats.unsynced_records,
            ),
            (
                "outpost_clock_corrected_records",
                "Unsynced records sent with their time recomputed from the boot's offset",
                &c.stats.corrected_records,
            ),
            (
                "outpost_clock_save_errors",
                "Failed writes of the clock's state file",
                &c.stats.save_errors,
            ),
            (
                "outpost_clock_confirmations_refused",
                "Times the fleet confirmed (verified HTTPS Date, signed command) that the system clock did not agree with",
                &c.stats.confirmations_refused,
            ),
        ] {
            counter(enc, name, help, &[(vec![], get(v))])?;
        }
        Ok(())
    }
}

/// The daemon's clock at work: a thread that reads the clocks every second
/// and reports changes; stopping it (drop) saves the state.
pub struct ClockTask {
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How often the clocks are read.
const TICK: Duration = Duration::from_secs(1);

/// Configures the process's clock from `cfg` and `<data_dir>/clock.json`
/// and starts watching it; event records go to `outbox` with ids of `ids`.
pub fn start(cfg: &ClockConfig, data_dir: &Path, ids: Arc<IdGen>, outbox: Outbox) -> ClockTask {
    let clock = global();
    if let Some(c) = clock.configure(cfg, &data_dir.join("clock.json")) {
        clock.report(&c, &ids, &outbox);
    }
    clock.save();
    let st = clock.status();
    tracing::info!(
        synced = st.synced,
        reason = ?st.reason,
        kernel = ?st.kernel,
        last_good = %st.last_good,
        "clock"
    );
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("outpost-clock".into())
        .spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(TICK) {
                if let Some(c) = clock.tick() {
                    clock.report(&c, &ids, &outbox);
                }
            }
            clock.save();
        });
    let thread = match thread {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::error!(error = %e, "clock: cannot start its thread; the clock is read at start only");
            None
        }
    };
    ClockTask {
        stop: Some(tx),
        thread,
    }
}

impl Drop for ClockTask {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests;
