//! Image preprocessing on the GPU (feature `cuda`): one NVRTC-compiled
//! kernel does what `image.rs` does on the CPU after decoding (resize by
//! stretch or letterbox with the same antialiased bilinear filter, centre
//! crop, RGB/BGR, normalisation, NCHW/NHWC, f32/f16/u8), from RGB, BGR or
//! NV12 frames, and writes straight into a model input's device buffer (an
//! I/O-bound buffer of the session, `backend::binding`).
//!
//! The CUDA driver and NVRTC are loaded at run time (cudarc's dynamic
//! loading): a build with this feature starts on machines without them, and
//! [`GpuImagePreprocessor::new`] says why it cannot serve; the caller then
//! keeps the CPU path. The CPU implementation is the reference: the same u8
//! pixel goes through the same f32 operations (no fused multiply-add), so
//! outputs differ only where the resampled pixel rounds differently (one
//! level in 255) between the one-pass 2-D filter here and the two-pass one
//! there.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use half::f16;
use ndarray::{ArrayD, IxDyn};

use super::gpu_launch::{LaunchParams, SourceFormat};
use super::image::OutputDType;
use super::{ImageTransform, PreprocessConfig};
use crate::backend::Tensor;

/// The kernel. One thread per output pixel; see `gpu_launch.rs` for the
/// arguments' arithmetic.
pub const KERNEL: &str = r#"
__device__ __forceinline__ unsigned char clip8(int x) {
    return (unsigned char)min(max((x + 128) >> 8, 0), 255);
}

// Source pixel (x, y) as RGB.
__device__ __forceinline__ void load_rgb(const unsigned char* src, int w, int h, int fmt,
                                         int x, int y, float* rgb) {
    if (fmt == 2) {
        int c = ((int)src[y * w + x] - 16) * 298;
        const unsigned char* uv = src + w * h + (y / 2) * w + (x / 2) * 2;
        int d = (int)uv[0] - 128, e = (int)uv[1] - 128;
        rgb[0] = clip8(c + 409 * e);
        rgb[1] = clip8(c - 100 * d - 208 * e);
        rgb[2] = clip8(c + 516 * d);
    } else {
        const unsigned char* p = src + (y * w + x) * 3;
        rgb[0] = p[fmt == 1 ? 2 : 0];
        rgb[1] = p[1];
        rgb[2] = p[fmt == 1 ? 0 : 2];
    }
}

__device__ __forceinline__ float tri(float x) {
    x = fabsf(x);
    return x < 1.0f ? 1.0f - x : 0.0f;
}

