//! Keyframes of many cameras through one decoder (feature `camera`).
//!
//! A camera that decodes keyframes only needs no decoder of its own: a
//! keyframe decodes alone. A software H.264 decoder keeps the reference
//! and reordering frames its stream declares, a few 1080p frames of 3 MiB
//! each, for as long as it lives; one per camera made memory grow by
//! tens of MiB with each camera. So while a camera decodes keyframes only,
//! its keyframes leave its parser for a decoder it shares with the other
//! cameras of the same kind of stream, and come back to it decoded.
//!
//! Invariants:
//! - One decoder per kind of stream: cameras whose parsed streams have the
//!   same caps (codec, size, profile, codec data; the frame rate aside),
//!   the same software decoder and the same output size share one. Each
//!   keyframe carries its parameter sets (the parser repeats them before
//!   every keyframe), so the decoder needs nothing of a camera's stream
//!   before it, and its segment says keyframes only, so it hands each
//!   frame on at once (see `fanout::add_key_units_probe`).
//! - Each keyframe goes back to its own camera: a number stands in for its
//!   timestamp through the decoder, and the camera's readers get the
//!   frame with its own timestamp and capture time, through the same fps
//!   gates and into the same queues as a frame of its own decoder.
//! - One camera's bad keyframe is its own: the decoder never gives up on
//!   errors (`max-errors = -1`); a keyframe that gives no frame is counted
//!   as that camera's `bad_frame`, and a decoder pipeline that fails all
//!   the same is rebuilt at the next keyframe. Keyframes wait in a bounded
//!   line: past it a camera's keyframe is dropped (`decoder_behind`).
//! - A decoder lives while a camera uses it (the last one to let go tears
//!   its pipeline down).
//! - Hardware decoders (Jetson) and hand-written pipelines keep their own.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::SystemTime;

use gstreamer as gst;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use parking_lot::Mutex;

use super::elements::{SetupError, from_plan};
use super::fanout::{
    Shared, add_key_units_probe, capture_time, consume, on_decoded, take_raw_frames,
};
use super::plan::rgb_tail;

/// The decoders cameras share, by the kind of stream they decode.
#[derive(Default)]
pub(super) struct KeyframeDecoders {
    decoders: Mutex<HashMap<String, Weak<KeyDecoder>>>,
}

/// What a camera's keyframes need of a shared decoder.
#[derive(Debug, Clone, PartialEq)]
struct Kind {
    /// The parser's output caps without the frame rate.
    caps: gst::Caps,
    parser: &'static str,
    decoder: String,
    /// The camera's output size (`width`/`height`), if it sets one.
    size: Option<(u32, u32)>,
}

impl Kind {
    fn key(&self) -> String {
        format!("{} {} {:?}", self.decoder, self.caps, self.size)
    }
}

impl KeyframeDecoders {
    /// The decoder of this kind of stream, made when no camera uses one.
    fn get(&self, kind: &Kind) -> Arc<KeyDecoder> {
        let key = kind.key();
        let mut map = self.decoders.lock();
        map.retain(|_, d| d.strong_count() > 0);
        if let Some(d) = map.get(&key).and_then(Weak::upgrade) {
            return d;
        }
        let d = Arc::new(KeyDecoder {
            kind: kind.clone(),
            broken: Default::default(),
            run: Mutex::new(None),
            pending: Arc::new(Mutex::new(VecDeque::new())),
            next: AtomicU64::new(1),
        });
        map.insert(key, Arc::downgrade(&d));
        d
    }

    /// How many decoders cameras share now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.decoders
            .lock()
            .values()
            .filter(|d| d.strong_count() > 0)
            .count()
    }
}

/// A keyframe in the decoder: whose, and its own timestamp and capture time.
struct Pending {
    id: u64,
    camera: Weak<Shared>,
    pts: Option<gst::ClockTime>,
    captured: SystemTime,
}

/// Keyframes waiting in a decoder, at most this many per camera using it.
const WAITING_PER_CAMERA: usize = 2;

/// Why a keyframe did not go into a shared decoder.
#[derive(Debug)]
enum SubmitError {
    /// Too many keyframes wait: this one is dropped.
    Behind(usize),
    /// The decoder cannot be made here: the camera's own decodes it.
    Unavailable(String),
}

