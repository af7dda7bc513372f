//! Retry delays, the one kind every reconnecting part uses (uplink, MQTT
//! source and output, cameras). Free of I/O: the random draw is an argument
//! of [`Backoff::next_with`], so the bounds are tested exactly, and a part
//! that is tested as a state machine (the uplink sessions) is handed its
//! randomness as a [`Jitter`]: the thread's generator when running, a
//! seeded one in tests, so a run is the same every time.

use std::time::Duration;

use rand::{RngExt, SeedableRng};

/// Where the jitter's draws come from.
pub trait Jitter: Send + std::fmt::Debug {
    /// A uniform draw in `[0, 1)`.
    fn unit(&mut self) -> f64;
    /// An independent generator for another part (a seeded one: seeded
    /// from this one, so a run is still the same every time).
    fn fork(&mut self) -> Box<dyn Jitter>;
}

/// The thread's random generator (seeded by the OS): every device of a
/// fleet draws differently.
#[derive(Debug, Default, Clone, Copy)]
pub struct ThreadJitter;

impl Jitter for ThreadJitter {
    fn unit(&mut self) -> f64 {
        rand::random_range(0.0..1.0)
    }
    fn fork(&mut self) -> Box<dyn Jitter> {
        Box::new(ThreadJitter)
    }
}

/// A generator from a seed: the same draws every run (tests, simulations).
#[derive(Debug)]
pub struct SeededJitter(rand::rngs::StdRng);

impl SeededJitter {
    pub fn new(seed: u64) -> SeededJitter {
        SeededJitter(rand::rngs::StdRng::seed_from_u64(seed))
    }
}

impl Jitter for SeededJitter {
    fn unit(&mut self) -> f64 {
        self.0.random_range(0.0..1.0)
    }
    fn fork(&mut self) -> Box<dyn Jitter> {
        Box::new(SeededJitter::new(self.0.random_range(0..u64::MAX)))
    }
}

/// Exponential backoff with full jitter between `min` and a ceiling that
/// doubles per attempt up to `max`. The jitter spreads a fleet that lost
/// its broker at the same moment, so the devices do not all come back in
/// lockstep; the floor at `min` keeps a tight loop from hammering a peer.
#[derive(Debug, Clone)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(min: Duration, max: Duration) -> Backoff {
        Backoff {
            min,
            max: max.max(min),
            attempt: 0,
        }
    }

    /// The ceiling of the next delay: `min * 2^(attempt+1)`, at most `max`.
    pub fn ceiling(&self) -> Duration {
        doubled(self.min, self.max, self.attempt.saturating_add(1))
    }

    /// The next delay for a uniform draw `u` in `[0, 1)`; counts an attempt.
    pub fn next_with(&mut self, u: f64) -> Duration {
        let ceil = self.ceiling();
        let span = ceil.saturating_sub(self.min);
        self.attempt = self.attempt.saturating_add(1);
        self.min + span.mul_f64(u.clamp(0.0, 1.0))
    }

    /// The next delay with a draw from `jitter`.
    pub fn next(&mut self, jitter: &mut dyn Jitter) -> Duration {
        self.next_with(jitter.unit())
    }

    /// The next delay with a fresh random draw.
    pub fn next_delay(&mut self) -> Duration {
        self.next(&mut ThreadJitter)
    }

    /// After a success the next failure starts from `min` again.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    pub fn attempts(&self) -> u32 {
        self.attempt
    }
}

/// `min * 2^n`, at most `max`: the deterministic doubling under every
/// retry delay (the jittered [`Backoff`], and retries that must be exact,
/// such as a QoS 1 frame handed in again).
pub fn doubled(min: Duration, max: Duration, n: u32) -> Duration {
    min.saturating_mul(1u32 << n.min(31)).min(max)
}

/// A uniform random delay in `[0, max]`: spreads periodic work (manifest
/// polls) across a fleet that started together.
pub fn jitter(max: Duration) -> Duration {
    max.mul_f64(rand::random_range(0.0..=1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_within_min_and_a_doubling_ceiling_capped_at_max() {
        let (min, max) = (Duration::from_millis(200), Duration::from_secs(30));
        let mut b = Backoff::new(min, max);
        let mut prev_ceil = Duration::ZERO;
        for i in 0..40 {
            let ceil = b.ceiling();
            assert!(ceil >= prev_ceil && ceil <= max, "attempt {i}: {ceil:?}");
            prev_ceil = ceil;
            let lo = b.clone().next_with(0.0);
            let hi = b.clone().next_with(0.999_999);
            assert_eq!(lo, min);
            assert!(
                hi <= ceil && hi >= ceil.mul_f64(0.99) - min,
                "{hi:?} {ceil:?}"
            );
            let d = b.next_delay();
            assert!(
                d >= min && d <= ceil,
                "attempt {i}: {d:?} outside [{min:?}, {ceil:?}]"
            );
        }
        assert_eq!(b.ceiling(), max);
        assert_eq!(Backoff::new(min, max).ceiling(), Duration::from_millis(400));
        b.reset();
        assert_eq!(b.attempts(), 0);
        assert_eq!(b.ceiling(), Duration::from_millis(400));
    }

    #[test]
    fn backoff_jitter_spreads_a_fleet() {
        // Devices that failed together draw different delays.
        let draws: Vec<Duration> = (0..50)
            .map(|_| {
                let mut b = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
                for _ in 0..5 {
                    b.next_delay();
                }
                b.next_delay()
            })
            .collect();
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(distinct.len() > 40, "{draws:?}");
    }

    #[test]
    fn a_seeded_jitter_draws_the_same_delays_every_run() {
        let run = |seed| {
            let mut j = SeededJitter::new(seed);
            let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
            (0..8).map(|_| b.next(&mut j)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        for d in run(7) {
            assert!(d >= Duration::from_millis(100) && d <= Duration::from_secs(10));
        }
        let mut j = SeededJitter::new(1);
        for _ in 0..1000 {
            let u = j.unit();
            assert!((0.0..1.0).contains(&u), "{u}");
        }
    }

    #[test]
    fn jitter_stays_within_its_bound() {
        let max = Duration::from_millis(30);
        for _ in 0..200 {
            assert!(jitter(max) <= max);
        }
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn backoff_min_above_max_uses_min() {
        let mut b = Backoff::new(Duration::from_secs(2), Duration::from_secs(1));
        assert_eq!(b.next_with(0.5), Duration::from_secs(2));
    }
}
