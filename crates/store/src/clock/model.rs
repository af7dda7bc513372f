//! The clock's state machine, free of I/O: readings go in (the system
//! clock, the time since boot, the kernel's sync flag), changes come out.
//!
//! The *last known good time* is a lower bound of the real time: a trusted
//! reading of the system clock, carried forward by the time since boot at
//! 0.1% less than its rate (a crystal is off by far less), so that while
//! the system clock cannot be trusted the bound still moves with the real
//! time and never passes it. It never moves backwards.
//!
//! A clock far ahead of everything the device knows of the time is not
//! trusted either: more than [`MAX_AHEAD_US`] past the newest trusted
//! reference, which is the last known good time (never earlier than the
//! build time) or a time the fleet confirmed ([`Model::confirm`]: the
//! `Date` of an answer of the HTTP uplink, the issue time of a verified
//! signed command), whichever is later. Such a clock gives no last known
//! good time and no offset, so a device that once started with its clock
//! at 2100 is not "behind" ever after.
//!
//! A confirmed time is evidence only where it agrees with the system
//! clock (within [`AGREE_US`]): it vouches for a clock far past the build
//! time, so a fleet's absurd `Date` (2100 against a clock at the real
//! time, 9999) is refused whatever the connection (the driver also takes a
//! `Date` only over verified TLS). And it is never taken past the ceiling
//! in force when it came (the reference + [`MAX_AHEAD_US`]): one answer
//! moves the ceiling by three years at most, however far it says.

/// One look at the clocks, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reading {
    /// The system clock (unix µs; negative before 1970).
    pub wall_us: i64,
    /// Time since boot (CLOCK_BOOTTIME: counts suspend, never steps).
    pub boot_us: u64,
    pub kernel: KernelSync,
}

/// What the kernel says of its clock (adjtimex).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelSync {
    /// A time service (NTP, PTP, chrony, systemd-timesyncd) keeps it synchronised.
    Synced,
    /// `STA_UNSYNC`: nothing has synchronised it (or not for a while).
    Unsynced,
    /// The kernel's state cannot be read (e.g. a seccomp filter).
    Unknown,
}

/// Why the clock is not trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Distrust {
    /// The system clock is behind the last known good time.
    Behind,
    /// The kernel says its clock is not synchronised (and `require_sync`).
    KernelUnsynced,
    /// The system clock is more than [`MAX_AHEAD_US`] past the newest
    /// trusted reference (a bad real-time clock at 2100).
    Ahead,
}

/// What an observation changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// The clock became trusted after it was not (or after a daemon start
    /// that found this boot's records possibly unsynced): `offset_us` is
    /// system clock − time since boot, so a record made `since_boot_us`
    /// after boot happened at `offset_us + since_boot_us`; `step_us` is
    /// how far the clock moved against the time since boot since the
    /// previous reading (None: no previous reading).
    Synced {
        offset_us: i64,
        step_us: Option<i64>,
    },
    /// The clock stopped being trusted.
    Lost { why: Distrust, step_us: Option<i64> },
    /// A trusted clock stepped (by more than [`STEP_US`]) and stayed trusted.
    Stepped { step_us: i64 },
}

/// Slack of the "behind" test: the system clock may be this far behind the
/// last known good time and still count as not behind.
pub const TOLERANCE_US: i64 = 2_000_000;
/// A trusted clock that moves further than this ahead of the last known
/// good time between two readings is followed only after it lost trust
/// once (a sync) or across a reboot: a bad forward step taken back later
/// must not leave the device "behind" its own last known good time.
pub const MAX_FOLLOW_US: i64 = 5 * 60 * 1_000_000;
/// How far past the newest trusted reference a clock may be and still be
/// trusted: three years (1096 days). More than a device runs without a
/// reference (the last known good time moves on with every trusted
/// reading, so only a device kept off that long with no fleet contact
/// meets it), more than a package waits between its build and its first
/// start, and above the two-year steps a trusted clock may take and be
/// taken back; far below the decades of a real-time clock reset to its
/// highest year.
pub const MAX_AHEAD_US: i64 = 1096 * 86_400 * 1_000_000;
/// A change of system clock − time since boot larger than this between
/// two readings is a step (NTP slews smaller errors).
pub const STEP_US: i64 = 1_000_000;
/// How close a time the fleet confirms must be to the system clock to be
/// taken: five minutes (a `Date` has one-second resolution and the answer
/// takes a while; a clock off by more than this is not vouched for).
pub const AGREE_US: i64 = 5 * 60 * 1_000_000;
/// The latest time anything is taken as (9999-12-31T23:59:59.999999Z, the
/// last one RFC 3339 writes): a saved or confirmed time past it is absurd.
pub const LATEST_US: i64 = crate::record::RFC3339_LAST_US as i64;

