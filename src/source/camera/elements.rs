//! GStreamer elements from plans and launch descriptions: made, given
//! their typed properties and linked in code (feature `camera`).

use gstreamer as gst;
use gstreamer::prelude::*;

use super::PARSER_NAME;
use super::plan::{CapsPlan, ElementPlan, Prop};

pub(super) use super::error::CameraError;
use super::scrub::Scrubber;

/// Makes a plan's elements in a new pipeline and links them in order. An
/// element whose source pad appears only once the stream is known
/// (`decodebin`) is linked when it appears.
pub(super) fn from_plan(plan: &[ElementPlan]) -> Result<gst::Pipeline, CameraError> {
    let p = gst::Pipeline::new();
    let mut prev: Option<gst::Element> = None;
    for ep in plan {
        let e = make(ep)?;
        p.add(&e).map_err(|x| CameraError::Add {
            element: ep.factory.to_string(),
            reason: x.to_string(),
        })?;
        if let Some(a) = prev.take() {
            link(&a, &e)?;
        }
        prev = Some(e);
    }
    Ok(p)
}

pub(super) fn make(ep: &ElementPlan) -> Result<gst::Element, CameraError> {
    let mut b = gst::ElementFactory::make(ep.factory);
    if let Some(n) = ep.name {
        b = b.name(n);
    }
    let e = b.build().map_err(|_| CameraError::missing(ep.factory))?;
    for (key, v) in &ep.props {
        set_prop(&e, ep.factory, key, v)?;
    }
    Ok(e)
}

/// Sets a property as its own type, or says why not (never a type
/// mismatch for GLib to abort on).
fn set_prop(e: &gst::Element, factory: &str, key: &str, v: &Prop) -> Result<(), CameraError> {
    use gst::glib::{self, prelude::ToValue};
    let pspec = e
        .find_property(key)
        .ok_or_else(|| CameraError::NoProperty {
            factory: factory.to_string(),
            property: key.to_string(),
        })?;
    let t = pspec.value_type();
    let range = |_| CameraError::PropertyRange {
        factory: factory.to_string(),
        property: key.to_string(),
    };
    let value = match v {
        Prop::Text(s) if t == glib::Type::STRING => s.to_value(),
        Prop::Int(n) if t == glib::Type::I32 => i32::try_from(*n).map_err(range)?.to_value(),
        Prop::Int(n) if t == glib::Type::U32 => u32::try_from(*n).map_err(range)?.to_value(),
        Prop::Int(n) if t == glib::Type::I64 => n.to_value(),
        Prop::Int(n) if t == glib::Type::U64 => u64::try_from(*n).map_err(range)?.to_value(),
        Prop::Caps(c) if t == gst::Caps::static_type() => caps(c)?.to_value(),
        _ => {
            return Err(CameraError::PropertyType {
                factory: factory.to_string(),
                property: key.to_string(),
                found: t.to_string(),
            });
        }
    };
    e.set_property_from_value(key, &value);
    Ok(())
}

fn caps(plan: &[CapsPlan]) -> Result<gst::Caps, CameraError> {
    let int = |n: u32| i32::try_from(n).map_err(|_| CameraError::CapsRange(n));
    let mut caps = gst::Caps::new_empty();
    let c = caps.make_mut();
    for s in plan {
        let mut st = gst::Structure::builder(s.media);
        match s.formats.as_slice() {
            [] => {}
            [one] => st = st.field("format", *one),
            many => st = st.field("format", gst::List::new(many.iter().copied())),
        }
        if let Some((w, h)) = s.size {
            st = st.field("width", int(w)?).field("height", int(h)?);
        }
        if let Some(f) = s.fps {
            st = st.field("framerate", gst::Fraction::new(int(f)?, 1));
        }
        c.append_structure_full(st.build(), s.feature.map(|f| gst::CapsFeatures::new([f])));
    }
    Ok(caps)
}

