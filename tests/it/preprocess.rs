//! Decoders against real files: PNG and JPEG written by the image crate to a
//! temporary folder, the models' own manifests, and the PP-OCR detector's
//! reference output (a synthetic image with three text lines).

use image::{ImageEncoder, RgbImage};
use outpost::backend::Tensor;
use outpost::model::manifest::Manifest;
use outpost::postprocess::PostprocessConfig;
use outpost::preprocess::{ItemMeta, PreprocessConfig};

use crate::common::model_dir;

fn image_config(extra: &str) -> PreprocessConfig {
    let c: PreprocessConfig = toml::from_str(&format!("type = \"image\"\n{extra}")).unwrap();
    assert!(c.validate().is_empty(), "{:?}", c.validate());
    c
}

/// 320x240: left half red (255, 0, 0), right half blue (0, 0, 255), a green
/// 40x40 square with its top-left corner at (200, 100).
fn scene() -> RgbImage {
    RgbImage::from_fn(320, 240, |x, y| {
        if (200..240).contains(&x) && (100..140).contains(&y) {
            image::Rgb([0, 255, 0])
        } else if x < 160 {
            image::Rgb([255, 0, 0])
        } else {
            image::Rgb([0, 0, 255])
        }
    })
}

fn write_files(dir: &std::path::Path) -> (Vec<u8>, Vec<u8>) {
    let img = scene();
    let png_path = dir.join("scene.png");
    let jpg_path = dir.join("scene.jpg");
    let mut f = std::fs::File::create(&png_path).unwrap();
    image::codecs::png::PngEncoder::new(&mut f)
        .write_image(img.as_raw(), 320, 240, image::ExtendedColorType::Rgb8)
        .unwrap();
    let mut f = std::fs::File::create(&jpg_path).unwrap();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut f, 95)
        .write_image(img.as_raw(), 320, 240, image::ExtendedColorType::Rgb8)
        .unwrap();
    (
        std::fs::read(png_path).unwrap(),
        std::fs::read(jpg_path).unwrap(),
    )
}

/// Value of channel `c` at model pixel (x, y) of an NCHW tensor.
fn at(t: &Tensor, c: usize, x: usize, y: usize) -> f64 {
    let s = t.shape();
    t.to_f64_vec()[c * s[2] * s[3] + y * s[3] + x]
}

#[test]
fn png_and_jpeg_files_decode_to_normalized_nchw() {
    let dir = tempfile::tempdir().unwrap();
    let (png, jpg) = write_files(dir.path());
    // The classifier's own manifest: 224x224, ImageNet mean/std, RGB, NCHW.
    let m = Manifest::load(&model_dir().join("classifier/manifest.toml")).unwrap();
    let cfg = m.preprocess.clone().unwrap();
    let mut pre = cfg.build();
    let norm = |v: f64, c: usize| {
        let (mean, std) = ([0.485, 0.456, 0.406][c], [0.229, 0.224, 0.225][c]);
        (v / 255.0 - mean) / std
    };
    for (bytes, tol) in [(&png, 1e-4), (&jpg, 0.1)] {
        let items = pre.process("cam", bytes).unwrap();
        assert_eq!(items.len(), 1);
        let t = &items[0].tensor;
        assert_eq!(t.shape(), &[1, 3, 224, 224]);
        // Far inside the red half, the blue half and the green square.
        for (x, y, rgb) in [
            (30, 30, [255.0, 0.0, 0.0]),
            (200, 200, [0.0, 0.0, 255.0]),
            (154, 112, [0.0, 255.0, 0.0]),
        ] {
            for (c, v) in rgb.into_iter().enumerate() {
                let got = at(t, c, x, y);
                assert!(
                    (got - norm(v, c)).abs() < tol,
                    "({x},{y}) c{c}: {got} vs {}",
                    norm(v, c)
                );
            }
        }
        let tr = items[0].meta.image.unwrap();
        assert_eq!((tr.orig_width, tr.orig_height), (320, 240));
        assert_eq!((tr.scale_x, tr.scale_y), (0.7, 224.0 / 240.0));
    }
    // Truncated copies of the same files are refused, never decoded into grey.
    for bytes in [&png, &jpg] {
        assert!(pre.process("cam", &bytes[..bytes.len() * 2 / 3]).is_err());
    }
}