/// How long past its build a device may run: a saved or confirmed time
/// further out than this (a century) is absurd, not a clock to bound.
pub const HORIZON_US: i64 = 100 * 36_525 * 86_400 * 10_000;

/// A time no device built at `build_us` can see: past [`HORIZON_US`] after
/// its build, or past [`LATEST_US`].
pub fn absurd(unix_us: i64, build_us: i64) -> bool {
    unix_us > build_us.saturating_add(HORIZON_US).min(LATEST_US)
}

/// What [`Model::confirm`] did with a time the fleet confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Confirmation {
    /// Taken: the newest confirmed time now.
    Taken,
    /// Agrees with the clock but is not newer than the one kept.
    NotNewer,
    /// Refused: this far from the system clock (µs, positive: ahead of it).
    Disagrees { by_us: i64 },
}

#[derive(Debug, Clone)]
pub struct Model {
    /// Trust the clock only while the kernel says it is synchronised.
    pub require_sync: bool,
    /// The last known good time and the time since boot at which it held.
    good_us: i64,
    good_boot_us: u64,
    /// The previous reading and whether the clock was trusted at it.
    last: Option<(Reading, bool)>,
    why: Option<Distrust>,
    /// The anchor came from this boot (readings, or a state saved in this
    /// boot): a forward jump against it is a step, not a reboot's gap.
    continuous: bool,
    /// Records of this boot may carry the unsynced mark (seen untrusted in
    /// this boot, here or by an earlier daemon of the same boot).
    pending: bool,
    /// This boot's system clock − time since boot, from a trusted reading.
    offset_us: Option<i64>,
    /// The newest time the fleet confirmed (unix µs).
    confirmed_us: Option<i64>,
}

impl Model {
    /// A model whose last known good time is `good_us`: at `good_boot_us`
    /// after boot when `same_boot` (saved in this boot), else at some
    /// unknown earlier time (the build time, or a previous boot's state).
    pub fn new(
        require_sync: bool,
        good_us: i64,
        good_boot_us: Option<u64>,
        pending: bool,
        offset_us: Option<i64>,
    ) -> Model {
        Model {
            require_sync,
            good_us,
            good_boot_us: good_boot_us.unwrap_or(0),
            last: None,
            why: None,
            continuous: good_boot_us.is_some(),
            pending,
            offset_us,
            confirmed_us: None,
        }
    }

    /// A time the fleet confirmed (an HTTP answer's `Date` over verified
    /// TLS, a verified signed command's issue time), with the reading it
    /// came at: a clock up to [`MAX_AHEAD_US`] past it is not "ahead".
    /// Taken only when it agrees with the system clock (within
    /// [`AGREE_US`]), and then at most up to the ceiling in force (the
    /// reference + [`MAX_AHEAD_US`]); only the newest is kept.
    pub fn confirm(&mut self, unix_us: i64, r: &Reading) -> Confirmation {
        let by_us = unix_us.saturating_sub(r.wall_us);
        if by_us.saturating_abs() > AGREE_US || unix_us > LATEST_US {
            return Confirmation::Disagrees { by_us };
        }
        let t = unix_us.min(self.ceiling_at(r.boot_us));
        if self.confirmed_us.is_some_and(|c| c >= t) {
            return Confirmation::NotNewer;
        }
        self.confirmed_us = Some(t);
        Confirmation::Taken
    }

    /// A confirmed time kept from an earlier start (checked when it was
    /// taken); one past [`LATEST_US`] is not taken. True when taken.
    pub fn restore_confirmed(&mut self, unix_us: i64) -> bool {
        if unix_us > LATEST_US || self.confirmed_us.is_some_and(|c| c >= unix_us) {
            return false;
        }
        self.confirmed_us = Some(unix_us);
        true
    }

    /// The newest time the fleet confirmed.
    pub fn confirmed_us(&self) -> Option<i64> {
        self.confirmed_us
    }

