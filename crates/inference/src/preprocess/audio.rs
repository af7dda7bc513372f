//! PCM16 mono little-endian audio to per-stream sliding windows.
//!
//! Invariant: per stream, window `k` holds model-rate samples
//! `[k * hop - lead, k * hop - lead + window)` of that stream, with
//! `lead = window - hop` and samples before the stream's start read as
//! zeros, whatever the frame sizes were. So every window is `lead` samples of
//! context followed by `hop` new ones, and a frame of `hop` samples yields
//! its window at once (no waiting for the next frame). `start_s`/`end_s`
//! bound the new samples, in seconds. With silero VAD's `window = 576,
//! hop = 512` this is the model's streaming contract: 64 samples of context
//! (zeros at first, as silero's own wrapper starts) and 512 new ones.

use std::collections::HashMap;

use ndarray::{ArrayD, IxDyn};

use super::resample::{MAX_PHASES, Resampler, phases};
use super::{DecodeError, Item, ItemMeta, MAX_ELEMENTS, Preprocessor};
use crate::backend::Tensor;

pub(super) fn validate(
    sample_rate: u32,
    window: usize,
    hop: usize,
    input_rate: Option<u32>,
) -> Vec<String> {
    let mut p = Vec::new();
    if sample_rate == 0 {
        p.push("audio: `sample_rate` must be positive".into());
    }
    if window == 0 || window > MAX_ELEMENTS {
        p.push(format!(
            "audio: `window` {window} must be in 1..={MAX_ELEMENTS}"
        ));
    }
    if hop == 0 {
        p.push("audio: `hop` must be at least 1".into());
    } else if hop > window {
        // Samples between windows would be dropped unseen.
        p.push(format!(
            "audio: `hop` {hop} is larger than `window` {window}"
        ));
    }
    if let Some(r) = input_rate {
        if r == 0 {
            p.push("audio: `input_rate` must be positive".into());
        } else if sample_rate != 0 && phases(r, sample_rate) > MAX_PHASES {
            p.push(format!(
                "audio: resampling {r} Hz to {sample_rate} Hz needs {} filter phases (at most {MAX_PHASES}); use rates with a larger common divisor",
                phases(r, sample_rate)
            ));
        }
    }
    p
}

/// One stream's position and pending samples.
struct StreamState {
    resampler: Option<Resampler>,
    /// Model-rate samples not yet fully consumed; `pending[0]` is sample `pending_start`.
    pending: Vec<f32>,
    pending_start: u64,
    /// Start sample of the next window.
    next_window: u64,
    scratch: Vec<f32>,
}

/// Cuts each stream's PCM into windows of the model's rate.
pub struct AudioPreprocessor {
    sample_rate: u32,
    window: usize,
    hop: usize,
    input_rate: u32,
    streams: HashMap<String, StreamState>,
}

impl AudioPreprocessor {
    pub fn new(sample_rate: u32, window: usize, hop: usize, input_rate: u32) -> AudioPreprocessor {
        AudioPreprocessor {
            sample_rate,
            window,
            hop,
            input_rate,
            streams: HashMap::new(),
        }
    }
}

impl Preprocessor for AudioPreprocessor {
    fn process(&mut self, stream: &str, payload: &[u8]) -> Result<Vec<Item>, DecodeError> {
        if self.sample_rate == 0 || self.window == 0 || self.hop == 0 || self.input_rate == 0 {
            return Err(DecodeError::Config {
                message: "audio sample_rate, window, hop and input_rate must be positive".into(),
            });
        }
        if !payload.len().is_multiple_of(2) {
            return Err(DecodeError::BadSize {
                expected: "an even number (16-bit samples)".into(),
                got: payload.len(),
            });
        }
        let (in_rate, out_rate) = (self.input_rate, self.sample_rate);
        let lead = self.window.saturating_sub(self.hop);
        let st = self
            .streams
            .entry(stream.to_string())
            .or_insert_with(|| StreamState {
                resampler: (in_rate != out_rate).then(|| Resampler::new(in_rate, out_rate)),
                // The context before the first sample is silence.
                pending: vec![0.0; lead],
                pending_start: 0,
                next_window: 0,
                scratch: Vec::new(),
            });
        // Full-scale i16 maps to [-1, 1): -32768 -> -1.0, 32767 -> 0.99997.
        let samples = payload
            .chunks_exact(2)
            .map(|c| i16::from_le_bytes([c[0], c[1]]) as f32 / 32768.0);
        match &mut st.resampler {
            None => st.pending.extend(samples),
            Some(r) => {
                st.scratch.clear();
                st.scratch.extend(samples);
                let before = st.pending.len();
                r.process(&st.scratch, &mut st.pending);
                // The filter may ring past full scale; keep the [-1, 1) contract.
                for x in &mut st.pending[before..] {
                    *x = x.clamp(-1.0, 32767.0 / 32768.0);
                }
            }
        }
        let mut items = Vec::new();
        let rate = self.sample_rate as f64;
        loop {
            let off = (st.next_window - st.pending_start) as usize;
            let Some(win) = st.pending.get(off..off + self.window) else {
                break;
            };
            let array =
                ArrayD::from_shape_vec(IxDyn(&[1, self.window]), win.to_vec()).map_err(|e| {
                    DecodeError::Config {
                        message: e.to_string(),
                    }
                })?;
            items.push(Item {
                tensor: Tensor::F32(array),
                meta: ItemMeta {
                    // Buffer position p is stream sample p - lead; the new part starts at p + lead.
                    start_s: Some(st.next_window as f64 / rate),
                    end_s: Some((st.next_window + (self.window - lead) as u64) as f64 / rate),
                    image: None,
                    level_scale: None,
                },
            });
            st.next_window += self.hop as u64;
        }
        // Samples before the next window start are never needed again.
        let drop = ((st.next_window - st.pending_start) as usize).min(st.pending.len());
        st.pending.drain(..drop);
        st.pending_start += drop as u64;
        Ok(items)
    }

