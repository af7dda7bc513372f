//! Frames that arrive decoded (cameras): packed RGB, or planar I420 as the
//! software and hardware H.264 decoders give it. I420 is never converted
//! whole for a model: its planes are resized to the model's size and only
//! those pixels are turned to RGB (a 1080p frame into a 224x224 input
//! converts 50 k pixels, not 2 M). Snapshots and cascade crops, which need
//! the whole frame, convert it whole.

use fast_image_resize as fir;

use super::DecodeError;
/// This path stays; the function lives in `pixels.rs`.
pub use super::pixels::yuv_pixel;
use super::pixels::{Rgb, resize_pixels};

/// What the bytes of a decoded frame are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawFormat {
    /// Packed RGB, 3 bytes a pixel, rows without padding.
    Rgb,
    /// Planar YUV 4:2:0: Y (`w * h`), then U and V (`ceil(w/2) * ceil(h/2)`
    /// each), rows without padding; `bt709` picks the matrix (else BT.601),
    /// limited range.
    I420 { bt709: bool },
}

/// A decoded frame's size and layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawImage {
    pub width: u32,
    pub height: u32,
    pub format: RawFormat,
}

impl RawImage {
    pub fn rgb(width: u32, height: u32) -> RawImage {
        RawImage {
            width,
            height,
            format: RawFormat::Rgb,
        }
    }

    /// Chroma plane size of an I420 frame.
    pub fn chroma_size(&self) -> (u32, u32) {
        (self.width.div_ceil(2), self.height.div_ceil(2))
    }

