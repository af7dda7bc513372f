//! A detector's layout from its outputs. Real exports often carry outputs
//! beside the one a layout reads (a CenterNet's heatmap and box sizes,
//! a segmenter's mask prototypes, features): each output, and each pair of
//! boxes beside scores, is tried; the one that fits is read, every other
//! output is named in the notes with why it is left out, and where
//! several fit, `--output` picks (the manifest's `[postprocess] output`
//! names it).

use serde_json::{Value, json};

use super::{
    GraphFacts, Guess, GuessError, Hints, IOU, Image, MAX_DETECTIONS, SCORE, STRIDES, class_names,
    fixed, image_pre, list, post, size,
};
use crate::backend::IoSpec;

/// A detector layout one output, or a pair of boxes and scores, fits.
#[derive(Debug, Clone)]
struct Fit {
    layout: &'static str,
    /// The class counts the output allows (empty: the `rows` layout, whose
    /// classes are numbers inside the rows).
    classes: Vec<u64>,
    /// Keys of the postprocess beyond the common ones.
    extra: Value,
    /// The output the postprocess reads (of a pair, the scores).
    output: String,
    /// Every output it reads.
    reads: Vec<String>,
    /// Why this layout, in words.
    note: String,
}

fn dims(o: &IoSpec) -> Vec<Option<u64>> {
    o.shape.iter().map(fixed).collect()
}

/// Why the outputs fit no detector layout (or more than one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoFit {
    #[error(
        "output `{output}` {shape}: {dims}-D, not a detector's [1, N, values] (an auxiliary \
         output: a heatmap, mask prototypes or features)"
    )]
    NotRows {
        output: String,
        shape: String,
        dims: usize,
    },
    #[error("output `{output}` {shape}: a detector's rows need fixed sizes")]
    FreeRows { output: String, shape: String },
    #[error(
        "output `{output}` {shape}: not a detector layout outpost knows (YOLOv5/v8/11, YOLOX, \
         rows of x1, y1, x2, y2, score, class); {w}x{h} has {grid} grid cells"
    )]
    UnknownLayout {
        output: String,
        shape: String,
        w: u64,
        h: u64,
        grid: u64,
    },
    #[error("two outputs, {a} and {b}: not boxes [1, N, 4] beside scores [1, N, C]")]
    NotAPair { a: String, b: String },
    #[error("a detector's scores need fixed sizes")]
    FreeScores,
    #[error("--output `{name}`: the model has no such output (its outputs are {outputs})")]
    NoSuchOutput { name: String, outputs: String },
    #[error("--output `{name}`: {}", why.as_ref().map_or("it fits no detector layout outpost knows".to_string(), |w| w.to_string()))]
    OutputFitsNone {
        name: String,
        why: Option<Box<NoFit>>,
    },
    #[error(
        "outputs {outputs}: no classifier, detector, text or face layout outpost knows ({}); \
         write the manifest by hand",
        why.iter().map(|w| w.to_string()).collect::<Vec<_>>().join("; ")
    )]
    NoLayout { outputs: String, why: Vec<NoFit> },
    #[error(
        "several outputs fit a detector layout: {0}; give --output NAME to pick the one to read"
    )]
    Several(String),
}

/// The layout one output fits alone, or why it fits none.
fn one(o: &IoSpec, w: u64, h: u64, grid: u64, facts: &GraphFacts) -> Result<Fit, NoFit> {
    if o.shape.len() != 3 {
        return Err(NoFit::NotRows {
            output: o.name.clone(),
            shape: o.shape_string(),
            dims: o.shape.len(),
        });
    }
    let d = dims(o);
    let (Some(a), Some(b)) = (d[1], d[2]) else {
        return Err(NoFit::FreeRows {
            output: o.name.clone(),
            shape: o.shape_string(),
        });
    };
    let fit = |layout, classes: Vec<u64>, extra, note| Fit {
        layout,
        classes,
        extra,
        output: o.name.clone(),
        reads: vec![o.name.clone()],
        note,
    };
    if a < b && a > 4 {
        Ok(fit(
            "yolov8",
            vec![a - 4],
            json!({}),
            format!(
                "output `{}` [1, {a}, {b}]: channels first, 4 box numbers and {} class scores \
                 per anchor: an Ultralytics YOLOv8 / YOLO11 export",
                o.name,
                a - 4
            ),
        ))
    } else if b > 5 && facts.ultralytics {
        Ok(fit(
            "yolov5",
            vec![b - 5],
            json!({}),
            format!(
                "output `{}` [1, {a}, {b}]: a row per anchor, objectness and {} class scores, \
                 in an Ultralytics export (its metadata): a YOLOv5 export",
                o.name,
                b - 5
            ),
        ))
    } else if b > 5 && a == grid {
        Ok(fit(
            "yolox",
            vec![b - 5],
            json!({"input_size": [w, h]}),
            format!(
                "output `{}` [1, {a}, {b}]: one row per cell of the stride 8/16/32 grids of \
                 {w}x{h} ({grid}), raw: a YOLOX export",
                o.name
            ),
        ))
    } else if b > 5 && a == 3 * grid {
        Ok(fit(
            "yolov5",
            vec![b - 5],
            json!({}),
            format!(
                "output `{}` [1, {a}, {b}]: three anchors per grid cell of {w}x{h} ({}), \
                 objectness and {} class scores: an Ultralytics YOLOv5 export",
                o.name,
                3 * grid,
                b - 5
            ),
        ))
    } else if (6..=7).contains(&b) && a <= 1000 {
        Ok(fit(
            "rows",
            Vec::new(),
            json!({}),
            format!(
                "output `{}` [1, {a}, {b}]: at most {a} finished detections, each x1, y1, x2, \
                 y2, score, class",
                o.name
            ),
        ))
    } else {
        Err(NoFit::UnknownLayout {
            output: o.name.clone(),
            shape: o.shape_string(),
            w,
            h,
            grid,
        })
    }
}