/// Links `a` to `b`: now when `a` has its source pad, else when a video
/// pad appears on it.
fn link(a: &gst::Element, b: &gst::Element) -> Result<(), CameraError> {
    let dynamic = a.static_pad("src").is_none()
        && a.pad_template_list().iter().any(|t| {
            t.direction() == gst::PadDirection::Src && t.presence() == gst::PadPresence::Sometimes
        });
    if !dynamic {
        return a.link(b).map_err(|_| CameraError::Link {
            from: factory_name(a),
            to: factory_name(b),
        });
    }
    let sink = b
        .static_pad("sink")
        .ok_or(CameraError::Shape("an element without a sink pad"))?;
    a.connect_pad_added(move |_, pad| {
        let video = pad
            .current_caps()
            .or_else(|| Some(pad.query_caps(None)))
            .and_then(|c| c.structure(0).map(|s| s.name().starts_with("video/")))
            .unwrap_or(false);
        if video && !sink.is_linked() {
            let _ = pad.link(&sink);
        }
    });
    Ok(())
}

pub(super) fn launch(desc: &str) -> Result<gst::Pipeline, CameraError> {
    let e = gst::parse::launch(desc).map_err(|e| CameraError::Launch {
        line: Scrubber::default().scrub(desc),
        reason: e.to_string(),
    })?;
    match e.downcast::<gst::Pipeline>() {
        Ok(p) => Ok(p),
        Err(e) => {
            // A single element: wrap it.
            let p = gst::Pipeline::new();
            p.add(&e).map_err(|x| CameraError::Add {
                element: factory_name(&e),
                reason: x.to_string(),
            })?;
            Ok(p)
        }
    }
}

/// The factory an element was made by (its name when it has none).
fn factory_name(e: &gst::Element) -> String {
    e.factory()
        .map(|f| f.name().to_string())
        .unwrap_or_else(|| e.name().to_string())
}

pub(super) fn element_names(p: &gst::Pipeline) -> Vec<String> {
    let mut v: Vec<String> = p
        .iterate_sorted()
        .into_iter()
        .flatten()
        .filter_map(|e| e.factory().map(|f| f.name().to_string()))
        .collect();
    // iterate_sorted goes sink to source.
    v.reverse();
    v
}

/// Whether GStreamer has this element here.
pub(super) fn has(element: &str) -> bool {
    gst::ElementFactory::find(element).is_some()
}