/// One shared decoder.
struct KeyDecoder {
    kind: Kind,
    /// It could not be built: the cameras keep to their own decoders.
    broken: std::sync::atomic::AtomicBool,
    /// `None` until the first keyframe, and after a failure.
    run: Mutex<Option<DecoderRun>>,
    pending: Arc<Mutex<VecDeque<Pending>>>,
    next: AtomicU64,
}

/// The decoder's GStreamer pipeline: appsrc, parser, decoder, the camera
/// tail (colour conversion, scaling) and an appsink.
struct DecoderRun {
    pipeline: gst::Pipeline,
    src: gst_app::AppSrc,
}

impl Drop for DecoderRun {
    fn drop(&mut self) {
        let _ = self.pipeline.set_state(gst::State::Null);
    }
}

impl KeyDecoder {
    /// Hands a camera's keyframe to the decoder; it comes back to the camera
    /// through `on_decoded`.
    fn submit(
        &self,
        sh: &Arc<Shared>,
        buffer: &gst::BufferRef,
        captured: SystemTime,
        users: usize,
    ) -> Result<(), SubmitError> {
        if self.broken.load(Ordering::Relaxed) {
            return Err(SubmitError::Unavailable("it could not be built".into()));
        }
        let mut run = self.run.lock();
        if run.as_ref().is_some_and(DecoderRun::failed) {
            *run = None;
        }
        let r = match run.as_mut() {
            Some(r) => r,
            None => match self.build() {
                Ok(b) => run.insert(b),
                Err(e) => {
                    self.broken.store(true, Ordering::Relaxed);
                    tracing::warn!(decoder = %self.kind.decoder, error = %e, "no shared keyframe decoder: cameras keep their own");
                    return Err(SubmitError::Unavailable(e.0));
                }
            },
        };
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        {
            let mut pending = self.pending.lock();
            if pending.len() >= WAITING_PER_CAMERA * users.max(1) {
                return Err(SubmitError::Behind(pending.len()));
            }
            pending.push_back(Pending {
                id,
                camera: Arc::downgrade(sh),
                pts: buffer.pts(),
                captured,
            });
        }
        // A new buffer on the same memory, numbered.
        let mut b = buffer.copy();
        {
            let b = b.make_mut();
            let t = gst::ClockTime::from_mseconds(id);
            b.set_pts(t);
            b.set_dts(t);
            b.set_duration(gst::ClockTime::NONE);
        }
        if let Err(e) = r.src.push_buffer(b) {
            // Flushing or failed: rebuilt at the next keyframe.
            self.pending.lock().retain(|p| p.id != id);
            *run = None;
            return Err(SubmitError::Unavailable(format!(
                "the shared decoder refused a keyframe: {e:?}"
            )));
        }
        Ok(())
    }

    fn build(&self) -> Result<DecoderRun, SetupError> {
        let k = &self.kind;
        let p = from_plan(&rgb_tail(k.size))?;
        let src = gst_app::AppSrc::builder()
            .caps(&k.caps)
            .is_live(true)
            .format(gst::Format::Time)
            .block(false)
            .build();
        let parse = gst::ElementFactory::make(k.parser)
            .build()
            .map_err(|e| SetupError(format!("{}: {e}", k.parser)))?;
        let dec = gst::ElementFactory::make(&k.decoder)
            .build()
            .map_err(|e| SetupError(format!("{}: {e}", k.decoder)))?;
        // A camera's broken keyframe must not stop the others' decoding.
        if dec.find_property("max-errors").is_some() {
            dec.set_property("max-errors", -1i32);
        }
        let convert = p
            .by_name("outpost_convert")
            .ok_or("no outpost_convert element")?;
        p.add_many([src.upcast_ref(), &parse, &dec])
            .map_err(|e| SetupError(e.to_string()))?;
        gst::Element::link_many([src.upcast_ref(), &parse, &dec, &convert])
            .map_err(|e| SetupError(e.to_string()))?;
        add_key_units_probe(&parse, || true)?;
        let sink = p
            .by_name("outpost")
            .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
            .ok_or("the decoder has no appsink")?;
        take_raw_frames(&sink);
        // Every frame is some camera's: none is dropped here.
        sink.set_drop(false);
        let pending = self.pending.clone();
        sink.set_callbacks(
            gst_app::AppSinkCallbacks::builder()
                .new_sample(move |sink| {
                    if let Ok(sample) = sink.pull_sample() {
                        route(&pending, &sample);
                    }
                    Ok(gst::FlowSuccess::Ok)
                })
                .build(),
        );
        p.set_state(gst::State::Playing)
            .map_err(|_| SetupError::from("the shared decoder did not start"))?;
        tracing::info!(decoder = %k.decoder, caps = %k.caps, "shared keyframe decoder started");
        Ok(DecoderRun { pipeline: p, src })
    }
}

