//! Images to model tensors: decode (JPEG/PNG by magic bytes, or raw RGB/BGR
//! frames), resize with fast_image_resize's SIMD convolution (bilinear, as
//! Pillow's `BILINEAR`, antialiased when shrinking), optional letterbox and
//! centre crop, then one pass that reorders channels, normalizes through a
//! 256-entry table per channel and writes NCHW or NHWC.

use std::io::Cursor;

use fast_image_resize as fir;
use half::f16;
use image::{ColorType, DynamicImage, ImageDecoder};
use ndarray::{ArrayD, IxDyn};
use serde::{Deserialize, Serialize};

/// These paths stay; the functions live in `pixels.rs`.
pub use super::pixels::{nv12_to_rgb, resize_pixels};
use super::raw::{RawFormat, RawImage};
use super::{
    ChannelOrder, DecodeError, ImageTransform, Item, ItemMeta, Layout, MAX_ELEMENTS,
    PreprocessConfig, Preprocessor,
};
use crate::backend::Tensor;

pub(super) fn default_mean() -> [f32; 3] {
    [0.0; 3]
}
pub(super) fn default_std() -> [f32; 3] {
    [1.0; 3]
}
pub(super) fn default_scale() -> f32 {
    1.0 / 255.0
}
/// YOLO-style grey.
pub(super) fn default_pad_value() -> u8 {
    114
}
/// 64 megapixels: a large camera still, far below what would exhaust memory.
pub(super) fn default_max_pixels() -> u64 {
    64_000_000
}

/// How an image is fitted to the model's width x height.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// Scale each axis independently (aspect ratio not kept).
    #[default]
    Stretch,
    /// Keep the aspect ratio; pad the rest with `pad_value`, centred.
    Letterbox,
    /// Keep the aspect ratio, fill the height, pad on the right (PP-OCR's
    /// text lines). As a stage's crop preprocessing the padding is zeros
    /// after normalization and, where the model's width is free, the width
    /// grows to fit the widest crop of a batch.
    PadRight,
}

/// What the payload holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageFormat {
    /// JPEG or PNG, told apart by their magic bytes.
    #[default]
    Auto,
    /// `input_width * input_height * 3` bytes, RGB order.
    RawRgb,
    /// `input_width * input_height * 3` bytes, BGR order (OpenCV frames).
    RawBgr,
    /// NV12 (what Jetson cameras and hardware decoders give): a full-size Y
    /// plane, then a half-size plane of interleaved U and V;
    /// `input_width * input_height * 3 / 2` bytes, even width and height.
    /// Converted to RGB with the BT.601 limited-range matrix.
    RawNv12,
}

/// The size the image is scaled to inside the model's `tw x th`: both axes
/// for `stretch`; for `letterbox` the largest that keeps the aspect ratio.
/// The GPU preprocessing computes its launch parameters with this too.
pub fn fit_size(resize: ResizeMode, tw: u32, th: u32, w: u32, h: u32) -> (u32, u32) {
    match resize {
        ResizeMode::Stretch => (tw, th),
        ResizeMode::Letterbox | ResizeMode::PadRight => {
            let s = (tw as f64 / w as f64).min(th as f64 / h as f64);
            (
                ((w as f64 * s).round() as u32).clamp(1, tw),
                ((h as f64 * s).round() as u32).clamp(1, th),
            )
        }
    }
}

/// Where a resized image of `nw` x `nh` sits in the `tw` x `th` input:
/// centred for a letterbox, top left for `pad_right`.
pub fn pad_offset(resize: ResizeMode, tw: u32, th: u32, nw: u32, nh: u32) -> (u32, u32) {
    match resize {
        ResizeMode::PadRight => (0, 0),
        _ => (centre_offset(tw, nw), centre_offset(th, nh)),
    }
}

/// Offset that centres `inner` in `outer` (letterbox padding, centre crop).
pub fn centre_offset(outer: u32, inner: u32) -> u32 {
    outer.saturating_sub(inner) / 2
}

