//! How a pipeline runs its frames, decided once when it is built from its
//! config and its model: whether one worker at a time runs it, whether the
//! model keeps state per stream, how items share inference runs, and
//! whether frames go through the cascade.

use super::PipelineConfig;
use crate::backend::{Dim, is_batch_name};
use crate::model::manifest::Manifest;
use crate::model::state::StreamStates;
use crate::postprocess::PostprocessConfig;
use crate::preprocess::PreprocessConfig;

/// Whether a pipeline runs through the cascade path (stages, thumbnails,
/// an image pyramid).
pub fn needs_cascade(cfg: &PipelineConfig, pre: &PreprocessConfig) -> bool {
    !cfg.stages.is_empty()
        || cfg.thumbnails.is_some()
        || matches!(pre, PreprocessConfig::Pyramid { .. })
}

/// How items share inference runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Batching {
    /// One run per item.
    One,
    /// Up to `max` items per run, stacked on the batch axis (a stateless
    /// model whose main input has one and that takes no constants).
    Stacked { max: usize },
    /// State batched across streams (as Triton's sequence batcher): up to
    /// `max` items of distinct streams per run, each stream's state on the
    /// state input's batch axis (`axes`, one per state input).
    AcrossStreams { max: usize, axes: Vec<usize> },
}

/// A pipeline's way of running, fixed at build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mode {
    /// Run by one worker at a time, so each stream's frames go in order:
    /// state is kept per stream somewhere (the model's recurrent state,
    /// audio windows, event thresholds, a stream hook).
    pub serial: bool,
    /// The model feeds state back per stream (`[[state]]` in its manifest).
    pub stateful: bool,
    pub batching: Batching,
    /// Frames go through the cascade (stages, an image pyramid,
    /// thumbnails): a frame's items are merged into one result.
    pub cascade: bool,
}

impl Mode {
    /// The mode of a pipeline `cfg` serving the model `m` with the given
    /// pre- and postprocessing and main input; `hooked`: a stream hook runs
    /// after postprocessing.
    pub fn decide(
        cfg: &PipelineConfig,
        m: &Manifest,
        pre: &PreprocessConfig,
        post: &PostprocessConfig,
        main_input: &str,
        hooked: bool,
    ) -> Mode {
        let stateful = !m.state.is_empty();
        let stateful_steps = matches!(pre, PreprocessConfig::Audio { .. })
            || matches!(post, PostprocessConfig::Threshold { .. });
        let serial = stateful || hooked || stateful_steps;
        // A pipeline over several cameras stacks the ready cameras' frames
        // though a hook (tracking) makes it serial: the hook runs after
        // inference, each frame in its stream's order, so one run for
        // frames of several streams changes nothing it sees.
        let many_cameras =
            matches!(&cfg.source, crate::source::SourceConfig::Camera(c) if c.is_many());
        let stackable = !serial || (many_cameras && hooked && !stateful && !stateful_steps);
        let cascade = needs_cascade(cfg, pre);
        let batched = |d: &Dim| matches!(d, Dim::Symbolic(s) if is_batch_name(s));
        let has_batch_axis = m
            .inputs
            .iter()
            .find(|i| i.name == main_input)
            .and_then(|i| i.shape.first())
            .is_some_and(batched);
        let constants = m
            .inputs
            .iter()
            .filter(|i| i.name != main_input && !m.is_state_input(&i.name));
        let max = cfg.max_batch;
        let pyramid = matches!(pre, PreprocessConfig::Pyramid { .. });
        let batching = if pyramid || max <= 1 || !has_batch_axis {
            // A pyramid's levels (of different sizes) run one by one; the
            // cascade otherwise takes the ready frames together, and their
            // stages' crops share runs.
            Batching::One
        } else if stateful {
            // Constants are fed once per run as they are: none may have a
            // batch axis.
            let constants_unbatched = constants.clone().all(|i| !i.shape.iter().any(batched));
            match StreamStates::batch_axes(m).filter(|_| constants_unbatched) {
                Some(axes) => Batching::AcrossStreams { max, axes },
                None => Batching::One,
            }
        } else if stackable && constants.count() == 0 {
            Batching::Stacked { max }
        } else {
            Batching::One
        };
        Mode {
            serial,
            stateful,
            batching,
            cascade,
        }
    }

