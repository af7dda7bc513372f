//! Daemon updates: two slots, a `current` link and a boot counter.
//!
//! ```text
//! <data_dir>/slots/a/outpost        <data_dir>/slots/b/outpost
//! <data_dir>/slots/current -> a     what runs now (switched by rename(2) of a new link)
//! <data_dir>/slots/boot.json        {"good": "a", "trying": "b", "attempts": 1, ...}
//! ```
//!
//! The packaged binary (`/usr/bin/outpost`, what the unit starts) is the
//! launcher: before anything else `outpost run` reads boot.json, counts a
//! start of the slot being tried, and exec(2)s the chosen slot's binary
//! (same PID, so systemd's `Type=notify` and `MAINPID` hold). When the slot
//! being tried has used up its starts without proving itself (READY, then a
//! probation window), the launcher falls back to the good slot, or to the
//! packaged binary when no slot has proved itself yet, and leaves a note the
//! daemon reports upstream. A slot binary is told its slot by `OUTPOST_SLOT`
//! and never hands off again.
//!
//! Install (by the OTA agent, after the bundle is verified): unpack into the
//! slot that is neither good nor running, fsync, write boot.json (trying =
//! that slot, attempts 0), switch `current`, then stop gracefully with exit
//! code 75 (the unit restarts it). Every file changes atomically, so a crash
//! at any point leaves either the old or the new binary to start.

use super::install::{InstallError, io};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::fsio::{fsync_dir, write_atomic};

/// Set by the launcher for the slot binary it starts: `a` or `b`.
pub const SLOT_ENV: &str = "OUTPOST_SLOT";
/// The exit code of a daemon that stops to let a new slot start (the unit
/// restarts on it).
pub const RESTART_EXIT: i32 = 75;
const SLOTS: [&str; 2] = ["a", "b"];
const BIN: &str = "outpost";

/// What boot.json holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BootState {
    /// The slot that last proved itself; None: the packaged binary.
    pub good: Option<String>,
    /// The slot on trial.
    pub trying: Option<String>,
    /// Starts of `trying` so far.
    pub attempts: u32,
    /// Starts `trying` gets before the launcher falls back to `good`.
    pub max_attempts: u32,
    /// What each slot holds.
    pub slots: BTreeMap<String, SlotInfo>,
    /// Left by the launcher when it fell back; the daemon reports it upstream
    /// (and refuses that bundle for good), then clears it.
    pub fell_back: Option<FellBack>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotInfo {
    pub version: String,
    /// sha256 of the bundle it came from.
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FellBack {
    pub slot: String,
    pub version: String,
    pub sha256: String,
    pub attempts: u32,
    /// The slot started instead; None: the packaged binary.
    pub to: Option<String>,
}

/// Which binary a start runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// The packaged binary itself (no slot has proved itself yet).
    Package,
    Slot(String),
}

impl BootState {
    /// One start, decided: counts a start of the slot on trial, or falls
    /// back when it has had its `max_attempts`. Outside a trial, a packaged
    /// binary newer than the good slot (the package was upgraded) runs
    /// itself. No I/O.
    pub fn on_start(&mut self, package_version: &str) -> Launch {
        if let Some(t) = self.trying.clone() {
            if self.attempts >= self.max_attempts.max(1) {
                self.fall_back(&t);
                return self.good_launch_over(package_version);
            }
            self.attempts += 1;
            return Launch::Slot(t);
        }
        self.good_launch_over(package_version)
    }

    /// The slot on trial failed (used up its starts, or cannot be started).
    pub fn fall_back(&mut self, slot: &str) {
        let info = self.slots.get(slot).cloned();
        self.fell_back = Some(FellBack {
            slot: slot.to_string(),
            version: info.as_ref().map(|i| i.version.clone()).unwrap_or_default(),
            sha256: info.map(|i| i.sha256).unwrap_or_default(),
            attempts: self.attempts,
            to: self.good.clone(),
        });
        self.trying = None;
        self.attempts = 0;
    }

    fn good_launch_over(&self, package_version: &str) -> Launch {
        match &self.good {
            Some(g)
                if super::machine::cmp_versions(package_version, &self.version_of(Some(g)))
                    == Some(std::cmp::Ordering::Greater) =>
            {
                Launch::Package
            }
            Some(g) => Launch::Slot(g.clone()),
            None => Launch::Package,
        }
    }

