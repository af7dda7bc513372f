//! `outpost models import`: a model folder from a bare .onnx file. What the
//! graph says (its inputs and outputs, what it does first to its input,
//! the class names its exporter wrote into its metadata) decides the
//! manifest: every input and output, the preprocessing, and the
//! postprocess recognised from the output shapes. Each guess comes with
//! its reason, and what cannot be recognised is refused with one.
//!
//! The recognition is free of I/O: [`guess`] takes the model's I/O as ONNX
//! Runtime reports it and the [`GraphFacts`] read from the file.

mod detector;

pub use detector::NoFit;

use bytes::Bytes;
use prost::Message;
use serde_json::{Value, json};

use super::manifest::{ManifestIo, Postprocess, Preprocess, StatePair};
use crate::backend::{DType, Dim, IoSpec};
use crate::onnx_proto::{ModelProto, NodeProto, TensorProto};

/// Strides of the YOLO heads: a YOLOX export has one row per cell of the
/// three grids, a YOLOv5 export three (one per anchor).
const STRIDES: [u64; 3] = [8, 16, 32];
/// Detector and classifier defaults a user tunes afterwards.
const SCORE: f64 = 0.25;
const IOU: f64 = 0.45;
const MAX_DETECTIONS: u64 = 100;
const IMAGENET_MEAN: [f64; 3] = [0.485, 0.456, 0.406];
const IMAGENET_STD: [f64; 3] = [0.229, 0.224, 0.225];

/// A model import cannot make a manifest of.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {reason}")]
pub struct ImportRefused {
    pub file: String,
    pub reason: String,
}

/// Why the importer cannot tell what the model is, or write its manifest.
#[derive(Debug, thiserror::Error)]
pub enum GuessError {
    /// A preprocessing or postprocess table the importer made that the
    /// manifest's types refuse.
    #[error("{what}: {source}")]
    Table {
        what: &'static str,
        source: serde_json::Error,
    },
    #[error(
        "no single image input (a 4-D f32 or u8 tensor with 1 or 3 channels) and not a \
         streaming audio model; the model's inputs are {inputs}"
    )]
    NoImageInput { inputs: String },
    #[error(
        "outpost feeds one image input; the model has {count} inputs ({inputs}): write the \
         manifest by hand, with a `fill` for each constant input"
    )]
    SeveralInputs { count: usize, inputs: String },
    #[error(
        "output `{output}` {shape} on text lines of free width: a CTC text recogniser; give its \
         character dictionary with --labels"
    )]
    NoDictionary { output: String, shape: String },
    #[error(
        "{from} has {given} characters, the model has {classes} classes: a CTC dictionary has \
         {} (the blank and the space are outpost's)",
        classes.saturating_sub(2)
    )]
    DictionarySize {
        from: &'static str,
        given: usize,
        classes: u64,
    },
    #[error(
        "{from} has {given} class names, the model has {classes} classes: give a list of {classes}"
    )]
    ClassCount {
        from: &'static str,
        given: usize,
        classes: u64,
    },
    #[error(
        "{from}: {what} {index}'s name {name:?} holds a control character (each name is one \
         line of labels.txt: a line break would shift every later {what} by one)"
    )]
    ControlCharacter {
        from: &'static str,
        what: &'static str,
        index: usize,
        name: String,
    },
    /// The outputs fit no detector layout (or several).
    #[error(transparent)]
    Detector(#[from] NoFit),
}

/// What the file says beyond its inputs and outputs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GraphFacts {
    /// Class names the exporter wrote into the metadata (Ultralytics:
    /// `names`, `{0: 'person', 1: 'bicycle', ...}`).
    pub names: Vec<String>,
    /// The metadata's `license`, where the exporter wrote one.
    pub license: Option<String>,
    /// The graph scales its image input to 0..1 itself (a `Div` by 255 or
    /// a `Mul` by 1/255 on it): the model takes 0..255 pixels.
    pub scales_itself: bool,
    /// Outputs made by a `Softmax`.
    pub softmaxed: Vec<String>,
    /// Written by Ultralytics' exporter (its metadata: `names`, `stride`).
    pub ultralytics: bool,
    /// Exported from PaddlePaddle (paddle2onnx: its producer or its
    /// `p2o.` dimension names): PP-OCR's recipes apply.
    pub paddle: bool,
    /// A text recogniser's dictionary in the metadata (PaddleOCR writes
    /// `character`).
    pub characters: Vec<String>,
    /// The graph's inputs (initializers left out) and outputs.
    pub inputs: Vec<IoSpec>,
    pub outputs: Vec<IoSpec>,
}