#[test]
fn letterbox_maps_a_known_point_back() {
    let dir = tempfile::tempdir().unwrap();
    let (png, _) = write_files(dir.path());
    // 320x240 into 160x160: scale 0.5, 160x120 image, 20 rows of padding above.
    let mut pre =
        image_config("width = 160\nheight = 160\nresize = \"letterbox\"\npad_value = 0").build();
    let items = pre.process("cam", &png).unwrap();
    let t = &items[0].tensor;
    let tr = items[0].meta.image.unwrap();
    assert_eq!(
        (tr.scale_x, tr.scale_y, tr.pad_x, tr.pad_y),
        (0.5, 0.5, 0.0, 20.0)
    );
    // The green square's corner (200, 100) lands at model (100, 70)...
    assert_eq!(tr.to_model(200.0, 100.0), (100.0, 70.0));
    assert_eq!(tr.to_original(100.0, 70.0), (200.0, 100.0));
    // ...and the model tensor really is green just inside it, padding above.
    assert!(at(t, 1, 105, 75) > 0.95 && at(t, 0, 105, 75) < 0.05);
    assert_eq!(at(t, 0, 80, 5), 0.0);
    assert_eq!(at(t, 0, 10, 30), 1.0);
}

#[test]
fn text_boxes_find_the_three_reference_lines() {
    let m = Manifest::load(&model_dir().join("ppocr_det/manifest.toml")).unwrap();
    let cfg: PostprocessConfig = m.postprocess.clone().unwrap();
    assert!(cfg.validate().is_empty());
    let map = Tensor::read_npy(&model_dir().join("ppocr_det/ref/out/sigmoid_0.tmp_0.npy")).unwrap();
    assert_eq!(map.shape(), &[1, 1, 96, 160]);
    let mut post = cfg.build(&model_dir().join("ppocr_det")).unwrap();
    let outputs = vec![(cfg.output().unwrap().to_string(), map)];
    let r = post
        .process("doc", &ItemMeta::default(), &outputs)
        .unwrap()
        .unwrap();
    let boxes = r["boxes"].as_array().unwrap();
    assert_eq!(boxes.len(), 3, "{r}");
    let b: Vec<Vec<f64>> = boxes
        .iter()
        .map(|b| {
            b["box"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect()
        })
        .collect();
    for (i, w) in b.windows(2).enumerate() {
        // Stacked: each line lies wholly below the one before.
        assert!(
            w[0][3] <= w[1][1] + 1.0,
            "line {i} {:?} overlaps line {} {:?}",
            w[0],
            i + 1,
            w[1]
        );
    }
    for bx in &b {
        // Lines are wide and short, and lie inside the 160x96 map.
        assert!(bx[2] - bx[0] > 3.0 * (bx[3] - bx[1]), "{bx:?}");
        assert!(bx[0] >= 0.0 && bx[1] >= 0.0 && bx[2] <= 160.0 && bx[3] <= 96.0);
    }
    for s in boxes.iter().map(|b| b["score"].as_f64().unwrap()) {
        assert!(s >= 0.5, "{r}");
    }
}

#[test]
fn ppocr_cls_reference_output_is_read_as_probabilities() {
    let m = Manifest::load(&model_dir().join("ppocr_cls/manifest.toml")).unwrap();
    let cfg = m.postprocess.clone().unwrap();
    let mut post = cfg.build(&model_dir().join("ppocr_cls")).unwrap();
    let name = cfg.output().unwrap();
    let probs =
        Tensor::read_npy(&model_dir().join("ppocr_cls/ref/out/save_infer_model_scale_0.tmp_1.npy"))
            .unwrap();
    let expected = probs.to_f64_vec();
    let r = post
        .process("line", &ItemMeta::default(), &[(name.to_string(), probs)])
        .unwrap()
        .unwrap();
    // Upright synthetic line: angle 0, score the model's own probability.
    assert_eq!(r["angle"], 0, "{r}");
    assert!((r["angle_score"].as_f64().unwrap() - expected[0]).abs() < 1e-6);
}

#[test]
fn every_model_manifest_preprocess_and_postprocess_validate_and_build() {
    for name in [
        "silero_vad",
        "ppocr_det",
        "ppocr_cls",
        "ppocr_rec",
        "mtcnn_pnet",
        "mtcnn_rnet",
        "mtcnn_onet",
        "coco_det",
        "classifier",
        "sensor_mlp",
    ] {
        let m = Manifest::load(&model_dir().join(name).join("manifest.toml")).unwrap();
        let pre = m.preprocess.clone().unwrap();
        assert!(pre.validate().is_empty(), "{name}: {:?}", pre.validate());
        let post = m.postprocess.clone().unwrap();
        assert!(post.validate().is_empty(), "{name}: {:?}", post.validate());
        let _ = pre.build();
        post.build(&model_dir().join(name)).unwrap();
    }
}