/// Element type of the image tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputDType {
    #[default]
    F32,
    F16,
    /// Raw 0..=255 pixels; `scale`, `mean` and `std` are not applied.
    U8,
}

pub(super) fn validate(c: &PreprocessConfig) -> Vec<String> {
    let mut p = Vec::new();
    let PreprocessConfig::Image {
        width,
        height,
        mean,
        std,
        scale,
        crop,
        format,
        input_width,
        input_height,
        max_pixels,
        ..
    } = c
    else {
        return p;
    };
    for (name, v) in [("width", *width), ("height", *height)] {
        if v == 0 {
            p.push(format!("image: `{name}` must be positive"));
        }
    }
    if (*width as usize)
        .saturating_mul(*height as usize)
        .saturating_mul(3)
        > MAX_ELEMENTS
    {
        p.push(format!(
            "image: {width}x{height} is larger than any model input"
        ));
    }
    if mean.iter().any(|m| !m.is_finite()) {
        p.push(format!("image: `mean` {mean:?} must be finite"));
    }
    if std.iter().any(|s| !s.is_finite() || *s == 0.0) {
        p.push(format!("image: `std` {std:?} must be finite and non-zero"));
    }
    if !scale.is_finite() || *scale == 0.0 {
        p.push(format!(
            "image: `scale` {scale} must be finite and non-zero"
        ));
    }
    if let Some([cw, ch]) = crop
        && (*cw == 0 || *ch == 0 || cw > width || ch > height)
    {
        p.push(format!(
            "image: `crop` [{cw}, {ch}] must be non-zero and fit in {width}x{height}"
        ));
    }
    match format {
        ImageFormat::Auto => {
            if input_width.is_some() || input_height.is_some() {
                p.push("image: `input_width`/`input_height` apply to raw formats only".into());
            }
        }
        ImageFormat::RawRgb | ImageFormat::RawBgr | ImageFormat::RawNv12 => {
            match (input_width, input_height) {
                (Some(w), Some(h)) if *w > 0 && *h > 0 => {
                    if *format == ImageFormat::RawNv12
                        && (!w.is_multiple_of(2) || !h.is_multiple_of(2))
                    {
                        p.push(format!("image: raw_nv12 needs an even size, got {w}x{h}"));
                    }
                    if *w as u64 * *h as u64 > *max_pixels {
                        p.push(format!(
                            "image: raw {w}x{h} exceeds `max_pixels` {max_pixels}"
                        ));
                    }
                }
                _ => p.push(
                    "image: raw formats need positive `input_width` and `input_height`".into(),
                ),
            }
        }
    }
    if *max_pixels == 0 {
        p.push("image: `max_pixels` must be positive".into());
    }
    p
}

/// Decodes, resizes and normalizes images.
pub struct ImagePreprocessor {
    width: u32,
    height: u32,
    crop: Option<[u32; 2]>,
    resize: ResizeMode,
    pad_value: u8,
    format: ImageFormat,
    raw_size: (u32, u32),
    layout: Layout,
    channel_order: ChannelOrder,
    dtype: OutputDType,
    max_pixels: u64,
    /// `lut[c][v]`: normalized value of pixel value `v` in output channel `c`.
    lut: [[f32; 256]; 3],
    resizer: fir::Resizer,
    /// Decoded pixels of the previous payload, reused for the next.
    buf: Vec<u8>,
    /// Set when the config was not an image config (build() without validate()).
    misconfigured: Option<String>,
}