    /// Bytes the payload must have.
    pub fn len(&self) -> usize {
        let (w, h) = (self.width as usize, self.height as usize);
        match self.format {
            RawFormat::Rgb => w * h * 3,
            RawFormat::I420 { .. } => {
                let (cw, ch) = self.chroma_size();
                w * h + 2 * cw as usize * ch as usize
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.width == 0 || self.height == 0
    }

    /// The payload has this frame's size.
    pub fn check(&self, payload: &[u8]) -> Result<(), DecodeError> {
        let n = self.len();
        if self.is_empty() || payload.len() != n {
            return Err(DecodeError::BadSize {
                expected: format!("{n} ({}x{} {})", self.width, self.height, self.name()),
                got: payload.len(),
            });
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        match self.format {
            RawFormat::Rgb => "RGB",
            RawFormat::I420 { .. } => "I420",
        }
    }

    /// Y, U and V planes of an I420 payload (checked first).
    fn planes<'a>(&self, payload: &'a [u8]) -> (&'a [u8], &'a [u8], &'a [u8]) {
        let (w, h) = (self.width as usize, self.height as usize);
        let (cw, ch) = self.chroma_size();
        let c = cw as usize * ch as usize;
        let (y, rest) = payload.split_at(w * h);
        let (u, v) = rest.split_at(c);
        (y, u, v)
    }

    /// The whole frame as packed RGB (snapshots, cascade crops).
    pub fn to_rgb(&self, payload: &[u8]) -> Result<Rgb, DecodeError> {
        self.check(payload)?;
        let pixels = match self.format {
            RawFormat::Rgb => payload.to_vec(),
            RawFormat::I420 { bt709 } => {
                let (yp, up, vp) = self.planes(payload);
                let (w, h) = (self.width as usize, self.height as usize);
                let cw = self.chroma_size().0 as usize;
                let mut out = Vec::with_capacity(w * h * 3);
                for y in 0..h {
                    let crow = (y / 2) * cw;
                    for x in 0..w {
                        let c = crow + x / 2;
                        out.extend_from_slice(&yuv_pixel(yp[y * w + x], up[c], vp[c], bt709));
                    }
                }
                out
            }
        };
        Ok(Rgb {
            width: self.width,
            height: self.height,
            pixels,
        })
    }

    /// An I420 frame resized to `nw` x `nh` and converted to packed RGB:
    /// each plane resized on its own (bilinear convolution, as RGB frames
    /// are), then only the resized pixels converted.
    pub fn i420_resized_rgb(
        &self,
        payload: &[u8],
        nw: u32,
        nh: u32,
        resizer: &mut fir::Resizer,
    ) -> Result<Vec<u8>, DecodeError> {
        self.check(payload)?;
        let RawFormat::I420 { bt709 } = self.format else {
            return Err(DecodeError::Config {
                message: "not an I420 frame".into(),
            });
        };
        let (yp, up, vp) = self.planes(payload);
        let (cw, ch) = self.chroma_size();
        let mut plane =
            |data, size| resize_pixels(resizer, data, size, (nw, nh), fir::PixelType::U8);
        let ry = plane(yp, (self.width, self.height))?;
        let ru = plane(up, (cw, ch))?;
        let rv = plane(vp, (cw, ch))?;
        let mut out = Vec::with_capacity(nw as usize * nh as usize * 3);
        for ((y, u), v) in ry.iter().zip(&ru).zip(&rv) {
            out.extend_from_slice(&yuv_pixel(*y, *u, *v, bt709));
        }
        Ok(out)
    }
}

/// The conversion a camera's I420 frames come from, written the slow and
/// obvious way: the reference of the tests here and in the daemon's
/// snapshots. Compiled in every build, used by none.
#[doc(hidden)]
pub mod reference {
    /// RGB to limited-range I420 (BT.601 or 709), averaging each 2x2 block's chroma.
    pub fn rgb_to_i420(rgb: &[u8], w: usize, h: usize, bt709: bool) -> Vec<u8> {
        let (kr, kb) = if bt709 {
            (0.2126, 0.0722)
        } else {
            (0.299, 0.114)
        };
        let kg = 1.0 - kr - kb;
        let yuv = |p: &[u8]| {
            let (r, g, b) = (p[0] as f64, p[1] as f64, p[2] as f64);
            let y = kr * r + kg * g + kb * b;
            let u = (b - y) / (2.0 * (1.0 - kb));
            let v = (r - y) / (2.0 * (1.0 - kr));
            (
                16.0 + y * 219.0 / 255.0,
                128.0 + u * 224.0 / 255.0,
                128.0 + v * 224.0 / 255.0,
            )
        };
        let (cw, ch) = (w.div_ceil(2), h.div_ceil(2));
        let mut out = vec![0u8; w * h + 2 * cw * ch];
        for y in 0..h {
            for x in 0..w {
                out[y * w + x] = yuv(&rgb[(y * w + x) * 3..]).0.round() as u8;
            }
        }
        for cy in 0..ch {
            for cx in 0..cw {
                let (mut su, mut sv, mut n) = (0.0, 0.0, 0.0);
                for (dx, dy) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
                    let (x, y) = (2 * cx + dx, 2 * cy + dy);
                    if x < w && y < h {
                        let (_, u, v) = yuv(&rgb[(y * w + x) * 3..]);
                        su += u;
                        sv += v;
                        n += 1.0;
                    }
                }
                out[w * h + cy * cw + cx] = (su / n).round() as u8;
                out[w * h + cw * ch + cy * cw + cx] = (sv / n).round() as u8;
            }
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::reference::rgb_to_i420;
    use super::*;

    /// A smooth colour picture (gradients), as RGB.
    pub fn picture(w: usize, h: usize) -> Vec<u8> {
        let mut p = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            for x in 0..w {
                p.extend_from_slice(&[
                    (40 + 170 * x / w) as u8,
                    (60 + 150 * y / h) as u8,
                    (200 - 120 * (x + y) / (w + h)) as u8,
                ]);
            }
        }
        p
    }

    #[test]
    fn sizes_and_checks() {
        let r = RawImage {
            width: 5,
            height: 3,
            format: RawFormat::I420 { bt709: false },
        };
        assert_eq!(r.chroma_size(), (3, 2));
        assert_eq!(r.len(), 15 + 12);
        assert!(r.check(&[0; 27]).is_ok());
        let e = r.check(&[0; 26]).unwrap_err();
        assert!(e.to_string().contains("I420"), "{e}");
        assert_eq!(RawImage::rgb(2, 2).len(), 12);
        assert!(RawImage::rgb(0, 2).check(&[]).is_err());
    }

    #[test]
    fn i420_converts_back_to_its_picture() {
        for bt709 in [false, true] {
            let (w, h) = (64, 48);
            let rgb = picture(w, h);
            let raw = RawImage {
                width: w as u32,
                height: h as u32,
                format: RawFormat::I420 { bt709 },
            };
            let back = raw.to_rgb(&rgb_to_i420(&rgb, w, h, bt709)).unwrap();
            let worst = rgb
                .iter()
                .zip(&back.pixels)
                .map(|(a, b)| (*a as i32 - *b as i32).abs())
                .max()
                .unwrap();
            assert!(worst <= 4, "bt709 {bt709}: worst channel error {worst}");
        }
    }

    #[test]
    fn resized_planes_match_the_resized_picture() {
        let (w, h) = (320, 240);
        let rgb = picture(w, h);
        let raw = RawImage {
            width: w as u32,
            height: h as u32,
            format: RawFormat::I420 { bt709: true },
        };
        let i420 = rgb_to_i420(&rgb, w, h, true);
        let mut resizer = fir::Resizer::new();
        let small = raw.i420_resized_rgb(&i420, 56, 42, &mut resizer).unwrap();
        assert_eq!(small.len(), 56 * 42 * 3);
        // Against the whole frame converted, then resized.
        let whole = raw.to_rgb(&i420).unwrap();
        let view =
            fir::images::ImageRef::new(w as u32, h as u32, &whole.pixels, fir::PixelType::U8x3)
                .unwrap();
        let mut dst = fir::images::Image::new(56, 42, fir::PixelType::U8x3);
        resizer
            .resize(
                &view,
                &mut dst,
                &fir::ResizeOptions::new()
                    .resize_alg(fir::ResizeAlg::Convolution(fir::FilterType::Bilinear)),
            )
            .unwrap();
        let worst = small
            .iter()
            .zip(dst.buffer())
            .map(|(a, b)| (*a as i32 - *b as i32).abs())
            .max()
            .unwrap();
        assert!(worst <= 4, "worst channel error {worst}");
    }
}