impl DecoderRun {
    /// Whether the pipeline stopped on an error (it is then rebuilt).
    /// Reads every message waiting on its bus (nothing else does: they
    /// would pile up), so none is kept longer than until the next keyframe.
    fn failed(&self) -> bool {
        let Some(bus) = self.pipeline.bus() else {
            return false;
        };
        let mut failed = false;
        while let Some(msg) = bus.pop() {
            if let gst::MessageView::Error(e) = msg.view() {
                tracing::warn!(error = %e.error(), "shared keyframe decoder failed; rebuilding it");
                failed = true;
            }
        }
        failed
    }
}

/// A decoded frame back to the camera whose keyframe it was; the keyframes
/// before it that gave no frame are their cameras' bad frames.
fn route(pending: &Mutex<VecDeque<Pending>>, sample: &gst::Sample) {
    let (Some(buffer), Some(caps)) = (sample.buffer_owned(), sample.caps()) else {
        return;
    };
    let Some(id) = buffer.pts().map(gst::ClockTime::mseconds) else {
        return;
    };
    let mut lost = Vec::new();
    let mut found = None;
    {
        let mut p = pending.lock();
        while let Some(front) = p.front() {
            if front.id > id {
                break;
            }
            let Some(entry) = p.pop_front() else { break };
            if entry.id == id {
                found = Some(entry);
                break;
            }
            lost.push(entry);
        }
    }
    for entry in lost {
        if let Some(sh) = entry.camera.upgrade() {
            for r in &sh.readers().list {
                r.ctx.count_drop("bad_frame", "the keyframe did not decode");
            }
        }
    }
    let Some(entry) = found else { return };
    let Some(sh) = entry.camera.upgrade() else {
        return;
    };
    let mut buffer = buffer;
    {
        let b = buffer.make_mut();
        b.set_pts(entry.pts);
        b.set_dts(gst::ClockTime::NONE);
    }
    on_decoded(&sh, buffer, caps, entry.captured);
}

/// The parser that makes a stream of these caps' codec.
fn parser_for(caps: &gst::CapsRef) -> Option<&'static str> {
    match caps.structure(0)?.name().as_str() {
        "video/x-h264" => Some("h264parse"),
        "video/x-h265" => Some("h265parse"),
        _ => None,
    }
}

/// Sends a camera's keyframes to a shared decoder while it decodes
/// keyframes only (`decoder`: the software decoder its chain has); other
/// frames, and keyframes while every frame is decoded, go on to its own.
fn add_divert_probe(
    parser: &gst::Element,
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
    decoder: &str,
    own: bool,
) -> Result<(), SetupError> {
    let pad = parser
        .static_pad("src")
        .ok_or("the parser has no source pad")?;
    let (sh, decoders, decoder) = (sh.clone(), decoders.clone(), decoder.to_string());
    let size = sh.def.width.zip(sh.def.height);
    let using: Mutex<Option<Arc<KeyDecoder>>> = Mutex::new(None);
    pad.add_probe(gst::PadProbeType::BUFFER, move |pad, info| {
        let Some(buf) = info.buffer() else {
            return gst::PadProbeReturn::Ok;
        };
        if buf.flags().contains(gst::BufferFlags::DELTA_UNIT) || !sh.keyframes_only() {
            return gst::PadProbeReturn::Ok;
        }
        let Some(kind) = pad.current_caps().and_then(|c| {
            let parser = parser_for(&c)?;
            let mut caps = c.copy();
            if let Some(s) = caps.make_mut().structure_mut(0) {
                s.remove_field("framerate");
            }
            Some(Kind {
                caps,
                parser,
                decoder: decoder.clone(),
                size,
            })
        }) else {
            return gst::PadProbeReturn::Ok;
        };
        let dec = {
            let mut u = using.lock();
            match u.as_ref() {
                Some(d) if d.kind == kind => d.clone(),
                _ => u.insert(decoders.get(&kind)).clone(),
            }
        };
        let segment = pad
            .sticky_event::<gst::event::Segment>(0)
            .map(|s| s.segment().clone());
        let captured = match pad.parent_element() {
            Some(e) => capture_time(&e, segment.as_ref(), buf.pts()),
            None => SystemTime::now(),
        };
        // The cameras using the decoder hold it (the map only refers to
        // it); `dec` is this call's own reference.
        let users = Arc::strong_count(&dec).saturating_sub(1);
        match dec.submit(&sh, buf, captured, users) {
            Ok(()) => {}
            Err(SubmitError::Behind(n)) => {
                let why = format!("{n} keyframes wait for the shared decoder: dropped");
                for r in &sh.readers().list {
                    r.ctx.count_drop("decoder_behind", &why);
                }
            }
            Err(SubmitError::Unavailable(why)) if own => {
                tracing::debug!(name = %sh.def.name, why = %why, "keyframe to the camera's own decoder");
                return gst::PadProbeReturn::Ok;
            }
            // No decoder of its own this connection: the next has one.
            Err(SubmitError::Unavailable(why)) => {
                sh.shared_decoder_failed.store(true, Ordering::Relaxed);
                if let Some(parser) = pad.parent_element() {
                    gst::element_error!(
                        parser,
                        gst::CoreError::Failed,
                        ["no shared keyframe decoder ({}): reconnecting with a decoder of its own", why]
                    );
                }
            }
        }
        consume(info)
    });
    Ok(())
}