    /// The slot an install goes into: neither the good one nor the running one.
    pub fn inactive(&self, running: Option<&str>) -> &'static str {
        SLOTS
            .into_iter()
            .find(|s| Some(*s) != self.good.as_deref() && Some(*s) != running)
            // Two slots, and good == running whenever a slot runs outside a trial.
            .unwrap_or("b")
    }

    /// Puts `slot` on trial (after its binary is in place).
    pub fn try_slot(
        &mut self,
        slot: &str,
        info: SlotInfo,
        max_attempts: u32,
        running: Option<&str>,
    ) {
        // A slot running outside a trial has proved itself.
        if self.trying.is_none() && running.is_some() {
            self.good = running.map(str::to_string);
        }
        self.slots.insert(slot.to_string(), info);
        self.trying = Some(slot.to_string());
        self.attempts = 0;
        self.max_attempts = max_attempts.max(1);
        self.fell_back = None;
    }

    /// The slot on trial proved itself; true when `slot` was on trial.
    pub fn mark_good(&mut self, slot: &str) -> bool {
        if self.trying.as_deref() != Some(slot) {
            return false;
        }
        self.good = Some(slot.to_string());
        self.trying = None;
        self.attempts = 0;
        true
    }

    /// The version a slot (None: the package) runs.
    pub fn version_of(&self, slot: Option<&str>) -> String {
        slot.and_then(|s| self.slots.get(s))
            .map(|i| i.version.clone())
            .unwrap_or_else(|| env!("CARGO_PKG_VERSION").to_string())
    }
}

/// The slot this process runs from (None: the packaged binary).
pub fn running_slot() -> Option<String> {
    std::env::var(SLOT_ENV)
        .ok()
        .filter(|s| SLOTS.contains(&s.as_str()))
}

/// The slot folders of one device.
#[derive(Debug, Clone)]
pub struct Slots {
    pub root: PathBuf,
}

impl Slots {
    pub fn new(data_dir: &Path) -> Slots {
        Slots {
            root: data_dir.join("slots"),
        }
    }

    pub fn boot_path(&self) -> PathBuf {
        self.root.join("boot.json")
    }

    pub fn current(&self) -> PathBuf {
        self.root.join("current")
    }

    pub fn binary(&self, slot: &str) -> PathBuf {
        self.root.join(slot).join(BIN)
    }

    /// boot.json; None when no daemon update was ever installed.
    pub fn load(&self) -> std::io::Result<Option<BootState>> {
        match std::fs::read(self.boot_path()) {
            Ok(b) => serde_json::from_slice(&b)
                .map(Some)
                .map_err(|e| std::io::Error::other(format!("{}: {e}", self.boot_path().display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn save(&self, s: &BootState) -> std::io::Result<()> {
        let b = serde_json::to_vec_pretty(s).map_err(std::io::Error::other)?;
        write_atomic(&self.boot_path(), &b)
    }

    /// Points `current` at `slot` (None: removes it) by rename(2) of a new link.
    pub fn point_current(&self, slot: Option<&str>) -> std::io::Result<()> {
        let cur = self.current();
        match slot {
            Some(s) => {
                if std::fs::read_link(&cur).ok().as_deref() == Some(Path::new(s)) {
                    return Ok(());
                }
                let tmp = self.root.join(".current.tmp");
                let _ = std::fs::remove_file(&tmp);
                std::os::unix::fs::symlink(s, &tmp)?;
                std::fs::rename(&tmp, &cur)?;
            }
            None => match std::fs::remove_file(&cur) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(e),
            },
        }
        fsync_dir(&self.root)
    }

    /// Unpacks a verified daemon bundle into `slot`: a complete, fsynced
    /// folder replaces the old one by rename(2).
    pub fn stage(&self, bundle: &Path, slot: &str) -> Result<PathBuf, InstallError> {
        let staging = self.root.join(format!(".staging-{slot}"));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&self.root).map_err(io("creating", &self.root))?;
        let m = super::bundle::unpack(bundle, &staging)?;
        let bin = staging.join(BIN);
        if m.kind != super::bundle::BundleKind::Daemon || !bin.is_file() {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(InstallError::NoBinary(BIN));
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755))
            .map_err(io("making executable", &bin))?;
        let dest = self.root.join(slot);
        if dest.exists() {
            std::fs::remove_dir_all(&dest).map_err(io("removing", &dest))?;
        }
        std::fs::rename(&staging, &dest).map_err(io("renaming to", &dest))?;
        fsync_dir(&self.root).map_err(io("syncing", &self.root))?;
        Ok(dest)
    }
}

/// Told once the daemon said READY (see [`ready_deadline`]); dropping it
/// unsaid (the daemon returned before READY) ends the watch too, as the
/// process is exiting with its own error.
pub struct ReadyDeadline(Option<std::sync::mpsc::Sender<()>>);

impl ReadyDeadline {
    /// The daemon said READY: the deadline is met.
    pub fn met(&self) {
        if let Some(tx) = &self.0 {
            let _ = tx.send(());
        }
    }
}

/// A daemon slot on trial must say READY within `limit`, or it exits and the
/// launcher's boot counter counts a failed start. The daemon calls
/// [`ReadyDeadline::met`] once it said READY. A thread, not a task: a start
/// stuck loading models must not hold it up. Does nothing outside a slot on
/// trial.
pub fn ready_deadline(data_dir: &Path, limit: Duration) -> ReadyDeadline {
    let Some(slot) = running_slot() else {
        return ReadyDeadline(None);
    };
    let on_trial = matches!(
        Slots::new(data_dir).load(),
        Ok(Some(b)) if b.trying.as_deref() == Some(slot.as_str())
    );
    if !on_trial {
        return ReadyDeadline(None);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let _ = std::thread::Builder::new()
        .name("ready-deadline".into())
        .spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                tracing::error!(slot = %slot, limit_s = limit.as_secs_f64(), "this daemon slot did not get READY in time; exiting");
                std::process::exit(1);
            }
        });
    ReadyDeadline(Some(tx))
}

