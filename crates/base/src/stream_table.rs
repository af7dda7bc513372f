//! A bounded, counted table of the streams one pipeline holds state for.
//!
//! Stream names come from outside (MQTT topic segments, datagram prefixes,
//! HTTP query strings), so whatever is kept per stream (model state, audio
//! windows and resamplers, hysteresis, later object tracks) must be bounded
//! by the table, not by the senders. This leaf room decides which streams are
//! held; the owners of per-stream state reset a stream when the table lets it
//! go, so a stream that comes back starts from zero, exactly like a new one.
//!
//! Invariants:
//! - Entries are ordered least recently seen first: every `begin`/`end`
//!   moves its stream to the back, so with a clock that does not go back
//!   the `seen` times rise from front to back.
//! - At most `max` streams are held, except streams in flight (between
//!   `begin` and `end`: a frame of theirs is being processed), which are
//!   never evicted; the table can then exceed `max` by the streams in
//!   flight, and is trimmed back at their `end`.
//! - A stream not seen for `idle` is expired by `expire` (the caller runs it
//!   periodically, so this happens without any new frame), unless in flight.
//! - Every stream that leaves the table other than by `remove` is handed
//!   back with its value and the reason, and counted by reason.

use std::time::{Duration, Instant};

use hashlink::LinkedHashMap;

/// Why a stream left the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// A new stream needed its place: it was the least recently seen.
    Lru,
    /// Not seen for the table's idle time.
    Idle,
}

impl Reason {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Lru => "lru",
            Reason::Idle => "idle",
        }
    }
}

/// A stream that left the table, with what it held.
#[derive(Debug, PartialEq)]
pub struct Evicted<V> {
    pub stream: String,
    pub value: V,
    pub reason: Reason,
}

struct Entry<V> {
    value: V,
    seen: Instant,
    /// Frames of this stream being processed now.
    in_flight: u32,
}

/// The held streams of one pipeline, least recently seen first, with a
/// value of the caller's per stream.
pub struct StreamTable<V> {
    entries: LinkedHashMap<String, Entry<V>>,
    max: usize,
    idle: Duration,
    evicted_lru: u64,
    evicted_idle: u64,
}

impl<V> StreamTable<V> {
    /// A table of at most `max` streams (at least 1) that expires streams
    /// not seen for `idle`.
    pub fn new(max: usize, idle: Duration) -> Self {
        StreamTable {
            entries: LinkedHashMap::new(),
            max: max.max(1),
            idle,
            evicted_lru: 0,
            evicted_idle: 0,
        }
    }

    /// Streams held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bound on held streams.
    pub fn max(&self) -> usize {
        self.max
    }

    /// How long a stream may go unseen before it is expired.
    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// Streams that left the table for `reason`, since it was made.
    pub fn evicted(&self, reason: Reason) -> u64 {
        match reason {
            Reason::Lru => self.evicted_lru,
            Reason::Idle => self.evicted_idle,
        }
    }

    pub fn contains(&self, stream: &str) -> bool {
        self.entries.contains_key(stream)
    }

    pub fn get(&self, stream: &str) -> Option<&V> {
        self.entries.get(stream).map(|e| &e.value)
    }

    pub fn get_mut(&mut self, stream: &str) -> Option<&mut V> {
        self.entries.get_mut(stream).map(|e| &mut e.value)
    }

