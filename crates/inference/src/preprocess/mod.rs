//! Decoding payloads into model input tensors.
//!
//! A pipeline's `[preprocess]` table (or the model manifest's default) is a
//! [`PreprocessConfig`]; `build()` gives a [`Preprocessor`] that turns each
//! payload of a stream into zero or more [`Item`]s. Decoders never panic on
//! a bad payload: every problem is a [`DecodeError`] whose `reason()` is a
//! short stable metric label.

mod audio;
pub mod crop;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod gpu_launch;
mod image;
pub mod pixels;
mod pyramid;
pub mod raw;
mod resample;
mod sensor;

use serde::{Deserialize, Serialize};

use crate::backend::Tensor;

pub use self::audio::AudioPreprocessor;
pub use self::image::{ImageFormat, ImagePreprocessor, OutputDType, ResizeMode};
pub use self::pyramid::PyramidPreprocessor;
pub use self::resample::Resampler;
pub use self::sensor::{SensorFormat, SensorPreprocessor};

/// One model input ready to run (batch axis of size 1 where the model has one).
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    pub tensor: Tensor,
    pub meta: ItemMeta,
}

/// Where an item came from, for postprocessing and result records.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ItemMeta {
    /// Audio windows: first sample's position in the stream, seconds.
    pub start_s: Option<f64>,
    /// Audio windows: position just past the last sample, seconds.
    pub end_s: Option<f64>,
    /// Images: how to map model coordinates back to the original image.
    pub image: Option<ImageTransform>,
    /// Pyramid levels: the level's nominal scale, at full precision.
    pub level_scale: Option<f64>,
}

/// The affine map from original image pixels to model input pixels:
/// `model = orig * scale + pad` on each axis (pad is negative where a centre
/// crop cut pixels away).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ImageTransform {
    pub orig_width: u32,
    pub orig_height: u32,
    pub scale_x: f32,
    pub scale_y: f32,
    pub pad_x: f32,
    pub pad_y: f32,
}

impl ImageTransform {
    /// Model coordinates of an original-image point.
    pub fn to_model(&self, x: f32, y: f32) -> (f32, f32) {
        (x * self.scale_x + self.pad_x, y * self.scale_y + self.pad_y)
    }

    /// Original-image coordinates of a model point, clamped to the image.
    pub fn to_original(&self, x: f32, y: f32) -> (f32, f32) {
        // Scales are positive by construction (sizes are validated non-zero);
        // the max() only keeps a hand-built transform from dividing by zero.
        let ox = (x - self.pad_x) / self.scale_x.max(f32::MIN_POSITIVE);
        let oy = (y - self.pad_y) / self.scale_y.max(f32::MIN_POSITIVE);
        (
            ox.clamp(0.0, self.orig_width as f32),
            oy.clamp(0.0, self.orig_height as f32),
        )
    }
}