impl ImagePreprocessor {
    pub fn from_config(c: &PreprocessConfig) -> ImagePreprocessor {
        let problems = validate(c);
        let PreprocessConfig::Image {
            width,
            height,
            mean,
            std,
            scale,
            layout,
            channel_order,
            resize,
            pad_value,
            crop,
            format,
            input_width,
            input_height,
            dtype,
            max_pixels,
        } = c
        else {
            return ImagePreprocessor::misconfigured("not an image config".into());
        };
        let mut lut = [[0f32; 256]; 3];
        for (c, table) in lut.iter_mut().enumerate() {
            for (v, x) in table.iter_mut().enumerate() {
                *x = (v as f32 * scale - mean[c]) / std[c];
            }
        }
        ImagePreprocessor {
            width: *width,
            height: *height,
            crop: *crop,
            resize: *resize,
            pad_value: *pad_value,
            format: *format,
            raw_size: (input_width.unwrap_or(0), input_height.unwrap_or(0)),
            layout: *layout,
            channel_order: *channel_order,
            dtype: *dtype,
            max_pixels: *max_pixels,
            lut,
            resizer: fir::Resizer::new(),
            buf: Vec::new(),
            misconfigured: (!problems.is_empty()).then(|| problems.join("; ")),
        }
    }

    fn misconfigured(message: String) -> ImagePreprocessor {
        ImagePreprocessor {
            width: 0,
            height: 0,
            crop: None,
            resize: ResizeMode::Stretch,
            pad_value: 0,
            format: ImageFormat::Auto,
            raw_size: (0, 0),
            layout: Layout::Nchw,
            channel_order: ChannelOrder::Rgb,
            dtype: OutputDType::F32,
            max_pixels: 0,
            lut: [[0.0; 256]; 3],
            resizer: fir::Resizer::new(),
            buf: Vec::new(),
            misconfigured: Some(message),
        }
    }

    /// Decodes the payload to packed 8-bit pixels in `order`.
    fn decode(&mut self, payload: &[u8]) -> Result<Decoded, DecodeError> {
        if payload.is_empty() {
            return Err(DecodeError::Empty);
        }
        let (order, (w, h)) = match self.format {
            ImageFormat::RawRgb => (ChannelOrder::Rgb, self.raw_size),
            ImageFormat::RawBgr => (ChannelOrder::Bgr, self.raw_size),
            ImageFormat::RawNv12 => return self.decode_nv12(payload),
            ImageFormat::Auto => return self.decode_compressed(payload),
        };
        let expected = w as usize * h as usize * 3;
        if payload.len() != expected {
            return Err(DecodeError::BadSize {
                expected: format!("{expected} ({w}x{h} x 3 bytes)"),
                got: payload.len(),
            });
        }
        let mut pixels = self.take_buffer(expected);
        pixels.extend_from_slice(payload);
        Ok(Decoded {
            pixels,
            width: w,
            height: h,
            order,
        })
    }

    fn decode_nv12(&mut self, payload: &[u8]) -> Result<Decoded, DecodeError> {
        let (w, h) = self.raw_size;
        let expected = w as usize * h as usize * 3 / 2;
        if payload.len() != expected {
            return Err(DecodeError::BadSize {
                expected: format!("{expected} ({w}x{h} NV12, 1.5 bytes a pixel)"),
                got: payload.len(),
            });
        }
        let mut pixels = self.take_buffer(w as usize * h as usize * 3);
        nv12_to_rgb(payload, w as usize, h as usize, &mut pixels);
        Ok(Decoded {
            pixels,
            width: w,
            height: h,
            order: ChannelOrder::Rgb,
        })
    }