/// The layout a pair of outputs fits as boxes `[1, N, 4]` beside scores
/// `[1, N, C]` (DETR, RT-DETR, SSD), or why not.
fn pair(a: &IoSpec, b: &IoSpec, w: u64, h: u64) -> Result<Fit, NoFit> {
    let not_a_pair = || NoFit::NotAPair {
        a: format!("`{}` {}", a.name, a.shape_string()),
        b: format!("`{}` {}", b.name, b.shape_string()),
    };
    if a.shape.len() != 3 || b.shape.len() != 3 {
        return Err(not_a_pair());
    }
    // The boxes by name where one says so (a detector of three classes and
    // a background has scores [1, N, 4] too).
    let is_box = |o: &IoSpec| o.name.to_lowercase().contains("box");
    let (boxes, scores) = match (is_box(a), is_box(b)) {
        (true, false) => (a, b),
        (false, true) => (b, a),
        _ if dims(a).get(2) == Some(&Some(4)) => (a, b),
        _ => (b, a),
    };
    let ds = dims(scores);
    let (Some(n), Some(k)) = (ds[1], ds[2]) else {
        return Err(NoFit::FreeScores);
    };
    if dims(boxes).get(2) != Some(&Some(4)) || dims(boxes).get(1) != Some(&Some(n)) {
        return Err(not_a_pair());
    }
    let q = json!({"boxes_output": boxes.name, "input_size": [w, h]});
    let fit = |layout, classes: Vec<u64>, extra, note| Fit {
        layout,
        classes,
        extra,
        output: scores.name.clone(),
        reads: vec![scores.name.clone(), boxes.name.clone()],
        note,
    };
    Ok(if scores.name.starts_with("pred_") {
        fit(
            "detr",
            vec![k - 1],
            q,
            format!(
                "`{}` [1, {n}, {k}] and `{}` [1, {n}, 4]: DETR's queries (its last class is \
                 \"no object\", boxes centre and size as fractions)",
                scores.name, boxes.name
            ),
        )
    } else if scores.name.contains("logit") {
        fit(
            "rtdetr",
            vec![k],
            q,
            format!(
                "`{}` [1, {n}, {k}] logits and `{}` [1, {n}, 4]: RT-DETR's queries (sigmoid \
                 scores, boxes centre and size as fractions)",
                scores.name, boxes.name
            ),
        )
    } else {
        let mut q = q;
        q["normalized"] = json!(true);
        q["format"] = json!("yxyx");
        q["background_class"] = json!(0);
        // Class 0 is the background: named, or left for outpost to name.
        fit(
            "ssd",
            vec![k, k - 1],
            q,
            format!(
                "`{}` [1, {n}, {k}] and `{}` [1, {n}, 4]: an SSD's priors (class 0 the \
                 background; boxes y1, x1, y2, x2 as fractions, TensorFlow's order)",
                scores.name, boxes.name
            ),
        )
    })
}