extern "C" __global__ void outpost_preprocess(
    const unsigned char* __restrict__ src, int src_w, int src_h, int src_format,
    int new_w, int new_h, int pad_x, int pad_y,
    int crop_x, int crop_y, int out_w, int out_h,
    float ratio_x, float ratio_y,
    float scale, float mean0, float mean1, float mean2,
    float std0, float std1, float std2,
    int map0, int map1, int map2, int pad_value,
    int stride_c, int stride_y, int stride_x, int dtype,
    unsigned long long dst_addr)
{
    int ox = blockIdx.x * blockDim.x + threadIdx.x;
    int oy = blockIdx.y * blockDim.y + threadIdx.y;
    if (ox >= out_w || oy >= out_h) return;
    int cx = ox + crop_x - pad_x, cy = oy + crop_y - pad_y;
    float rgb[3];
    if (cx < 0 || cy < 0 || cx >= new_w || cy >= new_h) {
        rgb[0] = rgb[1] = rgb[2] = (float)pad_value;
    } else if (new_w == src_w && new_h == src_h) {
        load_rgb(src, src_w, src_h, src_format, cx, cy, rgb);
    } else {
        // Bilinear (triangle) filter widened by the ratio when shrinking, the
        // window and weights of Pillow's and fast_image_resize's convolution.
        float fx = fmaxf(ratio_x, 1.0f), fy = fmaxf(ratio_y, 1.0f);
        float centre_x = (cx + 0.5f) * ratio_x, centre_y = (cy + 0.5f) * ratio_y;
        int x0 = max((int)(centre_x - fx + 0.5f), 0), x1 = min((int)(centre_x + fx + 0.5f), src_w);
        int y0 = max((int)(centre_y - fy + 0.5f), 0), y1 = min((int)(centre_y + fy + 0.5f), src_h);
        float acc[3] = {0.0f, 0.0f, 0.0f};
        float wsum_y = 0.0f;
        for (int y = y0; y < y1; ++y) {
            float wy = tri((y - centre_y + 0.5f) / fy);
            if (wy == 0.0f) continue;
            float row[3] = {0.0f, 0.0f, 0.0f};
            float wsum_x = 0.0f;
            for (int x = x0; x < x1; ++x) {
                float wx = tri((x - centre_x + 0.5f) / fx);
                if (wx == 0.0f) continue;
                float p[3];
                load_rgb(src, src_w, src_h, src_format, x, y, p);
                row[0] += wx * p[0]; row[1] += wx * p[1]; row[2] += wx * p[2];
                wsum_x += wx;
            }
            if (wsum_x > 0.0f) {
                acc[0] += wy * row[0] / wsum_x; acc[1] += wy * row[1] / wsum_x; acc[2] += wy * row[2] / wsum_x;
                wsum_y += wy;
            }
        }
        for (int c = 0; c < 3; ++c) {
            float v = wsum_y > 0.0f ? acc[c] / wsum_y : 0.0f;
            rgb[c] = fminf(fmaxf(floorf(v + 0.5f), 0.0f), 255.0f);
        }
    }
    int map[3] = {map0, map1, map2};
    float mean[3] = {mean0, mean1, mean2};
    float sd[3] = {std0, std1, std2};
    size_t base = (size_t)oy * stride_y + (size_t)ox * stride_x;
    for (int c = 0; c < 3; ++c) {
        float v = rgb[map[c]];
        size_t at = base + (size_t)c * stride_c;
        if (dtype == 2) {
            ((unsigned char*)dst_addr)[at] = (unsigned char)v;
        } else {
            // (v * scale - mean) / std, each step rounded as the CPU does.
            float n = __fdiv_rn(__fsub_rn(__fmul_rn(v, scale), mean[c]), sd[c]);
            if (dtype == 0) {
                ((float*)dst_addr)[at] = n;
            } else {
                unsigned short h;
                asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(n));
                ((unsigned short*)dst_addr)[at] = h;
            }
        }
    }
}
"#;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("CUDA driver library (libcuda.so) not found: no NVIDIA driver on this machine")]
    NoDriver,
    #[error(
        "NVRTC (libnvrtc.so.13) not found: install CUDA's NVRTC or add its folder to LD_LIBRARY_PATH"
    )]
    NoNvrtc,
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC could not compile the preprocessing kernel: {0}")]
    Compile(String),
    #[error("GPU preprocessing: {0}")]
    Params(String),
    #[error("GPU preprocessing: frame of {got} bytes, {expected} expected ({w}x{h} {format:?})")]
    FrameSize {
        got: usize,
        expected: usize,
        w: u32,
        h: u32,
        format: SourceFormat,
    },
    #[error("GPU preprocessing: the output needs {need} bytes, the buffer has {have}")]
    Buffer { need: usize, have: usize },
}

/// A frame in host memory.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    pub data: &'a [u8],
    pub width: u32,
    pub height: u32,
    pub format: SourceFormat,
}

/// The compiled kernel, a stream, and the frame buffers of the last size seen.
pub struct GpuImagePreprocessor {
    cfg: PreprocessConfig,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    func: CudaFunction,
    /// Pinned staging memory and the device copy of the frame.
    staging: Option<PinnedHostSlice<u8>>,
    src: Option<CudaSlice<u8>>,
    /// Output buffer of `run_scratch`.
    scratch: Option<CudaSlice<u8>>,
}