    /// The pixel buffer of the previous payload, emptied, so a stream of
    /// same-sized frames allocates (and page-faults) 6 MB once, not per frame.
    fn take_buffer(&mut self, need: usize) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.buf);
        // One huge image must not pin its buffer for the life of the stream.
        if buf.capacity() > need.saturating_mul(2) {
            buf = Vec::new();
        }
        buf.clear();
        buf
    }

    fn decode_compressed(&mut self, payload: &[u8]) -> Result<Decoded, DecodeError> {
        let undecodable = |source| DecodeError::UndecodableImage { source };
        let img = if payload.starts_with(&[0xFF, 0xD8, 0xFF]) {
            // The JPEG decoder is lenient: it fills a cut-off scan with grey
            // and reports success. A half-received frame must not reach the
            // model as if it were a picture.
            if !jpeg_has_end(payload) {
                return Err(DecodeError::TruncatedImage { format: "jpeg" });
            }
            let d =
                image::codecs::jpeg::JpegDecoder::new(Cursor::new(payload)).map_err(undecodable)?;
            let (width, height) = d.dimensions();
            self.check_size((width, height))?;
            if d.color_type() == ColorType::Rgb8 {
                // The common case: decode straight into the reused buffer.
                let n = d.total_bytes() as usize;
                let mut pixels = self.take_buffer(n);
                pixels.resize(n, 0);
                d.read_image(&mut pixels).map_err(undecodable)?;
                return Ok(Decoded {
                    pixels,
                    width,
                    height,
                    order: ChannelOrder::Rgb,
                });
            }
            DynamicImage::from_decoder(d).map_err(undecodable)?
        } else if payload.starts_with(b"\x89PNG\r\n\x1a\n") {
            let d =
                image::codecs::png::PngDecoder::new(Cursor::new(payload)).map_err(undecodable)?;
            self.check_size(d.dimensions())?;
            DynamicImage::from_decoder(d).map_err(undecodable)?
        } else {
            return Err(DecodeError::UnknownImageFormat);
        };
        // Grey, alpha and 16-bit images become 8-bit RGB (alpha dropped);
        // 8-bit RGB is moved, not copied.
        let rgb = img.into_rgb8();
        let (width, height) = rgb.dimensions();
        Ok(Decoded {
            pixels: rgb.into_raw(),
            width,
            height,
            order: ChannelOrder::Rgb,
        })
    }

    fn check_size(&self, (width, height): (u32, u32)) -> Result<(), DecodeError> {
        if width as u64 * height as u64 > self.max_pixels {
            return Err(DecodeError::ImageTooLarge {
                width,
                height,
                max_pixels: self.max_pixels,
            });
        }
        Ok(())
    }

    /// Resizes into a `self.width x self.height` packed RGB canvas.
    fn fit(&mut self, src: &DecodedRef<'_>) -> Result<(Vec<u8>, ImageTransform), DecodeError> {
        let (w, h) = (src.width, src.height);
        if w == 0 || h == 0 {
            return Err(DecodeError::BadSize {
                expected: "a non-empty image".into(),
                got: 0,
            });
        }
        let (tw, th) = (self.width, self.height);
        let (nw, nh) = fit_size(self.resize, tw, th, w, h);
        let resized = self.resize_to(src, nw, nh)?;
        let (px, py) = pad_offset(self.resize, tw, th, nw, nh);
        let transform = ImageTransform {
            orig_width: w,
            orig_height: h,
            scale_x: nw as f32 / w as f32,
            scale_y: nh as f32 / h as f32,
            pad_x: px as f32,
            pad_y: py as f32,
        };
        if (nw, nh) == (tw, th) {
            return Ok((resized, transform));
        }
        let mut canvas = vec![self.pad_value; tw as usize * th as usize * 3];
        let row = nw as usize * 3;
        for (y, src_row) in resized.chunks_exact(row).enumerate() {
            let at = ((py as usize + y) * tw as usize + px as usize) * 3;
            canvas[at..at + row].copy_from_slice(src_row);
        }
        Ok((canvas, transform))
    }

    fn resize_to(
        &mut self,
        src: &DecodedRef<'_>,
        nw: u32,
        nh: u32,
    ) -> Result<Vec<u8>, DecodeError> {
        if let RawFormat::I420 { .. } = src.format {
            let raw = RawImage {
                width: src.width,
                height: src.height,
                format: src.format,
            };
            return raw.i420_resized_rgb(src.pixels, nw, nh, &mut self.resizer);
        }
        resize_pixels(
            &mut self.resizer,
            src.pixels,
            (src.width, src.height),
            (nw, nh),
            fir::PixelType::U8x3,
        )
    }

    /// Channel reorder + normalization + layout in one pass over the
    /// (cropped) canvas.
    fn tensor(
        &self,
        canvas: &[u8],
        src_order: ChannelOrder,
        x0: usize,
        y0: usize,
        ow: usize,
        oh: usize,
    ) -> Result<Tensor, DecodeError> {
        let stride = self.width as usize * 3;
        // Output channel c reads source channel map[c].
        let map: [usize; 3] = if src_order == self.channel_order {
            [0, 1, 2]
        } else {
            [2, 1, 0]
        };
        let shape: [usize; 4] = match self.layout {
            Layout::Nchw => [1, 3, oh, ow],
            Layout::Nhwc => [1, oh, ow, 3],
            Layout::Nwhc => [1, ow, oh, 3],
        };
        let rows = (0..oh).map(|y| {
            let at = (y0 + y) * stride + x0 * 3;
            &canvas[at..at + ow * 3]
        });
        let shape_err = |e: ndarray::ShapeError| DecodeError::Resize {
            message: e.to_string(),
        };
        Ok(match self.dtype {
            OutputDType::F32 => {
                let luts = [&self.lut[0], &self.lut[1], &self.lut[2]];
                let v = write_planes(rows, self.layout, map, ow, oh, |c, v| luts[c][v as usize]);
                Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(shape_err)?)
            }
            OutputDType::F16 => {
                let lut16: Vec<[f16; 256]> = self
                    .lut
                    .iter()
                    .map(|t| std::array::from_fn(|i| f16::from_f32(t[i])))
                    .collect();
                let v = write_planes(rows, self.layout, map, ow, oh, |c, v| lut16[c][v as usize]);
                Tensor::F16(ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(shape_err)?)
            }
            OutputDType::U8 => {
                let v = write_planes(rows, self.layout, map, ow, oh, |_, v| v);
                Tensor::U8(ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(shape_err)?)
            }
        })
    }
}