impl GraphFacts {
    pub fn read(bytes: Bytes) -> Result<GraphFacts, crate::model::onnx::OnnxParseError> {
        let m = ModelProto::decode(bytes)?;
        let mut f = GraphFacts {
            paddle: m.producer_name.to_lowercase().contains("paddle"),
            ..GraphFacts::default()
        };
        for p in &m.metadata_props {
            match p.key.as_str() {
                "names" => f.names = parse_names(&p.value),
                "license" if !p.value.trim().is_empty() => f.license = Some(p.value.clone()),
                "character" => f.characters = p.value.lines().map(str::to_string).collect(),
                "author" if p.value.contains("Ultralytics") => f.ultralytics = true,
                "stride" => f.ultralytics = true,
                _ => {}
            }
        }
        let Some(g) = m.graph.as_ref() else {
            return Err(crate::model::onnx::OnnxParseError::NotAModel);
        };
        (f.inputs, f.outputs) = crate::model::onnx::graph_io(g);
        f.paddle |= f
            .inputs
            .iter()
            .flat_map(|i| &i.shape)
            .any(|d| matches!(d, Dim::Symbolic(p) if p.starts_with("p2o.")));
        let consts: Vec<(&str, f64)> = g
            .initializer
            .iter()
            .filter_map(|t| scalar(t).map(|v| (t.name.as_str(), v)))
            .chain(
                g.node
                    .iter()
                    .filter(|n| n.op_type == "Constant")
                    .filter_map(|n| {
                        let v = n
                            .attribute
                            .iter()
                            .find_map(|a| a.t.as_ref().and_then(scalar))?;
                        Some((n.output.first()?.as_str(), v))
                    }),
            )
            .collect();
        let value = |name: &str| consts.iter().find(|(n, _)| *n == name).map(|(_, v)| *v);
        let image_inputs: Vec<&str> = f.inputs.iter().map(|i| i.name.as_str()).collect();
        f.scales_itself = g
            .node
            .iter()
            .take(8)
            .any(|n| scales(n, &image_inputs, &value));
        f.softmaxed = g
            .node
            .iter()
            .filter(|n| n.op_type == "Softmax")
            .flat_map(|n| n.output.iter().cloned())
            .collect();
        Ok(f)
    }
}

/// Whether a node near the graph's start scales one of `inputs` (or a
/// cast or transpose of it) to 0..1.
fn scales(n: &NodeProto, inputs: &[&str], value: &impl Fn(&str) -> Option<f64>) -> bool {
    let (Some(a), Some(b)) = (n.input.first(), n.input.get(1)) else {
        return false;
    };
    let near = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() < want * 1e-3);
    let on_input = inputs.contains(&a.as_str()) || inputs.contains(&b.as_str());
    on_input
        && match n.op_type.as_str() {
            "Div" => near(value(b), 255.0),
            "Mul" => near(value(b), 1.0 / 255.0) || near(value(a), 1.0 / 255.0),
            _ => false,
        }
}

/// A one-element float tensor's value.
fn scalar(t: &TensorProto) -> Option<f64> {
    if t.dims.iter().product::<i64>() != 1 {
        return None;
    }
    match t.data_type {
        // FLOAT
        1 => t.float_data.first().map(|v| f64::from(*v)).or_else(|| {
            let b: [u8; 4] = t.raw_data.get(..4)?.try_into().ok()?;
            Some(f64::from(f32::from_le_bytes(b)))
        }),
        // DOUBLE
        11 => t.double_data.first().copied().or_else(|| {
            let b: [u8; 8] = t.raw_data.get(..8)?.try_into().ok()?;
            Some(f64::from_le_bytes(b))
        }),
        _ => None,
    }
}

/// Ultralytics' `names`: a Python dict literal, `{0: 'person', 1: 'car'}`
/// (Python's `str` of a dict: quotes and escapes as its `repr` writes them,
/// so `'cat\ndog'`, backslash and n, is a name holding a newline).
pub fn parse_names(text: &str) -> Vec<String> {
    let body = text.trim().trim_start_matches('{').trim_end_matches('}');
    let mut out: Vec<(u64, String)> = Vec::new();
    let mut rest = body;
    while let Some(colon) = rest.find(':') {
        let key = rest[..colon].trim().trim_start_matches(',').trim();
        let Ok(k) = key.parse::<u64>() else { break };
        let Some((name, after)) = python_string(rest[colon + 1..].trim_start()) else {
            break;
        };
        out.push((k, name));
        rest = after;
    }
    out.sort_by_key(|(k, _)| *k);
    // Only a dense 0..n list names classes by index.
    if out.iter().enumerate().all(|(i, (k, _))| *k == i as u64) {
        out.into_iter().map(|(_, v)| v).collect()
    } else {
        Vec::new()
    }
}

/// A quoted Python string literal at the start of `s`, its escapes
/// decoded, and what follows it.
fn python_string(s: &str) -> Option<(String, &str)> {
    let mut chars = s.char_indices();
    let (_, q) = chars.next().filter(|(_, c)| *c == '\'' || *c == '"')?;
    let mut out = String::new();
    while let Some((i, c)) = chars.next() {
        match c {
            c if c == q => return Some((out, &s[i + c.len_utf8()..])),
            '\\' => {
                let (_, e) = chars.next()?;
                let hex = |chars: &mut std::str::CharIndices, n: usize| {
                    let digits: String = chars.by_ref().take(n).map(|(_, c)| c).collect();
                    u32::from_str_radix(&digits, 16)
                        .ok()
                        .and_then(char::from_u32)
                };
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    'x' => out.push(hex(&mut chars, 2)?),
                    'u' => out.push(hex(&mut chars, 4)?),
                    'U' => out.push(hex(&mut chars, 8)?),
                    '\\' | '\'' | '"' => out.push(e),
                    other => {
                        out.push('\\');
                        out.push(other);
                    }
                }
            }
            c => out.push(c),
        }
    }
    None
}

