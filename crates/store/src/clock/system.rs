//! The machine's clocks: the system clock, the time since boot
//! (CLOCK_BOOTTIME), the kernel's sync state (adjtimex) and the boot id.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::SystemTime;

use super::model::{KernelSync, Reading};

/// Where readings come from: the system, or a test's script.
pub trait Source: Send + Sync {
    fn read(&self) -> Reading;
    /// The system clock only (the record stamps' hot path).
    fn wall_us(&self) -> i64;
    /// Time since boot only.
    fn boot_us(&self) -> u64;
}

/// The running machine.
#[derive(Debug, Default)]
pub struct System {
    /// adjtimex was refused once (logged once).
    refused: AtomicBool,
}

impl Source for System {
    fn read(&self) -> Reading {
        Reading {
            wall_us: self.wall_us(),
            boot_us: self.boot_us(),
            kernel: self.kernel(),
        }
    }

    fn wall_us(&self) -> i64 {
        unix_us(SystemTime::now())
    }

    fn boot_us(&self) -> u64 {
        boot_us()
    }
}

impl System {
    fn kernel(&self) -> KernelSync {
        match kernel_sync() {
            Ok(k) => k,
            Err(e) => {
                if !self.refused.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "clock: the kernel's sync state cannot be read (adjtimex); the clock is trusted whenever it is not behind the last known good time");
                }
                KernelSync::Unknown
            }
        }
    }
}

/// Unix µs of a system time (negative before 1970).
pub fn unix_us(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

/// CLOCK_BOOTTIME in µs: monotonic, counts suspend, the same for every
/// process of this boot.
pub fn boot_us() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec we own; CLOCK_BOOTTIME
    // exists on every Linux since 2.6.39.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    if rc != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000)
        .saturating_add(ts.tv_nsec as u64 / 1000)
}

/// The kernel's view of its clock: adjtimex with no modes only reads.
fn kernel_sync() -> std::io::Result<KernelSync> {
    // SAFETY: timex is plain data; with modes = 0 adjtimex only fills it.
    let mut t: libc::timex = unsafe { std::mem::zeroed() };
    // SAFETY: a valid pointer to the timex above.
    let rc = unsafe { libc::adjtimex(&mut t) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(
        if rc == libc::TIME_ERROR || t.status & libc::STA_UNSYNC != 0 {
            KernelSync::Unsynced
        } else {
            KernelSync::Synced
        },
    )
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`). Where the kernel
/// has none, one made up for this process: its records are then corrected
/// only by this process, never with another boot's offset.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("process-{:032x}", rand::random::<u128>()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machine_answers() {
        let s = System::default();
        let a = s.read();
        let b = s.read();
        assert!(b.boot_us >= a.boot_us);
        assert!(a.boot_us > 0);
        assert!(a.wall_us > 0);
        if std::path::Path::new("/proc/sys/kernel/random/boot_id").exists() {
            assert_eq!(boot_id().len(), 36, "{}", boot_id());
            assert_eq!(boot_id(), boot_id());
        }
        assert_eq!(unix_us(SystemTime::UNIX_EPOCH), 0);
        assert_eq!(
            unix_us(SystemTime::UNIX_EPOCH - std::time::Duration::from_secs(1)),
            -1_000_000
        );
    }
}