/// Writes `oh` rows of packed 3-channel pixels as NCHW planes, NHWC or NWHC.
pub(super) fn write_planes<'a, T: Copy + Default>(
    rows: impl Iterator<Item = &'a [u8]>,
    layout: Layout,
    map: [usize; 3],
    ow: usize,
    oh: usize,
    f: impl Fn(usize, u8) -> T,
) -> Vec<T> {
    let plane = ow * oh;
    let mut out = vec![T::default(); plane * 3];
    match layout {
        Layout::Nchw => {
            for (y, row) in rows.enumerate() {
                for (c, &sc) in map.iter().enumerate() {
                    let dst = &mut out[c * plane + y * ow..c * plane + (y + 1) * ow];
                    for (d, px) in dst.iter_mut().zip(row.chunks_exact(3)) {
                        *d = f(c, px[sc]);
                    }
                }
            }
        }
        Layout::Nhwc => {
            for (y, row) in rows.enumerate() {
                let dst = &mut out[y * ow * 3..(y + 1) * ow * 3];
                for (d, px) in dst.chunks_exact_mut(3).zip(row.chunks_exact(3)) {
                    for c in 0..3 {
                        d[c] = f(c, px[map[c]]);
                    }
                }
            }
        }
        Layout::Nwhc => {
            for (y, row) in rows.enumerate() {
                for (x, px) in row.chunks_exact(3).enumerate() {
                    let at = (x * oh + y) * 3;
                    for c in 0..3 {
                        out[at + c] = f(c, px[map[c]]);
                    }
                }
            }
        }
    }
    out
}

/// Whether a JPEG's end-of-image marker follows its first scan. Walks the
/// header segments by their lengths (so an EXIF thumbnail's own markers are
/// skipped), then looks for `FF D9` in the scan data, where byte stuffing
/// (`FF 00`) guarantees it appears only as a marker.
fn jpeg_has_end(b: &[u8]) -> bool {
    let mut i = 2; // after SOI
    while i + 4 <= b.len() {
        if b[i] != 0xFF {
            return false;
        }
        let marker = b[i + 1];
        if marker == 0xFF {
            i += 1; // fill byte
            continue;
        }
        let len = u16::from_be_bytes([b[i + 2], b[i + 3]]) as usize;
        if marker == 0xDA {
            let scan = b.get(i + 2 + len..).unwrap_or(&[]);
            return scan.windows(2).any(|w| w == [0xFF, 0xD9]);
        }
        i += 2 + len;
    }
    false
}

