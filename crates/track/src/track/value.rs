//! Between a frame's postprocessed value and the tracker: the boxes it
//! holds (`detections` from the `detections` postprocess, `boxes` from MTCNN,
//! text boxes and stages), and the track ids written back into them.

use serde_json::Value;

use super::tracker::{Detection, FrameOutput};

/// The keys a frame's boxes may be under, in the order they are looked for.
pub const BOX_KEYS: [&str; 2] = ["detections", "boxes"];

/// A frame's detections, and for each the index of its entry in the list
/// (entries without a usable `box` are skipped). Entries without `label`
/// take their `class` as a label, else `default_label`.
pub fn detections(v: &Value, default_label: &str) -> (Vec<Detection>, Vec<usize>) {
    let Some(list) = BOX_KEYS
        .iter()
        .find_map(|k| v.get(*k).and_then(Value::as_array))
    else {
        return (Vec::new(), Vec::new());
    };
    let mut dets = Vec::with_capacity(list.len());
    let mut at = Vec::with_capacity(list.len());
    for (i, e) in list.iter().enumerate() {
        let Some(b) = e.get("box").and_then(Value::as_array) else {
            continue;
        };
        if b.len() != 4 {
            continue;
        }
        let mut bbox = [0f32; 4];
        let mut ok = true;
        for (o, x) in bbox.iter_mut().zip(b) {
            match x.as_f64() {
                Some(f) if f.is_finite() => *o = f as f32,
                _ => ok = false,
            }
        }
        if !ok {
            continue;
        }
        let score = e.get("score").and_then(Value::as_f64).unwrap_or(1.0) as f32;
        let label = match (e.get("label"), e.get("class")) {
            (Some(Value::String(s)), _) => s.clone(),
            (_, Some(c)) if c.is_u64() => c.to_string(),
            _ => default_label.to_string(),
        };
        let text = e.get("text").and_then(Value::as_str).map(|t| {
            let s = e.get("text_score").and_then(Value::as_f64).unwrap_or(1.0) as f32;
            (t.to_string(), s)
        });
        dets.push(Detection {
            bbox,
            score,
            label,
            text,
        });
        at.push(i);
    }
    (dets, at)
}

/// Writes each tracked box's `track` id (and `stationary` when it is) into
/// the value's list; `at` is what [`detections`] returned with them.
pub fn annotate(v: &mut Value, at: &[usize], out: &FrameOutput) {
    let Some(key) = BOX_KEYS
        .into_iter()
        .find(|k| v.get(*k).is_some_and(Value::is_array))
    else {
        return;
    };
    let Some(list) = v.get_mut(key).and_then(Value::as_array_mut) else {
        return;
    };
    for (i, t) in at.iter().zip(&out.objects) {
        let (Some(id), Some(Value::Object(o))) = (&t.track, list.get_mut(*i)) else {
            continue;
        };
        o.insert("track".into(), Value::String(id.to_string()));
        if t.stationary {
            o.insert("stationary".into(), Value::Bool(true));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::track::tracker::Tracked;
    use serde_json::json;

    #[test]
    fn reads_both_layouts_and_skips_bad_entries() {
        let v = json!({"detections": [
            {"box": [0, 0, 10, 10], "score": 0.9, "class": 2, "label": "car"},
            {"box": [0, 0, 10], "score": 0.9},
            {"box": [1, 1, 5, 5], "class": 7},
        ]});
        let (d, at) = detections(&v, "object");
        assert_eq!(at, vec![0, 2]);
        assert_eq!(d[0].label, "car");
        assert_eq!(d[1].label, "7");
        assert_eq!(d[1].score, 1.0);
        let v = json!({"boxes": [{"box": [0, 0, 4, 2], "score": 0.5, "text": "AB12", "text_score": 0.8}]});
        let (d, _) = detections(&v, "plate");
        assert_eq!(d[0].label, "plate");
        assert_eq!(d[0].text, Some(("AB12".into(), 0.8)));
        assert!(detections(&json!({"other": 1}), "x").0.is_empty());
    }

    #[test]
    fn writes_track_ids_back() {
        let mut v = json!({"boxes": [{"box": [0, 0, 4, 2]}, {"nobox": 1}, {"box": [5, 5, 9, 9]}]});
        let (_, at) = detections(&v, "x");
        let out = FrameOutput {
            objects: vec![
                Tracked {
                    track: Some("d/p/s/1".into()),
                    stationary: true,
                    ..Tracked::default()
                },
                Tracked::default(),
            ],
            ..FrameOutput::default()
        };
        annotate(&mut v, &at, &out);
        assert_eq!(v["boxes"][0]["track"], "d/p/s/1");
        assert_eq!(v["boxes"][0]["stationary"], true);
        assert!(v["boxes"][2].get("track").is_none());
    }
}