    /// The held streams, least recently seen first.
    pub fn streams(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// A frame of `stream` is being processed from `now` on: the stream is
    /// seen (a new one gets `init()`), held until the matching `end`, and the
    /// least recently seen streams not in flight make room for it. Returns
    /// the streams evicted for it.
    pub fn begin(
        &mut self,
        stream: &str,
        now: Instant,
        init: impl FnOnce() -> V,
    ) -> Vec<Evicted<V>> {
        // Looked up by &str first: the name is copied once, when the stream is new.
        match self.entries.to_back(stream) {
            Some(e) => {
                e.seen = e.seen.max(now);
                e.in_flight = e.in_flight.saturating_add(1);
            }
            None => {
                self.entries.insert(
                    stream.to_string(),
                    Entry {
                        value: init(),
                        seen: now,
                        in_flight: 1,
                    },
                );
            }
        }
        self.trim()
    }

    /// The frame of `stream` begun before is done at `now`: the stream is
    /// seen again and may be evicted from here on. Returns the streams
    /// evicted to bring the table back to its bound (more than `max` were in
    /// flight).
    pub fn end(&mut self, stream: &str, now: Instant) -> Vec<Evicted<V>> {
        if let Some(e) = self.entries.to_back(stream) {
            e.seen = e.seen.max(now);
            e.in_flight = e.in_flight.saturating_sub(1);
        }
        self.trim()
    }

    /// A frame of `stream` seen at `now` that needs no span (`begin` and
    /// `end` at once).
    pub fn touch(
        &mut self,
        stream: &str,
        now: Instant,
        init: impl FnOnce() -> V,
    ) -> Vec<Evicted<V>> {
        let mut gone = self.begin(stream, now, init);
        gone.extend(self.end(stream, now));
        gone
    }

    /// Expires the streams not seen for the idle time at `now` (none in
    /// flight). Returns them.
    pub fn expire(&mut self, now: Instant) -> Vec<Evicted<V>> {
        // The stale ones are a prefix (seen rises front to back); streams in
        // flight inside it stay.
        let stale: Vec<String> = self
            .entries
            .iter()
            .take_while(|(_, e)| now.saturating_duration_since(e.seen) >= self.idle)
            .filter(|(_, e)| e.in_flight == 0)
            .map(|(k, _)| k.clone())
            .collect();
        let mut gone = Vec::with_capacity(stale.len());
        for k in stale {
            if let Some((stream, e)) = self.entries.remove_entry(k.as_str()) {
                self.evicted_idle += 1;
                gone.push(Evicted {
                    stream,
                    value: e.value,
                    reason: Reason::Idle,
                });
            }
        }
        if self.entries.is_empty() {
            // Give back what a burst of streams grew (freed nodes are kept otherwise).
            self.entries.shrink_to_fit();
        }
        gone
    }

    /// Forgets `stream` (it ended) without counting it; returns its value.
    pub fn remove(&mut self, stream: &str) -> Option<V> {
        self.entries.remove(stream).map(|e| e.value)
    }

    /// Takes every stream out, uncounted: `(stream, value, last seen)`,
    /// least recently seen first (to hand the values to another table).
    pub fn drain(&mut self) -> Vec<(String, V, Instant)> {
        let mut out = Vec::with_capacity(self.entries.len());
        while let Some((stream, e)) = self.entries.pop_front() {
            out.push((stream, e.value, e.seen));
        }
        out
    }

    /// Holds `stream` with `value`, last seen at `seen` (from another
    /// table's [`StreamTable::drain`]), as the most recently seen; a stream
    /// held already keeps its own value. Returns the streams evicted to stay
    /// within the bound.
    pub fn adopt(&mut self, stream: String, value: V, seen: Instant) -> Vec<Evicted<V>> {
        if !self.entries.contains_key(stream.as_str()) {
            // Seen times rise front to back: never older than the newest.
            let seen = self
                .entries
                .back()
                .map_or(seen, |(_, last)| seen.max(last.seen));
            self.entries.insert(
                stream,
                Entry {
                    value,
                    seen,
                    in_flight: 0,
                },
            );
        }
        self.trim()
    }

    /// Evicts the least recently seen streams not in flight while more than
    /// `max` are held.
    fn trim(&mut self) -> Vec<Evicted<V>> {
        let mut gone = Vec::new();
        while self.entries.len() > self.max {
            // Usually the front; streams in flight in front of it are skipped.
            let victim = match self.entries.front() {
                Some((_, e)) if e.in_flight == 0 => self.entries.pop_front(),
                _ => {
                    let Some(k) = self
                        .entries
                        .iter()
                        .find(|(_, e)| e.in_flight == 0)
                        .map(|(k, _)| k.clone())
                    else {
                        // Every held stream is in flight: trimmed at their `end`.
                        break;
                    };
                    self.entries.remove_entry(k.as_str())
                }
            };
            let Some((stream, e)) = victim else { break };
            self.evicted_lru += 1;
            gone.push(Evicted {
                stream,
                value: e.value,
                reason: Reason::Lru,
            });
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names<V>(gone: &[Evicted<V>]) -> Vec<(&str, Reason)> {
        gone.iter().map(|e| (e.stream.as_str(), e.reason)).collect()
    }

    fn held<V>(t: &StreamTable<V>) -> Vec<&str> {
        t.streams().collect()
    }

    #[test]
    fn the_least_recently_seen_makes_room() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut t: StreamTable<u32> = StreamTable::new(3, Duration::from_secs(60));
        for (i, s) in ["a", "b", "c"].iter().enumerate() {
            assert!(t.touch(s, ms(i as u64), || 0).is_empty());
        }
        // Seeing `a` again makes `b` the least recently seen.
        assert!(t.touch("a", ms(3), || 0).is_empty());
        assert_eq!(held(&t), ["b", "c", "a"]);
        let gone = t.touch("d", ms(4), || 0);
        assert_eq!(names(&gone), [("b", Reason::Lru)]);
        assert_eq!(held(&t), ["c", "a", "d"]);
        let gone = t.touch("e", ms(5), || 0);
        assert_eq!(names(&gone), [("c", Reason::Lru)]);
        assert_eq!(
            (t.len(), t.evicted(Reason::Lru), t.evicted(Reason::Idle)),
            (3, 2, 0)
        );
    }

    #[test]
    fn many_names_stay_bounded_and_each_extra_one_is_counted() {
        let t0 = Instant::now();
        let mut t: StreamTable<()> = StreamTable::new(100, Duration::from_secs(60));
        let mut gone = 0;
        for i in 0..5000u64 {
            gone += t
                .touch(&format!("s{i}"), t0 + Duration::from_micros(i), || ())
                .len();
            assert!(t.len() <= 100);
        }
        assert_eq!((gone, t.evicted(Reason::Lru)), (4900, 4900));
        // The newest 100 are the ones held.
        assert_eq!(t.streams().next(), Some("s4900"));
    }

    #[test]
    fn idle_streams_expire_without_new_frames() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut t: StreamTable<&str> = StreamTable::new(10, Duration::from_secs(10));
        t.touch("a", s(0), || "va");
        t.touch("b", s(5), || "vb");
        t.touch("c", s(8), || "vc");
        assert!(t.expire(s(9)).is_empty());
        let gone = t.expire(s(10));
        assert_eq!(
            gone,
            [Evicted {
                stream: "a".into(),
                value: "va",
                reason: Reason::Idle
            }]
        );
        // Seen again: `b` is fresh until 10 s after this.
        t.touch("b", s(12), || "new");
        assert_eq!(names(&t.expire(s(18))), [("c", Reason::Idle)]);
        assert_eq!(t.get("b"), Some(&"vb"));
        assert_eq!(names(&t.expire(s(22))), [("b", Reason::Idle)]);
        assert!(t.is_empty());
        assert_eq!((t.evicted(Reason::Idle), t.evicted(Reason::Lru)), (3, 0));
    }

    #[test]
    fn a_stream_that_comes_back_starts_from_its_initial_value() {
        let t0 = Instant::now();
        let mut t: StreamTable<Vec<u32>> = StreamTable::new(1, Duration::from_secs(60));
        t.touch("a", t0, Vec::new);
        t.get_mut("a").unwrap().extend([1, 2, 3]);
        let gone = t.touch("b", t0, Vec::new);
        assert_eq!(gone[0].value, [1, 2, 3], "the evicted state is handed back");
        t.touch("a", t0, Vec::new);
        assert_eq!(t.get("a"), Some(&Vec::new()));
        assert!(!t.contains("b"));
    }

    #[test]
    fn streams_in_flight_are_neither_evicted_nor_expired() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut t: StreamTable<()> = StreamTable::new(2, Duration::from_secs(10));
        // Three streams in one batch with room for two: all held until done.
        for x in ["a", "b", "c"] {
            assert!(t.begin(x, s(0), || ()).is_empty());
        }
        assert_eq!(t.len(), 3);
        assert!(t.expire(s(60)).is_empty(), "in flight: not expired");
        // `a` done first: over the bound, and the only one not in flight, it goes.
        assert_eq!(names(&t.end("a", s(1))), [("a", Reason::Lru)]);
        assert!(t.end("b", s(2)).is_empty());
        assert_eq!(held(&t), ["c", "b"]);
        // `c` still in flight at the front: a new stream evicts `b` behind it.
        assert_eq!(names(&t.touch("d", s(3), || ())), [("b", Reason::Lru)]);
        // Past the idle time only `d` goes; `c` stays while in flight.
        assert_eq!(names(&t.expire(s(13))), [("d", Reason::Idle)]);
        assert!(t.end("c", s(14)).is_empty());
        assert_eq!(names(&t.expire(s(24))), [("c", Reason::Idle)]);
    }