/// How a pipeline's payloads become model inputs.
#[derive(Deserialize, Serialize, Clone, Debug, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum PreprocessConfig {
    /// PCM16 mono little-endian audio cut into per-stream sliding windows.
    Audio {
        /// The model's sample rate, Hz.
        sample_rate: u32,
        /// Samples per window (at `sample_rate`).
        window: usize,
        /// Samples between the starts of consecutive windows.
        hop: usize,
        /// Rate of the incoming PCM, Hz; resampled to `sample_rate` when it
        /// differs. Default: `sample_rate`.
        #[serde(default)]
        input_rate: Option<u32>,
    },
    /// JPEG/PNG (detected by magic bytes) or raw RGB/BGR images, resized and
    /// normalized.
    Image {
        /// Model input width and height, pixels (before `crop`).
        width: u32,
        height: u32,
        /// Per-channel mean subtracted after `scale` (in the model's channel order).
        #[serde(default = "image::default_mean")]
        mean: [f32; 3],
        /// Per-channel divisor applied after the mean.
        #[serde(default = "image::default_std")]
        std: [f32; 3],
        /// Factor applied to the 0..=255 pixel values first.
        #[serde(default = "image::default_scale")]
        scale: f32,
        #[serde(default)]
        layout: Layout,
        #[serde(default)]
        channel_order: ChannelOrder,
        /// `stretch` (ignore aspect ratio) or `letterbox` (keep it, pad).
        #[serde(default)]
        resize: ResizeMode,
        /// Pixel value of letterbox padding.
        #[serde(default = "image::default_pad_value")]
        pad_value: u8,
        /// Optional centre crop `[w, h]` applied after resizing to width x height.
        #[serde(default)]
        crop: Option<[u32; 2]>,
        /// `auto` (JPEG/PNG by magic bytes), `raw_rgb`, `raw_bgr` or `raw_nv12`.
        #[serde(default)]
        format: ImageFormat,
        /// Size of raw frames (required for `raw_rgb`/`raw_bgr`).
        #[serde(default)]
        input_width: Option<u32>,
        #[serde(default)]
        input_height: Option<u32>,
        /// Element type of the tensor: `f32`, `f16`, or `u8` (u8 skips normalization).
        #[serde(default)]
        dtype: OutputDType,
        /// Largest decoded image accepted, in pixels (decompression bombs).
        #[serde(default = "image::default_max_pixels")]
        max_pixels: u64,
    },
    /// Fixed-shape sensor vectors.
    Sensor {
        /// Shorthand for `shape = [length]` (the manifests' form).
        #[serde(default)]
        length: Option<usize>,
        /// Shape of one reading, without the batch axis.
        #[serde(default)]
        shape: Option<Vec<usize>>,
        /// `json` (flat or nested array), `f32le` or `i16le`.
        #[serde(default)]
        format: SensorFormat,
        /// Factor applied to each value (i16 counts to physical units).
        #[serde(default = "sensor::default_scale")]
        scale: f32,
    },
    /// An image pyramid (MTCNN's P-Net): one item per scale, from
    /// `window / min_size` down by `factor` while the shorter side still
    /// holds a `window`; each level resized by area averaging and normalized.
    Pyramid {
        /// Smallest object (face) to find, pixels.
        #[serde(default = "pyramid::default_min_size")]
        min_size: f64,
        /// Scale from one level to the next.
        #[serde(default = "pyramid::default_factor")]
        factor: f64,
        /// The net's input window, pixels.
        #[serde(default = "pyramid::default_window")]
        window: u32,
        #[serde(default = "image::default_mean")]
        mean: [f32; 3],
        #[serde(default = "image::default_std")]
        std: [f32; 3],
        #[serde(default = "image::default_scale")]
        scale: f32,
        #[serde(default)]
        layout: Layout,
        #[serde(default)]
        channel_order: ChannelOrder,
        /// Largest decoded image accepted, in pixels.
        #[serde(default = "image::default_max_pixels")]
        max_pixels: u64,
    },
    /// The payload is already a tensor the pipeline feeds as is.
    None,
}

/// Order of the image tensor's axes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    #[default]
    Nchw,
    Nhwc,
    /// Width before height (nets converted from Keras with the axes swapped, e.g. MTCNN).
    Nwhc,
}

/// Order of the colour channels the model expects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChannelOrder {
    #[default]
    Rgb,
    Bgr,
}

/// Upper bound on window and shape sizes: far above any real model input,
/// low enough that a typo cannot make the daemon allocate gigabytes.
const MAX_ELEMENTS: usize = 1 << 26;

impl PreprocessConfig {
    /// Every problem with the configuration, at once.
    pub fn validate(&self) -> Vec<String> {
        match self {
            PreprocessConfig::Audio {
                sample_rate,
                window,
                hop,
                input_rate,
            } => audio::validate(*sample_rate, *window, *hop, *input_rate),
            PreprocessConfig::Image { .. } => image::validate(self),
            PreprocessConfig::Pyramid { .. } => pyramid::validate(self),
            PreprocessConfig::Sensor {
                length,
                shape,
                scale,
                ..
            } => sensor::validate(*length, shape.as_deref(), *scale),
            PreprocessConfig::None => Vec::new(),
        }
    }