/// Packed 8-bit 3-channel pixels.
struct Decoded {
    pixels: Vec<u8>,
    width: u32,
    height: u32,
    order: ChannelOrder,
}

/// Packed 8-bit 3-channel pixels someone else owns (a decoded payload or a camera frame).
struct DecodedRef<'a> {
    pixels: &'a [u8],
    width: u32,
    height: u32,
    /// Packed RGB (decoded images, RGB camera frames) or I420 camera frames.
    format: RawFormat,
}

impl Decoded {
    fn view(&self) -> DecodedRef<'_> {
        DecodedRef {
            pixels: &self.pixels,
            width: self.width,
            height: self.height,
            format: RawFormat::Rgb,
        }
    }
}

impl Preprocessor for ImagePreprocessor {
    fn process(&mut self, _stream: &str, payload: &[u8]) -> Result<Vec<Item>, DecodeError> {
        DecodeError::check_config(&self.misconfigured)?;
        let decoded = self.decode(payload)?;
        self.finish(decoded)
    }

    fn process_raw(
        &mut self,
        _stream: &str,
        pixels: &[u8],
        raw: RawImage,
    ) -> Result<Vec<Item>, DecodeError> {
        DecodeError::check_config(&self.misconfigured)?;
        self.check_size((raw.width, raw.height))?;
        raw.check(pixels)?;
        // Resized straight from the frame: no copy of the camera's pixels
        // (an I420 frame is converted only at the model's size).
        let fitted = self.fit(&DecodedRef {
            pixels,
            width: raw.width,
            height: raw.height,
            format: raw.format,
        });
        let (canvas, transform) = fitted?;
        self.items(&canvas, ChannelOrder::Rgb, transform)
    }
}

impl ImagePreprocessor {
    fn finish(&mut self, decoded: Decoded) -> Result<Vec<Item>, DecodeError> {
        let fitted = self.fit(&decoded.view());
        self.buf = decoded.pixels;
        let (canvas, transform) = fitted?;
        self.items(&canvas, decoded.order, transform)
    }

