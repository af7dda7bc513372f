//! Pixels for cascade stages and image pyramids: decode a frame to packed
//! RGB, cut a box out of it (zeros where the box leaves the frame), rotate
//! by multiples of 90 degrees, resize (area averaging when shrinking, as
//! OpenCV's INTER_AREA; bilinear when enlarging) and normalize into f32
//! tensors in the model's layout and channel order.

use std::io::Cursor;

use fast_image_resize as fir;

/// This path stays; the type lives in `pixels.rs`.
pub use super::pixels::Rgb;
use super::{ChannelOrder, DecodeError, ImageFormat, Layout, PreprocessConfig};

/// Decodes a frame the way the pipeline's preprocessing reads it (JPEG or
/// PNG, or raw RGB/BGR of a configured size) to RGB.
pub fn decode_frame(payload: &[u8], cfg: &PreprocessConfig) -> Result<Rgb, DecodeError> {
    let (format, raw, max_pixels) = match cfg {
        PreprocessConfig::Image {
            format,
            input_width,
            input_height,
            max_pixels,
            ..
        } => (
            *format,
            (input_width.unwrap_or(0), input_height.unwrap_or(0)),
            *max_pixels,
        ),
        PreprocessConfig::Pyramid { max_pixels, .. } => (ImageFormat::Auto, (0, 0), *max_pixels),
        _ => {
            return Err(DecodeError::Config {
                message: "not an image preprocessing".into(),
            });
        }
    };
    if payload.is_empty() {
        return Err(DecodeError::Empty);
    }
    match format {
        ImageFormat::Auto => decode_rgb(payload, max_pixels),
        ImageFormat::RawRgb | ImageFormat::RawBgr => {
            let (w, h) = raw;
            let n = w as usize * h as usize * 3;
            if payload.len() != n {
                return Err(DecodeError::BadSize {
                    expected: format!("{n} ({w}x{h} x 3 bytes)"),
                    got: payload.len(),
                });
            }
            let mut pixels = payload.to_vec();
            if format == ImageFormat::RawBgr {
                for px in pixels.chunks_exact_mut(3) {
                    px.swap(0, 2);
                }
            }
            Ok(Rgb {
                width: w,
                height: h,
                pixels,
            })
        }
        ImageFormat::RawNv12 => {
            let (w, h) = raw;
            let n = w as usize * h as usize * 3 / 2;
            if payload.len() != n || !w.is_multiple_of(2) || !h.is_multiple_of(2) {
                return Err(DecodeError::BadSize {
                    expected: format!("{n} ({w}x{h} NV12, even sides, 1.5 bytes a pixel)"),
                    got: payload.len(),
                });
            }
            let mut pixels = Vec::with_capacity(w as usize * h as usize * 3);
            super::pixels::nv12_to_rgb(payload, w as usize, h as usize, &mut pixels);
            Ok(Rgb {
                width: w,
                height: h,
                pixels,
            })
        }
    }
}

/// JPEG or PNG to RGB, refusing images over `max_pixels` before decoding.
pub fn decode_rgb(payload: &[u8], max_pixels: u64) -> Result<Rgb, DecodeError> {
    let undecodable = |source| DecodeError::UndecodableImage { source };
    if !(payload.starts_with(&[0xFF, 0xD8, 0xFF]) || payload.starts_with(b"\x89PNG\r\n\x1a\n")) {
        return Err(DecodeError::UnknownImageFormat);
    }
    let reader = || {
        image::ImageReader::new(Cursor::new(payload))
            .with_guessed_format()
            .map_err(|e| DecodeError::UndecodableImage {
                source: image::ImageError::IoError(e),
            })
    };
    let (width, height) = reader()?.into_dimensions().map_err(undecodable)?;
    if width as u64 * height as u64 > max_pixels {
        return Err(DecodeError::ImageTooLarge {
            width,
            height,
            max_pixels,
        });
    }
    let img = reader()?.decode().map_err(undecodable)?.into_rgb8();
    Ok(Rgb {
        width,
        height,
        pixels: img.into_raw(),
    })
}

