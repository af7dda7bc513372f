//! Pacing, free of I/O: the byte-rate cap of the uplink (its retry delays
//! are [`crate::backoff::Backoff`]).
//!
//! The bucket takes the clock as an argument, so its bounds are tested
//! exactly.

use std::time::{Duration, Instant};

/// Token bucket over bytes: `rate` bytes/s, holding at most one second's
/// worth. A message larger than the bucket still goes when the bucket is
/// full and leaves it in debt, so no size can stall the uplink forever and
/// the long-run rate still holds. `rate = 0` means no cap.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: u64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: u64, now: Instant) -> TokenBucket {
        TokenBucket {
            rate,
            tokens: rate as f64,
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        if self.rate == 0 {
            return;
        }
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate as f64).min(self.rate as f64);
    }

    /// How long until a message may go (zero: now).
    pub fn ready_in(&mut self, now: Instant) -> Duration {
        if self.rate == 0 {
            return Duration::ZERO;
        }
        self.refill(now);
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / self.rate as f64)
        }
    }

    /// Charges `bytes` that were just sent.
    pub fn take(&mut self, bytes: usize, now: Instant) {
        if self.rate == 0 {
            return;
        }
        self.refill(now);
        self.tokens -= bytes as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_bucket_holds_the_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1000, t0);
        // A full second's worth goes at once.
        assert_eq!(b.ready_in(t0), Duration::ZERO);
        b.take(1000, t0);
        assert_eq!(b.ready_in(t0), Duration::ZERO, "empty, not in debt");
        b.take(500, t0);
        let w = b.ready_in(t0);
        assert!((w.as_secs_f64() - 0.5).abs() < 1e-9, "{w:?}");
        // Refill after the wait.
        assert_eq!(b.ready_in(t0 + Duration::from_millis(500)), Duration::ZERO);
        // Sending 10 kB in 100 B messages as fast as allowed takes ~9 s (1 s burst).
        let mut b = TokenBucket::new(1000, t0);
        let mut now = t0;
        for _ in 0..100 {
            now += b.ready_in(now);
            b.take(100, now);
        }
        let secs = (now - t0).as_secs_f64();
        assert!((8.8..=9.1).contains(&secs), "{secs}");
    }

    #[test]
    fn token_bucket_lets_an_oversized_message_through_and_then_waits() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(100, t0);
        assert_eq!(b.ready_in(t0), Duration::ZERO);
        b.take(1000, t0);
        let w = b.ready_in(t0);
        assert!((w.as_secs_f64() - 9.0).abs() < 1e-9, "{w:?}");
    }

    #[test]
    fn token_bucket_zero_rate_is_unlimited() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(0, t0);
        b.take(usize::MAX, t0);
        assert_eq!(b.ready_in(t0), Duration::ZERO);
    }
}