/// What import makes of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Guess {
    /// What the model was recognised as, in words.
    pub kind: String,
    pub inputs: Vec<ManifestIo>,
    pub outputs: Vec<ManifestIo>,
    pub state: Vec<StatePair>,
    pub preprocess: Option<Preprocess>,
    pub postprocess: Option<Postprocess>,
    /// Each guess and why.
    pub notes: Vec<String>,
    /// Class names to write as the labels file (from the metadata).
    pub labels: Vec<String>,
}

/// What the user gave beside the file.
#[derive(Debug, Clone, Default)]
pub struct Hints {
    /// `--labels`: the file's lines (class names, or a CTC dictionary).
    pub labels: Option<Vec<String>>,
    /// `--output`: the output a detector's postprocess reads, where
    /// several fit a layout.
    pub output: Option<String>,
}

fn fixed(d: &Dim) -> Option<u64> {
    match d {
        Dim::Fixed(n) => Some(*n),
        Dim::Symbolic(_) => None,
    }
}

fn io(s: &IoSpec) -> ManifestIo {
    ManifestIo {
        name: s.name.clone(),
        dtype: s.dtype,
        shape: s.shape.clone(),
        fill: None,
    }
}

fn pre(v: Value) -> Result<Preprocess, GuessError> {
    serde_json::from_value(v).map_err(|source| GuessError::Table {
        what: "preprocessing",
        source,
    })
}

fn post(v: Value) -> Result<Postprocess, GuessError> {
    serde_json::from_value(v).map_err(|source| GuessError::Table {
        what: "postprocess",
        source,
    })
}

/// The image input: its layout and size.
struct Image {
    layout: &'static str,
    width: Option<u64>,
    height: Option<u64>,
}

fn image_input(s: &IoSpec) -> Option<Image> {
    if s.shape.len() != 4 || !matches!(s.dtype, DType::F32 | DType::U8) {
        return None;
    }
    let d: Vec<Option<u64>> = s.shape.iter().map(fixed).collect();
    match (d[1], d[3]) {
        (Some(1 | 3), _) => Some(Image {
            layout: "nchw",
            height: d[2],
            width: d[3],
        }),
        (_, Some(3)) => Some(Image {
            layout: "nhwc",
            height: d[1],
            width: d[2],
        }),
        _ => None,
    }
}

/// Recognises the model from its I/O and graph facts.
pub fn guess(
    inputs: &[IoSpec],
    outputs: &[IoSpec],
    facts: &GraphFacts,
    hints: &Hints,
) -> Result<Guess, GuessError> {
    if let Some(g) = vad(inputs, outputs)? {
        return Ok(g);
    }
    let images: Vec<(usize, Image)> = inputs
        .iter()
        .enumerate()
        .filter_map(|(i, s)| image_input(s).map(|im| (i, im)))
        .collect();
    let [(i, image)] = images.as_slice() else {
        return Err(GuessError::NoImageInput {
            inputs: list(inputs),
        });
    };
    if inputs.len() > 1 {
        return Err(GuessError::SeveralInputs {
            count: inputs.len(),
            inputs: list(inputs),
        });
    }
    let input = &inputs[*i];
    let mut notes = Vec::new();
    let mut g = image_model(input, image, outputs, facts, hints, &mut notes)?;
    g.notes.splice(0..0, notes);
    Ok(g)
}