/// The one layout to read: a pair of boxes and scores before a single
/// output (it reads more of what the model gives), `hint` (`--output`)
/// where several fit. Notes say which outputs are left out and why.
fn choose(
    outputs: &[IoSpec],
    w: u64,
    h: u64,
    grid: u64,
    facts: &GraphFacts,
    hint: Option<&str>,
    notes: &mut Vec<String>,
) -> Result<Fit, NoFit> {
    if let Some(name) = hint
        && !outputs.iter().any(|o| o.name == name)
    {
        return Err(NoFit::NoSuchOutput {
            name: name.to_string(),
            outputs: list(outputs),
        });
    }
    let singles: Vec<Result<Fit, NoFit>> =
        outputs.iter().map(|o| one(o, w, h, grid, facts)).collect();
    let mut pairs = Vec::new();
    let mut pair_error = None;
    for (i, a) in outputs.iter().enumerate() {
        for b in &outputs[i + 1..] {
            match pair(a, b, w, h) {
                Ok(f) => pairs.push(f),
                Err(e) => pair_error = pair_error.or(Some(e)),
            }
        }
    }
    let mut fits: Vec<Fit> = if pairs.is_empty() {
        singles
            .iter()
            .filter_map(|r| r.as_ref().ok())
            .cloned()
            .collect()
    } else {
        pairs
    };
    if let Some(name) = hint {
        fits.retain(|f| f.reads.iter().any(|r| r == name));
        if fits.is_empty() {
            let why = outputs
                .iter()
                .zip(&singles)
                .find(|(o, _)| o.name == name)
                .and_then(|(_, r)| r.as_ref().err().cloned());
            return Err(NoFit::OutputFitsNone {
                name: name.to_string(),
                why: why.map(Box::new),
            });
        }
    }
    let fit = match (fits.len(), outputs) {
        (1, _) => fits.remove(0),
        // Alone, an output's own reason; two 3-D outputs, the pair's.
        (0, [_] | [_, _]) if outputs.iter().all(|o| o.shape.len() == 3) => {
            return Err(match (outputs, &singles[..], pair_error) {
                ([_], [Err(e)], _) => e.clone(),
                (_, _, Some(e)) => e,
                (_, _, None) => NoFit::NoLayout {
                    outputs: list(outputs),
                    why: Vec::new(),
                },
            });
        }
        (0, _) => {
            let why: Vec<NoFit> = singles
                .iter()
                .filter_map(|r| r.as_ref().err())
                .cloned()
                .collect();
            return Err(NoFit::NoLayout {
                outputs: list(outputs),
                why,
            });
        }
        _ => {
            return Err(NoFit::Several(
                fits.iter()
                    .map(|f| format!("`{}` ({})", f.output, f.layout))
                    .collect::<Vec<_>>()
                    .join(", "),
            ));
        }
    };
    notes.push(fit.note.clone());
    for (o, r) in outputs.iter().zip(&singles) {
        if fit.reads.contains(&o.name) {
            continue;
        }
        notes.push(match r {
            Ok(other) => format!(
                "output `{}` {} left out: it fits the {} layout too (`--output {}` reads it \
                 instead)",
                o.name,
                o.shape_string(),
                other.layout,
                o.name
            ),
            Err(why) => format!("{why}: left out"),
        });
    }
    if hint.is_some() {
        notes.push(format!("`{}` read as --output asked", fit.output));
    }
    Ok(fit)
}

/// An object detector: its layout from its outputs, class names, NMS
/// defaults and the preprocessing its export needs.
pub(super) fn detector(
    image: &Image,
    outputs: &[IoSpec],
    facts: &GraphFacts,
    hints: &Hints,
    notes: &mut Vec<String>,
    mut g: Guess,
) -> Result<Guess, GuessError> {
    let (w, h) = size(image, (640, 640), notes);
    let grid: u64 = STRIDES.iter().map(|s| (w / s) * (h / s)).sum();
    let fit = choose(outputs, w, h, grid, facts, hints.output.as_deref(), notes)?;
    let layout = fit.layout;
    // TensorFlow exports (channels last) stretch their input; the
    // PyTorch ones keep the aspect ratio (Ultralytics, YOLOX: letterbox).
    let resize = if image.layout == "nhwc" {
        "stretch"
    } else {
        "letterbox"
    };
    notes.push(format!(
        "{resize}ed to {w}x{h} ({})",
        if resize == "stretch" {
            "a channels-last export: TensorFlow's detectors stretch"
        } else {
            "a channels-first export keeps the aspect ratio"
        }
    ));
    let mut names = class_names(&fit.classes, facts, hints, notes)?;
    if layout == "ssd"
        && !names.is_empty()
        && fit.classes.first() == Some(&(names.len() as u64 + 1))
    {
        names.insert(0, "background".into());
    }
    let mut p = json!({"type": "detections", "layout": layout, "output": fit.output,
        "score_threshold": SCORE, "iou_threshold": IOU, "max_detections": MAX_DETECTIONS});
    if let (Some(a), Some(b)) = (p.as_object_mut(), fit.extra.as_object()) {
        a.extend(b.clone());
    }
    if !names.is_empty() {
        p["class_names"] = json!(names);
    }
    notes.push(format!(
        "score threshold {SCORE}, class-wise NMS at IoU {IOU}, at most {MAX_DETECTIONS} boxes"
    ));
    g.kind = format!("an object detector ({layout} layout)");
    g.preprocess = Some(image_pre(w, h, image, facts, resize, true, notes)?);
    g.postprocess = Some(post(p)?);
    Ok(g)
}
