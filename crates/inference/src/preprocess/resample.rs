//! A streaming polyphase resampler: windowed-sinc low-pass (cut-off below
//! the lower of the two Nyquist frequencies, so downsampling does not alias)
//! evaluated at the exact rational positions `n * in_rate / out_rate`.
//!
//! Invariant: output sample `n` sits at input time `n * M / L` (`L/M` is
//! `out_rate/in_rate` in lowest terms), so frames of any size give the same
//! samples as one long frame: the state carries the last `taps` inputs and
//! the next output index across calls. Samples before the stream's start are
//! zeros; output lags input by half the filter length.

/// Zero crossings of the sinc on each side, in units of the lower rate:
/// 16 gives > 60 dB stop-band with the Blackman window, at ~100 taps for
/// 48 kHz -> 16 kHz.
const ZERO_CROSSINGS: f64 = 16.0;
/// Cut-off as a fraction of the lower Nyquist frequency; the rest is the
/// transition band (speech models do not need the top 5 %).
const CUTOFF: f64 = 0.95;
/// Largest number of polyphase phases accepted (`out_rate / gcd`): rates this
/// incommensurate (e.g. 16000 vs 44101) would need a huge table.
pub const MAX_PHASES: u64 = 4096;

/// Resamples one stream of mono samples from `in_rate` to `out_rate`.
#[derive(Debug, Clone)]
pub struct Resampler {
    /// Upsampling factor L and downsampling factor M (lowest terms).
    up: u64,
    down: u64,
    /// Taps per phase; `table[p * taps + k]` weights input `base + k` for phase p.
    taps: usize,
    table: Vec<f32>,
    /// Offset of the first tap relative to floor(position).
    first: i64,
    /// Input history; `buf[0]` is input sample `buf_start`.
    buf: Vec<f32>,
    buf_start: i64,
    /// Inputs received so far.
    received: i64,
    /// Index of the next output sample.
    next_out: u64,
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// Number of phases the resampler between two rates needs.
pub fn phases(in_rate: u32, out_rate: u32) -> u64 {
    let g = gcd(in_rate as u64, out_rate as u64).max(1);
    out_rate as u64 / g
}

impl Resampler {
    /// Rates must be non-zero with `phases(in, out) <= MAX_PHASES` (checked by
    /// the config's validate); otherwise the resampler passes samples through.
    pub fn new(in_rate: u32, out_rate: u32) -> Resampler {
        let g = gcd(in_rate as u64, out_rate as u64).max(1);
        let (mut up, mut down) = (out_rate as u64 / g, in_rate as u64 / g);
        if up == 0 || down == 0 || up > MAX_PHASES {
            (up, down) = (1, 1);
        }
        // Normalized cut-off in cycles per input sample.
        let fc = 0.5 * CUTOFF * (up as f64 / down as f64).min(1.0);
        let half = (ZERO_CROSSINGS / (2.0 * fc)).ceil() as i64; // half-width in input samples
        let taps = (2 * half) as usize;
        let first = -half + 1;
        let mut table = vec![0f32; up as usize * taps];
        for p in 0..up as usize {
            let frac = p as f64 / up as f64;
            let row = &mut table[p * taps..(p + 1) * taps];
            let mut sum = 0.0;
            let mut w = vec![0f64; taps];
            for (k, wk) in w.iter_mut().enumerate() {
                let x = (first + k as i64) as f64 - frac; // distance in input samples
                *wk = kernel(x, fc, half as f64);
                sum += *wk;
            }
            // Unit DC gain for every phase, so a constant stays constant.
            for (r, wk) in row.iter_mut().zip(&w) {
                *r = if sum.abs() > 1e-12 {
                    (wk / sum) as f32
                } else {
                    0.0
                };
            }
        }
        if up == 1 && down == 1 {
            // Identity: one tap of weight 1 at offset 0.
            return Resampler {
                up,
                down,
                taps: 1,
                table: vec![1.0],
                first: 0,
                buf: Vec::new(),
                buf_start: 0,
                received: 0,
                next_out: 0,
            };
        }
        Resampler {
            up,
            down,
            taps,
            table,
            first,
            buf: Vec::new(),
            buf_start: 0,
            received: 0,
            next_out: 0,
        }
    }

