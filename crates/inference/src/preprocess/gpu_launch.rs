//! Host-side arithmetic of the GPU image preprocessing (`gpu.rs`, feature
//! `cuda`): where the resized image sits in the model's canvas, which part of
//! the canvas the crop keeps, the grid that covers the output, and where each
//! output element goes. Compiled in every build, so it is tested against the
//! CPU preprocessing (`image.rs`, the reference) on machines without a GPU.

use super::image::{OutputDType, centre_offset, fit_size, pad_offset};
use super::{ChannelOrder, ImageTransform, Layout, PreprocessConfig};

/// Threads per block (x, y): one thread per output pixel, 256 per block,
/// rows of 32 so a warp writes 32 neighbouring pixels of a plane.
pub const BLOCK: (u32, u32) = (32, 8);

/// Pixel format of a frame handed to the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceFormat {
    Rgb,
    Bgr,
    /// Y plane, then interleaved UV at half resolution (BT.601 limited range).
    Nv12,
}

impl SourceFormat {
    /// The kernel's `src_format` argument.
    pub fn code(self) -> i32 {
        match self {
            SourceFormat::Rgb => 0,
            SourceFormat::Bgr => 1,
            SourceFormat::Nv12 => 2,
        }
    }

    /// Bytes of a `w x h` frame.
    pub fn frame_bytes(self, w: u32, h: u32) -> usize {
        let px = w as usize * h as usize;
        match self {
            SourceFormat::Rgb | SourceFormat::Bgr => px * 3,
            SourceFormat::Nv12 => px * 3 / 2,
        }
    }
}

/// Everything one kernel launch needs, for one frame size.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchParams {
    pub src_w: u32,
    pub src_h: u32,
    pub src_format: SourceFormat,
    pub src_bytes: usize,
    /// Size of the resized image inside the canvas, and its top-left corner.
    pub new_w: u32,
    pub new_h: u32,
    pub pad_x: u32,
    pub pad_y: u32,
    /// Top-left corner of the crop in the canvas, and the output size.
    pub crop_x: u32,
    pub crop_y: u32,
    pub out_w: u32,
    pub out_h: u32,
    /// Source pixels per resized pixel (the filter widens by this when shrinking).
    pub ratio_x: f32,
    pub ratio_y: f32,
    pub scale: f32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    /// Output channel c takes RGB channel `map[c]`.
    pub map: [i32; 3],
    pub pad_value: u8,
    pub layout: Layout,
    pub dtype: OutputDType,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Element strides of the output: channel, row, pixel.
    pub strides: [usize; 3],
    /// Elements and bytes of one image's output (batch item).
    pub out_elems: usize,
    pub out_bytes: usize,
    /// Model coordinates of the source, as the CPU path reports them.
    pub transform: ImageTransform,
}

/// Why a frame and an image config give no launch parameters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("GPU preprocessing handles image configs only")]
    NotImage,
    #[error("empty image or model input ({src_w}x{src_h} to {tw}x{th})")]
    Empty {
        src_w: u32,
        src_h: u32,
        tw: u32,
        th: u32,
    },
    #[error("NV12 needs an even size, got {src_w}x{src_h}")]
    OddNv12 { src_w: u32, src_h: u32 },
}

