//! Where the detector runs when only parts of a frame move
//! (`regions = true`): the moving boxes grown to the model's input aspect
//! (and at least its size, so a crop is never enlarged), merged while they
//! overlap, and cut out of the decoded frame at full resolution. No I/O.

use crate::preprocess::raw::{RawFormat, RawImage};

/// The crops to run the detector on, `[x0, y0, x1, y1]` in source pixels
/// (even corners, so an I420 frame's chroma is cut on its own grid); `None`
/// when the whole frame is the better run: more than `max` crops, or one
/// that is the whole frame anyway.
pub fn plan(
    boxes: &[[u32; 4]],
    frame: (u32, u32),
    input: (u32, u32),
    max: usize,
) -> Option<Vec<[u32; 4]>> {
    if boxes.is_empty() || frame.0 < 2 || frame.1 < 2 {
        return None;
    }
    let mut regions: Vec<[u32; 4]> = boxes.iter().map(|b| grow(*b, frame, input)).collect();
    loop {
        let mut joined = false;
        let mut i = 0;
        while i < regions.len() {
            let mut j = i + 1;
            while j < regions.len() {
                if overlap(&regions[i], &regions[j]) {
                    let b = regions.swap_remove(j);
                    let a = regions[i];
                    regions[i] = grow(
                        [
                            a[0].min(b[0]),
                            a[1].min(b[1]),
                            a[2].max(b[2]),
                            a[3].max(b[3]),
                        ],
                        frame,
                        input,
                    );
                    joined = true;
                } else {
                    j += 1;
                }
            }
            i += 1;
        }
        if !joined {
            break;
        }
    }
    let whole = |r: &[u32; 4]| r[2] - r[0] >= frame.0 - 1 && r[3] - r[1] >= frame.1 - 1;
    if regions.len() > max || regions.iter().any(whole) {
        return None;
    }
    regions.sort_unstable();
    Some(regions)
}

fn overlap(a: &[u32; 4], b: &[u32; 4]) -> bool {
    a[0] < b[2] && b[0] < a[2] && a[1] < b[3] && b[1] < a[3]
}

/// `b` grown about its centre to the input's aspect and at least the
/// input's size, then moved (not cut) inside the frame where it fits.
fn grow(b: [u32; 4], (fw, fh): (u32, u32), (iw, ih): (u32, u32)) -> [u32; 4] {
    let aspect = iw.max(1) as f64 / ih.max(1) as f64;
    let (bw, bh) = (f64::from(b[2] - b[0]), f64::from(b[3] - b[1]));
    let mut h = bh.max(bw / aspect).max(f64::from(ih));
    let mut w = h * aspect;
    w = w.min(f64::from(fw));
    h = h.min(f64::from(fh));
    let (cx, cy) = (f64::from(b[0] + b[2]) / 2.0, f64::from(b[1] + b[3]) / 2.0);
    let place = |c: f64, len: f64, max: u32| -> (u32, u32) {
        let len = (len.ceil() as u32).min(max);
        let start = (c - f64::from(len) / 2.0).max(0.0) as u32;
        let start = start.min(max - len) & !1;
        let end = (start + len + (len & 1)).min(max);
        (start, end)
    };
    let (x0, x1) = place(cx, w, fw);
    let (y0, y1) = place(cy, h, fh);
    [x0, y0, x1, y1]
}