impl Rgb {
    /// The pixels `x0..x1`, `y0..y1` (end exclusive, may reach outside the
    /// frame: those pixels are black).
    pub fn crop(&self, x0: i64, y0: i64, x1: i64, y1: i64) -> Rgb {
        let (w, h) = ((x1 - x0).max(0) as usize, (y1 - y0).max(0) as usize);
        let mut pixels = vec![0u8; w * h * 3];
        let (fw, fh) = (self.width as i64, self.height as i64);
        let (sx0, sx1) = (x0.clamp(0, fw), x1.clamp(0, fw));
        if sx1 > sx0 {
            let n = (sx1 - sx0) as usize * 3;
            for y in y0.max(0)..y1.min(fh) {
                let src = ((y * fw + sx0) * 3) as usize;
                let dst = (((y - y0) as usize * w) + (sx0 - x0) as usize) * 3;
                pixels[dst..dst + n].copy_from_slice(&self.pixels[src..src + n]);
            }
        }
        Rgb {
            width: w as u32,
            height: h as u32,
            pixels,
        }
    }

    /// Rotated clockwise by `degrees` (0, 90, 180 or 270; others: unchanged).
    pub fn rotate(self, degrees: u16) -> Rgb {
        let (w, h) = (self.width as usize, self.height as usize);
        let px = |x: usize, y: usize| &self.pixels[(y * w + x) * 3..(y * w + x) * 3 + 3];
        match degrees % 360 {
            180 => {
                let mut pixels = Vec::with_capacity(self.pixels.len());
                for p in self.pixels.chunks_exact(3).rev() {
                    pixels.extend_from_slice(p);
                }
                Rgb { pixels, ..self }
            }
            90 | 270 => {
                let cw = degrees % 360 == 90;
                let mut pixels = Vec::with_capacity(self.pixels.len());
                // Output is h wide, w high.
                for oy in 0..w {
                    for ox in 0..h {
                        let (x, y) = if cw {
                            (oy, h - 1 - ox)
                        } else {
                            (w - 1 - oy, ox)
                        };
                        pixels.extend_from_slice(px(x, y));
                    }
                }
                Rgb {
                    width: h as u32,
                    height: w as u32,
                    pixels,
                }
            }
            _ => self,
        }
    }

    /// Resized to `w` x `h`: area averaging when both sides shrink (or stay),
    /// bilinear otherwise.
    pub fn resize(&self, w: u32, h: u32) -> Result<Rgb, DecodeError> {
        if (w, h) == (self.width, self.height) {
            return Ok(self.clone());
        }
        let err = |e: &dyn std::fmt::Display| DecodeError::Resize {
            message: e.to_string(),
        };
        if self.width == 0 || self.height == 0 || w == 0 || h == 0 {
            return Err(DecodeError::Resize {
                message: format!("{}x{} to {w}x{h}", self.width, self.height),
            });
        }
        let view =
            fir::images::ImageRef::new(self.width, self.height, &self.pixels, fir::PixelType::U8x3)
                .map_err(|e| err(&e))?;
        let mut dst = fir::images::Image::new(w, h, fir::PixelType::U8x3);
        let filter = if w <= self.width && h <= self.height {
            fir::FilterType::Box
        } else {
            fir::FilterType::Bilinear
        };
        let opts = fir::ResizeOptions::new().resize_alg(fir::ResizeAlg::Convolution(filter));
        fir::Resizer::new()
            .resize(&view, &mut dst, &opts)
            .map_err(|e| err(&e))?;
        Ok(Rgb {
            width: w,
            height: h,
            pixels: dst.into_vec(),
        })
    }
}

/// Pixel values to model values: `(v * scale - mean[c]) / std[c]` per model
/// channel, from RGB sources.
#[derive(Clone, Debug)]
pub struct Normalizer {
    lut: [[f32; 256]; 3],
    /// Model channel c reads RGB channel map[c].
    map: [usize; 3],
    pub layout: Layout,
}