    /// The decoder. Call `validate()` first: an invalid config builds a
    /// decoder that refuses every payload rather than panicking.
    pub fn build(&self) -> Box<dyn Preprocessor> {
        match self {
            PreprocessConfig::Audio {
                sample_rate,
                window,
                hop,
                input_rate,
            } => Box::new(AudioPreprocessor::new(
                *sample_rate,
                *window,
                *hop,
                input_rate.unwrap_or(*sample_rate),
            )),
            PreprocessConfig::Image { .. } => Box::new(ImagePreprocessor::from_config(self)),
            PreprocessConfig::Pyramid { .. } => Box::new(PyramidPreprocessor::from_config(self)),
            PreprocessConfig::Sensor {
                length,
                shape,
                format,
                scale,
            } => {
                let shape = shape
                    .clone()
                    .or_else(|| length.map(|l| vec![l]))
                    .unwrap_or_default();
                Box::new(SensorPreprocessor::new(shape, *format, *scale))
            }
            PreprocessConfig::None => Box::new(Passthrough),
        }
    }
}

/// Decodes payloads of many streams into model inputs.
pub trait Preprocessor: Send {
    /// Decodes one payload of `stream` into zero or more items (audio:
    /// sliding windows may give 0..n per frame; image/sensor: exactly 1).
    fn process(&mut self, stream: &str, payload: &[u8]) -> Result<Vec<Item>, DecodeError>;
    /// Decodes one already decoded frame (cameras: packed RGB or I420);
    /// only image and pyramid preprocessing take them.
    fn process_raw(
        &mut self,
        _stream: &str,
        _pixels: &[u8],
        _raw: raw::RawImage,
    ) -> Result<Vec<Item>, DecodeError> {
        Err(DecodeError::Config {
            message: "decoded camera frames need image preprocessing".into(),
        })
    }
    /// Forgets per-stream buffers (stream ended).
    fn reset(&mut self, _stream: &str) {}
}

/// `type = "none"`: the payload is a `.npy` tensor fed unchanged.
struct Passthrough;

impl Preprocessor for Passthrough {
    fn process(&mut self, _stream: &str, payload: &[u8]) -> Result<Vec<Item>, DecodeError> {
        let tensor = Tensor::parse_npy(payload, "payload").map_err(|e| DecodeError::BadNpy {
            message: e.to_string(),
        })?;
        Ok(vec![Item {
            tensor,
            meta: ItemMeta::default(),
        }])
    }
}