    #[test]
    fn drained_streams_move_to_another_table_in_order_and_within_its_bound() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut old: StreamTable<u32> = StreamTable::new(10, Duration::from_secs(60));
        for (i, x) in ["a", "b", "c"].iter().enumerate() {
            old.touch(x, s(i as u64), || i as u32);
        }
        let taken = old.drain();
        assert!(old.is_empty());
        assert_eq!(old.evicted(Reason::Lru) + old.evicted(Reason::Idle), 0);
        let mut new: StreamTable<u32> = StreamTable::new(2, Duration::from_secs(60));
        let mut gone = Vec::new();
        for (stream, v, seen) in taken {
            gone.extend(new.adopt(stream, v, seen));
        }
        // The least recently seen makes room, counted, with its value.
        assert_eq!(names(&gone), [("a", Reason::Lru)]);
        assert_eq!(held(&new), ["b", "c"]);
        assert_eq!((new.get("b"), new.get("c")), (Some(&1), Some(&2)));
        // Each keeps its last-seen time: `b` expires first.
        assert_eq!(names(&new.expire(s(61))), [("b", Reason::Idle)]);
    }

    #[test]
    fn remove_is_not_counted() {
        let mut t: StreamTable<u8> = StreamTable::new(0, Duration::from_secs(1));
        assert_eq!(t.max(), 1, "at least one stream");
        t.touch("a", Instant::now(), || 7);
        assert_eq!(t.remove("a"), Some(7));
        assert_eq!((t.evicted(Reason::Lru), t.evicted(Reason::Idle)), (0, 0));
    }
}
