//! A camera on `rtspsrc` (`rtsps://`, and RTP over UDP): GStreamer's own
//! RTSP client, with the camera's credentials as properties, its video
//! track's depayloader, parser and decoder chosen when the server
//! announces its tracks.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use gstreamer as gst;
use gstreamer::prelude::*;
use parking_lot::Mutex;

use super::elements::{CameraError, decoder_elements, has};
use super::fanout::{Shared, add_decode_probe};
use super::keyframes::{KeyframeDecoders, decodes_alone, parser_end, share_keyframe_decoder};
use super::{CameraUrl, Transport, pick_decoder};

/// `rtspsrc` with its credentials as properties; the depayloader, parser and
/// decoder are chosen and linked when the server announces its tracks.
pub(super) fn add_rtspsrc(
    p: &gst::Pipeline,
    url: Option<&CameraUrl>,
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
) -> Result<(), CameraError> {
    let Some(CameraUrl::Rtsp {
        location,
        user,
        password,
    }) = url
    else {
        return Err(CameraError::Shape("not an rtsp url"));
    };
    if !has("rtspsrc") {
        return Err(CameraError::MissingElement {
            factory: "rtspsrc".into(),
            hint: Some("Debian: gstreamer1.0-plugins-good"),
        });
    }
    let (protocols, latency) = match sh.def.transport {
        // TCP neither loses nor reorders: no jitter buffer delay is needed.
        Transport::Tcp => ("tcp", 0u32),
        Transport::Udp => ("udp", 200u32),
    };
    let mut b = gst::ElementFactory::make("rtspsrc")
        .name("outpost_rtspsrc")
        .property("location", location.as_str())
        .property_from_str("protocols", protocols)
        .property("latency", latency);
    if let Some(u) = user {
        b = b.property("user-id", u.as_str());
    }
    if let Some(pw) = password {
        b = b.property("user-pw", pw.as_str());
    }
    let src = b.build().map_err(|_| CameraError::missing("rtspsrc"))?;
    // Before the server answers, status shows the H.264 chain this machine would use.
    if let Ok(planned) = pick_decoder("H264", has) {
        let mut v = vec!["rtspsrc"];
        v.extend(planned);
        sh.each(|s| s.set_elements(&v));
    }
    let video = Arc::new(AtomicBool::new(false));
    let tracks = Arc::new(Mutex::new(Vec::<String>::new()));
    let (s, v, t) = (sh.clone(), video.clone(), tracks.clone());
    let decoders = decoders.clone();
    src.connect_pad_added(move |src, pad| {
        let caps = pad.current_caps().or_else(|| Some(pad.query_caps(None)));
        let (media, encoding) = caps
            .as_ref()
            .and_then(|c| c.structure(0))
            .map(|st| {
                (
                    st.get::<String>("media").unwrap_or_default(),
                    st.get::<String>("encoding-name").unwrap_or_default(),
                )
            })
            .unwrap_or_default();
        t.lock().push(format!("{media}/{encoding}"));
        let Some(bin) = src.parent().and_downcast::<gst::Bin>() else {
            return;
        };
        if media != "video" || v.load(Ordering::SeqCst) {
            // Audio and metadata tracks (or a second video track) end in a
            // fakesink, so they neither block nor fail the stream.
            if let Ok(f) = gst::ElementFactory::make("fakesink")
                .property("sync", false)
                .build()
                && bin.add(&f).is_ok()
            {
                let _ = f.sync_state_with_parent();
                if let Some(sp) = f.static_pad("sink") {
                    let _ = pad.link(&sp);
                }
            }
            return;
        }
        let chain = match pick_decoder(&encoding, has) {
            Ok(c) => c,
            Err(e) => {
                gst::element_error!(src, gst::StreamError::CodecNotFound, ["{}", e]);
                return;
            }
        };
        v.store(true, Ordering::SeqCst);
        let linked = (|| -> Result<(), CameraError> {
            // [depayloader, parser, decoder, ...], or the parser into a
            // fakesink when its keyframes all leave there.
            let alone = decodes_alone(&chain, &s);
            let mut elements = decoder_elements(if alone { &chain[..2] } else { &chain }, 0)?;
            if alone {
                elements.push(parser_end()?);
            }
            for e in &elements {
                bin.add(e).map_err(|x| CameraError::Add {
                    element: e.name().to_string(),
                    reason: x.to_string(),
                })?;
            }
            if !alone {
                let convert = bin
                    .by_name("outpost_convert")
                    .ok_or(CameraError::Shape("no outpost_convert element"))?;
                elements.push(convert);
            }
            gst::Element::link_many(&elements)
                .map_err(|e| CameraError::runtime("linking the decoder chain", e))?;
            if !alone {
                elements.pop();
            }
            if let Some(parser) = elements.get(1) {
                add_decode_probe(parser, &s)?;
                share_keyframe_decoder(parser, &chain, &s, &decoders, !alone)?;
            }
            // Downstream first, so no element pushes into one not yet playing.
            for e in elements.iter().rev() {
                e.sync_state_with_parent()
                    .map_err(|e| CameraError::runtime("starting the decoder chain", e))?;
            }
            let sink = elements
                .first()
                .and_then(|d| d.static_pad("sink"))
                .ok_or(CameraError::Shape("the depayloader has no sink pad"))?;
            pad.link(&sink)
                .map_err(|e| CameraError::runtime("linking the video track", e))?;
            Ok(())
        })();
        if let Err(e) = linked {
            // A part this machine lacks stays permanent on the bus.
            if e.retriable() {
                gst::element_error!(
                    src,
                    gst::CoreError::Negotiation,
                    ["linking the decoder: {}", e]
                );
            } else {
                gst::element_error!(
                    src,
                    gst::CoreError::MissingPlugin,
                    ["linking the decoder: {}", e]
                );
            }
            return;
        }
        let mut names = vec!["rtspsrc"];
        names.extend(chain.iter().copied());
        s.each(|st| st.set_elements(&names));
        s.log_chain(&names.join(" ! "));
    });
    let (v, t) = (video, tracks);
    src.connect_no_more_pads(move |src| {
        if !v.load(Ordering::SeqCst) {
            let tracks = t.lock().join(", ");
            gst::element_error!(
                src,
                gst::StreamError::WrongType,
                [
                    "the stream has no video track (tracks: {})",
                    if tracks.is_empty() { "none" } else { &tracks }
                ]
            );
        }
    });
    p.add(&src).map_err(|x| CameraError::Add {
        element: "rtspsrc".into(),
        reason: x.to_string(),
    })?;
    Ok(())
}