/// Why a payload could not be decoded.
#[derive(thiserror::Error, Debug)]
pub enum DecodeError {
    #[error("payload is {got} bytes, expected {expected}")]
    BadSize { expected: String, got: usize },
    #[error("empty payload")]
    Empty,
    #[error("payload is not JSON: {source}")]
    BadJson { source: serde_json::Error },
    #[error("JSON array has shape {got}, expected {expected:?} (or a flat array of {len})")]
    BadShape {
        expected: Vec<usize>,
        got: String,
        len: usize,
    },
    #[error("value at index {index} is not a finite number")]
    BadValue { index: usize },
    #[error("image format not recognised (expected JPEG or PNG by magic bytes)")]
    UnknownImageFormat,
    #[error("cannot decode image: {source}")]
    UndecodableImage { source: ::image::ImageError },
    #[error("{format} image is truncated (no end marker)")]
    TruncatedImage { format: &'static str },
    #[error("image is {width}x{height}, more than the {max_pixels} pixels allowed")]
    ImageTooLarge {
        width: u32,
        height: u32,
        max_pixels: u64,
    },
    #[error("cannot resize image: {message}")]
    Resize { message: String },
    #[error("payload is not a .npy tensor: {message}")]
    BadNpy { message: String },
    #[error("decoder is misconfigured: {message}")]
    Config { message: String },
}

impl DecodeError {
    /// `Config` when a decoder was built from a config it cannot serve (the
    /// reason kept at build time), so every frame hears why.
    pub fn check_config(misconfigured: &Option<String>) -> Result<(), DecodeError> {
        match misconfigured {
            Some(message) => Err(DecodeError::Config {
                message: message.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Short stable label for metrics (`outpost_decode_errors_total{reason=..}`).
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::BadSize { .. } => "bad_size",
            DecodeError::Empty => "empty",
            DecodeError::BadJson { .. } => "bad_json",
            DecodeError::BadShape { .. } => "bad_shape",
            DecodeError::BadValue { .. } => "bad_value",
            DecodeError::UnknownImageFormat => "unknown_image_format",
            DecodeError::UndecodableImage { .. } => "undecodable_image",
            DecodeError::TruncatedImage { .. } => "truncated_image",
            DecodeError::ImageTooLarge { .. } => "image_too_large",
            DecodeError::Resize { .. } => "resize",
            DecodeError::BadNpy { .. } => "bad_npy",
            DecodeError::Config { .. } => "config",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Wrap {
        preprocess: PreprocessConfig,
    }

    fn parse(s: &str) -> Result<PreprocessConfig, toml::de::Error> {
        toml::from_str::<Wrap>(s).map(|w| w.preprocess)
    }

    #[test]
    fn manifest_forms_parse_and_validate() {
        let audio =
            parse("[preprocess]\ntype = \"audio\"\nsample_rate = 16000\nwindow = 576\nhop = 512")
                .unwrap();
        assert!(audio.validate().is_empty());
        let sensor = parse("[preprocess]\ntype = \"sensor\"\nlength = 16").unwrap();
        assert!(sensor.validate().is_empty());
        let image = parse(
            "[preprocess]\ntype = \"image\"\nwidth = 192\nheight = 48\nmean = [0.5, 0.5, 0.5]\n\
             std = [0.5, 0.5, 0.5]\nscale = 0.00392156862745098\nlayout = \"nchw\"\nchannel_order = \"bgr\"",
        )
        .unwrap();
        assert!(image.validate().is_empty());
        assert!(
            parse("[preprocess]\ntype = \"none\"")
                .unwrap()
                .validate()
                .is_empty()
        );
    }

    #[test]
    fn unknown_keys_and_types_are_refused() {
        assert!(parse("[preprocess]\ntype = \"sensor\"\nlength = 16\nlenght = 3").is_err());
        assert!(parse("[preprocess]\ntype = \"video\"").is_err());
    }

    #[test]
    fn validate_reports_every_problem() {
        let c = parse(
            "[preprocess]\ntype = \"image\"\nwidth = 0\nheight = 0\nstd = [0.0, 1.0, 1.0]\nformat = \"raw_rgb\"",
        )
        .unwrap();
        let p = c.validate();
        // width, height, std, input_width/input_height missing for raw
        assert!(p.len() >= 4, "{p:?}");
    }

    #[test]
    fn transform_round_trips() {
        let t = ImageTransform {
            orig_width: 640,
            orig_height: 480,
            scale_x: 0.5,
            scale_y: 0.5,
            pad_x: 0.0,
            pad_y: 40.0,
        };
        let (mx, my) = t.to_model(100.0, 200.0);
        assert_eq!((mx, my), (50.0, 140.0));
        assert_eq!(t.to_original(mx, my), (100.0, 200.0));
        // Points in the padding clamp to the image edge.
        assert_eq!(t.to_original(0.0, 0.0), (0.0, 0.0));
    }

    #[test]
    fn reasons_are_stable_labels() {
        assert_eq!(DecodeError::Empty.reason(), "empty");
        assert_eq!(
            DecodeError::BadSize {
                expected: "4".into(),
                got: 3
            }
            .reason(),
            "bad_size"
        );
    }
}
