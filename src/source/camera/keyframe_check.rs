//! Whether a keyframe decoded completely: its two decodes, compared.
//!
//! libav's H.264 decoder hands out a picture whatever part of it the
//! keyframe left out, and says so nowhere GStreamer passes on. Decoding
//! alone, it fills such a part from the rest of the picture (error
//! concealment); decoding with slice threads it leaves it as the recycled
//! buffer held it: a picture decoded before, which in a shared decoder is
//! another camera's. A keyframe that decodes completely decodes to the
//! same picture either way, bit for bit; one that does not, differs where
//! it was cut. So the shared decoder decodes each keyframe both ways and
//! hands the picture on only when they agree.

use gstreamer as gst;
use gstreamer_video as gst_video;
use gstreamer_video::prelude::*;

/// Why two decodes of a keyframe are not one complete picture.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum Mismatch {
    #[error("it decoded to no picture")]
    NoPicture,
    #[error("only one of its two decodes gave a picture")]
    OneDecode,
    #[error("it decoded to different pictures ({0}): part of it was missing or damaged")]
    Differ(&'static str),
    #[error("it decoded to an interlaced picture, which the shared decoder does not take")]
    Interlaced,
}

/// Whether pictures `a` and `b` (with their caps) are one complete,
/// progressive picture: same format and size, every row of every
/// component equal (strides and padding aside).
pub(super) fn same_picture(
    a: &gst::BufferRef,
    a_caps: &gst::CapsRef,
    b: &gst::BufferRef,
    b_caps: &gst::CapsRef,
) -> Result<(), Mismatch> {
    let (Ok(ia), Ok(ib)) = (
        gst_video::VideoInfo::from_caps(a_caps),
        gst_video::VideoInfo::from_caps(b_caps),
    ) else {
        return Err(Mismatch::Differ("caps that are not raw video"));
    };
    // libav's pictures of fields come with caps of interlaced video.
    for info in [&ia, &ib] {
        if info.interlace_mode() != gst_video::VideoInterlaceMode::Progressive {
            return Err(Mismatch::Interlaced);
        }
    }
    if (ia.format(), ia.width(), ia.height()) != (ib.format(), ib.width(), ib.height()) {
        return Err(Mismatch::Differ("format or size"));
    }
    let (Ok(fa), Ok(fb)) = (
        gst_video::VideoFrameRef::from_buffer_ref_readable(a, &ia),
        gst_video::VideoFrameRef::from_buffer_ref_readable(b, &ib),
    ) else {
        return Err(Mismatch::Differ("a picture shorter than its caps"));
    };
    for c in 0..fa.n_components() {
        let (Ok(da), Ok(db)) = (fa.comp_data(c), fb.comp_data(c)) else {
            return Err(Mismatch::Differ("a picture shorter than its caps"));
        };
        let row = fa.comp_width(c) as usize * fa.comp_pstride(c).max(1) as usize;
        let (sa, sb) = (
            fa.comp_stride(c).max(0) as usize,
            fb.comp_stride(c).max(0) as usize,
        );
        for y in 0..fa.comp_height(c) as usize {
            let ra = da.get(y * sa..).map(|r| &r[..row.min(r.len())]);
            let rb = db.get(y * sb..).map(|r| &r[..row.min(r.len())]);
            match (ra, rb) {
                (Some(ra), Some(rb)) if ra.len() == row && ra == rb => {}
                _ => return Err(Mismatch::Differ("pixels")),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(w: u32, h: u32) -> gst::Caps {
        gst_video::VideoInfo::builder(gst_video::VideoFormat::I420, w, h)
            .build()
            .unwrap()
            .to_caps()
            .unwrap()
    }

    /// An I420 picture of `w` x `h` filled by `px(plane, x, y)`, laid out
    /// as its caps say (`stride` 0) or with luma rows `stride` bytes apart
    /// and a video meta saying where the planes lie.
    fn picture(
        w: u32,
        h: u32,
        stride: usize,
        px: impl Fn(usize, usize, usize) -> u8,
    ) -> (gst::Buffer, gst::Caps) {
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::I420, w, h)
            .build()
            .unwrap();
        let (cw, ch) = (w.div_ceil(2) as usize, h.div_ceil(2) as usize);
        let (offsets, strides, size) = if stride == 0 {
            let s = info.stride();
            (
                [info.offset()[0], info.offset()[1], info.offset()[2]],
                [s[0] as usize, s[1] as usize, s[2] as usize],
                info.size(),
            )
        } else {
            let cs = stride / 2;
            let (l, c) = (stride * h as usize, cs * ch);
            ([0, l, l + c], [stride, cs, cs], l + 2 * c)
        };
        let mut data = vec![0xEEu8; size];
        for p in 0..3 {
            let (pw, ph) = if p == 0 {
                (w as usize, h as usize)
            } else {
                (cw, ch)
            };
            for y in 0..ph {
                for x in 0..pw {
                    data[offsets[p] + y * strides[p] + x] = px(p, x, y);
                }
            }
        }
        let mut buffer = gst::Buffer::from_mut_slice(data);
        if stride != 0 {
            gst_video::VideoMeta::add_full(
                buffer.get_mut().unwrap(),
                gst_video::VideoFrameFlags::empty(),
                gst_video::VideoFormat::I420,
                w,
                h,
                &offsets,
                &strides.map(|s| s as i32),
            )
            .unwrap();
        }
        (buffer, caps(w, h))
    }

    fn same(a: &(gst::Buffer, gst::Caps), b: &(gst::Buffer, gst::Caps)) -> Result<(), Mismatch> {
        same_picture(&a.0, &a.1, &b.0, &b.1)
    }

    /// The same picture laid out as its caps say and with wider rows is one
    /// picture;
    /// a byte of any plane that differs, another size, or an
    /// interlaced frame is not.
    #[test]
    fn pictures_agree_only_when_every_row_of_every_plane_does() {
        gst::init().unwrap();
        let px = |p: usize, x: usize, y: usize| (p * 50 + x * 3 + y * 7) as u8;
        let tight = picture(10, 6, 0, px);
        let padded = picture(10, 6, 16, px);
        assert_eq!(same(&tight, &padded), Ok(()));
        for plane in 0..3 {
            let one_off = picture(10, 6, 16, |p, x, y| {
                px(p, x, y).wrapping_add((p == plane && x == 2 && y == 1) as u8)
            });
            assert_eq!(
                same(&tight, &one_off),
                Err(Mismatch::Differ("pixels")),
                "plane {plane}"
            );
        }
        let smaller = picture(8, 6, 0, px);
        assert_eq!(
            same(&tight, &smaller),
            Err(Mismatch::Differ("format or size"))
        );
        let mut interlaced = picture(10, 6, 0, px);
        interlaced.1 = gst_video::VideoInfo::builder(gst_video::VideoFormat::I420, 10, 6)
            .interlace_mode(gst_video::VideoInterlaceMode::Mixed)
            .build()
            .unwrap()
            .to_caps()
            .unwrap();
        assert_eq!(same(&tight, &interlaced), Err(Mismatch::Interlaced));
    }
}