impl GpuImagePreprocessor {
    /// Loads the driver and NVRTC, compiles the kernel for CUDA device
    /// `ordinal`. Errors say why the GPU path cannot serve here.
    pub fn new(cfg: &PreprocessConfig, ordinal: usize) -> Result<Self, GpuError> {
        // SAFETY: these only try to dlopen the libraries; no CUDA call is made.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        // SAFETY: as above, a dlopen of NVRTC and nothing else.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(GpuError::NoNvrtc);
        }
        // Check the config once (any frame size will do).
        LaunchParams::new(cfg, 2, 2, SourceFormat::Rgb)
            .map_err(|e| GpuError::Params(e.to_string()))?;
        let ctx = CudaContext::new(ordinal)?;
        let opts = cudarc::nvrtc::CompileOptions {
            fmad: Some(false),
            prec_div: Some(true),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(KERNEL, opts)
            .map_err(|e| GpuError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx)?;
        let func = module.load_function("outpost_preprocess")?;
        let stream = ctx.new_stream()?;
        Ok(GpuImagePreprocessor {
            cfg: cfg.clone(),
            ctx,
            stream,
            func,
            staging: None,
            src: None,
            scratch: None,
        })
    }

    /// Launch parameters for a frame.
    pub fn params(&self, frame: &Frame<'_>) -> Result<LaunchParams, GpuError> {
        let p = LaunchParams::new(&self.cfg, frame.width, frame.height, frame.format)
            .map_err(|e| GpuError::Params(e.to_string()))?;
        if frame.data.len() != p.src_bytes {
            return Err(GpuError::FrameSize {
                got: frame.data.len(),
                expected: p.src_bytes,
                w: frame.width,
                h: frame.height,
                format: frame.format,
            });
        }
        Ok(p)
    }

    /// Uploads the frame through pinned memory and runs the kernel, writing
    /// one image at device address `dst` (`dst_bytes` long); returns when
    /// the output is written.
    ///
    /// # Safety
    /// `dst` must be device memory of this device, valid for `dst_bytes`
    /// bytes, that nothing else uses until this returns (an input buffer of
    /// an I/O binding between runs).
    pub unsafe fn run_into(
        &mut self,
        frame: &Frame<'_>,
        dst: u64,
        dst_bytes: usize,
    ) -> Result<LaunchParams, GpuError> {
        let p = self.params(frame)?;
        if dst_bytes < p.out_bytes {
            return Err(GpuError::Buffer {
                need: p.out_bytes,
                have: dst_bytes,
            });
        }
        let n = p.src_bytes;
        if self.staging.as_ref().map(|s| s.len()) != Some(n) {
            // SAFETY: pinned host memory of n bytes, written below before any read.
            self.staging = Some(unsafe { self.ctx.alloc_pinned::<u8>(n)? });
            // SAFETY: device memory of n bytes, filled by the copy below before the kernel reads it.
            self.src = Some(unsafe { self.stream.alloc::<u8>(n)? });
        }
        let (Some(staging), Some(src)) = (self.staging.as_mut(), self.src.as_mut()) else {
            return Err(GpuError::Params("frame buffers missing".into()));
        };
        staging.as_mut_slice()?.copy_from_slice(frame.data);
        self.stream.memcpy_htod(staging, src)?;
        let cfg = LaunchConfig {
            grid_dim: p.grid,
            block_dim: p.block,
            shared_mem_bytes: 0,
        };
        let i = |v: u32| v as i32;
        let (src_w, src_h, fmt) = (i(p.src_w), i(p.src_h), p.src_format.code());
        let (new_w, new_h, pad_x, pad_y) = (i(p.new_w), i(p.new_h), i(p.pad_x), i(p.pad_y));
        let (crop_x, crop_y, out_w, out_h) = (i(p.crop_x), i(p.crop_y), i(p.out_w), i(p.out_h));
        let pad = p.pad_value as i32;
        let [sc, sy, sx] = p.strides.map(|s| s as i32);
        let dtype = match p.dtype {
            OutputDType::F32 => 0i32,
            OutputDType::F16 => 1,
            OutputDType::U8 => 2,
        };
        let mut b = self.stream.launch_builder(&self.func);
        b.arg(&*src)
            .arg(&src_w)
            .arg(&src_h)
            .arg(&fmt)
            .arg(&new_w)
            .arg(&new_h)
            .arg(&pad_x)
            .arg(&pad_y)
            .arg(&crop_x)
            .arg(&crop_y)
            .arg(&out_w)
            .arg(&out_h)
            .arg(&p.ratio_x)
            .arg(&p.ratio_y)
            .arg(&p.scale)
            .arg(&p.mean[0])
            .arg(&p.mean[1])
            .arg(&p.mean[2])
            .arg(&p.std[0])
            .arg(&p.std[1])
            .arg(&p.std[2])
            .arg(&p.map[0])
            .arg(&p.map[1])
            .arg(&p.map[2])
            .arg(&pad)
            .arg(&sc)
            .arg(&sy)
            .arg(&sx)
            .arg(&dtype)
            .arg(&dst);
        // SAFETY: the arguments match the kernel's signature one by one; the
        // grid covers out_w x out_h and the kernel returns outside it; src
        // holds src_bytes; dst holds out_bytes (checked above, caller's contract).
        unsafe { b.launch(cfg) }?;
        self.stream.synchronize()?;
        Ok(p)
    }

