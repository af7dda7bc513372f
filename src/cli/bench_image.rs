//! `outpost bench --image FILE`: end to end per iteration, as a camera
//! pipeline does it. The picture is decoded once to a raw RGB frame; each
//! iteration preprocesses that frame into the model's image input (on the
//! GPU, written straight into the session's bound input buffer, when the
//! model runs on CUDA/TensorRT, the build has the `cuda` feature and the
//! driver loads; otherwise the CPU preprocessing), runs the model and copies
//! the outputs back.

use std::path::Path;

use crate::backend::binding::Placement;
use crate::backend::ort::OrtSession;
use crate::backend::{DType, Tensor};
use crate::model::registry::LoadedModel;
use crate::preprocess::{ImageFormat, PreprocessConfig, Preprocessor};

pub struct ImageLoop {
    frame: Vec<u8>,
    /// The model's image input and the shape of a batch of it.
    input: String,
    // Read by the GPU path only (it binds the input buffer by type and shape).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    dtype: DType,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    shape: Vec<usize>,
    others: Vec<(String, Tensor)>,
    batch: usize,
    cpu: Box<dyn Preprocessor>,
    #[cfg(feature = "cuda")]
    gpu: Option<(crate::preprocess::gpu::GpuImagePreprocessor, u32, u32)>,
    /// `gpu` or `cpu`, and why not the GPU.
    pub path: &'static str,
    pub reason: Option<String>,
}

impl ImageLoop {
    pub fn new(
        session: &OrtSession,
        model: &LoadedModel,
        image: &Path,
        batch: usize,
        inputs: &[(String, Tensor)],
    ) -> anyhow::Result<ImageLoop> {
        let Some(mut cfg) = model.manifest.preprocess.clone() else {
            anyhow::bail!(
                "--image: model {} has no [preprocess] in its manifest",
                model.id()
            );
        };
        if !model.manifest.state.is_empty() {
            anyhow::bail!("--image: model {} is stateful", model.id());
        }
        let rgb = image::open(image)
            .map_err(|e| anyhow::anyhow!("--image {}: {e}", image.display()))?
            .into_rgb8();
        let (w, h) = rgb.dimensions();
        let PreprocessConfig::Image {
            format,
            input_width,
            input_height,
            ..
        } = &mut cfg
        else {
            anyhow::bail!("--image: model {} does not take images", model.id());
        };
        *format = ImageFormat::RawRgb;
        *input_width = Some(w);
        *input_height = Some(h);
        let problems = cfg.validate();
        if !problems.is_empty() {
            anyhow::bail!("--image: {}", problems.join("; "));
        }
        // The image input: the first 4-D input of the manifest.
        let Some(spec) = model.manifest.inputs.iter().find(|i| i.shape.len() == 4) else {
            anyhow::bail!("--image: model {} has no 4-D input", model.id());
        };
        let mut cpu = cfg.build();
        let probe = cpu.process("bench", rgb.as_raw())?;
        let one = probe
            .first()
            .map(|i| i.tensor.shape().to_vec())
            .ok_or_else(|| anyhow::anyhow!("--image: preprocessing gave nothing"))?;
        let mut shape = one.clone();
        shape[0] = batch;
        let others = inputs
            .iter()
            .filter(|(n, _)| *n != spec.name)
            .cloned()
            .collect();
        let (path, reason) = match session.binding_mode() {
            Some((Placement::Cuda(_), _)) => ("gpu", None),
            Some((Placement::Cpu, _)) | None if session_provider(session) == "cpu" => (
                "cpu",
                Some("the model runs on the cpu provider".to_string()),
            ),
            _ => (
                "cpu",
                Some("I/O binding is off ([runtime.cuda] io_binding = false)".to_string()),
            ),
        };
        let mut l = ImageLoop {
            frame: rgb.into_raw(),
            input: spec.name.clone(),
            dtype: spec.dtype,
            shape,
            others,
            batch,
            cpu,
            #[cfg(feature = "cuda")]
            gpu: None,
            path,
            reason,
        };
        if l.path == "gpu" {
            l.select_gpu(&cfg, session, w, h);
        }
        match &l.reason {
            Some(r) => tracing::info!(model = %model.id(), reason = %r, "preprocessing on the CPU"),
            None => tracing::info!(model = %model.id(), "preprocessing on the GPU"),
        }
        Ok(l)
    }

    #[cfg(feature = "cuda")]
    fn select_gpu(&mut self, cfg: &PreprocessConfig, session: &OrtSession, w: u32, h: u32) {
        let ordinal = match session.binding_mode() {
            Some((Placement::Cuda(id), _)) => id.max(0) as usize,
            _ => 0,
        };
        match crate::preprocess::gpu::GpuImagePreprocessor::new(cfg, ordinal) {
            Ok(g) => self.gpu = Some((g, w, h)),
            Err(e) => {
                self.path = "cpu";
                self.reason = Some(e.to_string());
            }
        }
    }

    #[cfg(not(feature = "cuda"))]
    fn select_gpu(&mut self, _cfg: &PreprocessConfig, _session: &OrtSession, _w: u32, _h: u32) {
        self.path = "cpu";
        self.reason = Some("this outpost was built without the `cuda` feature".into());
    }

    pub fn step(&mut self, session: &mut OrtSession) -> anyhow::Result<()> {
        #[cfg(feature = "cuda")]
        if let Some((gpu, w, h)) = self.gpu.as_mut() {
            use crate::preprocess::gpu::Frame;
            use crate::preprocess::gpu_launch::SourceFormat;
            let frame = Frame {
                data: &self.frame,
                width: *w,
                height: *h,
                format: SourceFormat::Rgb,
            };
            let mut shapes: Vec<(&str, DType, &[usize])> =
                vec![(self.input.as_str(), self.dtype, self.shape.as_slice())];
            shapes.extend(
                self.others
                    .iter()
                    .map(|(n, t)| (n.as_str(), t.dtype(), t.shape())),
            );
            let data: Vec<(&str, &Tensor)> =
                self.others.iter().map(|(n, t)| (n.as_str(), t)).collect();
            let batch = self.batch;
            let mut fill =
                |addr: u64, len: usize| -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
                    let per = len / batch.max(1);
                    for i in 0..batch {
                        // SAFETY: the bound input buffer holds `batch` images of
                        // `per` bytes; nothing reads it until the run below.
                        unsafe { gpu.run_into(&frame, addr + (i * per) as u64, per) }?;
                    }
                    Ok(())
                };
            session.run_bound_filled(&shapes, &data, &self.input, &mut fill)?;
            return Ok(());
        }
        let items = self.cpu.process("bench", &self.frame)?;
        let Some(item) = items.into_iter().next() else {
            anyhow::bail!("preprocessing gave nothing");
        };
        let image = if self.batch == 1 {
            item.tensor
        } else {
            let parts: Vec<&Tensor> = (0..self.batch).map(|_| &item.tensor).collect();
            Tensor::concat0(&parts).map_err(|e| anyhow::anyhow!(e))?
        };
        let mut refs: Vec<(&str, &Tensor)> = vec![(self.input.as_str(), &image)];
        refs.extend(self.others.iter().map(|(n, t)| (n.as_str(), t)));
        session.run_prechecked(&refs)?;
        Ok(())
    }
}

fn session_provider(s: &OrtSession) -> String {
    use crate::backend::InferenceSession;
    s.provider().to_string()
}