    fn reset(&mut self, stream: &str) {
        self.streams.remove(stream);
        // After many streams went (idle), the table's own memory goes too.
        if self.streams.len() * 4 < self.streams.capacity() {
            self.streams.shrink_to_fit();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pcm(samples: impl IntoIterator<Item = i16>) -> Vec<u8> {
        samples.into_iter().flat_map(|s| s.to_le_bytes()).collect()
    }

    #[test]
    fn silero_windows_are_64_context_plus_512_new() {
        let mut a = AudioPreprocessor::new(16000, 576, 512, 16000);
        // Sample i has value i (mod 32768) so windows can be located.
        let all: Vec<i16> = (0..3000).map(|i| i as i16).collect();
        let mut items = Vec::new();
        for frame in all.chunks(333) {
            items.extend(a.process("mic", &pcm(frame.iter().copied())).unwrap());
        }
        // New parts start at 0, 512, 1024, 1536, 2048 (2048 + 512 <= 3000).
        assert_eq!(items.len(), 5);
        for (k, it) in items.iter().enumerate() {
            assert_eq!(it.tensor.shape(), &[1, 576]);
            let v = it.tensor.to_f64_vec();
            // 64 samples of context, then the 512 new ones.
            assert_eq!((v[64] * 32768.0).round() as usize, k * 512);
            assert_eq!((v[575] * 32768.0).round() as usize, k * 512 + 511);
            if k == 0 {
                assert!(
                    v[..64].iter().all(|x| *x == 0.0),
                    "silence before the stream"
                );
            } else {
                assert_eq!((v[0] * 32768.0).round() as usize, k * 512 - 64);
            }
            assert_eq!(it.meta.start_s, Some(k as f64 * 0.032));
            assert_eq!(it.meta.end_s, Some((k * 512 + 512) as f64 / 16000.0));
        }
        // The next window's first 64 samples are this one's last 64.
        let w0 = items[0].tensor.to_f64_vec();
        let w1 = items[1].tensor.to_f64_vec();
        assert_eq!(&w0[512..], &w1[..64]);
    }

    #[test]
    fn streams_are_independent_and_reset_forgets() {
        // window 4, hop 2: 2 samples of lead-in, a window per 2 new samples.
        let mut a = AudioPreprocessor::new(16000, 4, 2, 16000);
        assert!(a.process("a", &pcm([1])).unwrap().is_empty());
        assert_eq!(a.process("b", &pcm([1, 2, 3, 4])).unwrap().len(), 2);
        assert_eq!(a.process("a", &pcm([2])).unwrap().len(), 1);
        a.reset("a");
        assert!(a.process("a", &pcm([1])).unwrap().is_empty());
    }

    #[test]
    fn scaling_and_odd_bytes() {
        let mut a = AudioPreprocessor::new(16000, 2, 2, 16000);
        let it = a.process("s", &pcm([i16::MIN, i16::MAX])).unwrap();
        let v = it[0].tensor.to_f64_vec();
        assert_eq!(v[0], -1.0);
        assert!(v[1] < 1.0 && v[1] > 0.9999);
        assert_eq!(a.process("s", &[0, 0, 0]).unwrap_err().reason(), "bad_size");
    }

    #[test]
    fn resampled_stream_keeps_time() {
        // 48 kHz in, 16 kHz model: one second in gives ~1 s of windows out.
        let mut a = AudioPreprocessor::new(16000, 512, 512, 48000);
        let tone: Vec<i16> = (0..48000)
            .map(|i| {
                (8000.0 * (2.0 * std::f64::consts::PI * 440.0 * i as f64 / 48000.0).sin()) as i16
            })
            .collect();
        let mut items = Vec::new();
        for f in tone.chunks(960) {
            items.extend(a.process("s", &pcm(f.iter().copied())).unwrap());
        }
        assert_eq!(items.len(), 31); // 15950-ish samples out / 512
        let last = items.last().unwrap();
        assert_eq!(last.meta.end_s, Some(31.0 * 512.0 / 16000.0));
        // The 440 Hz tone's amplitude survives (peak ~ 8000/32768).
        let peak = last
            .tensor
            .to_f64_vec()
            .iter()
            .fold(0f64, |m, x| m.max(x.abs()));
        assert!((peak - 8000.0 / 32768.0).abs() < 0.01, "{peak}");
    }

    #[test]
    fn validate_catches_bad_windows_and_rates() {
        assert!(validate(16000, 576, 512, None).is_empty());
        assert!(validate(16000, 576, 512, Some(44100)).is_empty());
        assert_eq!(validate(0, 0, 0, Some(0)).len(), 4);
        assert_eq!(validate(16000, 10, 20, Some(16001)).len(), 2);
    }

    proptest! {
        #[test]
        fn arbitrary_pcm_never_panics(frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 0..8)) {
            let mut plain = AudioPreprocessor::new(16000, 64, 32, 16000);
            let mut resampling = AudioPreprocessor::new(16000, 64, 32, 44100);
            for f in &frames {
                for a in [&mut plain, &mut resampling] {
                    match a.process("s", f) {
                        Ok(items) => for it in items {
                            prop_assert_eq!(it.tensor.shape(), &[1, 64]);
                            prop_assert!(it.tensor.to_f64_vec().iter().all(|x| (-1.0..1.0).contains(x)));
                        },
                        Err(e) => prop_assert_eq!(e.reason(), "bad_size"),
                    }
                }
            }
        }
    }
}