    /// Takes several frames at once (stacked, or across streams).
    pub fn batchable(&self) -> bool {
        !matches!(self.batching, Batching::One)
    }

    /// How many frames a worker takes at once.
    pub fn take_limit(&self) -> usize {
        match self.batching {
            Batching::One => 1,
            Batching::Stacked { max } | Batching::AcrossStreams { max, .. } => max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: &str = r#"
name = "m"
version = "1.0.0"
file = "m.onnx"
sha256 = "00"
source = "tests"
license = "Apache-2.0"
[[inputs]]
name = "x"
dtype = "f32"
shape = ["batch", 4]
[[outputs]]
name = "y"
dtype = "f32"
shape = ["batch", 2]
"#;

    fn mode(manifest: &str, extra: &str, pre: &str, post: &str, hooked: bool) -> Mode {
        let m: Manifest = toml::from_str(manifest).unwrap();
        let cfg: PipelineConfig = toml::from_str(&format!(
            "name = \"p\"\nmodel = \"m\"\nsource = {{ type = \"http\" }}\n{extra}"
        ))
        .unwrap();
        let pre: PreprocessConfig = toml::from_str(pre).unwrap();
        let post: PostprocessConfig = toml::from_str(post).unwrap();
        Mode::decide(&cfg, &m, &pre, &post, "x", hooked)
    }

    const SENSOR: &str = "type = \"sensor\"\nlength = 4";
    const RAW: &str = "type = \"raw\"";

    #[test]
    fn a_stateless_model_with_a_batch_axis_stacks_items() {
        let m = mode(MODEL, "max_batch = 8", SENSOR, RAW, false);
        assert_eq!(m.batching, Batching::Stacked { max: 8 });
        assert!(!m.serial && !m.stateful && !m.cascade);
        assert_eq!((m.batchable(), m.take_limit()), (true, 8));
        let one = mode(MODEL, "", SENSOR, RAW, false);
        assert_eq!((&one.batching, one.take_limit()), (&Batching::One, 1));
    }

    #[test]
    fn per_stream_state_makes_a_pipeline_serial_and_unstacked() {
        let thresholds = "type = \"threshold\"\noutput = \"y\"\non = 0.5\noff = 0.4";
        let m = mode(MODEL, "max_batch = 8", SENSOR, thresholds, false);
        assert!(m.serial);
        assert_eq!(m.batching, Batching::One);
        let hooked = mode(MODEL, "max_batch = 8", SENSOR, RAW, true);
        assert!(hooked.serial);
        assert_eq!(hooked.batching, Batching::One);
    }

    #[test]
    fn a_stateful_model_batches_across_streams_on_its_state_axes() {
        let stateful = format!(
            "{MODEL}[[inputs]]\nname = \"h\"\ndtype = \"f32\"\nshape = [2, \"batch\", 3]\n\
             [[outputs]]\nname = \"hN\"\ndtype = \"f32\"\nshape = [2, \"batch\", 3]\n\
             [[state]]\ninput = \"h\"\noutput = \"hN\"\n"
        );
        let m = mode(&stateful, "max_batch = 4", SENSOR, RAW, false);
        assert!(m.serial && m.stateful);
        assert_eq!(
            m.batching,
            Batching::AcrossStreams {
                max: 4,
                axes: vec![1]
            }
        );
        assert_eq!(
            mode(&stateful, "", SENSOR, RAW, false).batching,
            Batching::One
        );
    }

    #[test]
    fn a_pyramid_runs_its_levels_one_by_one_and_other_cascades_take_ready_frames_together() {
        let image = "type = \"image\"\nwidth = 8\nheight = 8";
        let thumbs = "max_batch = 8\nthumbnails = { max_bytes = 2000 }";
        let m = mode(MODEL, thumbs, image, RAW, false);
        assert!(m.cascade);
        assert_eq!(m.batching, Batching::Stacked { max: 8 });
        let pyramid = "type = \"pyramid\"\nwindow = 12\nmin_size = 12";
        let p = mode(MODEL, thumbs, pyramid, RAW, false);
        assert!(p.cascade);
        assert_eq!(p.batching, Batching::One);
    }
}