/// The launcher's step at `outpost run`: when a daemon update is installed
/// under `data_dir`, count the start, pick the slot, and exec(2) its binary
/// with the same arguments. Returns only when this process should serve
/// itself (no slots, already a slot binary, or nothing else can start).
pub fn handoff(data_dir: &Path) {
    if running_slot().is_some() {
        return;
    }
    let slots = Slots::new(data_dir);
    let mut st = match slots.load() {
        Ok(Some(st)) => st,
        Ok(None) => return,
        Err(e) => {
            tracing::error!(error = %e, "daemon slots: boot.json unreadable; running the packaged binary");
            return;
        }
    };
    // At most: the slot on trial, then the good one, then the package.
    for _ in 0..3 {
        let launch = st.on_start(env!("CARGO_PKG_VERSION"));
        if launch == Launch::Package && st.good.is_some() && st.trying.is_none() {
            tracing::info!(
                package = env!("CARGO_PKG_VERSION"),
                slot_version = %st.version_of(st.good.as_deref()),
                "daemon slots: the packaged binary is newer than the good slot; running it"
            );
        }
        let slot = match &launch {
            Launch::Package => None,
            Launch::Slot(s) => Some(s.clone()),
        };
        if let Err(e) = slots
            .save(&st)
            .and_then(|_| slots.point_current(slot.as_deref()))
        {
            tracing::error!(error = %e, "daemon slots: cannot record this start; running the packaged binary");
            return;
        }
        let Some(slot) = slot else {
            return;
        };
        let bin = slots.binary(&slot);
        tracing::info!(slot = %slot, version = %st.version_of(Some(&slot)), attempt = st.attempts, "daemon slots: starting {}", bin.display());
        use std::os::unix::process::CommandExt;
        let err = std::process::Command::new(&bin)
            .args(std::env::args_os().skip(1))
            .env(SLOT_ENV, &slot)
            .exec();
        // exec(2) returned: that binary cannot start at all.
        tracing::error!(slot = %slot, error = %err, "daemon slots: cannot start {}", bin.display());
        if st.trying.as_deref() == Some(slot.as_str()) {
            st.fall_back(&slot);
        } else if st.good.as_deref() == Some(slot.as_str()) {
            st.good = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(v: &str) -> SlotInfo {
        SlotInfo {
            version: v.into(),
            sha256: format!("sha-{v}"),
        }
    }

    #[test]
    fn no_update_runs_the_package() {
        let mut s = BootState::default();
        assert_eq!(s.on_start("0.1.0"), Launch::Package);
        assert_eq!(s.inactive(None), "a");
    }

    #[test]
    fn a_trial_counts_starts_then_falls_back_to_the_package() {
        let mut s = BootState::default();
        s.try_slot("a", info("0.2.0"), 3, None);
        assert_eq!(s.good, None);
        for n in 1..=3 {
            assert_eq!(s.on_start("0.1.0"), Launch::Slot("a".into()));
            assert_eq!(s.attempts, n);
        }
        // Three starts without proving itself: the fourth runs the package.
        assert_eq!(s.on_start("0.1.0"), Launch::Package);
        let fb = s.fell_back.clone().unwrap();
        assert_eq!(
            (fb.slot.as_str(), fb.version.as_str(), fb.attempts),
            ("a", "0.2.0", 3)
        );
        assert_eq!(fb.to, None);
        assert_eq!(s.trying, None);
        assert_eq!(s.on_start("0.1.0"), Launch::Package, "stays fallen back");
    }

    #[test]
    fn a_proved_slot_becomes_good_and_the_next_install_takes_the_other() {
        let mut s = BootState::default();
        s.try_slot("a", info("0.2.0"), 3, None);
        assert_eq!(s.on_start("0.1.0"), Launch::Slot("a".into()));
        assert!(!s.mark_good("b"), "only the slot on trial");
        assert!(s.mark_good("a"));
        assert_eq!(s.on_start("0.1.0"), Launch::Slot("a".into()));
        assert_eq!(s.attempts, 0, "a good slot's starts are not counted");
        assert_eq!(s.inactive(Some("a")), "b");
        s.try_slot("b", info("0.3.0"), 2, Some("a"));
        assert_eq!(s.on_start("0.1.0"), Launch::Slot("b".into()));
        assert_eq!(s.on_start("0.1.0"), Launch::Slot("b".into()));
        // b fails twice: back to a, not to the package.
        assert_eq!(s.on_start("0.1.0"), Launch::Slot("a".into()));
        assert_eq!(s.fell_back.as_ref().unwrap().to.as_deref(), Some("a"));
        assert_eq!(s.version_of(Some("a")), "0.2.0");
        assert_eq!(s.version_of(None), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn an_upgraded_package_newer_than_the_good_slot_runs_itself() {
        let mut s = BootState::default();
        s.try_slot("a", info("0.2.0"), 3, None);
        assert_eq!(s.on_start("0.1.0"), Launch::Slot("a".into()));
        assert!(s.mark_good("a"));
        assert_eq!(
            s.on_start("0.2.0"),
            Launch::Slot("a".into()),
            "same version: the slot"
        );
        assert_eq!(s.on_start("0.3.0"), Launch::Package);
        // A trial still runs its slot whatever the package is.
        s.try_slot("b", info("0.4.0"), 3, Some("a"));
        assert_eq!(s.on_start("0.3.0"), Launch::Slot("b".into()));
    }

    #[test]
    fn a_slot_running_outside_a_trial_is_good_when_the_next_is_tried() {
        let mut s = BootState::default();
        s.slots.insert("a".into(), info("0.2.0"));
        s.try_slot("b", info("0.3.0"), 3, Some("a"));
        assert_eq!(s.good.as_deref(), Some("a"));
        assert_eq!(s.inactive(Some("a")), "b");
    }

    #[test]
    fn current_link_switches_and_boot_json_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let slots = Slots::new(dir.path());
        assert_eq!(slots.load().unwrap(), None);
        std::fs::create_dir_all(&slots.root).unwrap();
        slots.point_current(Some("a")).unwrap();
        assert_eq!(std::fs::read_link(slots.current()).unwrap(), Path::new("a"));
        slots.point_current(Some("b")).unwrap();
        assert_eq!(std::fs::read_link(slots.current()).unwrap(), Path::new("b"));
        slots.point_current(None).unwrap();
        assert!(std::fs::symlink_metadata(slots.current()).is_err());
        slots.point_current(None).unwrap();
        let mut s = BootState::default();
        s.try_slot("a", info("1.0.0"), 3, None);
        slots.save(&s).unwrap();
        assert_eq!(slots.load().unwrap(), Some(s));
        std::fs::write(slots.boot_path(), b"{nope").unwrap();
        assert!(slots.load().is_err());
    }
}
