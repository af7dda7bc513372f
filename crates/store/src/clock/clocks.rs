//! The clocks a part of the daemon reads, handed in rather than read from
//! the process (Moonfire NVR's `Clocks` is the model): [`RealClocks`] when
//! running, [`SimulatedClocks`] in tests, where time moves only when the
//! test moves it and the system clock can be put anywhere (2100) without
//! touching the machine's.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use super::model::{KernelSync, Reading};
use super::system::Source;

/// A monotonic clock and the system clock.
pub trait Clocks: Send + Sync + std::fmt::Debug {
    /// Never steps back (timers, rate caps, retry times).
    fn monotonic(&self) -> Instant;
    /// The system clock, as it is (possibly wrong: see [`crate::clock`]).
    fn realtime(&self) -> SystemTime;

    /// The system clock in unix milliseconds (0 before 1970).
    fn unix_ms(&self) -> u64 {
        self.realtime()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// The machine's clocks.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealClocks;

impl Clocks for RealClocks {
    fn monotonic(&self) -> Instant {
        Instant::now()
    }
    fn realtime(&self) -> SystemTime {
        SystemTime::now()
    }
}

#[derive(Debug)]
struct Sim {
    /// Time since the simulated boot.
    elapsed: Duration,
    /// The system clock at the simulated boot (unix µs): moved by
    /// [`SimulatedClocks::set_realtime`] as a time service or a bad
    /// real-time clock would.
    boot_wall_us: i64,
    kernel: KernelSync,
}

/// Clocks that move only when told; clones share them. Also a
/// [`Source`] for [`crate::clock::Clock`], so one simulated machine drives
/// the trusted clock and what it is handed to.
#[derive(Debug, Clone)]
pub struct SimulatedClocks {
    base: Instant,
    sim: Arc<Mutex<Sim>>,
}

impl SimulatedClocks {
    /// Booted just now, the system clock at `realtime_us` (unix µs).
    pub fn new(realtime_us: i64) -> SimulatedClocks {
        SimulatedClocks {
            base: Instant::now(),
            sim: Arc::new(Mutex::new(Sim {
                elapsed: Duration::ZERO,
                boot_wall_us: realtime_us,
                kernel: KernelSync::Unknown,
            })),
        }
    }

    fn with<T>(&self, f: impl FnOnce(&mut Sim) -> T) -> T {
        // A test that panicked while holding it left plain data behind.
        f(&mut self.sim.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Time passes: both clocks move on by `d`.
    pub fn advance(&self, d: Duration) {
        self.with(|s| s.elapsed = s.elapsed.saturating_add(d));
    }

    /// The system clock is set to `realtime_us` now (a step); the
    /// monotonic clock does not move.
    pub fn set_realtime(&self, realtime_us: i64) {
        self.with(|s| {
            let since = i64::try_from(s.elapsed.as_micros()).unwrap_or(i64::MAX);
            s.boot_wall_us = realtime_us.saturating_sub(since);
        });
    }

    /// What the kernel says of its clock from now on.
    pub fn set_kernel(&self, k: KernelSync) {
        self.with(|s| s.kernel = k);
    }

    fn realtime_us(&self) -> i64 {
        self.with(|s| {
            let since = i64::try_from(s.elapsed.as_micros()).unwrap_or(i64::MAX);
            s.boot_wall_us.saturating_add(since)
        })
    }
}

impl Clocks for SimulatedClocks {
    fn monotonic(&self) -> Instant {
        self.base + self.with(|s| s.elapsed)
    }
    fn realtime(&self) -> SystemTime {
        let us = self.realtime_us();
        match u64::try_from(us) {
            Ok(u) => SystemTime::UNIX_EPOCH + Duration::from_micros(u),
            Err(_) => SystemTime::UNIX_EPOCH - Duration::from_micros(us.unsigned_abs()),
        }
    }
}

impl Source for SimulatedClocks {
    fn read(&self) -> Reading {
        Reading {
            wall_us: self.wall_us(),
            boot_us: self.boot_us(),
            kernel: self.with(|s| s.kernel),
        }
    }
    fn wall_us(&self) -> i64 {
        self.realtime_us()
    }
    fn boot_us(&self) -> u64 {
        u64::try_from(self.with(|s| s.elapsed.as_micros())).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::super::system::unix_us;
    use super::*;

    #[test]
    fn simulated_clocks_move_only_when_told() {
        let c = SimulatedClocks::new(1_796_083_200_000_000);
        let (m0, w0) = (c.monotonic(), c.realtime());
        assert_eq!(c.monotonic(), m0);
        assert_eq!(unix_us(w0), 1_796_083_200_000_000);
        c.advance(Duration::from_secs(5));
        assert_eq!(c.monotonic() - m0, Duration::from_secs(5));
        assert_eq!(c.unix_ms(), 1_796_083_205_000);
        assert_eq!(c.boot_us(), 5_000_000);
        // A step of the system clock leaves the monotonic clock alone.
        let shared = c.clone();
        shared.set_realtime(4_102_444_800_000_000);
        assert_eq!(c.wall_us(), 4_102_444_800_000_000);
        assert_eq!(c.monotonic() - m0, Duration::from_secs(5));
        c.set_realtime(-1_000_000);
        assert_eq!(unix_us(c.realtime()), -1_000_000);
        assert_eq!(c.unix_ms(), 0);
        let r = RealClocks;
        assert!(r.realtime() > SystemTime::UNIX_EPOCH);
        assert!(r.monotonic() <= Instant::now());
    }
}