    /// The newest trusted reference at `boot_us`: the later of the last
    /// known good time and the newest confirmed time.
    pub fn reference_at(&self, boot_us: u64) -> i64 {
        let floor = self.floor_at(boot_us);
        self.confirmed_us.map_or(floor, |c| c.max(floor))
    }

    /// The latest system clock trusted at `boot_us`.
    pub fn ceiling_at(&self, boot_us: u64) -> i64 {
        self.reference_at(boot_us).saturating_add(MAX_AHEAD_US)
    }

    /// The last known good time, carried forward to `boot_us`.
    pub fn floor_at(&self, boot_us: u64) -> i64 {
        if !self.continuous && self.last.is_none() {
            return self.good_us;
        }
        let e = i64::try_from(boot_us.saturating_sub(self.good_boot_us)).unwrap_or(i64::MAX);
        self.good_us.saturating_add(e - e / 1000)
    }

    /// Trusted at the last reading (false before the first).
    pub fn trusted(&self) -> bool {
        self.last.is_some_and(|(_, t)| t)
    }

    pub fn why(&self) -> Option<Distrust> {
        self.why
    }

    /// This boot's offset (system clock − time since boot), once known.
    pub fn offset_us(&self) -> Option<i64> {
        self.offset_us
    }

    /// Records of this boot may still carry the unsynced mark.
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// The later of the system clock and the last known good time; the
    /// newest trusted reference when the clock is far ahead of it.
    pub fn trusted_now_us(&self, r: &Reading) -> i64 {
        if r.wall_us > self.ceiling_at(r.boot_us) {
            return self.reference_at(r.boot_us);
        }
        r.wall_us.max(self.floor_at(r.boot_us))
    }

    /// Takes one reading; returns what changed.
    pub fn observe(&mut self, r: Reading) -> Option<Change> {
        if self.last.is_none() && !self.continuous {
            // The anchor is from an earlier boot: it holds from now on.
            self.good_boot_us = r.boot_us;
        }
        let floor = self.floor_at(r.boot_us);
        let behind = r.wall_us.saturating_add(TOLERANCE_US) < floor;
        let ahead = r.wall_us > self.ceiling_at(r.boot_us);
        let kernel_ok = match r.kernel {
            KernelSync::Synced => true,
            KernelSync::Unsynced => !self.require_sync,
            // Unreadable: the "behind" test alone decides.
            KernelSync::Unknown => true,
        };
        let trusted = !behind && !ahead && kernel_ok;
        let before = self.last.map(|(_, t)| t);
        let step_us = self
            .last
            .map(|(l, _)| offset(&r).saturating_sub(offset(&l)));
        let mut change = None;
        if trusted {
            let sync = before == Some(false) || (before.is_none() && self.pending);
            // A sync, or the first reading after a reboot: nothing to
            // compare the clock with but the bound it is not behind.
            let accept_any = sync || (before.is_none() && !self.continuous);
            if accept_any || r.wall_us.saturating_sub(floor) <= MAX_FOLLOW_US {
                self.good_us = r.wall_us.max(floor);
                self.good_boot_us = r.boot_us;
                self.continuous = true;
                self.offset_us = Some(offset(&r));
            }
            if sync {
                self.pending = false;
                change = Some(Change::Synced {
                    offset_us: offset(&r),
                    step_us,
                });
            } else if before == Some(true)
                && let Some(s) = step_us
                && s.abs() > STEP_US
            {
                change = Some(Change::Stepped { step_us: s });
            }
            self.why = None;
        } else {
            let why = if behind {
                Distrust::Behind
            } else if ahead {
                Distrust::Ahead
            } else {
                Distrust::KernelUnsynced
            };
            self.pending = true;
            self.why = Some(why);
            if before != Some(false) {
                change = Some(Change::Lost { why, step_us });
            }
        }
        self.last = Some((r, trusted));
        change
    }

    /// The time since boot at which the last known good time holds (for
    /// the state saved: a later daemon of the same boot carries it on).
    pub fn anchor(&self, boot_us: u64) -> (i64, u64) {
        (self.floor_at(boot_us), boot_us)
    }
}

