//! Keyframe-only decoding: which compressed frames reach the decoder.
//!
//! A keyframe decodes alone; a delta frame needs every frame back to its
//! keyframe. When no pipeline on a camera wants frames more often than the
//! stream sends keyframes, the delta frames can be dropped before the
//! decoder (at the parser's source pad), and decoding costs one frame per
//! keyframe interval instead of every frame.
//!
//! Invariants (the [`DecodeGate`] state machine, free of GStreamer):
//! - Dropping starts at any frame (what is decoded afterwards is keyframes,
//!   which need nothing before them), but stops only at a keyframe: a delta
//!   frame whose references were dropped would decode to garbage.
//! - `auto` chooses keyframes only once it has seen the keyframe interval
//!   (at least [`MIN_INTERVALS`] of them) and while that interval (the
//!   median of the last few: one late keyframe is jitter, not a new
//!   stream) stays within the interval of the fastest consumer, plus
//!   [`TOLERANCE`]. Keyframes that come rarer for good bring every frame
//!   back, at a keyframe, within a few intervals.

use std::collections::VecDeque;

use super::Decode;

/// Keyframe intervals kept to take their median: three long ones in a row
/// change it.
const KEPT: usize = 5;
/// Intervals seen before `auto` trusts the figure.
pub const MIN_INTERVALS: usize = 2;
/// How much longer than a consumer's frame interval the keyframe interval
/// may be and still serve it (clock jitter; the fps gate admits a frame up
/// to an eighth of an interval early, so every keyframe still passes it).
pub const TOLERANCE: f64 = 0.05;

/// The keyframe interval of a stream, from the frames the parser hands on.
#[derive(Debug, Default)]
pub struct KeyframeWatch {
    last_key: Option<u64>,
    intervals: VecDeque<u64>,
}

impl KeyframeWatch {
    /// A frame at stream time `t_ns`; `key`: it decodes alone.
    pub fn see(&mut self, t_ns: u64, key: bool) {
        if !key {
            return;
        }
        if let Some(last) = self.last_key
            && t_ns > last
        {
            if self.intervals.len() == KEPT {
                self.intervals.pop_front();
            }
            self.intervals.push_back(t_ns - last);
        }
        self.last_key = Some(t_ns);
    }

    /// The median of the last intervals, once [`MIN_INTERVALS`] were seen.
    pub fn interval_ns(&self) -> Option<u64> {
        if self.intervals.len() < MIN_INTERVALS {
            return None;
        }
        let mut v: Vec<u64> = self.intervals.iter().copied().collect();
        v.sort_unstable();
        Some(v[v.len() / 2])
    }

    /// Forgets the stream (a new connection may send another one).
    pub fn reset(&mut self) {
        *self = KeyframeWatch::default();
    }
}

/// What happens to one compressed frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// To the decoder.
    Decode,
    /// Dropped before the decoder.
    Skip,
}

/// The fastest consumer's frame interval (`None`: one wants every frame).
fn need_ns(fps: &[Option<f64>]) -> Option<u64> {
    fps.iter()
        .map(|f| f.filter(|f| *f > 0.0).map(|f| (1e9 / f) as u64))
        .collect::<Option<Vec<u64>>>()
        .and_then(|v| v.into_iter().min())
}

/// Decides, frame by frame at the parser's output, what the decoder gets.
#[derive(Debug)]
pub struct DecodeGate {
    decode: Decode,
    /// The fastest consumer's frame interval; `None`: some consumer wants
    /// every frame (keyframes alone never serve it).
    need_ns: Option<u64>,
    watch: KeyframeWatch,
    /// Dropping delta frames now (until a keyframe when `auto` decides against it).
    keyframes_only: bool,
    /// Keyframes stopped coming while only they were decoded: every frame
    /// is decoded until the stream's keyframe interval is seen again.
    fallback: bool,
}

impl DecodeGate {
    /// `fps`: each consumer's (`None`: every frame).
    pub fn new(decode: Decode, fps: &[Option<f64>]) -> DecodeGate {
        DecodeGate {
            decode,
            need_ns: need_ns(fps),
            watch: KeyframeWatch::default(),
            keyframes_only: decode == Decode::Keyframes,
            fallback: false,
        }
    }

    /// The consumers changed (a reload): what they need from now on. The
    /// keyframe interval seen so far stays; a change of mode waits for the
    /// next keyframe as ever.
    pub fn set_need(&mut self, fps: &[Option<f64>]) {
        self.need_ns = need_ns(fps);
    }

    /// Whether keyframes alone serve every consumer now.
    fn keyframes_serve(&self) -> bool {
        if self.fallback {
            return false;
        }
        match self.decode {
            Decode::All => false,
            Decode::Keyframes => true,
            Decode::Auto => {
                let (Some(need), Some(iv)) = (self.need_ns, self.watch.interval_ns()) else {
                    return false;
                };
                iv as f64 <= need as f64 * (1.0 + TOLERANCE)
            }
        }
    }