/// The pixels of `r` (even corners) cut out of a decoded frame, with the
/// crop's size and layout.
pub fn crop(payload: &[u8], raw: RawImage, r: [u32; 4]) -> (Vec<u8>, RawImage) {
    let (x0, y0) = (r[0] as usize, r[1] as usize);
    let (w, h) = ((r[2] - r[0]) as usize, (r[3] - r[1]) as usize);
    let fw = raw.width as usize;
    let out_raw = RawImage {
        width: w as u32,
        height: h as u32,
        format: raw.format,
    };
    let mut out = Vec::with_capacity(out_raw.len());
    let rows = |out: &mut Vec<u8>, plane: &[u8], stride: usize, x: usize, y: usize, w, h| {
        for row in y..y + h {
            let at = row * stride + x;
            out.extend_from_slice(plane.get(at..at + w).unwrap_or_default());
        }
    };
    match raw.format {
        RawFormat::Rgb => rows(&mut out, payload, fw * 3, x0 * 3, y0, w * 3, h),
        RawFormat::I420 { .. } => {
            let (cw, ch) = raw.chroma_size();
            let (cw, ch) = (cw as usize, ch as usize);
            let luma = fw * raw.height as usize;
            let (ocw, och) = out_raw.chroma_size();
            rows(&mut out, payload, fw, x0, y0, w, h);
            let u = payload.get(luma..luma + cw * ch).unwrap_or_default();
            rows(&mut out, u, cw, x0 / 2, y0 / 2, ocw as usize, och as usize);
            let at = luma + cw * ch;
            let v = payload.get(at..at + cw * ch).unwrap_or_default();
            rows(&mut out, v, cw, x0 / 2, y0 / 2, ocw as usize, och as usize);
        }
    }
    // A frame whose size was checked gives the whole crop; anything else is
    // padded so the crop's own check holds.
    out.resize(out_raw.len(), 0);
    (out, out_raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_small_mover_gets_one_crop_of_the_input_aspect_around_it() {
        let r = plan(&[[900, 500, 960, 620]], (1920, 1080), (512, 512), 4).unwrap();
        assert_eq!(r.len(), 1);
        let [x0, y0, x1, y1] = r[0];
        assert_eq!((x1 - x0, y1 - y0), (512, 512));
        assert!(x0 <= 900 && x1 >= 960 && y0 <= 500 && y1 >= 620, "{r:?}");
        assert_eq!((x0 % 2, y0 % 2), (0, 0));
    }

    #[test]
    fn overlapping_crops_merge_and_a_crop_at_the_edge_moves_inside() {
        let r = plan(
            &[
                [0, 0, 40, 40],
                [300, 100, 340, 140],
                [1800, 1000, 1920, 1080],
            ],
            (1920, 1080),
            (512, 512),
            4,
        )
        .unwrap();
        assert_eq!(r.len(), 2, "{r:?}");
        for c in &r {
            assert!(c[2] <= 1920 && c[3] <= 1080);
        }
        assert!(r.iter().any(|c| c[0] == 0 && c[1] == 0 && c[2] >= 340));
        assert!(r.iter().any(|c| c[2] == 1920 && c[3] == 1080));
    }

    #[test]
    fn too_many_crops_or_a_whole_frame_crop_run_the_whole_frame() {
        let many: Vec<[u32; 4]> = (0..5).map(|i| [i * 800, 0, i * 800 + 10, 10]).collect();
        assert_eq!(plan(&many, (4000, 1080), (512, 512), 4), None);
        assert!(plan(&many, (4000, 1080), (512, 512), 5).is_some());
        assert_eq!(plan(&[[0, 0, 10, 10]], (640, 480), (640, 480), 4), None);
    }

    #[test]
    fn a_crop_of_an_i420_frame_keeps_its_planes() {
        let (w, h) = (8u32, 4u32);
        let raw = RawImage {
            width: w,
            height: h,
            format: RawFormat::I420 { bt709: false },
        };
        let mut p: Vec<u8> = (0..w * h).map(|i| i as u8).collect();
        p.extend((0..8).map(|i| 100 + i as u8));
        p.extend((0..8).map(|i| 200 + i as u8));
        let (c, cr) = crop(&p, raw, [2, 2, 6, 4]);
        assert_eq!((cr.width, cr.height), (4, 2));
        assert_eq!(c.len(), cr.len());
        assert_eq!(&c[..8], &[18, 19, 20, 21, 26, 27, 28, 29]);
        assert_eq!(&c[8..10], &[105, 106]);
        assert_eq!(&c[10..12], &[205, 206]);
        let rgb: Vec<u8> = (0..4 * 2 * 3).map(|i| i as u8).collect();
        let (c, _) = crop(&rgb, RawImage::rgb(4, 2), [2, 0, 4, 2]);
        assert_eq!(c, vec![6, 7, 8, 9, 10, 11, 18, 19, 20, 21, 22, 23]);
    }
}
