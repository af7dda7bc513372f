//! Pixel buffers and the pixel arithmetic every image path shares: packed
//! RGB, YUV to RGB, NV12 frames and the bilinear resize. A leaf of the
//! preprocessing room: image, raw-frame and crop code read it; it reads
//! none of them.

use fast_image_resize as fir;

use super::DecodeError;

/// Packed 8-bit RGB pixels.
#[derive(Clone, Debug, PartialEq)]
pub struct Rgb {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

/// One limited-range YUV pixel to RGB, integer arithmetic (x256): BT.709
/// or BT.601 coefficients (Cr to R, Cb to G, Cr to G, Cb to B).
#[inline]
pub fn yuv_pixel(y: u8, u: u8, v: u8, bt709: bool) -> [u8; 3] {
    let (rv, gu, gv, bu) = if bt709 {
        (459, 55, 136, 541)
    } else {
        (409, 100, 208, 516)
    };
    let c = (y as i32 - 16) * 298;
    let d = u as i32 - 128;
    let e = v as i32 - 128;
    let clip = |x: i32| ((x + 128) >> 8).clamp(0, 255) as u8;
    [
        clip(c + rv * e),
        clip(c - gu * d - gv * e),
        clip(c + bu * d),
    ]
}

/// One pixel of NV12 to RGB, BT.601 limited range, in integer arithmetic
/// (the GPU kernel does the same operations, so both give the same bytes).
#[inline]
pub fn yuv_to_rgb(y: u8, u: u8, v: u8) -> [u8; 3] {
    yuv_pixel(y, u, v, false)
}

/// `pixels` (`from` in size, of `kind`) resized to `to` with the bilinear
/// convolution every image path uses; a copy when the size is already right.
pub fn resize_pixels(
    resizer: &mut fir::Resizer,
    pixels: &[u8],
    from: (u32, u32),
    to: (u32, u32),
    kind: fir::PixelType,
) -> Result<Vec<u8>, DecodeError> {
    if from == to {
        return Ok(pixels.to_vec());
    }
    let err = |e: &dyn std::fmt::Display| DecodeError::Resize {
        message: e.to_string(),
    };
    let view = fir::images::ImageRef::new(from.0, from.1, pixels, kind).map_err(|e| err(&e))?;
    let mut dst = fir::images::Image::new(to.0, to.1, kind);
    let opts = fir::ResizeOptions::new()
        .resize_alg(fir::ResizeAlg::Convolution(fir::FilterType::Bilinear));
    resizer
        .resize(&view, &mut dst, &opts)
        .map_err(|e| err(&e))?;
    Ok(dst.into_vec())
}

/// An NV12 frame (`w * h` Y bytes, then `w * h / 2` interleaved UV bytes;
/// even `w` and `h`) as packed RGB.
pub fn nv12_to_rgb(frame: &[u8], w: usize, h: usize, out: &mut Vec<u8>) {
    out.clear();
    out.reserve(w * h * 3);
    let (yp, uv) = frame.split_at(w * h);
    for y in 0..h {
        for x in 0..w {
            let i = (y / 2) * w + (x / 2) * 2;
            out.extend_from_slice(&yuv_to_rgb(yp[y * w + x], uv[i], uv[i + 1]));
        }
    }
}