fn list(v: &[IoSpec]) -> String {
    v.iter()
        .map(|s| format!("`{}` {} {}", s.name, s.dtype, s.shape_string()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A streaming voice-activity model in silero's form: audio `[batch,
/// samples]`, a state input fed from an output of the same shape, a
/// scalar sample rate, a probability `[batch, 1]`.
fn vad(inputs: &[IoSpec], outputs: &[IoSpec]) -> Result<Option<Guess>, GuessError> {
    let audio = inputs
        .iter()
        .find(|s| s.shape.len() == 2 && s.dtype == DType::F32);
    let rate = inputs
        .iter()
        .find(|s| s.shape.is_empty() && s.dtype == DType::I64);
    let state: Vec<StatePair> = inputs
        .iter()
        .filter_map(|s| {
            let o = outputs.iter().find(|o| {
                o.shape.len() == s.shape.len()
                    && (o.name == format!("{}N", s.name) || o.name == format!("{}n", s.name))
            })?;
            Some(StatePair {
                input: s.name.clone(),
                output: o.name.clone(),
            })
        })
        .collect();
    let prob = outputs
        .iter()
        .find(|o| o.shape.len() == 2 && o.shape.get(1).and_then(fixed) == Some(1));
    let (Some(audio), Some(rate), Some(prob)) = (audio, rate, prob) else {
        return Ok(None);
    };
    if state.is_empty() || inputs.len() != 2 + state.len() {
        return Ok(None);
    }
    let (sr, window, hop) = (16_000u64, 576u64, 512u64);
    let inputs = inputs
        .iter()
        .map(|s| {
            let mut m = io(s);
            if s.name == audio.name {
                m.shape = vec![s.shape[0].clone(), Dim::Fixed(window)];
            }
            if s.name == rate.name {
                m.fill = Some(sr as f64);
            }
            m
        })
        .collect();
    Ok(Some(Guess {
        kind: "a streaming voice-activity detector (silero's form)".into(),
        inputs,
        outputs: outputs.iter().map(io).collect(),
        preprocess: Some(pre(json!({
            "type": "audio", "sample_rate": sr, "window": window, "hop": hop
        }))?),
        postprocess: Some(post(json!({
            "type": "threshold", "output": prob.name, "on": 0.5, "off": 0.35,
            "min_silence_s": 0.3, "min_duration_s": 0.25
        }))?),
        notes: vec![
            format!(
                "audio input `{}` [batch, samples], state {} fed back between calls, scalar `{}`: \
                 a streaming VAD in silero's form",
                audio.name,
                state
                    .iter()
                    .map(|s| format!("`{}` <- `{}`", s.input, s.output))
                    .collect::<Vec<_>>()
                    .join(", "),
                rate.name
            ),
            format!(
                "sample rate {sr} Hz (`{}` is always given it), windows of {window} samples: 512 new \
                 ones after the last 64 of the window before (hop {hop}), as silero streams",
                rate.name
            ),
            format!(
                "`{}` is a speech probability: start at 0.5, end below 0.35",
                prob.name
            ),
        ],
        state,
        labels: Vec::new(),
    }))
}

/// The size to feed: the input's own, or `default` where it is free.
fn size(image: &Image, default: (u64, u64), notes: &mut Vec<String>) -> (u64, u64) {
    match (image.width, image.height) {
        (Some(w), Some(h)) => (w, h),
        _ => {
            notes.push(format!(
                "the input's size is free: {}x{} assumed (set `width` and `height` to change it)",
                default.0, default.1
            ));
            default
        }
    }
}

fn image_model(
    input: &IoSpec,
    image: &Image,
    outputs: &[IoSpec],
    facts: &GraphFacts,
    hints: &Hints,
    notes: &mut Vec<String>,
) -> Result<Guess, GuessError> {
    let dims = |o: &IoSpec| o.shape.iter().map(fixed).collect::<Vec<_>>();
    let c = if image.layout == "nchw" {
        input.shape.get(1).and_then(fixed)
    } else {
        input.shape.get(3).and_then(fixed)
    };
    notes.push(format!(
        "input `{}` {}: {} images, {} channel(s)",
        input.name,
        input.shape_string(),
        image.layout.to_uppercase(),
        c.unwrap_or(3)
    ));
    let mut g = Guess {
        kind: String::new(),
        inputs: vec![io(input)],
        outputs: outputs.iter().map(io).collect(),
        state: Vec::new(),
        preprocess: None,
        postprocess: None,
        notes: Vec::new(),
        labels: Vec::new(),
    };
    // MTCNN's three nets (Keras exports, width before height).
    if let Some(m) = mtcnn(input, image, outputs, notes)? {
        return Ok(Guess {
            kind: m.0,
            preprocess: Some(m.1),
            postprocess: Some(m.2),
            ..g
        });
    }
    let out4: Vec<&IoSpec> = outputs.iter().filter(|o| o.shape.len() == 4).collect();
    // A DB text detector: one probability map the size of the input.
    if let [o] = outputs
        && out4.len() == 1
        && dims(o).get(1) == Some(&Some(1))
        && image.layout == "nchw"
    {
        let (w, h) = size(image, (736, 736), notes);
        notes.push(format!(
            "output `{}` {} is one map the input's size: a DB text detector (PP-OCR's); \
             PaddleOCR's normalisation (ImageNet mean and std, BGR)",
            o.name,
            o.shape_string()
        ));
        g.kind = "a text detector (DB, PP-OCR)".into();
        g.preprocess = Some(pre(json!({
            "type": "image", "width": w, "height": h, "mean": IMAGENET_MEAN, "std": IMAGENET_STD,
            "scale": 1.0 / 255.0, "layout": "nchw", "channel_order": "bgr"
        }))?);
        g.postprocess = Some(post(json!({
            "type": "text_boxes", "output": o.name, "threshold": 0.3, "box_threshold": 0.5
        }))?);
        return Ok(g);
    }
    if let [o] = outputs
        && o.shape.len() == 2
        && let Some(k) = dims(o)[1]
    {
        // PP-OCR's orientation classifier: text-line crops, two classes.
        let crops = image.height == Some(48) && image.width.is_some_and(|w| w >= 3 * 48);
        if k == 2 && (crops || (facts.paddle && image.height.is_none())) {
            let w = image.width.unwrap_or(192);
            notes.push(format!(
                "output `{}` [batch, 2] on {w}x48 text-line crops: an orientation classifier \
                 (0 or 180 degrees, PP-OCR's), padded on the right",
                o.name
            ));
            g.kind = "a text-line orientation classifier (PP-OCR)".into();
            g.preprocess = Some(pre(json!({
                "type": "image", "width": w, "height": 48, "mean": [0.5, 0.5, 0.5],
                "std": [0.5, 0.5, 0.5], "scale": 1.0 / 255.0, "layout": "nchw",
                "channel_order": "bgr", "resize": "pad_right"
            }))?);
            g.postprocess = Some(post(json!({
                "type": "angle", "output": o.name, "angles": [0, 180], "min_score": 0.9
            }))?);
            return Ok(g);
        }
        if k >= 2 {
            let (w, h) = size(image, (224, 224), notes);
            let probs = facts.softmaxed.contains(&o.name);
            notes.push(format!(
                "output `{}` [batch, {k}]: a classifier of {k} classes{}",
                o.name,
                if probs {
                    " (already probabilities: a Softmax makes it)"
                } else {
                    " (scores: softmax applied)"
                }
            ));
            let labels = class_names(&[k], facts, hints, notes)?;
            g.kind = format!("an image classifier of {k} classes");
            g.preprocess = Some(image_pre(w, h, image, facts, "stretch", false, notes)?);
            let mut p = json!({"type": "softmax_topk", "output": o.name, "k": k.min(5)});
            if probs {
                p["already_probabilities"] = json!(true);
            }
            if !labels.is_empty() {
                p["labels"] = json!("labels.txt");
            }
            g.postprocess = Some(post(p)?);
            g.labels = labels;
            return Ok(g);
        }
    }
    // A CTC text recogniser: [batch, steps, characters] on 48-high lines.
    if let [o] = outputs
        && o.shape.len() == 3
        && (image.height == Some(48) || facts.paddle)
        && image.width.is_none()
    {
        let dict = hints
            .labels
            .as_ref()
            .or_else(|| (!facts.characters.is_empty()).then_some(&facts.characters));
        let Some(dict) = dict else {
            return Err(GuessError::NoDictionary {
                output: o.name.clone(),
                shape: o.shape_string(),
            });
        };
        let from = if hints.labels.is_some() {
            "--labels"
        } else {
            "the model's metadata (`character`)"
        };
        check_lines(dict, from, "character")?;
        // PaddleOCR's classes: the blank, the dictionary, a space.
        if let Some(k) = o.shape.get(2).and_then(fixed)
            && dict.len() as u64 + 2 != k
        {
            return Err(GuessError::DictionarySize {
                from,
                given: dict.len(),
                classes: k,
            });
        }
        notes.push(format!(
            "output `{}` {} on 48-pixel text lines of free width: a CTC text recogniser \
             (PP-OCR's), its dictionary from {from} ({} characters)",
            o.name,
            o.shape_string(),
            dict.len()
        ));
        g.kind = "a text recogniser (CTC, PP-OCR)".into();
        g.preprocess = Some(pre(json!({
            "type": "image", "width": 320, "height": 48, "mean": [0.5, 0.5, 0.5],
            "std": [0.5, 0.5, 0.5], "scale": 1.0 / 255.0, "layout": "nchw",
            "channel_order": "bgr", "resize": "pad_right"
        }))?);
        g.postprocess = Some(post(json!({
            "type": "ctc_text", "output": o.name, "dictionary": "labels.txt", "min_score": 0.5
        }))?);
        g.labels = dict.clone();
        return Ok(g);
    }
    detector::detector(image, outputs, facts, hints, notes, g)
}

/// MTCNN: (kind, preprocessing, postprocess) when the nets' shapes match.
fn mtcnn(
    input: &IoSpec,
    image: &Image,
    outputs: &[IoSpec],
    notes: &mut Vec<String>,
) -> Result<Option<(String, Preprocess, Postprocess)>, GuessError> {
    if image.layout != "nhwc" || input.shape.len() != 4 {
        return Ok(None);
    }
    let last = |o: &IoSpec| o.shape.last().and_then(fixed);
    let find = |rank: usize, n: u64| {
        outputs
            .iter()
            .find(|o| o.shape.len() == rank && last(o) == Some(n))
    };
    // MTCNN's normalisation: (x - 127.5) / 128.
    let norm = json!({"mean": [0.99609375, 0.99609375, 0.99609375], "std": [1.0, 1.0, 1.0],
                      "scale": 0.0078125, "layout": "nwhc", "channel_order": "rgb"});
    let with = |mut v: Value| {
        if let (Some(a), Some(b)) = (v.as_object_mut(), norm.as_object()) {
            a.extend(b.clone());
        }
        v
    };
    match (image.width, image.height, outputs.len()) {
        (None, None, 2) => {
            let (Some(boxes), Some(score)) = (find(4, 4), find(4, 2)) else {
                return Ok(None);
            };
            notes.push(format!(
                "free-size input, a face probability map `{}` and a box map `{}`: MTCNN's P-Net \
                 (width before height), run over an image pyramid",
                score.name, boxes.name
            ));
            Ok(Some((
                "MTCNN P-Net (face proposals)".into(),
                pre(with(
                    json!({"type": "pyramid", "min_size": 20.0, "factor": 0.709, "window": 12}),
                ))?,
                post(
                    json!({"type": "mtcnn_proposals", "score_output": score.name,
                            "box_output": boxes.name, "threshold": 0.6}),
                )?,
            )))
        }
        (Some(s @ (24 | 48)), Some(h), n) if h == s && (n == 2 || n == 3) => {
            let (Some(boxes), Some(score)) = (find(2, 4), find(2, 2)) else {
                return Ok(None);
            };
            let marks = find(2, 10);
            let (net, mode) = if s == 24 {
                ("R-Net", "union")
            } else {
                ("O-Net", "min")
            };
            notes.push(format!(
                "{s}x{s} face crops with a face probability `{}` and a box refinement `{}`: \
                 MTCNN's {net}, a stage on P-Net's proposals",
                score.name, boxes.name
            ));
            let mut p = json!({"type": "mtcnn_refine", "score_output": score.name,
                               "box_output": boxes.name, "threshold": 0.7, "nms": 0.7,
                               "nms_mode": mode});
            if let Some(m) = marks {
                p["landmarks_output"] = json!(m.name);
            }
            Ok(Some((
                format!("MTCNN {net} (face refinement)"),
                pre(with(json!({"type": "image", "width": s, "height": s})))?,
                post(p)?,
            )))
        }
        _ => Ok(None),
    }
}

/// Class names: `--labels`, or the metadata's, or none (indexes). Each is
/// one line of labels.txt, so a name holding a line break (or another
/// control character) is refused: it would shift every later class by one.
/// `classes`: the counts the model's output allows (empty: any); a list of
/// another length names other classes than the model has, and is refused
/// with both numbers.
fn class_names(
    classes: &[u64],
    facts: &GraphFacts,
    hints: &Hints,
    notes: &mut Vec<String>,
) -> Result<Vec<String>, GuessError> {
    let (names, from) = match (&hints.labels, facts.names.is_empty()) {
        (Some(l), _) => (l, "--labels"),
        (None, false) => (&facts.names, "the model's metadata (`names`)"),
        (None, true) => {
            notes.push(
                "no class names in the model: records carry class numbers (give --labels)".into(),
            );
            return Ok(Vec::new());
        }
    };
    check_lines(names, from, "class")?;
    if let Some(k) = classes.first()
        && !classes.contains(&(names.len() as u64))
    {
        return Err(GuessError::ClassCount {
            from,
            given: names.len(),
            classes: *k,
        });
    }
    notes.push(format!("class names from {from} ({})", names.len()));
    Ok(names.clone())
}

/// Refuses a name holding a control character (a line break would split it
/// over two lines of labels.txt).
fn check_lines(names: &[String], from: &'static str, what: &'static str) -> Result<(), GuessError> {
    match names
        .iter()
        .enumerate()
        .find(|(_, n)| n.chars().any(char::is_control))
    {
        Some((i, n)) => Err(GuessError::ControlCharacter {
            from,
            what,
            index: i,
            name: n.clone(),
        }),
        None => Ok(()),
    }
}

/// Image preprocessing at `w` x `h`: 0..255 when the graph scales its
/// input itself, else 0..1; ImageNet normalisation for a classifier that
/// does not scale itself.
fn image_pre(
    w: u64,
    h: u64,
    image: &Image,
    facts: &GraphFacts,
    resize: &str,
    detector: bool,
    notes: &mut Vec<String>,
) -> Result<Preprocess, GuessError> {
    let mut v = json!({"type": "image", "width": w, "height": h, "layout": image.layout,
                       "channel_order": "rgb", "resize": resize});
    if facts.scales_itself {
        notes.push("the graph divides its input by 255 itself: 0..255 pixels go in".into());
        v["scale"] = json!(1.0);
    } else if resize == "stretch" && image.layout == "nhwc" && detector {
        notes.push(
            "0..255 pixels: TensorFlow's detection models (channels last) normalise inside \
             the graph (check the model's documentation; `scale = 0.00392156862745098` for 0..1)"
                .into(),
        );
        v["scale"] = json!(1.0);
    } else if !detector {
        notes.push(
            "0..1 pixels normalised with ImageNet's mean and std (torchvision's classifiers)"
                .into(),
        );
        v["scale"] = json!(1.0 / 255.0);
        v["mean"] = json!(IMAGENET_MEAN);
        v["std"] = json!(IMAGENET_STD);
    } else {
        notes.push("0..1 pixels (divided by 255), RGB".into());
        v["scale"] = json!(1.0 / 255.0);
        v["mean"] = json!([0.0, 0.0, 0.0]);
        v["std"] = json!([1.0, 1.0, 1.0]);
    }
    pre(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: DType, shape: &[&str]) -> IoSpec {
        IoSpec {
            name: name.into(),
            dtype,
            shape: shape
                .iter()
                .map(|d| match d.parse::<u64>() {
                    Ok(n) => Dim::Fixed(n),
                    Err(_) => Dim::Symbolic((*d).into()),
                })
                .collect(),
        }
    }

    fn layout_of(g: &Guess) -> String {
        match &g.postprocess {
            Some(Postprocess::Detections(d)) => format!("{:?}", d.layout).to_lowercase(),
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn ultralytics_names_are_read_in_class_order() {
        assert_eq!(
            parse_names("{0: 'person', 1: \"bicycle\", 2: 'traffic light'}"),
            ["person", "bicycle", "traffic light"]
        );
        assert!(parse_names("{1: 'a'}").is_empty());
        assert!(parse_names("nonsense").is_empty());
        // Python's repr: escapes decoded, the other quote inside.
        assert_eq!(
            parse_names(r#"{0: 'cat\ndog', 1: "it's", 2: 'caf\xe9', 3: 'a\\b', 4: '\u00fc'}"#),
            ["cat\ndog", "it's", "café", "a\\b", "ü"]
        );
    }

    fn classifier(k: &str) -> (Vec<IoSpec>, Vec<IoSpec>) {
        (
            vec![spec("x", DType::F32, &["1", "3", "32", "32"])],
            vec![spec("y", DType::F32, &["1", k])],
        )
    }

    #[test]
    fn names_that_would_shift_labels_txt_are_refused() {
        let (i, o) = classifier("3");
        let names = |n: &[&str]| GraphFacts {
            names: n.iter().map(|s| s.to_string()).collect(),
            ..GraphFacts::default()
        };
        let e = guess(
            &i,
            &o,
            &names(&["cat\ndog", "bird", "fish"]),
            &Hints::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("class 0's name \"cat\\ndog\""), "{e}");
        let hints = Hints {
            labels: Some(vec!["a".into(), "b\u{7}".into(), "c".into()]),
            ..Hints::default()
        };
        let e = guess(&i, &o, &GraphFacts::default(), &hints)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--labels: class 1's name"), "{e}");
        let g = guess(&i, &o, &names(&["a b", "é", ""]), &Hints::default()).unwrap();
        assert_eq!(g.labels, ["a b", "é", ""]);
    }

    #[test]
    fn a_class_count_unlike_the_model_s_is_refused_with_both_numbers() {
        let (i, o) = classifier("10");
        let hints = Hints {
            labels: Some((0..1_000_000).map(|n| n.to_string()).collect()),
            ..Hints::default()
        };
        let e = guess(&i, &o, &GraphFacts::default(), &hints)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--labels has 1000000 class names, the model has 10 classes"),
            "{e}"
        );
        // A detector: YOLOv8's 3 classes; an SSD's background may go unnamed.
        let img = [spec("images", DType::F32, &["1", "3", "160", "160"])];
        let three = Hints {
            labels: Some(vec!["a".into(), "b".into(), "c".into()]),
            ..Hints::default()
        };
        let yolo = [spec("o", DType::F32, &["1", "8", "525"])];
        let e = guess(&img, &yolo, &GraphFacts::default(), &three)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("has 3 class names, the model has 4 classes"),
            "{e}"
        );
        let ssd = [
            spec("scores", DType::F32, &["1", "525", "4"]),
            spec("boxes", DType::F32, &["1", "525", "4"]),
        ];
        assert!(guess(&img, &ssd, &GraphFacts::default(), &three).is_ok());
        // A CTC dictionary: the model's classes less the blank and the space.
        let line = [spec("x", DType::F32, &["batch", "3", "48", "width"])];
        let ctc = [spec("y", DType::F32, &["batch", "steps", "6"])];
        let four = Hints {
            labels: Some(vec!["a".into(), "b".into(), "c".into(), "d".into()]),
            ..Hints::default()
        };
        assert!(guess(&line, &ctc, &GraphFacts::default(), &four).is_ok());
        let e = guess(&line, &ctc, &GraphFacts::default(), &three)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("has 3 characters, the model has 6 classes"),
            "{e}"
        );
    }

    #[test]
    fn a_detector_s_auxiliary_outputs_are_left_out_with_their_reason() {
        let img = [spec("images", DType::F32, &["1", "512", "512", "3"])];
        let centernet = [
            spec("wh", DType::F32, &["1", "128", "128", "4"]),
            spec("heatmap", DType::F32, &["1", "128", "128", "80"]),
            spec("detections", DType::F32, &["1", "100", "6"]),
        ];
        let g = guess(&img, &centernet, &GraphFacts::default(), &Hints::default()).unwrap();
        assert_eq!(layout_of(&g), "rows");
        assert_eq!(
            g.postprocess.as_ref().and_then(|p| p.output()),
            Some("detections")
        );
        let left: Vec<&String> = g.notes.iter().filter(|n| n.contains("left out")).collect();
        assert_eq!(left.len(), 2, "{:?}", g.notes);
        assert!(
            left[0].starts_with("output `wh` [1, 128, 128, 4]: 4-D"),
            "{left:?}"
        );
        // Every output is still declared (the manifest must name them all).
        assert_eq!(g.outputs.len(), 3);
        // Two outputs that both fit: --output picks, and without it the
        // refusal names both.
        let img = [spec("images", DType::F32, &["1", "3", "160", "160"])];
        let two = [
            spec("raw", DType::F32, &["1", "7", "525"]),
            spec("final", DType::F32, &["1", "100", "6"]),
        ];
        let e = guess(&img, &two, &GraphFacts::default(), &Hints::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`raw` (yolov8), `final` (rows)"), "{e}");
        let pick = |o: &str| Hints {
            output: Some(o.into()),
            ..Hints::default()
        };
        let g = guess(&img, &two, &GraphFacts::default(), &pick("final")).unwrap();
        assert_eq!(layout_of(&g), "rows");
        assert!(
            g.notes
                .iter()
                .any(|n| n.contains("`raw` [1, 7, 525] left out: it fits the yolov8")),
            "{:?}",
            g.notes
        );
        let e = guess(&img, &two, &GraphFacts::default(), &pick("nope"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--output `nope`: the model has no such output"),
            "{e}"
        );
    }

    #[test]
    fn every_detector_layout_is_recognised_from_its_shapes() {
        let img = [spec("images", DType::F32, &["1", "3", "160", "160"])];
        let f = GraphFacts::default();
        let h = Hints::default();
        let one = |o: IoSpec| guess(&img, &[o], &f, &h).map(|g| layout_of(&g));
        assert_eq!(
            one(spec("o", DType::F32, &["1", "7", "525"])).unwrap(),
            "yolov8"
        );
        assert_eq!(
            one(spec("o", DType::F32, &["1", "525", "8"])).unwrap(),
            "yolox"
        );
        assert_eq!(
            one(spec("o", DType::F32, &["1", "1575", "8"])).unwrap(),
            "yolov5"
        );
        assert_eq!(
            one(spec("o", DType::F32, &["1", "100", "6"])).unwrap(),
            "rows"
        );
        let two = |a: IoSpec, b: IoSpec| guess(&img, &[a, b], &f, &h).map(|g| layout_of(&g));
        assert_eq!(
            two(
                spec("pred_logits", DType::F32, &["1", "20", "4"]),
                spec("pred_boxes", DType::F32, &["1", "20", "4"])
            )
            .unwrap(),
            "detr"
        );
        assert_eq!(
            two(
                spec("logits", DType::F32, &["1", "20", "3"]),
                spec("boxes", DType::F32, &["1", "20", "4"])
            )
            .unwrap(),
            "rtdetr"
        );
        assert_eq!(
            two(
                spec("scores", DType::F32, &["1", "525", "4"]),
                spec("boxes", DType::F32, &["1", "525", "4"])
            )
            .unwrap(),
            "ssd"
        );
        let e = one(spec("o", DType::F32, &["1", "33", "9"])).unwrap_err();
        assert!(
            matches!(e, GuessError::Detector(NoFit::UnknownLayout { .. })),
            "{e:?}"
        );
        assert!(e.to_string().contains("not a detector layout"), "{e}");
    }

    #[test]
    fn a_classifier_a_vad_and_the_refusals_say_why() {
        let f = GraphFacts {
            softmaxed: vec!["prob".into()],
            ..GraphFacts::default()
        };
        let g = guess(
            &[spec("x", DType::F32, &["batch", "3", "224", "224"])],
            &[spec("prob", DType::F32, &["batch", "1000"])],
            &f,
            &Hints::default(),
        )
        .unwrap();
        assert!(g.kind.contains("classifier of 1000"), "{g:?}");
        assert!(g.notes.iter().any(|n| n.contains("already probabilities")));
        let g = guess(
            &[
                spec("input", DType::F32, &["batch", "samples"]),
                spec("state", DType::F32, &["2", "batch", "128"]),
                spec("sr", DType::I64, &[]),
            ],
            &[
                spec("output", DType::F32, &["batch", "1"]),
                spec("stateN", DType::F32, &["2", "batch", "128"]),
            ],
            &GraphFacts::default(),
            &Hints::default(),
        )
        .unwrap();
        assert_eq!(g.state[0].input, "state");
        assert_eq!(g.inputs[2].fill, Some(16000.0));
        let e = guess(
            &[spec("tokens", DType::I64, &["batch", "seq"])],
            &[spec("logits", DType::F32, &["batch", "seq", "50000"])],
            &GraphFacts::default(),
            &Hints::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("no single image input"), "{e}");
        let e = guess(
            &[spec("x", DType::F32, &["batch", "3", "48", "width"])],
            &[spec("y", DType::F32, &["batch", "steps", "6625"])],
            &GraphFacts::default(),
            &Hints::default(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("--labels"), "{e}");
    }
}