    /// Centre crop, channel order, normalization and layout of a fitted canvas.
    fn items(
        &self,
        canvas: &[u8],
        order: ChannelOrder,
        mut transform: ImageTransform,
    ) -> Result<Vec<Item>, DecodeError> {
        let (tw, th) = (self.width as usize, self.height as usize);
        let [cw, ch] = self
            .crop
            .map(|[w, h]| [w as usize, h as usize])
            .unwrap_or([tw, th]);
        // validate() guarantees the crop fits; min() keeps an unvalidated one in bounds.
        let (cw, ch) = (cw.min(tw), ch.min(th));
        let (x0, y0) = ((tw - cw) / 2, (th - ch) / 2);
        transform.pad_x -= x0 as f32;
        transform.pad_y -= y0 as f32;
        let tensor = self.tensor(canvas, order, x0, y0, cw, ch)?;
        Ok(vec![Item {
            tensor,
            meta: ItemMeta {
                image: Some(transform),
                ..ItemMeta::default()
            },
        }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{ImageEncoder, RgbImage};
    use proptest::prelude::*;

    fn config(extra: &str) -> PreprocessConfig {
        #[derive(Deserialize)]
        struct W {
            p: PreprocessConfig,
        }
        let text = format!("[p]\ntype = \"image\"\n{extra}");
        let w: W = toml::from_str(&text).unwrap();
        let problems = w.p.validate();
        assert!(problems.is_empty(), "{problems:?}");
        w.p
    }

    /// A 64x48 image: red rises with x, green with y, blue constant 200.
    fn gradient(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| {
            image::Rgb([(x * 255 / (w - 1)) as u8, (y * 255 / (h - 1)) as u8, 200])
        })
    }

    fn png(img: &RgbImage) -> Vec<u8> {
        let mut out = Vec::new();
        image::codecs::png::PngEncoder::new(&mut out)
            .write_image(
                img.as_raw(),
                img.width(),
                img.height(),
                image::ExtendedColorType::Rgb8,
            )
            .unwrap();
        out
    }

    fn jpeg(img: &RgbImage) -> Vec<u8> {
        let mut out = Vec::new();
        image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 90)
            .write_image(
                img.as_raw(),
                img.width(),
                img.height(),
                image::ExtendedColorType::Rgb8,
            )
            .unwrap();
        out
    }

    #[test]
    fn png_same_size_is_exact_nchw_and_bgr() {
        let img = gradient(64, 48);
        let mut p = config("width = 64\nheight = 48\nchannel_order = \"bgr\"").build();
        let items = p.process("cam", &png(&img)).unwrap();
        let t = &items[0].tensor;
        assert_eq!(t.shape(), &[1, 3, 48, 64]);
        let v = t.to_f64_vec();
        let plane = 48 * 64;
        // BGR: channel 0 is blue (200), channel 2 is red = x gradient.
        assert!((v[0] - 200.0 / 255.0).abs() < 1e-6);
        assert!((v[2 * plane + 63] - 1.0).abs() < 1e-6);
        assert!((v[plane + 47 * 64] - 1.0).abs() < 1e-6);
        let tr = items[0].meta.image.unwrap();
        assert_eq!((tr.orig_width, tr.scale_x, tr.pad_x), (64, 1.0, 0.0));
    }

    #[test]
    fn stretch_resize_normalizes_and_keeps_gradient() {
        let img = gradient(640, 480);
        let mut p = config("width = 32\nheight = 16\nmean = [0.5, 0.5, 0.5]\nstd = [0.5, 0.5, 0.5]\nlayout = \"nhwc\"").build();
        let items = p.process("cam", &jpeg(&img)).unwrap();
        let t = &items[0].tensor;
        assert_eq!(t.shape(), &[1, 16, 32, 3]);
        let v = t.to_f64_vec();
        // (200/255 - 0.5) / 0.5 for blue everywhere, give or take JPEG.
        let blue = (200.0 / 255.0 - 0.5) / 0.5;
        assert!((v[2] - blue).abs() < 0.05, "{}", v[2]);
        // Red rises from left (-1) to right (+1).
        assert!(v[0] < -0.9 && v[31 * 3] > 0.9, "{} {}", v[0], v[31 * 3]);
        let tr = items[0].meta.image.unwrap();
        assert_eq!((tr.scale_x, tr.scale_y), (0.05, 16.0 / 480.0));
    }

    #[test]
    fn letterbox_pads_and_maps_back() {
        // 200x100 into 100x100: scale 0.5, 50x... rows 25..75 hold the image.
        let img = RgbImage::from_pixel(200, 100, image::Rgb([255, 255, 255]));
        let mut p =
            config("width = 100\nheight = 100\nresize = \"letterbox\"\ndtype = \"u8\"").build();
        let items = p.process("cam", &png(&img)).unwrap();
        let t = &items[0].tensor;
        assert_eq!(t.dtype(), crate::backend::DType::U8);
        let v = t.to_f64_vec();
        assert_eq!(v[0], 114.0); // top padding
        assert_eq!(v[50 * 100 + 50], 255.0); // centre
        assert_eq!(v[99 * 100], 114.0); // bottom padding
        let tr = items[0].meta.image.unwrap();
        assert_eq!(
            (tr.scale_x, tr.scale_y, tr.pad_x, tr.pad_y),
            (0.5, 0.5, 0.0, 25.0)
        );
        assert_eq!(tr.to_original(50.0, 75.0), (100.0, 100.0));
    }

    #[test]
    fn centre_crop_shifts_the_transform() {
        let img = gradient(100, 100);
        let mut p = config("width = 100\nheight = 100\ncrop = [50, 40]\ndtype = \"f16\"").build();
        let items = p.process("cam", &png(&img)).unwrap();
        assert_eq!(items[0].tensor.shape(), &[1, 3, 40, 50]);
        let tr = items[0].meta.image.unwrap();
        assert_eq!((tr.pad_x, tr.pad_y), (-25.0, -30.0));
        // Model (0,0) is original (25,30): red = 25*255/99.
        let v = items[0].tensor.to_f64_vec();
        assert!(
            (v[0] - (25 * 255 / 99) as f64 / 255.0).abs() < 1e-3,
            "{}",
            v[0]
        );
    }

    #[test]
    fn raw_frames_and_their_sizes() {
        let mut p = config("width = 2\nheight = 1\nformat = \"raw_bgr\"\ninput_width = 2\ninput_height = 1\ndtype = \"u8\"").build();
        let items = p.process("cam", &[1, 2, 3, 4, 5, 6]).unwrap();
        // BGR in, RGB out, NCHW: R plane [3, 6], G [2, 5], B [1, 4].
        assert_eq!(
            items[0].tensor.to_f64_vec(),
            vec![3.0, 6.0, 2.0, 5.0, 1.0, 4.0]
        );
        assert_eq!(
            p.process("cam", &[1, 2, 3]).unwrap_err().reason(),
            "bad_size"
        );
    }

    #[test]
    fn garbage_and_truncated_images_are_errors() {
        let mut p = config("width = 8\nheight = 8").build();
        assert_eq!(
            p.process("c", b"GIF89a....").unwrap_err().reason(),
            "unknown_image_format"
        );
        assert_eq!(p.process("c", b"").unwrap_err().reason(), "empty");
        let img = gradient(64, 48);
        // A JPEG cut just before its end marker still decodes (the scan is
        // complete) but is refused: it may as well have been cut mid-scan.
        for (bytes, tail) in [(png(&img), 0), (jpeg(&img), 2)] {
            for cut in [bytes.len() / 2, bytes.len() - tail, 20] {
                if cut == bytes.len() {
                    continue;
                }
                let e = p.process("c", &bytes[..cut]).unwrap_err();
                assert!(
                    ["undecodable_image", "truncated_image"].contains(&e.reason()),
                    "{e}"
                );
            }
        }
    }

    #[test]
    fn oversized_images_are_refused_before_decoding() {
        let mut p = config("width = 8\nheight = 8\nmax_pixels = 100").build();
        let e = p.process("c", &png(&gradient(64, 48))).unwrap_err();
        assert_eq!(e.reason(), "image_too_large");
    }

    fn arbitrary_bytes_with_header() -> impl Strategy<Value = Vec<u8>> {
        let headers = prop_oneof![
            Just(vec![0xFF, 0xD8, 0xFF]),
            Just(b"\x89PNG\r\n\x1a\n".to_vec()),
            Just(Vec::new()),
        ];
        (headers, proptest::collection::vec(any::<u8>(), 0..512)).prop_map(|(mut h, t)| {
            h.extend(t);
            h
        })
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in arbitrary_bytes_with_header()) {
            for cfg in ["width = 16\nheight = 16", "width = 4\nheight = 4\nformat = \"raw_rgb\"\ninput_width = 4\ninput_height = 4"] {
                let mut p = config(cfg).build();
                if let Ok(items) = p.process("c", &bytes) {
                    prop_assert_eq!(items.len(), 1);
                }
            }
        }

        #[test]
        fn truncated_and_corrupted_images_never_panic(cut in 0usize..4000, flip in 0usize..4000, val in any::<u8>()) {
            let img = gradient(40, 30);
            let mut p = config("width = 16\nheight = 16\nresize = \"letterbox\"").build();
            for mut bytes in [png(&img), jpeg(&img)] {
                let n = bytes.len();
                bytes[flip % n] ^= val;
                let _ = p.process("c", &bytes[..cut.min(n)]);
                let _ = p.process("c", &bytes);
            }
        }
    }
}
