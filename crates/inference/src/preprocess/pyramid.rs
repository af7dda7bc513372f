//! An image pyramid for sliding-window detectors (MTCNN's P-Net): one item
//! per scale. Levels as the reference computes them: the first scale is
//! `window / min_size`, each next one `factor` times the last, while the
//! shorter side at that scale is still at least `window`; a level's size is
//! `ceil(side * scale)`. An item's `ImageTransform` carries the level's
//! nominal scale (the detector maps cells back by it, not by the rounded size).

use ndarray::{ArrayD, IxDyn};

use super::crop::{Normalizer, Rgb, decode_rgb};
use super::raw::RawImage;
use super::{DecodeError, ImageTransform, Item, ItemMeta, PreprocessConfig, Preprocessor};
use crate::backend::Tensor;

pub(super) fn default_min_size() -> f64 {
    20.0
}
pub(super) fn default_factor() -> f64 {
    0.709
}
pub(super) fn default_window() -> u32 {
    12
}

pub(super) fn validate(c: &PreprocessConfig) -> Vec<String> {
    let mut p = Vec::new();
    let PreprocessConfig::Pyramid {
        min_size,
        factor,
        window,
        std,
        scale,
        max_pixels,
        ..
    } = c
    else {
        return p;
    };
    if !min_size.is_finite() || *min_size < 1.0 {
        p.push(format!("pyramid: `min_size` {min_size} must be at least 1"));
    }
    if !(0.1..0.99).contains(factor) {
        p.push(format!("pyramid: `factor` {factor} must be in 0.1..0.99"));
    }
    if *window == 0 {
        p.push("pyramid: `window` must be positive".into());
    }
    if std.iter().any(|s| !s.is_finite() || *s == 0.0) {
        p.push(format!(
            "pyramid: `std` {std:?} must be finite and non-zero"
        ));
    }
    if !scale.is_finite() || *scale == 0.0 {
        p.push(format!(
            "pyramid: `scale` {scale} must be finite and non-zero"
        ));
    }
    if *max_pixels == 0 {
        p.push("pyramid: `max_pixels` must be positive".into());
    }
    p
}

/// The scales of an image whose shorter side is `short`.
pub fn scales(short: f64, min_size: f64, factor: f64, window: u32) -> Vec<f64> {
    let window = window as f64;
    let m = window / min_size;
    let mut layer = short * m;
    let mut out = Vec::new();
    let mut k = 0;
    // The factor is validated below 1, so this ends; the cap guards a hand-built config.
    while layer >= window && out.len() < 64 {
        out.push(m * factor.powi(k));
        layer *= factor;
        k += 1;
    }
    out
}

pub struct PyramidPreprocessor {
    min_size: f64,
    factor: f64,
    window: u32,
    max_pixels: u64,
    norm: Normalizer,
    misconfigured: Option<String>,
}

impl PyramidPreprocessor {
    pub fn from_config(c: &PreprocessConfig) -> PyramidPreprocessor {
        let problems = validate(c);
        match c {
            PreprocessConfig::Pyramid {
                min_size,
                factor,
                window,
                mean,
                std,
                scale,
                layout,
                channel_order,
                max_pixels,
            } => PyramidPreprocessor {
                min_size: *min_size,
                factor: *factor,
                window: *window,
                max_pixels: *max_pixels,
                norm: Normalizer::new(*mean, *std, *scale, *channel_order, *layout),
                misconfigured: (!problems.is_empty()).then(|| problems.join("; ")),
            },
            _ => PyramidPreprocessor {
                min_size: 1.0,
                factor: 0.5,
                window: 1,
                max_pixels: 0,
                norm: Normalizer::new(
                    [0.0; 3],
                    [1.0; 3],
                    1.0,
                    super::ChannelOrder::Rgb,
                    super::Layout::Nchw,
                ),
                misconfigured: Some("not a pyramid config".into()),
            },
        }
    }
}

impl Preprocessor for PyramidPreprocessor {
    fn process(&mut self, _stream: &str, payload: &[u8]) -> Result<Vec<Item>, DecodeError> {
        DecodeError::check_config(&self.misconfigured)?;
        if payload.is_empty() {
            return Err(DecodeError::Empty);
        }
        let img = decode_rgb(payload, self.max_pixels)?;
        self.levels(&img)
    }

    fn process_raw(
        &mut self,
        _stream: &str,
        pixels: &[u8],
        raw: RawImage,
    ) -> Result<Vec<Item>, DecodeError> {
        DecodeError::check_config(&self.misconfigured)?;
        let img = raw.to_rgb(pixels)?;
        self.levels(&img)
    }
}

impl PyramidPreprocessor {
    /// One item per pyramid scale of a decoded frame.
    fn levels(&self, img: &Rgb) -> Result<Vec<Item>, DecodeError> {
        let (w, h) = (img.width as f64, img.height as f64);
        let mut items = Vec::new();
        for s in scales(w.min(h), self.min_size, self.factor, self.window) {
            let (sw, sh) = ((w * s).ceil() as u32, (h * s).ceil() as u32);
            let level = img.resize(sw.max(1), sh.max(1))?;
            let (lw, lh) = (level.width as usize, level.height as usize);
            let mut data = vec![0f32; lw * lh * 3];
            self.norm.write(&level, &mut data, lw, lh);
            let shape = self.norm.shape(1, lw, lh);
            let array =
                ArrayD::from_shape_vec(IxDyn(&shape), data).map_err(|e| DecodeError::Resize {
                    message: e.to_string(),
                })?;
            items.push(Item {
                tensor: Tensor::F32(array),
                meta: ItemMeta {
                    image: Some(ImageTransform {
                        orig_width: img.width,
                        orig_height: img.height,
                        scale_x: s as f32,
                        scale_y: s as f32,
                        pad_x: 0.0,
                        pad_y: 0.0,
                    }),
                    level_scale: Some(s),
                    ..ItemMeta::default()
                },
            });
        }
        Ok(items)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_follow_the_reference() {
        // 512x512, min face 20: m = 0.6, shorter side 307.2 at the first level.
        let s = scales(512.0, 20.0, 0.709, 12);
        assert!((s[0] - 0.6).abs() < 1e-12);
        assert!((s[1] - 0.6 * 0.709).abs() < 1e-12);
        // The last level still holds a 12 px window.
        assert!(512.0 * s[s.len() - 1] >= 12.0 * 0.999);
        assert_eq!(s.len(), 10);
        assert!(scales(10.0, 20.0, 0.709, 12).is_empty());
    }
}