    /// Feeds input samples, appends every output sample now computable.
    pub fn process(&mut self, input: &[f32], out: &mut Vec<f32>) {
        if self.up == 1 && self.down == 1 {
            out.extend_from_slice(input);
            self.received += input.len() as i64;
            return;
        }
        self.buf.extend_from_slice(input);
        self.received += input.len() as i64;
        loop {
            let pos = self.next_out * self.down;
            let base = (pos / self.up) as i64;
            let phase = (pos % self.up) as usize;
            let lo = base + self.first;
            let hi = lo + self.taps as i64; // exclusive
            if hi > self.received {
                break;
            }
            let weights = &self.table[phase * self.taps..(phase + 1) * self.taps];
            let mut acc = 0f32;
            for (k, w) in weights.iter().enumerate() {
                let i = lo + k as i64 - self.buf_start;
                // Indices before the buffer are before the stream: zeros.
                if i >= 0
                    && let Some(x) = self.buf.get(i as usize)
                {
                    acc += w * x;
                }
            }
            out.push(acc);
            self.next_out += 1;
        }
        // Drop inputs no later output can reach.
        let pos = self.next_out * self.down;
        let keep_from = (pos / self.up) as i64 + self.first;
        let drop = (keep_from - self.buf_start).clamp(0, self.buf.len() as i64) as usize;
        if drop > 0 {
            self.buf.drain(..drop);
            self.buf_start += drop as i64;
        }
    }
}

/// Blackman-windowed sinc low-pass with cut-off `fc` (cycles/sample).
fn kernel(x: f64, fc: f64, half: f64) -> f64 {
    if x.abs() >= half {
        return 0.0;
    }
    let s = if x == 0.0 {
        2.0 * fc
    } else {
        (2.0 * std::f64::consts::PI * fc * x).sin() / (std::f64::consts::PI * x)
    };
    let t = std::f64::consts::PI * (x / half + 1.0); // 0..2pi over the window
    let w = 0.42 - 0.5 * t.cos() + 0.08 * (2.0 * t).cos();
    s * w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tone(freq: f64, rate: f64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (0.5 * (2.0 * std::f64::consts::PI * freq * i as f64 / rate).sin()) as f32)
            .collect()
    }

    fn rms(x: &[f32]) -> f64 {
        (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len().max(1) as f64).sqrt()
    }

    #[test]
    fn chunking_does_not_change_the_output() {
        let input = tone(440.0, 48000.0, 4800);
        let mut whole = Vec::new();
        Resampler::new(48000, 16000).process(&input, &mut whole);
        let mut parts = Vec::new();
        let mut r = Resampler::new(48000, 16000);
        for c in input.chunks(37) {
            r.process(c, &mut parts);
        }
        assert_eq!(whole, parts);
        // All but the filter's half-length tail is out.
        assert!(whole.len() > 1500 && whole.len() <= 1600, "{}", whole.len());
    }

    #[test]
    fn passband_kept_and_alias_removed() {
        // 1 kHz survives 48k -> 16k; 12 kHz (above the new Nyquist) would
        // alias to 4 kHz without the low-pass: it must vanish.
        let mut out = Vec::new();
        Resampler::new(48000, 16000).process(&tone(1000.0, 48000.0, 48000), &mut out);
        let pass = rms(&out[200..out.len() - 200]);
        assert!((pass - 0.5 / 2f64.sqrt()).abs() < 0.01, "{pass}");
        let mut out = Vec::new();
        Resampler::new(48000, 16000).process(&tone(12000.0, 48000.0, 48000), &mut out);
        let stop = rms(&out[200..out.len() - 200]);
        assert!(stop < 0.005, "{stop}");
    }

    #[test]
    fn upsampling_and_odd_ratios_keep_a_tone() {
        for (a, b) in [(8000, 16000), (44100, 16000), (22050, 16000)] {
            let mut out = Vec::new();
            Resampler::new(a, b).process(&tone(300.0, a as f64, a as usize), &mut out);
            let expected = (b as usize) as f64;
            assert!(
                (out.len() as f64 - expected).abs() < 200.0,
                "{a}->{b}: {}",
                out.len()
            );
            let r = rms(&out[300..out.len() - 300]);
            assert!((r - 0.5 / 2f64.sqrt()).abs() < 0.01, "{a}->{b}: {r}");
        }
    }

    #[test]
    fn identity_passes_through() {
        let mut out = Vec::new();
        Resampler::new(16000, 16000).process(&[0.1, 0.2], &mut out);
        assert_eq!(out, vec![0.1, 0.2]);
        assert_eq!(phases(44100, 16000), 160);
    }
}