/// Whether a chain's decoder (its third element) is one whose keyframes a
/// shared decoder takes: a software one (libav), whose behaviour with
/// keyframes only is known.
fn shareable(chain: &[&str]) -> bool {
    chain.get(2).is_some_and(|d| d.starts_with("avdec_"))
}

/// Whether this connection of the camera needs no decoder of its own:
/// it decodes keyframes only from start to end and a shared decoder
/// serves its chain. Its parser then ends in a `fakesink` (its keyframes
/// all leave at the parser), saving the idle decoder's memory.
pub(super) fn decodes_alone(chain: &[&str], sh: &Shared) -> bool {
    shareable(chain)
        && !sh.shared_decoder_failed.load(Ordering::Relaxed)
        && sh.decode.lock().keyframes_for_good()
}

/// What ends the parser of a camera that [`decodes_alone`].
pub(super) fn parser_end() -> Result<gst::Element, SetupError> {
    gst::ElementFactory::make("fakesink")
        .property("sync", false)
        .property("async", false)
        .build()
        .map_err(|e| SetupError(format!("fakesink: {e}")))
}

/// While the camera decodes keyframes only, they go to a decoder shared
/// with the other cameras of the same kind of stream, when its chain's
/// decoder is a software one. `own`: whether the camera has a decoder of
/// its own to fall back on (see [`decodes_alone`]).
pub(super) fn share_keyframe_decoder(
    parser: &gst::Element,
    chain: &[&str],
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
    own: bool,
) -> Result<(), SetupError> {
    match chain.get(2) {
        Some(d) if shareable(chain) => add_divert_probe(parser, sh, decoders, d, own),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use tokio_util::sync::CancellationToken;

    use super::super::fanout::Reader;
    use super::super::fanout::tests::{Unit, b_frame_stream, feed};
    use super::super::{CameraDef, Decode, Transport};
    use super::*;
    use crate::source::{Frame, FrameSink, SourceCtx};

    /// A reader's queue that hands each frame to the test, and counts drops.
    struct Collect {
        frames: Mutex<mpsc::Sender<Frame>>,
        drops: Mutex<Vec<&'static str>>,
    }

    impl FrameSink for Collect {
        fn offer(&self, frame: Frame) -> Result<(), Frame> {
            let _ = self.frames.lock().send(frame);
            Ok(())
        }
        fn space(&self) -> Arc<tokio::sync::Notify> {
            Arc::new(tokio::sync::Notify::new())
        }
        fn count_drop(&self, reason: &'static str, _detail: &str) {
            self.drops.lock().push(reason);
        }
        fn set_state(&self, _state: &'static str) {}
    }

    /// A camera decoding keyframes only: its parser (with the probe that
    /// sends keyframes to the shared decoder) and its own decoder, fed
    /// through a pad of the test's; its reader's frames and drops.
    struct Camera {
        _pipeline: gst::Pipeline,
        feed: gst::Pad,
        own: gst_app::AppSink,
        frames: mpsc::Receiver<Frame>,
        sink: Arc<Collect>,
        _shared: Arc<Shared>,
    }

    fn camera(name: &str, decoders: &Arc<KeyframeDecoders>) -> Camera {
        let (tx, rx) = mpsc::channel();
        let sink = Arc::new(Collect {
            frames: Mutex::new(tx),
            drops: Mutex::new(Vec::new()),
        });
        let ctx = SourceCtx {
            pipeline: name.into(),
            sink: sink.clone(),
            shutdown: CancellationToken::new(),
            mqtt: None,
            outbox: None,
            events: None,
            camera: None,
            data_dir: std::env::temp_dir(),
        };
        let def = CameraDef {
            name: name.into(),
            url: None,
            pipeline: None,
            width: None,
            height: None,
            transport: Transport::Tcp,
            stall_timeout: Duration::from_secs(5),
            decode: Decode::Keyframes,
            max_frame_bytes: 8 << 20,
            fps: None,
        };
        let readers = vec![Reader::new(ctx, None, None, name)];
        let shared = Arc::new(Shared::new(def, readers, CancellationToken::new()));
        let p = gst::Pipeline::new();
        let parse = gst::ElementFactory::make("h264parse")
            .property("config-interval", -1i32)
            .build()
            .unwrap();
        let dec = gst::ElementFactory::make("avdec_h264").build().unwrap();
        let own = gst_app::AppSink::builder().sync(false).build();
        p.add_many([&parse, &dec, own.upcast_ref()]).unwrap();
        gst::Element::link_many([&parse, &dec, own.upcast_ref()]).unwrap();
        share_keyframe_decoder(
            &parse,
            &["rtph264depay", "h264parse", "avdec_h264"],
            &shared,
            decoders,
            true,
        )
        .unwrap();
        let feed = feed(&p, &parse, name);
        Camera {
            _pipeline: p,
            feed,
            own,
            frames: rx,
            sink,
            _shared: shared,
        }
    }

    fn push(c: &Camera, u: &Unit, data: &[u8]) {
        let mut b = gst::Buffer::from_slice(data.to_vec());
        {
            let b = b.get_mut().unwrap();
            b.set_pts(u.1);
            b.set_dts(u.2);
        }
        c.feed.push(b).unwrap();
    }

    /// Two cameras decoding keyframes only share one decoder: each
    /// keyframe comes back, decoded, to its own camera before the next is
    /// sent (nothing held back for reordering), their own decoders get
    /// nothing, and one camera's broken keyframe leaves the other's
    /// decoding as it was.
    #[test]
    fn two_cameras_keyframes_decode_in_one_shared_decoder_each_back_to_its_camera() {
        gst::init().unwrap();
        let units = b_frame_stream();
        let keys: Vec<&Unit> = units.iter().filter(|u| u.3).collect();
        assert!(keys.len() >= 4, "{} keyframes", keys.len());
        let decoders = Arc::new(KeyframeDecoders::default());
        let a = camera("a", &decoders);
        let b = camera("b", &decoders);
        let wait = Duration::from_secs(20);
        for k in &keys {
            for c in [&a, &b] {
                push(c, k, &k.0);
                let f = c.frames.recv_timeout(wait).expect("the keyframe came back");
                assert_eq!(f.raw.map(|r| (r.width, r.height)), Some((320, 240)));
                assert!(c.frames.try_recv().is_err(), "a frame too many");
            }
        }
        assert!(a.frames.try_recv().is_err() && b.frames.try_recv().is_err());
        assert_eq!(decoders.len(), 1, "one decoder for both cameras");
        for c in [&a, &b] {
            assert!(
                c.own.try_pull_sample(gst::ClockTime::ZERO).is_none(),
                "the camera's own decoder decoded a keyframe"
            );
        }
        // B sends a keyframe cut short; A's keyframes decode on.
        let k = keys[0];
        push(&b, k, &k.0[..k.0.len() / 8]);
        for k in &keys[1..3] {
            push(&a, k, &k.0);
            a.frames
                .recv_timeout(wait)
                .expect("A's keyframe after B's broken one");
        }
        push(&b, keys[1], &keys[1].0);
        b.frames.recv_timeout(wait).expect("B's next keyframe");
        assert!(a.sink.drops.lock().is_empty(), "{:?}", a.sink.drops.lock());
    }
}