/// The elements of a decoder chain (`pick_decoder`'s, from index `from`),
/// made one by one (not parsed) so the parser, always the chain's second,
/// can be found by its name: keyframe-only decoding may drop delta frames
/// at its source pad.
pub(super) fn decoder_elements(
    chain: &[&str],
    from: usize,
) -> Result<Vec<gst::Element>, CameraError> {
    chain
        .iter()
        .enumerate()
        .skip(from)
        .map(|(i, f)| {
            let mut b = gst::ElementFactory::make(f);
            if i == 1 {
                // Parameter sets before every keyframe: a keyframe then
                // decodes alone (a decoder shared by cameras, `keyframes.rs`).
                b = b.name(PARSER_NAME).property("config-interval", -1i32);
            }
            b.build().map_err(|_| CameraError::missing(f))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gstreamer_app as gst_app;
    use gstreamer_video as gst_video;

    use super::super::plan::{rgb_tail, source_plan};
    use super::super::{CameraDef, CameraUrl, Decode, Transport};
    use super::*;

    /// A device string that holds pipeline syntax stays the value of
    /// v4l2src's `device`: no other element appears, and the file the text
    /// names is never touched when the pipeline runs.
    #[test]
    fn a_v4l2_device_with_pipeline_syntax_builds_no_other_element() {
        gst::init().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let victim = dir.path().join("VICTIM");
        std::fs::write(&victim, b"precious").unwrap();
        let device = format!(
            "/dev/null ! fakesink videotestsrc num-buffers=3 ! tee name=t ! queue ! filesink location={} t. ! queue",
            victim.display()
        );
        let cfg = CameraDef {
            name: "usb".into(),
            url: None,
            pipeline: None,
            width: Some(320),
            height: Some(240),
            transport: Transport::Tcp,
            stall_timeout: Duration::from_secs(5),
            decode: Decode::Auto,
            max_frame_bytes: 8 << 20,
            fps: None,
        };
        let plan = source_plan(
            &cfg,
            None,
            &CameraUrl::V4l2 {
                device: device.clone(),
            },
        )
        .unwrap();
        let p = from_plan(&plan).unwrap();
        let mut names = element_names(&p);
        names.sort();
        assert_eq!(
            names,
            [
                "appsink",
                "capsfilter",
                "capsfilter",
                "decodebin",
                "v4l2src",
                "videoconvert",
                "videoscale"
            ]
        );
        let src = p
            .iterate_elements()
            .into_iter()
            .flatten()
            .find(|e| e.factory().is_some_and(|f| f.name() == "v4l2src"))
            .unwrap();
        assert_eq!(src.property::<String>("device"), device);
        // Played, it fails on the device (there is no such file) and nothing else runs.
        let _ = p.set_state(gst::State::Playing);
        let bus = p.bus().unwrap();
        let msg = bus.timed_pop_filtered(
            gst::ClockTime::from_seconds(10),
            &[gst::MessageType::Error, gst::MessageType::Eos],
        );
        assert!(matches!(
            msg.map(|m| m.type_()),
            Some(gst::MessageType::Error)
        ));
        let _ = p.set_state(gst::State::Null);
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    }

    /// decodebin's pad appears once the stream is known: it is linked then,
    /// and frames reach the appsink at the size the tail asks for.
    #[test]
    fn a_plan_through_decodebin_delivers_frames() {
        gst::init().unwrap();
        let mut plan = vec![
            ElementPlan {
                factory: "videotestsrc",
                name: None,
                props: vec![("num-buffers", Prop::Int(3))],
            },
            ElementPlan {
                factory: "decodebin",
                name: None,
                props: Vec::new(),
            },
        ];
        plan.extend(rgb_tail(Some((64, 48))));
        let p = from_plan(&plan).unwrap();
        let sink = p
            .by_name("outpost")
            .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
            .unwrap();
        p.set_state(gst::State::Playing).unwrap();
        let sample = sink.try_pull_sample(gst::ClockTime::from_seconds(10));
        let _ = p.set_state(gst::State::Null);
        let sample = sample.expect("no frame reached the appsink");
        let info = gst_video::VideoInfo::from_caps(sample.caps().unwrap()).unwrap();
        assert_eq!((info.width(), info.height()), (64, 48));
    }

    #[test]
    fn plans_become_linked_pipelines_with_typed_caps() {
        gst::init().unwrap();
        let p = from_plan(&rgb_tail(Some((64, 48)))).unwrap();
        let filter = p
            .iterate_elements()
            .into_iter()
            .flatten()
            .find(|e| e.factory().is_some_and(|f| f.name() == "capsfilter"))
            .unwrap();
        let caps = filter.property::<gst::Caps>("caps");
        let s = caps.structure(0).unwrap();
        assert_eq!(s.name(), "video/x-raw");
        assert_eq!(s.get::<i32>("width").unwrap(), 64);
        assert_eq!(s.get::<i32>("height").unwrap(), 48);
        assert!(caps.to_string().contains("I420") && caps.to_string().contains("RGB"));
        let e = make(&ElementPlan {
            factory: "videoconvert",
            name: None,
            props: vec![("no-such-property", Prop::Int(1))],
        });
        let e = e.unwrap_err();
        assert!(matches!(e, CameraError::NoProperty { .. }), "{e:?}");
        assert!(e.to_string().contains("no property"), "{e}");
        let e = make(&ElementPlan {
            factory: "capsfilter",
            name: None,
            props: vec![("caps", Prop::Text("video/x-raw".into()))],
        });
        let e = e.unwrap_err();
        assert!(matches!(e, CameraError::PropertyType { .. }), "{e:?}");
        assert!(e.to_string().contains("not the value"), "{e}");
    }
}
