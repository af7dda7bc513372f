use std::sync::Arc;

use serde_json::json;

use super::*;

fn frame(w: u32, h: u32, square: Option<(u32, u32)>) -> Vec<u8> {
    let mut f = vec![70u8; (w * h * 3) as usize];
    if let Some((x, y)) = square {
        for r in y..y + 30 {
            for c in x..x + 30 {
                let at = ((r * w + c) * 3) as usize;
                f[at..at + 3].copy_from_slice(&[230, 220, 210]);
            }
        }
    }
    f
}

#[test]
fn a_still_frame_carries_the_latest_detections_and_a_mover_runs_the_detector() {
    let gate = MotionGate::new(MotionConfig::default(), (512, 512));
    let cam = MotionCounts::default();
    let s: Arc<str> = Arc::from("gate");
    let raw = RawImage::rgb(640, 480);
    let still = frame(640, 480, None);
    // First frame: no background, nothing to carry.
    assert_eq!(gate.decide(&s, &still, raw, &[], Some(&cam)), Decision::Run);
    // Still, but nothing was remembered yet: the detector runs.
    assert_eq!(gate.decide(&s, &still, raw, &[], Some(&cam)), Decision::Run);
    let dets = json!({"detections": [{"box": [1.0, 2.0, 30.0, 40.0], "label": "car"}]});
    gate.remember("gate", &dets);
    match gate.decide(&s, &still, raw, &[], Some(&cam)) {
        Decision::Still(v) => {
            assert_eq!(v["detections"], dets["detections"]);
            assert_eq!(v["motion"], "still");
        }
        other => panic!("{other:?}"),
    }
    // A track that moved at the latest frame keeps the detector running.
    assert_eq!(
        gate.decide(&s, &still, raw, &[[1.0, 2.0, 30.0, 40.0]], Some(&cam)),
        Decision::Run
    );
    assert_eq!(
        gate.decide(&s, &frame(640, 480, Some((300, 200))), raw, &[], Some(&cam)),
        Decision::Run
    );
    let r = gate.counts.report();
    assert_eq!((r.frames_still, r.detector_runs, r.regions), (1, 4, 0));
    assert_eq!(cam.report(), r);
    // Another stream has its own background.
    let t: Arc<str> = Arc::from("yard");
    assert_eq!(gate.decide(&t, &still, raw, &[], None), Decision::Run);
    gate.reset("gate");
    assert_eq!(gate.decide(&s, &still, raw, &[], None), Decision::Run);
}

#[test]
fn with_regions_a_mover_gets_a_crop_of_the_input_aspect() {
    let cfg = MotionConfig {
        regions: true,
        ..MotionConfig::default()
    };
    let gate = MotionGate::new(cfg, (320, 320));
    let s: Arc<str> = Arc::from("c");
    let raw = RawImage::rgb(1280, 720);
    gate.decide(&s, &frame(1280, 720, None), raw, &[], None);
    gate.remember("c", &json!({"detections": []}));
    match gate.decide(&s, &frame(1280, 720, Some((1000, 600))), raw, &[], None) {
        Decision::Regions(r) => {
            assert_eq!(r.len(), 1, "{r:?}");
            let [x0, y0, x1, y1] = r[0];
            assert_eq!((x1 - x0, y1 - y0), (320, 320));
            assert!(x0 <= 1000 && x1 >= 1030 && y0 <= 600 && y1 >= 630, "{r:?}");
        }
        other => panic!("{other:?}"),
    }
    // A moving track elsewhere adds its own crop.
    match gate.decide(
        &s,
        &frame(1280, 720, Some((1000, 600))),
        raw,
        &[[10.0, 10.0, 60.0, 80.0]],
        None,
    ) {
        Decision::Regions(r) => assert_eq!(r.len(), 2, "{r:?}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(gate.counts.report().regions, 3);
}

#[test]
fn region_results_are_mapped_back_to_the_frame() {
    let a = json!({"detections": [{"box": [1.0, 2.0, 3.0, 4.0], "label": "person"}]});
    let b = json!({"detections": [{"box": [0.0, 0.0, 10.0, 10.0], "label": "car"}]});
    let v = merge_regions(vec![a, b], &[[100.0, 50.0], [0.0, 200.0]]);
    assert_eq!(v["detections"][0]["box"], json!([101.0, 52.0, 103.0, 54.0]));
    assert_eq!(v["detections"][1]["box"], json!([0.0, 200.0, 10.0, 210.0]));
    assert_eq!(v["detections"][1]["label"], "car");
}

#[test]
fn every_bad_key_is_named() {
    let cfg: MotionConfig = toml::from_str(
        "frame_height = 4\nthreshold = 0\nalpha = 1.5\nmax_regions = 0\nmask = [[0, 0], [1, 1]]",
    )
    .unwrap();
    let p = cfg.validate("pipelines[0].motion");
    for key in [
        "frame_height",
        "threshold",
        "alpha",
        "max_regions",
        "mask[0]",
    ] {
        assert!(
            p.iter()
                .any(|e| e.starts_with(&format!("pipelines[0].motion.{key}: "))),
            "{key}: {p:?}"
        );
    }
    let many: MotionConfig =
        toml::from_str("mask = [[[0, 0], [10, 0], [10, 10]], [[20, 20], [30, 20], [30, 30]]]")
            .unwrap();
    assert_eq!(many.mask.polygons().len(), 2);
    assert!(many.validate("m").is_empty());
    assert!(MotionConfig::gates(None, true, true));
    assert!(!MotionConfig::gates(None, false, true));
    assert!(!MotionConfig::gates(None, true, false));
    let off = MotionConfig {
        enabled: Some(false),
        ..MotionConfig::default()
    };
    assert!(!MotionConfig::gates(Some(&off), true, true));
    let on = MotionConfig {
        enabled: Some(true),
        ..MotionConfig::default()
    };
    assert!(MotionConfig::gates(Some(&on), true, false));
    assert!(!MotionConfig::gates(Some(&on), false, true));
}