impl Normalizer {
    pub fn new(
        mean: [f32; 3],
        std: [f32; 3],
        scale: f32,
        order: ChannelOrder,
        layout: Layout,
    ) -> Normalizer {
        let mut lut = [[0f32; 256]; 3];
        for (c, table) in lut.iter_mut().enumerate() {
            for (v, x) in table.iter_mut().enumerate() {
                *x = (v as f32 * scale - mean[c]) / std[c];
            }
        }
        let map = match order {
            ChannelOrder::Rgb => [0, 1, 2],
            ChannelOrder::Bgr => [2, 1, 0],
        };
        Normalizer { lut, map, layout }
    }

    /// The shape of `n` items of `w` x `h`.
    pub fn shape(&self, n: usize, w: usize, h: usize) -> [usize; 4] {
        match self.layout {
            Layout::Nchw => [n, 3, h, w],
            Layout::Nhwc => [n, h, w, 3],
            Layout::Nwhc => [n, w, h, 3],
        }
    }

    /// Writes `img` into one item's slot `out` (`3 * w * h` values, zeros
    /// where the image is smaller: right and bottom padding).
    pub fn write(&self, img: &Rgb, out: &mut [f32], w: usize, h: usize) {
        let (iw, ih) = ((img.width as usize).min(w), (img.height as usize).min(h));
        let stride = img.width as usize * 3;
        for y in 0..ih {
            let row = &img.pixels[y * stride..y * stride + iw * 3];
            for (x, px) in row.chunks_exact(3).enumerate() {
                for c in 0..3 {
                    let v = self.lut[c][px[self.map[c]] as usize];
                    let at = match self.layout {
                        Layout::Nchw => c * w * h + y * w + x,
                        Layout::Nhwc => (y * w + x) * 3 + c,
                        Layout::Nwhc => (x * h + y) * 3 + c,
                    };
                    out[at] = v;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(w: u32, h: u32) -> Rgb {
        let mut pixels = Vec::new();
        for y in 0..h {
            for x in 0..w {
                pixels.extend_from_slice(&[x as u8, y as u8, 7]);
            }
        }
        Rgb {
            width: w,
            height: h,
            pixels,
        }
    }

    #[test]
    fn crops_outside_the_frame_are_black() {
        let c = img(4, 3).crop(-1, 1, 2, 5);
        assert_eq!((c.width, c.height), (3, 4));
        assert_eq!(&c.pixels[0..3], &[0, 0, 0]); // x = -1
        assert_eq!(&c.pixels[3..6], &[0, 1, 7]); // (0, 1)
        assert!(c.pixels[2 * 9..].iter().all(|v| *v == 0)); // rows 3, 4
        // Entirely outside, or empty: no panic.
        assert_eq!(img(4, 3).crop(10, 10, 12, 12).pixels, vec![0; 12]);
        assert_eq!(img(4, 3).crop(2, 2, 1, 1).width, 0);
    }

    #[test]
    fn rotations() {
        let r = img(3, 2).rotate(180);
        assert_eq!(&r.pixels[0..3], &[2, 1, 7]);
        let r = img(3, 2).rotate(90);
        assert_eq!((r.width, r.height), (2, 3));
        // Clockwise: the bottom-left pixel comes to the top-left.
        assert_eq!(&r.pixels[0..3], &[0, 1, 7]);
    }

    #[test]
    fn writes_layouts_with_padding() {
        let n = Normalizer::new([0.0; 3], [1.0; 3], 1.0, ChannelOrder::Bgr, Layout::Nchw);
        let mut out = vec![0f32; 3 * 4 * 2];
        n.write(&img(2, 2), &mut out, 4, 2);
        // Channel 0 is blue (7), x = 0..2 then padding.
        assert_eq!(&out[0..4], &[7.0, 7.0, 0.0, 0.0]);
        // Channel 2 is red = x.
        assert_eq!(&out[16..20], &[0.0, 1.0, 0.0, 0.0]);
        let n = Normalizer::new([0.0; 3], [1.0; 3], 1.0, ChannelOrder::Rgb, Layout::Nwhc);
        let mut out = vec![0f32; 3 * 2 * 2];
        n.write(&img(2, 2), &mut out, 2, 2);
        // (x=1, y=0) sits at index (1 * 2 + 0) * 3.
        assert_eq!(&out[6..9], &[1.0, 0.0, 7.0]);
    }
}