    /// The same into a device buffer of its own (kept between calls),
    /// without copying back: for timing the preprocessing alone.
    pub fn run_scratch(&mut self, frame: &Frame<'_>) -> Result<LaunchParams, GpuError> {
        let p = self.params(frame)?;
        if self.scratch.as_ref().map(|s| s.len()) != Some(p.out_bytes) {
            self.scratch = Some(self.stream.alloc_zeros::<u8>(p.out_bytes)?);
        }
        let Some(out) = self.scratch.as_mut() else {
            return Err(GpuError::Params("scratch buffer missing".into()));
        };
        let (addr, _sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(out, &self.stream);
        drop(_sync);
        // SAFETY: the scratch buffer is device memory of out_bytes on this device, used by nothing else.
        unsafe { self.run_into(frame, addr, p.out_bytes) }
    }

    /// The same into a device buffer of its own, copied back: for checks
    /// against the CPU path.
    pub fn run_to_host(&mut self, frame: &Frame<'_>) -> Result<(Tensor, ImageTransform), GpuError> {
        let p = self.params(frame)?;
        let mut out = self.stream.alloc_zeros::<u8>(p.out_bytes)?;
        let (addr, sync) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut out, &self.stream);
        drop(sync);
        // SAFETY: `out` is device memory of out_bytes on this device, used by nothing else.
        let p = unsafe { self.run_into(frame, addr, p.out_bytes)? };
        let bytes = self.stream.clone_dtoh(&out)?;
        let shape = p.shape(1);
        let shape_err = |e: ndarray::ShapeError| GpuError::Params(e.to_string());
        let t = match p.dtype {
            OutputDType::U8 => {
                Tensor::U8(ArrayD::from_shape_vec(IxDyn(&shape), bytes).map_err(shape_err)?)
            }
            OutputDType::F32 => {
                let v = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                Tensor::F32(ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(shape_err)?)
            }
            OutputDType::F16 => {
                let v = bytes
                    .chunks_exact(2)
                    .map(|b| f16::from_le_bytes([b[0], b[1]]))
                    .collect();
                Tensor::F16(ArrayD::from_shape_vec(IxDyn(&shape), v).map_err(shape_err)?)
            }
        };
        Ok((t, p.transform))
    }
}