impl LaunchParams {
    /// Launch parameters for a `src_w x src_h` frame under an image config.
    pub fn new(
        cfg: &PreprocessConfig,
        src_w: u32,
        src_h: u32,
        src_format: SourceFormat,
    ) -> Result<LaunchParams, ParamsError> {
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
            dtype,
            ..
        } = cfg
        else {
            return Err(ParamsError::NotImage);
        };
        let (tw, th) = (*width, *height);
        if src_w == 0 || src_h == 0 || tw == 0 || th == 0 {
            return Err(ParamsError::Empty {
                src_w,
                src_h,
                tw,
                th,
            });
        }
        if src_format == SourceFormat::Nv12
            && (!src_w.is_multiple_of(2) || !src_h.is_multiple_of(2))
        {
            return Err(ParamsError::OddNv12 { src_w, src_h });
        }
        let (new_w, new_h) = fit_size(*resize, tw, th, src_w, src_h);
        let (pad_x, pad_y) = pad_offset(*resize, tw, th, new_w, new_h);
        let [cw, ch] = crop.unwrap_or([tw, th]);
        let (out_w, out_h) = (cw.min(tw), ch.min(th));
        let (crop_x, crop_y) = (centre_offset(tw, out_w), centre_offset(th, out_h));
        let plane = out_w as usize * out_h as usize;
        let strides = match layout {
            Layout::Nchw => [plane, out_w as usize, 1],
            Layout::Nhwc => [1, out_w as usize * 3, 3],
            Layout::Nwhc => [1, 3, out_h as usize * 3],
        };
        let elem = match dtype {
            OutputDType::F32 => 4,
            OutputDType::F16 => 2,
            OutputDType::U8 => 1,
        };
        let map = if *channel_order == ChannelOrder::Rgb {
            [0, 1, 2]
        } else {
            [2, 1, 0]
        };
        Ok(LaunchParams {
            src_w,
            src_h,
            src_format,
            src_bytes: src_format.frame_bytes(src_w, src_h),
            new_w,
            new_h,
            pad_x,
            pad_y,
            crop_x,
            crop_y,
            out_w,
            out_h,
            ratio_x: src_w as f32 / new_w as f32,
            ratio_y: src_h as f32 / new_h as f32,
            scale: *scale,
            mean: *mean,
            std: *std,
            map,
            pad_value: *pad_value,
            layout: *layout,
            dtype: *dtype,
            grid: (out_w.div_ceil(BLOCK.0), out_h.div_ceil(BLOCK.1), 1),
            block: (BLOCK.0, BLOCK.1, 1),
            strides,
            out_elems: plane * 3,
            out_bytes: plane * 3 * elem,
            transform: ImageTransform {
                orig_width: src_w,
                orig_height: src_h,
                scale_x: new_w as f32 / src_w as f32,
                scale_y: new_h as f32 / src_h as f32,
                pad_x: pad_x as f32 - crop_x as f32,
                pad_y: pad_y as f32 - crop_y as f32,
            },
        })
    }

    /// Where output channel `c` of output pixel (`x`, `y`) goes, in elements.
    pub fn offset(&self, c: usize, y: usize, x: usize) -> usize {
        c * self.strides[0] + y * self.strides[1] + x * self.strides[2]
    }

    /// The shape of a batch of `n` outputs.
    pub fn shape(&self, n: usize) -> [usize; 4] {
        let (w, h) = (self.out_w as usize, self.out_h as usize);
        match self.layout {
            Layout::Nchw => [n, 3, h, w],
            Layout::Nhwc => [n, h, w, 3],
            Layout::Nwhc => [n, w, h, 3],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str, w: u32, h: u32, format: &str) -> PreprocessConfig {
        #[derive(serde::Deserialize)]
        struct W {
            p: PreprocessConfig,
        }
        let text = format!(
            "[p]\ntype = \"image\"\nformat = \"{format}\"\ninput_width = {w}\ninput_height = {h}\n{extra}"
        );
        let w: W = toml::from_str(&text).unwrap();
        let problems = w.p.validate();
        assert!(problems.is_empty(), "{problems:?}");
        w.p
    }

    /// The CPU path's tensor and transform for a raw frame of this size.
    fn cpu(
        cfg: &PreprocessConfig,
        frame: &[u8],
    ) -> (Vec<usize>, ImageTransform, crate::backend::Tensor) {
        let mut p = cfg.build();
        let mut items = p.process("s", frame).unwrap();
        let item = items.remove(0);
        let t = item.meta.image.unwrap();
        (item.tensor.shape().to_vec(), t, item.tensor)
    }

    const SIZES: [(u32, u32); 7] = [
        (640, 480),
        (300, 1000),
        (224, 224),
        (18, 6),
        (2, 2),
        (1920, 1080),
        (100, 37),
    ];
    const MODELS: [&str; 5] = [
        "width = 224\nheight = 224",
        "width = 640\nheight = 384\nresize = \"letterbox\"",
        "width = 256\nheight = 256\ncrop = [224, 224]",
        "width = 320\nheight = 240\nresize = \"letterbox\"\ncrop = [300, 200]\nlayout = \"nhwc\"",
        "width = 33\nheight = 17\nresize = \"letterbox\"\nchannel_order = \"bgr\"\ndtype = \"f16\"",
    ];

    #[test]
    fn geometry_matches_the_cpu_preprocessing() {
        for model in MODELS {
            for (w, h) in SIZES {
                let cfg = config(model, w, h, "raw_rgb");
                let frame = vec![90u8; (w * h * 3) as usize];
                let (shape, transform, _) = cpu(&cfg, &frame);
                let p = LaunchParams::new(&cfg, w, h, SourceFormat::Rgb).unwrap();
                let ctx = format!("{model} from {w}x{h}");
                assert_eq!(p.shape(1).to_vec(), shape, "{ctx}");
                assert_eq!(p.transform, transform, "{ctx}");
                assert_eq!(p.src_bytes, frame.len(), "{ctx}");
                assert_eq!(p.out_elems, shape.iter().product::<usize>(), "{ctx}");
                // The grid covers the output and not one block more.
                let (gx, gy, gz) = p.grid;
                assert_eq!(gz, 1);
                assert!(
                    gx * BLOCK.0 >= p.out_w && (gx - 1) * BLOCK.0 < p.out_w,
                    "{ctx}"
                );
                assert!(
                    gy * BLOCK.1 >= p.out_h && (gy - 1) * BLOCK.1 < p.out_h,
                    "{ctx}"
                );
                // The resized image and the crop lie inside the canvas.
                let [cw, ch] = [p.crop_x + p.out_w, p.crop_y + p.out_h];
                assert!(p.pad_x + p.new_w <= 640 && cw <= 640, "{ctx}");
                assert!(p.pad_y + p.new_h <= 384 && ch <= 384, "{ctx}");
            }
        }
    }

    #[test]
    fn strides_address_the_cpu_tensor_elements() {
        // A frame whose every pixel differs, a model input the same size (no
        // resampling): output element (c, y, x) of the CPU tensor must be
        // found at params.offset(c, y, x) of its flat data.
        for model in [
            "width = 40\nheight = 30\nscale = 1.0\ndtype = \"u8\"",
            "width = 40\nheight = 30\nscale = 1.0\ndtype = \"u8\"\nlayout = \"nhwc\"\nchannel_order = \"bgr\"",
            "width = 40\nheight = 30\nscale = 1.0\ndtype = \"u8\"\ncrop = [20, 10]",
        ] {
            let (w, h) = (40u32, 30u32);
            let cfg = config(model, w, h, "raw_rgb");
            let frame: Vec<u8> = (0..w * h * 3).map(|i| (i * 7 % 251) as u8).collect();
            let (_, _, t) = cpu(&cfg, &frame);
            let crate::backend::Tensor::U8(a) = t else {
                panic!("u8 tensor")
            };
            let flat = a.as_slice().unwrap();
            let p = LaunchParams::new(&cfg, w, h, SourceFormat::Rgb).unwrap();
            for y in 0..p.out_h as usize {
                for x in 0..p.out_w as usize {
                    let (sx, sy) = (
                        x + p.crop_x as usize - p.pad_x as usize,
                        y + p.crop_y as usize - p.pad_y as usize,
                    );
                    for c in 0..3 {
                        let src = frame[(sy * w as usize + sx) * 3 + p.map[c] as usize];
                        assert_eq!(flat[p.offset(c, y, x)], src, "{model} c{c} y{y} x{x}");
                    }
                }
            }
        }
    }

    #[test]
    fn nv12_frames_take_one_and_a_half_bytes_a_pixel_and_even_sizes() {
        let cfg = config("width = 64\nheight = 64", 64, 48, "raw_nv12");
        let p = LaunchParams::new(&cfg, 64, 48, SourceFormat::Nv12).unwrap();
        assert_eq!(p.src_bytes, 64 * 48 * 3 / 2);
        assert!(LaunchParams::new(&cfg, 63, 48, SourceFormat::Nv12).is_err());
        // The CPU path takes the same bytes and gives the same transform.
        let frame = vec![128u8; p.src_bytes];
        let (shape, transform, _) = cpu(&cfg, &frame);
        assert_eq!(p.shape(1).to_vec(), shape);
        assert_eq!(p.transform, transform);
    }

    #[test]
    fn nv12_conversion_is_bt601_limited_range() {
        use crate::preprocess::pixels::yuv_to_rgb;
        assert_eq!(yuv_to_rgb(16, 128, 128), [0, 0, 0]);
        assert_eq!(yuv_to_rgb(235, 128, 128), [255, 255, 255]);
        // Saturated red: Y 81, U 90, V 240 (BT.601).
        let [r, g, b] = yuv_to_rgb(81, 90, 240);
        assert!(r >= 250 && g <= 5 && b <= 5, "{r} {g} {b}");
    }
}