/// System clock − time since boot.
fn offset(r: &Reading) -> i64 {
    r.wall_us
        .saturating_sub(i64::try_from(r.boot_us).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;
    /// 2026-12-01T00:00:00Z.
    const NOW: i64 = 1_796_083_200 * S;
    /// A build time, 30 days earlier.
    const BUILD: i64 = NOW - 30 * 86_400 * S;

    fn at(wall_s: f64, boot_s: f64, kernel: KernelSync) -> Reading {
        Reading {
            wall_us: (wall_s * 1e6) as i64,
            boot_us: (boot_s * 1e6) as u64,
            kernel,
        }
    }

    fn r(wall_us: i64, boot_s: u64) -> Reading {
        Reading {
            wall_us,
            boot_us: boot_s * S as u64,
            kernel: KernelSync::Synced,
        }
    }

    #[test]
    fn a_device_in_1970_is_not_trusted_until_the_clock_is_set_then_syncs_once() {
        let mut m = Model::new(true, BUILD, None, false, None);
        let c = m.observe(r(86_400 * S, 10));
        assert_eq!(
            c,
            Some(Change::Lost {
                why: Distrust::Behind,
                step_us: None
            })
        );
        assert!(!m.trusted());
        // While untrusted the floor runs on with the time since boot.
        assert_eq!(m.floor_at(110 * S as u64), BUILD + 100 * S - 100 * S / 1000);
        assert_eq!(m.observe(r(86_401 * S, 11)), None);
        assert!(m.trusted_now_us(&r(86_401 * S, 11)) >= BUILD);
        // NTP steps it to now: a sync, with this boot's offset.
        let c = m.observe(r(NOW, 12));
        assert_eq!(
            c,
            Some(Change::Synced {
                offset_us: NOW - 12 * S,
                step_us: Some(NOW - 86_401 * S - S)
            })
        );
        assert!(m.trusted());
        assert_eq!(m.offset_us(), Some(NOW - 12 * S));
        assert!(!m.pending());
        assert_eq!(m.observe(r(NOW + S, 13)), None);
        assert_eq!(m.floor_at(13 * S as u64), NOW + S);
    }

    #[test]
    fn the_kernel_flag_decides_when_sync_is_required() {
        let mut m = Model::new(true, BUILD, None, false, None);
        let c = m.observe(at(1_796_083_200.0, 5.0, KernelSync::Unsynced));
        assert_eq!(
            c,
            Some(Change::Lost {
                why: Distrust::KernelUnsynced,
                step_us: None
            })
        );
        assert_eq!(m.why(), Some(Distrust::KernelUnsynced));
        assert!(matches!(
            m.observe(at(1_796_083_201.0, 6.0, KernelSync::Synced)),
            Some(Change::Synced { .. })
        ));
        // Not required: a clock not behind is trusted whatever the kernel says.
        let mut m = Model::new(false, BUILD, None, false, None);
        assert_eq!(
            m.observe(at(1_796_083_200.0, 5.0, KernelSync::Unsynced)),
            None
        );
        assert!(m.trusted());
        // Unreadable: the "behind" test alone.
        let mut m = Model::new(true, BUILD, None, false, None);
        assert_eq!(
            m.observe(at(1_796_083_200.0, 5.0, KernelSync::Unknown)),
            None
        );
        assert!(m.trusted());
    }

    #[test]
    fn a_clock_behind_the_last_known_good_time_is_not_trusted_until_it_passes_it() {
        // Saved an hour ago by an earlier boot; this boot's clock says
        // two hours ago.
        let mut m = Model::new(true, NOW - 3600 * S, None, false, None);
        let c = m.observe(r(NOW - 7200 * S, 20));
        assert!(matches!(
            c,
            Some(Change::Lost {
                why: Distrust::Behind,
                ..
            })
        ));
        // Just within the tolerance counts as not behind.
        let mut m2 = Model::new(true, NOW, None, false, None);
        assert_eq!(m2.observe(r(NOW - TOLERANCE_US + 1, 20)), None);
        assert!(m2.trusted());
        // Stepped to the real time: synced, the step is one hour.
        let c = m.observe(r(NOW + S, 21));
        assert_eq!(
            c,
            Some(Change::Synced {
                offset_us: NOW + S - 21 * S,
                step_us: Some(7200 * S)
            })
        );
    }

    #[test]
    fn a_jump_forward_two_years_and_back_keeps_the_floor_and_the_trust() {
        let mut m = Model::new(true, BUILD, None, false, None);
        assert_eq!(m.observe(r(NOW, 100)), None);
        assert!(m.trusted());
        let two_years = 2 * 365 * 86_400 * S;
        // Forward: still trusted (not behind), a step; the floor does not follow.
        let c = m.observe(r(NOW + S + two_years, 101));
        assert_eq!(c, Some(Change::Stepped { step_us: two_years }));
        assert!(m.trusted());
        assert!(m.floor_at(101 * S as u64) < NOW + 2 * S);
        assert_eq!(m.observe(r(NOW + 2 * S + two_years, 102)), None);
        // Back: the clock is not behind the floor, so still trusted.
        let c = m.observe(r(NOW + 3 * S, 103));
        assert_eq!(
            c,
            Some(Change::Stepped {
                step_us: -two_years
            })
        );
        assert!(m.trusted());
        assert_eq!(m.offset_us(), Some(NOW + 3 * S - 103 * S));
        // And the floor follows the clock again.
        assert_eq!(m.observe(r(NOW + 4 * S, 104)), None);
        assert_eq!(m.floor_at(104 * S as u64), NOW + 4 * S);
    }

    #[test]
    fn a_small_forward_step_is_followed_and_a_step_back_loses_trust() {
        let mut m = Model::new(true, BUILD, None, false, None);
        m.observe(r(NOW, 100));
        assert_eq!(
            m.observe(r(NOW + 61 * S, 101)),
            Some(Change::Stepped { step_us: 60 * S })
        );
        assert_eq!(m.floor_at(101 * S as u64), NOW + 61 * S);
        // Back by a minute: behind the last known good time.
        let c = m.observe(r(NOW + 2 * S, 102));
        assert_eq!(
            c,
            Some(Change::Lost {
                why: Distrust::Behind,
                step_us: Some(-60 * S)
            })
        );
        assert!(m.pending());
        // The floor never moved back.
        assert!(m.floor_at(102 * S as u64) >= NOW + 61 * S);
    }

    #[test]
    fn the_floor_never_passes_a_slow_trusted_clock() {
        // A system clock 100 ppm slower than the time since boot, for a day
        // of readings: never "behind".
        let mut m = Model::new(true, BUILD, None, false, None);
        for i in 0..86_400u64 {
            let boot = i * S as u64;
            let wall = NOW + (boot as f64 * (1.0 - 1e-4)) as i64;
            m.observe(Reading {
                wall_us: wall,
                boot_us: boot,
                kernel: KernelSync::Synced,
            });
            assert!(m.trusted(), "at {i} s");
        }
    }

    #[test]
    fn a_restart_in_the_same_boot_carries_the_floor_on() {
        // Saved at 100 s after boot; the daemon restarts at 400 s with the
        // clock two years ahead (a bad step the previous daemon saw): not
        // followed, the floor is the saved one carried forward.
        let two_years = 2 * 365 * 86_400 * S;
        let mut m = Model::new(true, NOW, Some(100 * S as u64), false, None);
        assert_eq!(m.observe(r(NOW + 300 * S + two_years, 400)), None);
        let f = m.floor_at(400 * S as u64);
        assert!(f > NOW + 299 * S && f <= NOW + 300 * S, "{f}");
        // A previous boot's floor is not carried: its gap is unknown.
        let mut m = Model::new(true, NOW, None, false, None);
        assert_eq!(m.floor_at(400 * S as u64), NOW);
        assert_eq!(m.observe(r(NOW + two_years, 400)), None);
        assert_eq!(m.floor_at(400 * S as u64), NOW + two_years);
    }

    /// 2100-01-01T00:00:00Z.
    const Y2100: i64 = 4_102_444_800 * S;

    #[test]
    fn a_clock_far_ahead_of_every_reference_is_not_trusted_and_never_the_last_good_time() {
        // A first start (no saved state) with the clock at 2100.
        let mut m = Model::new(false, BUILD, None, false, None);
        assert_eq!(
            m.observe(r(Y2100, 10)),
            Some(Change::Lost {
                why: Distrust::Ahead,
                step_us: None
            })
        );
        assert_eq!(m.why(), Some(Distrust::Ahead));
        assert!(m.pending());
        assert_eq!(m.offset_us(), None);
        assert_eq!(m.floor_at(10 * S as u64), BUILD);
        // TLS and signed commands get the reference, not 2100.
        assert_eq!(m.trusted_now_us(&r(Y2100, 10)), BUILD);
        assert_eq!(m.observe(r(Y2100 + S, 11)), None);
        // Set to the real time: a sync with the real offset.
        assert_eq!(
            m.observe(r(NOW, 20)),
            Some(Change::Synced {
                offset_us: NOW - 20 * S,
                step_us: Some(NOW - Y2100 - 10 * S)
            })
        );
        assert_eq!(m.floor_at(20 * S as u64), NOW);
        // Up to the bound past the reference is trusted; beyond, not.
        let mut m = Model::new(false, NOW, None, false, None);
        assert_eq!(m.observe(r(NOW + MAX_AHEAD_US, 5)), None);
        assert!(m.trusted());
        let mut m = Model::new(false, NOW, None, false, None);
        assert!(matches!(
            m.observe(r(NOW + MAX_AHEAD_US + S, 5)),
            Some(Change::Lost {
                why: Distrust::Ahead,
                ..
            })
        ));
    }

    #[test]
    fn a_time_the_fleet_confirmed_lets_a_clock_far_past_the_build_be_trusted() {
        let later = NOW + 5 * 365 * 86_400 * S;
        let mut m = Model::new(false, BUILD, None, false, None);
        assert!(matches!(
            m.observe(r(later, 10)),
            Some(Change::Lost {
                why: Distrust::Ahead,
                ..
            })
        ));
        let now = r(later, 10);
        assert_eq!(m.confirm(later - 60 * S, &now), Confirmation::Taken);
        // One answer moves the ceiling three years at most: taken as the
        // ceiling in force, which puts the clock within the new one.
        assert_eq!(m.confirmed_us(), Some(BUILD + MAX_AHEAD_US));
        assert_eq!(m.trusted_now_us(&r(later, 10)), later);
        // The next answer moves it on, three more years at most: here to
        // what it says; an older one changes nothing.
        assert_eq!(m.confirm(later - 30 * S, &now), Confirmation::Taken);
        assert_eq!(m.confirmed_us(), Some(later - 30 * S));
        assert_eq!(m.confirm(later - 120 * S, &now), Confirmation::NotNewer);
        assert!(matches!(
            m.observe(r(later + S, 11)),
            Some(Change::Synced { .. })
        ));
        assert_eq!(m.floor_at(11 * S as u64), later + S);
        // Trusted now, the next answer is taken as it came.
        assert_eq!(m.confirm(later + S, &r(later + S, 11)), Confirmation::Taken);
        assert_eq!(m.confirmed_us(), Some(later + S));
    }

    #[test]
    fn a_trusted_clock_that_jumps_to_2100_loses_trust_and_the_floor_stays() {
        let mut m = Model::new(false, BUILD, None, false, None);
        assert_eq!(m.observe(r(NOW, 100)), None);
        assert!(matches!(
            m.observe(r(Y2100, 101)),
            Some(Change::Lost {
                why: Distrust::Ahead,
                ..
            })
        ));
        assert!(m.floor_at(101 * S as u64) < NOW + 2 * S);
        assert_eq!(m.offset_us(), Some(NOW - 100 * S));
        assert!(matches!(
            m.observe(r(NOW + 2 * S, 102)),
            Some(Change::Synced { .. })
        ));
        assert!(m.trusted());
    }

    #[test]
    fn a_daemon_that_finds_this_boots_records_unsynced_reports_the_sync() {
        let mut m = Model::new(true, NOW, Some(50 * S as u64), true, None);
        assert_eq!(
            m.observe(r(NOW + 100 * S, 100)),
            Some(Change::Synced {
                offset_us: NOW,
                step_us: None
            })
        );
        // Without pending records, a trusted start is no event.
        let mut m = Model::new(true, NOW, Some(50 * S as u64), false, None);
        assert_eq!(m.observe(r(NOW + 100 * S, 100)), None);
        assert_eq!(m.offset_us(), Some(NOW));
    }

    /// Issue 50, item 9: a fleet's `Date` of 2100 was kept as confirmed,
    /// so a clock at 2100 was trusted and became the last known good time.
    /// A time the system clock does not agree with is refused, and one it
    /// agrees with moves the ceiling three years at most.
    #[test]
    fn a_confirmed_time_far_from_the_clock_is_refused_and_raises_nothing() {
        // The real clock; the fleet says 2100.
        let mut m = Model::new(false, BUILD, None, false, None);
        assert_eq!(m.observe(r(NOW, 10)), None);
        let c = m.confirm(Y2100, &r(NOW, 10));
        assert_eq!(c, Confirmation::Disagrees { by_us: Y2100 - NOW });
        assert_eq!(m.confirmed_us(), None);
        assert_eq!(m.ceiling_at(10 * S as u64), NOW + MAX_AHEAD_US);
        // The clock at 2100 and the fleet a year later: refused.
        let mut m = Model::new(false, BUILD, None, false, None);
        m.observe(r(Y2100, 10));
        let c = m.confirm(Y2100 + 365 * 86_400 * S, &r(Y2100, 10));
        assert!(matches!(c, Confirmation::Disagrees { .. }), "{c:?}");
        // Both at 2100: taken only up to the ceiling; 2100 stays ahead.
        assert_eq!(m.confirm(Y2100, &r(Y2100, 10)), Confirmation::Taken);
        assert_eq!(m.confirmed_us(), Some(BUILD + MAX_AHEAD_US));
        assert!(matches!(
            m.observe(r(Y2100 + S, 11)),
            None | Some(Change::Lost { .. })
        ));
        assert_eq!(m.why(), Some(Distrust::Ahead));
        assert_eq!(m.floor_at(11 * S as u64), BUILD + S - S / 1000);
        // 9999-12-31T23:59:59Z, and past what RFC 3339 writes: refused.
        let y9999 = 253_402_300_799 * S;
        assert!(matches!(
            m.confirm(y9999, &r(NOW, 11)),
            Confirmation::Disagrees { .. }
        ));
        assert!(matches!(
            m.confirm(i64::MAX, &r(i64::MAX, 11)),
            Confirmation::Disagrees { .. }
        ));
        assert_eq!(m.confirmed_us(), Some(BUILD + MAX_AHEAD_US));
        // Each further agreeing answer: three more years at most.
        assert_eq!(m.confirm(Y2100, &r(Y2100, 12)), Confirmation::Taken);
        assert_eq!(m.confirmed_us(), Some(BUILD + 2 * MAX_AHEAD_US));
        // Within the agreement, both ways: taken (the newest only).
        let mut m = Model::new(false, BUILD, None, false, None);
        let now = r(NOW, 10);
        m.observe(now);
        assert_eq!(m.confirm(NOW + AGREE_US, &now), Confirmation::Taken);
        assert_eq!(m.confirm(NOW - AGREE_US, &now), Confirmation::NotNewer);
        assert!(matches!(
            m.confirm(NOW + AGREE_US + 1, &now),
            Confirmation::Disagrees { .. }
        ));
        assert_eq!(m.confirmed_us(), Some(NOW + AGREE_US));
        // A kept one past the last writable time is not restored.
        assert!(!m.restore_confirmed(LATEST_US + 1));
        assert!(m.restore_confirmed(NOW + 2 * AGREE_US));
        assert_eq!(m.confirmed_us(), Some(NOW + 2 * AGREE_US));
    }

    /// However absurd the readings and references, nothing overflows: the
    /// bounds saturate and a clock past every bound is "ahead".
    #[test]
    fn absurd_readings_and_references_saturate() {
        let mut m = Model::new(false, BUILD, None, false, None);
        assert!(matches!(
            m.observe(r(i64::MAX, 10)),
            Some(Change::Lost {
                why: Distrust::Ahead,
                ..
            })
        ));
        assert_eq!(m.trusted_now_us(&r(i64::MAX, 10)), BUILD);
        assert_eq!(m.observe(r(i64::MIN, 11)), None);
        assert_eq!(m.why(), Some(Distrust::Behind));
        // A last known good time at the last writable instant.
        let mut m = Model::new(false, LATEST_US, None, false, None);
        assert!(m.restore_confirmed(LATEST_US));
        assert_eq!(m.ceiling_at(5 * S as u64), LATEST_US + MAX_AHEAD_US);
        assert_eq!(m.observe(r(LATEST_US, 5)), None);
        assert!(m.trusted());
        assert_eq!(m.floor_at(u64::MAX), i64::MAX);
    }
}