    /// One compressed frame at stream time `t_ns`; `key`: a keyframe.
    pub fn frame(&mut self, t_ns: u64, key: bool) -> Verdict {
        self.watch.see(t_ns, key);
        if self.fallback && self.watch.interval_ns().is_some() {
            // Keyframes came back, at a steady interval.
            self.fallback = false;
        }
        let serve = self.keyframes_serve();
        if key {
            // A keyframe always decodes, and is where every-frame decoding may resume.
            self.keyframes_only = serve;
            return Verdict::Decode;
        }
        if serve {
            self.keyframes_only = true;
        }
        if self.keyframes_only {
            Verdict::Skip
        } else {
            Verdict::Decode
        }
    }

    /// Whether this connection decodes keyframes only from start to end
    /// (`keyframes` set, and no fall-back to every frame pending): only a
    /// stall ends that, and the next connection decides again.
    pub fn keyframes_for_good(&self) -> bool {
        self.decode == Decode::Keyframes && !self.fallback
    }

    /// `keyframes` or `all`: what the decoder gets now.
    pub fn mode(&self) -> &'static str {
        if self.keyframes_only {
            "keyframes"
        } else {
            "all"
        }
    }

    /// The observed keyframe interval.
    pub fn interval_ns(&self) -> Option<u64> {
        self.watch.interval_ns()
    }

    /// A new connection: the stream is observed afresh (a forced
    /// `keyframes` stays: the first frames are dropped until a keyframe,
    /// which a decoder could not use anyway).
    pub fn reset(&mut self) {
        self.watch.reset();
        self.keyframes_only = self.decode == Decode::Keyframes && !self.fallback;
    }

    /// Keyframes stopped while only they were decoded: from the next
    /// connection on, every frame is decoded until keyframes come at a
    /// steady interval again (a forced `keyframes` too).
    pub fn fall_back(&mut self) {
        self.fallback = true;
        self.keyframes_only = false;
    }

    /// The keyframe interval as last seen (one interval is enough), for
    /// how long keyframe-only decoding may wait for the next.
    pub fn last_interval_ns(&self) -> Option<u64> {
        self.watch.intervals.back().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FRAME: u64 = 1_000_000_000 / 30;

    /// 30 fps, a keyframe every `gop` frames, from frame `from` to `to`.
    fn run(g: &mut DecodeGate, gop: u64, frames: std::ops::Range<u64>) -> Vec<(u64, Verdict)> {
        frames
            .map(|n| (n, g.frame(n * FRAME, n % gop == 0)))
            .collect()
    }

    #[test]
    fn after_keyframes_stopped_every_frame_is_decoded_until_they_come_steadily_again() {
        for decode in [Decode::Keyframes, Decode::Auto] {
            let mut g = DecodeGate::new(decode, &[Some(1.0)]);
            run(&mut g, 30, 0..120);
            assert_eq!(g.mode(), "keyframes", "{decode:?}");
            g.fall_back();
            g.reset();
            assert_eq!(g.mode(), "all");
            // Delta frames alone: all decoded.
            let v = run(&mut g, 1_000_000, 1..100);
            assert!(v.iter().all(|(_, d)| *d == Verdict::Decode), "{decode:?}");
            // Keyframes again, a second apart: two intervals, then keyframes only.
            let v = run(&mut g, 30, 120..300);
            assert!(v[..60].iter().all(|(_, d)| *d == Verdict::Decode));
            assert_eq!(g.mode(), "keyframes", "{decode:?}");
            assert_eq!(g.last_interval_ns(), Some(30 * FRAME));
        }
    }

    #[test]
    fn auto_decodes_keyframes_only_once_it_knows_they_serve_every_consumer() {
        let mut g = DecodeGate::new(Decode::Auto, &[Some(1.0), Some(0.5)]);
        let v = run(&mut g, 30, 0..150);
        // Every frame until two intervals were seen (keyframes 0, 30, 60) ...
        assert!(v[..60].iter().all(|(_, d)| *d == Verdict::Decode), "{v:?}");
        // ... then keyframes only.
        for (n, d) in &v[60..] {
            assert_eq!(*d == Verdict::Decode, n % 30 == 0, "frame {n}");
        }
        assert_eq!(g.mode(), "keyframes");
        assert_eq!(g.interval_ns(), Some(30 * FRAME));
    }

    /// A reload that brings a consumer wanting every frame turns every-frame
    /// decoding on at the next keyframe (the delta frames before it would
    /// not decode), and one that takes it away goes back to keyframes only
    /// at once, on the interval already seen.
    #[test]
    fn new_consumers_change_the_mode_at_the_next_keyframe_keeping_the_interval_seen() {
        let mut g = DecodeGate::new(Decode::Auto, &[Some(1.0)]);
        run(&mut g, 30, 0..100);
        assert_eq!(g.mode(), "keyframes");
        g.set_need(&[Some(1.0), None]);
        let v = run(&mut g, 30, 100..200);
        // Frames 100..119 are still skipped; from keyframe 120 on, all decode.
        assert!(v[..20].iter().all(|(_, d)| *d == Verdict::Skip), "{v:?}");
        assert!(v[20..].iter().all(|(_, d)| *d == Verdict::Decode), "{v:?}");
        assert_eq!(g.mode(), "all");
        g.set_need(&[Some(1.0)]);
        let v = run(&mut g, 30, 200..260);
        for (n, d) in &v {
            assert_eq!(*d == Verdict::Decode, n % 30 == 0, "frame {n}");
        }
        assert_eq!(g.interval_ns(), Some(30 * FRAME));
    }

    #[test]
    fn auto_keeps_every_frame_for_a_consumer_faster_than_the_keyframes() {
        for fps in [[Some(1.0), Some(5.0)], [Some(1.0), None]] {
            let mut g = DecodeGate::new(Decode::Auto, &fps);
            let v = run(&mut g, 30, 0..300);
            assert!(v.iter().all(|(_, d)| *d == Verdict::Decode), "{fps:?}");
            assert_eq!(g.mode(), "all");
        }
        // A keyframe every 2 s does not serve 1 fps.
        let mut g = DecodeGate::new(Decode::Auto, &[Some(1.0)]);
        assert!(
            run(&mut g, 60, 0..600)
                .iter()
                .all(|(_, d)| *d == Verdict::Decode)
        );
    }

    #[test]
    fn one_late_keyframe_is_jitter_but_rarer_keyframes_bring_every_frame_back() {
        let mut g = DecodeGate::new(Decode::Auto, &[Some(1.0)]);
        run(&mut g, 30, 0..120);
        assert_eq!(g.mode(), "keyframes");
        // The keyframe after 120 comes at 160, then they are on time again.
        let key = |n: u64| n == 120 || (n >= 160 && (n - 160).is_multiple_of(30));
        for n in 120..250 {
            let d = g.frame(n * FRAME, key(n));
            assert_eq!(d == Verdict::Decode, key(n), "frame {n}");
        }
        assert_eq!(g.mode(), "keyframes");
        // Now every 2 s for good: every frame again after a few such
        // intervals, from just after a keyframe (deltas before it lack
        // their references).
        let mut first_all = None;
        for n in 250..250 + 60 * 6 {
            let key = (n - 250) % 60 == 0;
            if g.frame(n * FRAME, key) == Verdict::Decode && !key && first_all.is_none() {
                first_all = Some(n);
            }
        }
        let first = first_all.expect("every frame came back");
        assert_eq!((first - 250) % 60, 1, "resumed at frame {first}");
        assert!(first < 250 + 60 * 4, "resumed only at frame {first}");
        assert_eq!(g.mode(), "all");
    }

    #[test]
    fn forced_modes_ignore_the_stream() {
        let mut g = DecodeGate::new(Decode::Keyframes, &[None]);
        let v = run(&mut g, 30, 0..90);
        for (n, d) in &v {
            assert_eq!(*d == Verdict::Decode, n % 30 == 0, "frame {n}");
        }
        let mut g = DecodeGate::new(Decode::All, &[Some(0.1)]);
        assert!(
            run(&mut g, 30, 0..300)
                .iter()
                .all(|(_, d)| *d == Verdict::Decode)
        );
        // A reconnect: auto watches afresh, keyframes stays keyframes.
        let mut g = DecodeGate::new(Decode::Auto, &[Some(1.0)]);
        run(&mut g, 30, 0..120);
        g.reset();
        assert_eq!((g.mode(), g.interval_ns()), ("all", None));
    }

    #[test]
    fn jitter_within_the_tolerance_keeps_keyframes_only() {
        let mut g = DecodeGate::new(Decode::Auto, &[Some(1.0)]);
        let mut t = 0u64;
        let mut decoded = 0;
        for n in 0..600u64 {
            // Keyframes 1 s apart, give or take 20 ms.
            let jitter = if n % 60 < 30 { 20_000_000 } else { 0 };
            t = t.max(n * FRAME + jitter);
            if g.frame(t, n % 30 == 0) == Verdict::Decode {
                decoded += 1;
            }
        }
        assert_eq!(g.mode(), "keyframes");
        // 20 keyframes, and every frame of the first two intervals.
        assert!(decoded <= 20 + 60, "{decoded}");
    }
}
