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
//! - No camera's picture is made of another camera's data. Before a
//!   keyframe the decoder is emptied (flushed: nothing of the keyframe
//!   before it stays as a reference or a picture to conceal from), and
//!   before another camera's keyframe than the last, or after one that
//!   failed, it also gets a new libav context (libav keeps state a flush
//!   does not clear: a keyframe cut short changed how the next one
//!   decoded). It decodes on one thread, where libav fills any part of the
//!   picture a keyframe leaves out from the rest of that picture. A second
//!   decoder decodes the keyframe with slice threads, which leave such a
//!   part as the recycled buffer held it: a keyframe whose two pictures
//!   differ did not decode completely and is dropped as its camera's
//!   `corrupt_keyframe` (`keyframe_check.rs`); one that gives no picture
//!   too. Only H.264 (libav's decoder conceals within a picture; its H.265
//!   decoder leaves the recycled buffer's content) on progressive streams
//!   (libav does not conceal fields) is shared.
//! - A camera whose keyframes keep failing is down: after
//!   [`CORRUPT_IN_A_ROW`] in a row its pipeline fails with that reason and
//!   reconnects; one now and then only costs its frame.
//! - Each keyframe goes back to its own camera: a number stands in for its
//!   timestamp through the decoder, and the camera's readers get the
//!   frame with its own timestamp and capture time, through the same fps
//!   gates and into the same queues as a frame of its own decoder.
//! - One camera cannot hold up another: at most [`WAITING_PER_CAMERA`]
//!   keyframes of a camera wait, a camera over that loses its own oldest
//!   (`decoder_behind`), and the decoder takes the cameras' keyframes in
//!   turn (`keyframe_line.rs`). It never gives up on errors
//!   (`max-errors = -1`), and one that fails all the same is rebuilt at
//!   the next keyframe.
//! - A decoder lives while a camera uses it (the last one to let go ends
//!   its thread and tears its pipelines down).
//! - Hardware decoders (Jetson) and hand-written pipelines keep their own.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::SystemTime;

use gstreamer as gst;
use gstreamer::glib;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use parking_lot::{Condvar, Mutex};

use super::elements::{CameraError, from_plan};
use super::fanout::{Shared, add_key_units_probe, capture_time, on_decoded, take_raw_frames};
use super::keyframe_check::{Mismatch, same_picture};
use super::keyframe_line::Line;
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
            work: Arc::new(Work {
                state: Mutex::new(WorkState {
                    line: Line::new(WAITING_PER_CAMERA),
                    running: false,
                    broken: None,
                    closed: false,
                }),
                wake: Condvar::new(),
            }),
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

/// Keyframes of one camera waiting for its shared decoder, at most.
const WAITING_PER_CAMERA: usize = 2;

/// Keyframes of a camera in a row that did not decode completely before
/// the camera is down: one lost now and then (a lossy link) costs its
/// frame only; a camera that sends nothing else is reconnected.
const CORRUPT_IN_A_ROW: u32 = 3;

/// A camera's keyframe waiting for the decoder: whose, and its own
/// timestamp and capture time.
struct Job {
    camera: Weak<Shared>,
    /// The camera's parser: where an error that takes the camera down goes.
    parser: glib::WeakRef<gst::Element>,
    buffer: gst::Buffer,
    pts: Option<gst::ClockTime>,
    captured: SystemTime,
}

/// One shared decoder: its kind, and the line its thread serves.
struct KeyDecoder {
    kind: Kind,
    work: Arc<Work>,
}

/// What the cameras and the decoder's thread share.
struct Work {
    state: Mutex<WorkState>,
    /// A keyframe came, or the decoder closed.
    wake: Condvar,
}

struct WorkState {
    line: Line<usize, Job>,
    /// The thread runs (from the first keyframe on).
    running: bool,
    /// Why the decoder could not be built: the cameras keep to their own.
    broken: Option<Arc<CameraError>>,
    /// No camera uses the decoder any more: the thread ends.
    closed: bool,
}

impl Drop for KeyDecoder {
    fn drop(&mut self) {
        self.work.state.lock().closed = true;
        self.work.wake.notify_all();
    }
}

impl KeyDecoder {
    /// Puts a camera's keyframe in line for the decoder; it comes back to
    /// the camera through `on_decoded`. `Ok(true)`: the camera's oldest
    /// waiting keyframe left the line for it. `Err`: why the decoder cannot
    /// take keyframes (it could not be built): the camera decodes its own.
    fn submit(&self, sh: &Arc<Shared>, job: Job) -> Result<bool, Arc<CameraError>> {
        let mut s = self.work.state.lock();
        if let Some(why) = &s.broken {
            return Err(why.clone());
        }
        if !s.running {
            // Built on the camera's thread, so that a decoder that cannot
            // be made sends this very keyframe to the camera's own.
            let run = match DecoderRun::build(&self.kind) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(decoder = %self.kind.decoder, error = %e, "no shared keyframe decoder: cameras keep their own");
                    let e = Arc::new(e);
                    s.broken = Some(e.clone());
                    return Err(e);
                }
            };
            let (work, kind) = (self.work.clone(), self.kind.clone());
            let spawned = std::thread::Builder::new()
                .name("outpost-keyframes".into())
                .spawn(move || serve(work, kind, run));
            if let Err(e) = spawned {
                let why = Arc::new(CameraError::Thread {
                    what: "the shared decoder's thread",
                    source: e,
                });
                s.broken = Some(why.clone());
                return Err(why);
            }
            s.running = true;
        }
        let out = s.line.push(Arc::as_ptr(sh) as usize, job);
        drop(s);
        self.work.wake.notify_one();
        Ok(out.is_some())
    }
}

/// The decoder's thread: takes the cameras' keyframes in turn and decodes
/// each, until no camera uses the decoder.
fn serve(work: Arc<Work>, kind: Kind, run: DecoderRun) {
    let mut run = Some(run);
    let mut id = 0u64;
    // Whose keyframe the decoder had last, if it decoded completely: the
    // next keyframe of another camera, or after a failure, gets new
    // decoder contexts.
    let mut last: Option<usize> = None;
    loop {
        let (camera, job) = {
            let mut s = work.state.lock();
            loop {
                if s.closed {
                    s.running = false;
                    return;
                }
                if let Some(next) = s.line.pop() {
                    break next;
                }
                work.wake.wait(&mut s);
            }
        };
        let Some(sh) = job.camera.upgrade() else {
            continue;
        };
        if run.is_none() {
            match DecoderRun::build(&kind) {
                Ok(r) => run = Some(r),
                Err(e) => {
                    tracing::warn!(decoder = %kind.decoder, error = %e, "the shared keyframe decoder could not be rebuilt: cameras keep their own");
                    let why = format!("the shared decoder could not be rebuilt ({e})");
                    let lost = {
                        let mut s = work.state.lock();
                        s.broken = Some(Arc::new(e));
                        s.running = false;
                        s.line.drain()
                    };
                    for j in std::iter::once(job).chain(lost.into_iter().map(|(_, j)| j)) {
                        if let Some(sh) = j.camera.upgrade() {
                            bad_frame(&sh, &why);
                        }
                    }
                    return;
                }
            }
        }
        let Some(r) = run.as_mut() else { continue };
        // A number stands in for the keyframe's timestamp, increasing.
        id += 1;
        let fresh = last != Some(camera);
        last = None;
        match r.decode(job, id, fresh) {
            Ok(Ok(())) => {
                sh.corrupt_keyframes.store(0, Ordering::Relaxed);
                last = Some(camera);
            }
            Ok(Err((mismatch, parser))) => corrupt(&sh, &mismatch, &parser),
            Err(e) => {
                tracing::warn!(error = %e, "shared keyframe decoder failed; rebuilding it");
                bad_frame(&sh, &format!("{e}: the shared decoder is rebuilt"));
                run = None;
            }
        }
    }
}

fn bad_frame(sh: &Shared, why: &str) {
    for r in &sh.readers().list {
        r.ctx.count_drop("bad_frame", why);
    }
}

/// A camera's keyframe that did not decode completely: dropped, counted
/// and shown as the camera's error; after [`CORRUPT_IN_A_ROW`] in a row the
/// camera's pipeline fails with that reason (it is down and reconnects).
fn corrupt(sh: &Shared, why: &Mismatch, parser: &glib::WeakRef<gst::Element>) {
    let detail = format!("a keyframe did not decode completely: {why}; dropped");
    for r in &sh.readers().list {
        r.ctx.count_drop("corrupt_keyframe", &detail);
    }
    sh.each(|s| s.set_error(&detail));
    // The camera is not silent (its keyframes come): whether it is down is
    // decided here, by how many in a row failed, not by the stall timer.
    sh.last_decoded_ms.store(sh.now_ms(), Ordering::Relaxed);
    let n = sh.corrupt_keyframes.fetch_add(1, Ordering::Relaxed) + 1;
    if n >= CORRUPT_IN_A_ROW {
        sh.corrupt_keyframes.store(0, Ordering::Relaxed);
        tracing::warn!(camera = %sh.shown, name = %sh.def.name, "{n} keyframes in a row did not decode completely ({why}): reconnecting");
        if let Some(parser) = parser.upgrade() {
            gst::element_error!(
                parser,
                gst::StreamError::Decode,
                (
                    "{} keyframes in a row did not decode completely ({}; dropped as corrupt_keyframe): reconnecting",
                    n,
                    why
                )
            );
        }
    }
}

/// The keyframe in the decoders now: where its picture goes, and what the
/// checking decoder made of it.
#[derive(Default)]
struct Slots {
    /// The picture of the decoder with slice threads.
    check: Option<(gst::Buffer, gst::Caps)>,
    /// What became of the keyframe in the delivering decoder (`None`: it
    /// gave no picture).
    verdict: Option<Result<(), Mismatch>>,
    /// Whose keyframe it is, until its picture went to the camera.
    current: Option<Delivery>,
}

struct Delivery {
    camera: Weak<Shared>,
    id: u64,
    pts: Option<gst::ClockTime>,
    captured: SystemTime,
}

/// A GStreamer pipeline fed from the decoder's thread through a pad of its
/// own: each push returns once every element is done with the keyframe.
struct Chain {
    pipeline: gst::Pipeline,
    feed: gst::Pad,
    decoder: gst::Element,
    caps: gst::Caps,
    segment: gst::FormattedSegment<gst::ClockTime>,
}

impl Drop for Chain {
    fn drop(&mut self) {
        let _ = self.pipeline.set_state(gst::State::Null);
    }
}

impl Chain {
    /// Links a feed pad into `first`, starts the pipeline and the stream.
    fn start(
        pipeline: gst::Pipeline,
        first: &gst::Element,
        decoder: gst::Element,
        caps: &gst::Caps,
    ) -> Result<Chain, CameraError> {
        let sink = first.static_pad("sink").ok_or(CameraError::Shape(
            "the shared decoder's parser has no sink pad",
        ))?;
        let feed = gst::Pad::builder(gst::PadDirection::Src)
            .name("keyframes")
            .build();
        feed.link(&sink)
            .map_err(|e| CameraError::runtime("feeding the shared decoder", e))?;
        feed.set_active(true)
            .map_err(|e| CameraError::runtime("feeding the shared decoder", e))?;
        pipeline
            .set_state(gst::State::Playing)
            .map_err(|e| CameraError::runtime("the shared decoder did not start", e))?;
        let chain = Chain {
            pipeline,
            feed,
            decoder,
            caps: caps.clone(),
            segment: gst::FormattedSegment::<gst::ClockTime>::new(),
        };
        if !chain.stream() {
            return Err(CameraError::Runtime {
                what: "starting the shared decoder's stream",
                reason: "refused".into(),
            });
        }
        Ok(chain)
    }

    /// (Re)starts the stream: its start, caps and a time segment.
    fn stream(&self) -> bool {
        self.feed
            .push_event(gst::event::StreamStart::new("outpost-keyframes"))
            && self.feed.push_event(gst::event::Caps::new(&self.caps))
            && self
                .feed
                .push_event(gst::event::Segment::new(&self.segment))
    }

    /// Empties the pipeline: the decoder keeps no reference, picture to
    /// conceal from or frame to reorder of what it had decoded.
    fn flush(&self) -> bool {
        self.feed.push_event(gst::event::FlushStart::new())
            && self.feed.push_event(gst::event::FlushStop::new(false))
            && self
                .feed
                .push_event(gst::event::Segment::new(&self.segment))
    }

    /// Empties the pipeline and gives it a new decoder context: libav
    /// keeps state a flush does not clear (a keyframe cut short changed
    /// how the next one decoded, after a flush, whichever camera's it was).
    fn reset(&self) -> bool {
        self.decoder.set_state(gst::State::Ready).is_ok()
            && self.decoder.set_state(gst::State::Playing).is_ok()
            && self.feed.push_event(gst::event::FlushStart::new())
            && self.feed.push_event(gst::event::FlushStop::new(false))
            && self.stream()
    }

    /// The first error on the pipeline's bus, reading every message there
    /// (nothing else reads them: they would pile up).
    fn failed(&self) -> Option<CameraError> {
        let bus = self.pipeline.bus()?;
        let mut failed = None;
        while let Some(msg) = bus.pop() {
            if failed.is_none() {
                failed = CameraError::from_bus(&msg);
            }
        }
        failed
    }
}

/// The shared decoder's two pipelines: the one whose pictures go to the
/// cameras (parser, decoder on one thread, the camera tail: colour
/// conversion, scaling, an appsink), and the one that checks them
/// (parser, decoder with slice threads, a fakesink).
struct DecoderRun {
    check: Chain,
    deliver: Chain,
    slots: Arc<Mutex<Slots>>,
}

impl DecoderRun {
    fn build(k: &Kind) -> Result<DecoderRun, CameraError> {
        let slots = Arc::new(Mutex::new(Slots::default()));
        let check = {
            let p = gst::Pipeline::new();
            let parse = element(k.parser)?;
            let dec = decoder(k, false)?;
            let sink = gst::ElementFactory::make("fakesink")
                .property("sync", false)
                .property("async", false)
                .build()
                .map_err(|_| CameraError::missing("fakesink"))?;
            p.add_many([&parse, &dec, &sink])
                .map_err(|e| CameraError::runtime("building the shared decoder", e))?;
            gst::Element::link_many([&parse, &dec, &sink])
                .map_err(|e| CameraError::runtime("building the shared decoder", e))?;
            add_key_units_probe(&parse, || true)?;
            let s = slots.clone();
            dec.static_pad("src")
                .ok_or(CameraError::Shape("the shared decoder has no source pad"))?
                .add_probe(gst::PadProbeType::BUFFER, move |pad, info| {
                    if let (Some(buffer), Some(caps)) = (info.take_buffer(), pad.current_caps()) {
                        s.lock().check = Some((buffer, caps));
                    }
                    gst::PadProbeReturn::Handled
                });
            Chain::start(p, &parse, dec, &k.caps)?
        };
        let deliver = {
            let p = from_plan(&rgb_tail(k.size))?;
            let parse = element(k.parser)?;
            let dec = decoder(k, true)?;
            let convert = p
                .by_name("outpost_convert")
                .ok_or(CameraError::Shape("no outpost_convert element"))?;
            p.add_many([&parse, &dec])
                .map_err(|e| CameraError::runtime("building the shared decoder", e))?;
            gst::Element::link_many([&parse, &dec, &convert])
                .map_err(|e| CameraError::runtime("building the shared decoder", e))?;
            add_key_units_probe(&parse, || true)?;
            let s = slots.clone();
            dec.static_pad("src")
                .ok_or(CameraError::Shape("the shared decoder has no source pad"))?
                .add_probe(gst::PadProbeType::BUFFER, move |pad, info| {
                    let caps = pad.current_caps();
                    let Some(buffer) = info.buffer() else {
                        return gst::PadProbeReturn::Ok;
                    };
                    let mut s = s.lock();
                    let verdict = match (s.check.take(), caps) {
                        (Some((b, c)), Some(caps)) => same_picture(&b, &c, buffer, &caps),
                        _ => Err(Mismatch::OneDecode),
                    };
                    // A keyframe with a picture that failed stays failed.
                    let verdict = match s.verdict.take() {
                        Some(Err(e)) => Err(e),
                        _ => verdict,
                    };
                    let pass = verdict.is_ok();
                    s.verdict = Some(verdict);
                    drop(s);
                    if pass {
                        gst::PadProbeReturn::Ok
                    } else {
                        drop(info.take_buffer());
                        gst::PadProbeReturn::Handled
                    }
                });
            let sink = p
                .by_name("outpost")
                .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
                .ok_or(CameraError::Shape("the decoder has no appsink"))?;
            take_raw_frames(&sink);
            // Every frame is some camera's: none is dropped here.
            sink.set_drop(false);
            sink.set_property("async", false);
            let s = slots.clone();
            sink.set_callbacks(
                gst_app::AppSinkCallbacks::builder()
                    .new_sample(move |sink| {
                        if let Ok(sample) = sink.pull_sample() {
                            route(&s, &sample);
                        }
                        Ok(gst::FlowSuccess::Ok)
                    })
                    .build(),
            );
            Chain::start(p, &parse, dec, &k.caps)?
        };
        tracing::info!(decoder = %k.decoder, caps = %k.caps, "shared keyframe decoder started");
        Ok(DecoderRun {
            check,
            deliver,
            slots,
        })
    }

    /// Decodes a camera's keyframe in both pipelines, emptied first (and
    /// with new decoder contexts when `fresh`); a complete one goes to the
    /// camera on the way (`route`). `Ok(Err)`: it did not decode
    /// completely (with the camera's parser). `Err`: a pipeline failed (it
    /// is rebuilt).
    #[allow(clippy::type_complexity)]
    fn decode(
        &mut self,
        job: Job,
        id: u64,
        fresh: bool,
    ) -> Result<Result<(), (Mismatch, glib::WeakRef<gst::Element>)>, CameraError> {
        let emptied = if fresh {
            self.check.reset() && self.deliver.reset()
        } else {
            self.check.flush() && self.deliver.flush()
        };
        if !emptied {
            return Err(CameraError::Runtime {
                what: "emptying the shared decoder",
                reason: "refused".into(),
            });
        }
        let Job {
            camera,
            parser,
            mut buffer,
            pts,
            captured,
        } = job;
        *self.slots.lock() = Slots {
            current: Some(Delivery {
                camera,
                id,
                pts,
                captured,
            }),
            ..Slots::default()
        };
        {
            let b = buffer.make_mut();
            let t = gst::ClockTime::from_mseconds(id);
            b.set_pts(t);
            b.set_dts(t);
            b.set_duration(gst::ClockTime::NONE);
        }
        let pushed = self
            .check
            .feed
            .push(buffer.clone())
            .and_then(|_| self.deliver.feed.push(buffer));
        let verdict = {
            let mut s = self.slots.lock();
            let v = s.verdict.take();
            *s = Slots::default();
            v
        };
        if let Some(e) = self.check.failed().or_else(|| self.deliver.failed()) {
            return Err(e);
        }
        if let Err(e) = pushed {
            return Err(CameraError::runtime(
                "the shared decoder failed a keyframe",
                e,
            ));
        }
        Ok(verdict
            .unwrap_or(Err(Mismatch::NoPicture))
            .map_err(|m| (m, parser)))
    }
}

fn element(factory: &str) -> Result<gst::Element, CameraError> {
    gst::ElementFactory::make(factory)
        .build()
        .map_err(|_| CameraError::missing(factory))
}

/// The kind's decoder: on one thread for the pictures the cameras get
/// (`deliver`: libav conceals what a keyframe left out from the rest of
/// its picture), on slice threads for the check (libav leaves it as it
/// was). Neither ever gives up on errors: a camera's broken keyframe must
/// not stop the others' decoding.
fn decoder(k: &Kind, deliver: bool) -> Result<gst::Element, CameraError> {
    let dec = element(&k.decoder)?;
    if dec.find_property("max-errors").is_some() {
        dec.set_property("max-errors", -1i32);
    }
    if dec.find_property("max-threads").is_some() {
        dec.set_property("max-threads", if deliver { 1i32 } else { 2i32 });
    }
    if !deliver && dec.find_property("thread-type").is_some() {
        dec.set_property_from_str("thread-type", "slice");
    }
    Ok(dec)
}

/// A complete keyframe's picture back to the camera whose keyframe it was.
fn route(slots: &Mutex<Slots>, sample: &gst::Sample) {
    let (Some(buffer), Some(caps)) = (sample.buffer_owned(), sample.caps()) else {
        return;
    };
    let Some(d) = slots.lock().current.take() else {
        return;
    };
    if buffer.pts() != Some(gst::ClockTime::from_mseconds(d.id)) {
        return;
    }
    let Some(sh) = d.camera.upgrade() else {
        return;
    };
    let mut buffer = buffer;
    {
        let b = buffer.make_mut();
        b.set_pts(d.pts);
        b.set_dts(gst::ClockTime::NONE);
    }
    on_decoded(&sh, buffer, caps, d.captured);
}

/// The parser that makes a stream of these caps' codec.
fn parser_for(caps: &gst::CapsRef) -> Option<&'static str> {
    match caps.structure(0)?.name().as_str() {
        "video/x-h264" => Some("h264parse"),
        _ => None,
    }
}

/// Why a stream of these parsed caps cannot share a decoder, if it cannot.
fn not_shareable(caps: &gst::CapsRef) -> Option<String> {
    let s = caps.structure(0)?;
    if parser_for(caps).is_none() {
        return Some(format!("{} is not shared", s.name()));
    }
    match s.get::<&str>("interlace-mode") {
        Ok("progressive") | Err(_) => None,
        Ok(mode) => Some(format!(
            "an interlaced stream ({mode}) is not shared: its decoder does not conceal fields"
        )),
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
) -> Result<(), CameraError> {
    let pad = parser
        .static_pad("src")
        .ok_or(CameraError::Shape("the parser has no source pad"))?;
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
        let Some(caps) = pad.current_caps() else {
            return gst::PadProbeReturn::Ok;
        };
        let parent = pad.parent_element();
        let submitted = match not_shareable(&caps) {
            Some(why) => Err(why),
            None => {
                let mut caps = caps.copy();
                if let Some(s) = caps.make_mut().structure_mut(0) {
                    s.remove_field("framerate");
                }
                let kind = Kind {
                    caps,
                    parser: "h264parse",
                    decoder: decoder.clone(),
                    size,
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
                let captured = match &parent {
                    Some(e) => capture_time(e, segment.as_ref(), buf.pts()),
                    None => SystemTime::now(),
                };
                let job = Job {
                    camera: Arc::downgrade(&sh),
                    parser: parent
                        .as_ref()
                        .map(|p| p.downgrade())
                        .unwrap_or_default(),
                    buffer: buf.copy(),
                    pts: buf.pts(),
                    captured,
                };
                dec.submit(&sh, job).map_err(|e| e.to_string())
            }
        };
        match submitted {
            Ok(false) => {}
            Ok(true) => {
                let why = format!(
                    "{WAITING_PER_CAMERA} keyframes of the camera already wait for the shared decoder: its oldest dropped"
                );
                for r in &sh.readers().list {
                    r.ctx.count_drop("decoder_behind", &why);
                }
            }
            Err(why) if own => {
                tracing::debug!(name = %sh.def.name, why = %why, "keyframe to the camera's own decoder");
                return gst::PadProbeReturn::Ok;
            }
            // No decoder of its own this connection: the next has one.
            Err(why) => {
                sh.shared_decoder_failed.store(true, Ordering::Relaxed);
                if let Some(parser) = parent {
                    gst::element_error!(
                        parser,
                        gst::CoreError::Failed,
                        ["no shared keyframe decoder ({}): reconnecting with a decoder of its own", why]
                    );
                }
            }
        }
        super::fanout::consume(info)
    });
    Ok(())
}

/// Whether a chain's decoder (its third element) is one whose keyframes a
/// shared decoder takes: libav's H.264 decoder, whose behaviour with
/// keyframes only, and with keyframes cut short, is known.
fn shareable(chain: &[&str]) -> bool {
    chain.get(2) == Some(&"avdec_h264")
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
pub(super) fn parser_end() -> Result<gst::Element, CameraError> {
    gst::ElementFactory::make("fakesink")
        .property("sync", false)
        .property("async", false)
        .build()
        .map_err(|_| CameraError::missing("fakesink"))
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
) -> Result<(), CameraError> {
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
        dropped: Mutex<mpsc::Sender<&'static str>>,
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
            let _ = self.dropped.lock().send(reason);
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
        /// Each drop's reason as it is counted.
        dropped: mpsc::Receiver<&'static str>,
        _shared: Arc<Shared>,
    }

    fn camera(name: &str, decoders: &Arc<KeyframeDecoders>) -> Camera {
        let (tx, rx) = mpsc::channel();
        let (dropped_tx, dropped) = mpsc::channel();
        let sink = Arc::new(Collect {
            frames: Mutex::new(tx),
            drops: Mutex::new(Vec::new()),
            dropped: Mutex::new(dropped_tx),
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
            modbus: Default::default(),
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
            dropped,
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

    /// Keyframes of a test pattern (`n` of them, each an H.264 access
    /// unit with its parameter sets), as every camera of a kind encodes
    /// them: 25 fps, constrained baseline; `x264`: more encoder options.
    fn keyframes(pattern: &str, (w, h): (u32, u32), n: usize, x264: &str) -> Vec<Vec<u8>> {
        let p = gst::parse::launch(&format!(
            "videotestsrc num-buffers={n} pattern={pattern} ! \
             video/x-raw,format=I420,width={w},height={h},framerate=25/1 ! \
             x264enc speed-preset=ultrafast key-int-max=1 threads=1 {x264} ! \
             video/x-h264,profile=constrained-baseline ! h264parse config-interval=-1 ! \
             video/x-h264,stream-format=byte-stream,alignment=au ! appsink name=out sync=false"
        ))
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
        let sink = p
            .by_name("out")
            .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
            .unwrap();
        p.set_state(gst::State::Playing).unwrap();
        let mut out = Vec::new();
        while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(30)) {
            out.push(sample.buffer().unwrap().map_readable().unwrap().to_vec());
        }
        let _ = p.set_state(gst::State::Null);
        assert_eq!(out.len(), n, "{pattern}");
        out
    }

    /// Where each NAL unit of an access unit starts (its start code) and
    /// its type.
    fn nal_units(au: &[u8]) -> Vec<(usize, u8)> {
        let mut v = Vec::new();
        let mut i = 0;
        while i + 3 < au.len() {
            if au[i..i + 3] == [0, 0, 1] {
                let start = if i > 0 && au[i - 1] == 0 { i - 1 } else { i };
                v.push((start, au[i + 3] & 0x1f));
                i += 3;
            } else {
                i += 1;
            }
        }
        v
    }

    /// Where the first IDR slice's header byte is.
    fn idr_at(au: &[u8]) -> usize {
        let (start, _) = nal_units(au)
            .into_iter()
            .find(|(_, t)| *t == 5)
            .expect("an IDR slice");
        start + if au[start + 2] == 0 { 4 } else { 3 }
    }

    /// The keyframe cut short: its IDR slices to an eighth of their bytes.
    fn cut_short(au: &[u8]) -> Vec<u8> {
        let at = idr_at(au);
        au[..at + (au.len() - at) / 8].to_vec()
    }

    /// The keyframe with its parameter sets and an IDR slice of noise after
    /// the first bytes of its header.
    fn random_idr(au: &[u8]) -> Vec<u8> {
        let at = idr_at(au);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let noise = (at + 4..au.len()).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        });
        au[..at + 4].iter().copied().chain(noise).collect()
    }

    /// The keyframe without its second slice, as a depayloader hands it on
    /// after losing one of its packets.
    fn slice_lost(au: &[u8]) -> Vec<u8> {
        let nals = nal_units(au);
        let slices: Vec<usize> = nals
            .iter()
            .enumerate()
            .filter(|(_, (_, t))| *t == 5)
            .map(|(i, _)| i)
            .collect();
        assert!(slices.len() >= 3, "{} slices", slices.len());
        let (from, to) = (nals[slices[1]].0, nals[slices[1] + 1].0);
        [&au[..from], &au[to..]].concat()
    }

    fn push_keyframe(c: &Camera, data: &[u8], n: u64) {
        let mut b = gst::Buffer::from_slice(data.to_vec());
        {
            let b = b.get_mut().unwrap();
            let t = gst::ClockTime::from_mseconds(40 * n);
            b.set_pts(t);
            b.set_dts(t);
        }
        c.feed.push(b).unwrap();
    }

    /// The picture a camera got next.
    fn next_picture(c: &Camera) -> bytes::Bytes {
        c.frames
            .recv_timeout(Duration::from_secs(20))
            .expect("the camera's keyframe came back")
            .payload
    }

    /// A camera's keyframe cut short, made of noise or missing a slice,
    /// between other cameras' keyframes of solid colours in one shared
    /// decoder: the camera never gets a picture of it (before, the part
    /// it lacked was filled from a picture another camera's keyframe had
    /// left in the decoder, and the camera got that), the keyframe is its
    /// `corrupt_keyframe`, and its next keyframe decodes to its own
    /// picture, bit for bit. The others lose nothing.
    #[test]
    fn a_broken_keyframe_never_shows_another_cameras_picture() {
        gst::init().unwrap();
        let size = (320, 240);
        let solid: Vec<Vec<u8>> = ["red", "green", "blue"]
            .iter()
            .map(|p| keyframes(p, size, 1, "").remove(0))
            .collect();
        let noise = keyframes("snow", size, 1, "option-string=slices=4").remove(0);
        let decoders = Arc::new(KeyframeDecoders::default());
        let others: Vec<Camera> = ["a", "c", "d"]
            .iter()
            .map(|n| camera(n, &decoders))
            .collect();
        let b = camera("b", &decoders);
        let mut n = 0;
        let mut tick = || {
            n += 1;
            n
        };
        push_keyframe(&b, &noise, tick());
        let own = next_picture(&b);
        let mut theirs = Vec::new();
        for (c, k) in others.iter().zip(&solid) {
            push_keyframe(c, k, tick());
            theirs.push(next_picture(c));
        }
        let broken = [
            ("cut short", cut_short(&noise)),
            ("noise", random_idr(&noise)),
            ("a slice lost", slice_lost(&noise)),
        ];
        for (i, (what, k)) in broken.iter().enumerate() {
            // Another camera's picture is the last the decoder made.
            let (c, key) = (&others[i], &solid[i]);
            push_keyframe(c, key, tick());
            assert!(next_picture(c) == theirs[i]);
            push_keyframe(&b, k, tick());
            push_keyframe(&b, &noise, tick());
            let got = next_picture(&b);
            // Luma where the picture is another camera's, not b's own.
            let foreign = (0..320 * 240)
                .filter(|&i| got[i] != own[i] && theirs.iter().any(|t| t[i] == got[i]))
                .count();
            assert!(
                got == own,
                "the keyframe {what} gave camera b a picture not its own: {:.0} % of it \
                 another camera's",
                foreign as f64 * 100.0 / (320.0 * 240.0)
            );
            assert!(b.frames.try_recv().is_err(), "{what}: a picture too many");
            assert_eq!(
                *b.sink.drops.lock(),
                vec!["corrupt_keyframe"; i + 1],
                "{what}"
            );
        }
        for c in &others {
            assert!(c.sink.drops.lock().is_empty(), "{:?}", c.sink.drops.lock());
            assert!(c.frames.try_recv().is_err());
        }
        assert_eq!(decoders.len(), 1, "one decoder for all the cameras");
    }

    /// Keyframes that keep failing take the camera down: its pipeline gets
    /// an error saying so, and none of them reached it as a picture.
    #[test]
    fn keyframes_failing_in_a_row_take_the_camera_down() {
        gst::init().unwrap();
        let noise = keyframes("snow", (320, 240), 1, "").remove(0);
        let decoders = Arc::new(KeyframeDecoders::default());
        let b = camera("b", &decoders);
        let bus = b._pipeline.bus().unwrap();
        for n in 0..CORRUPT_IN_A_ROW as u64 {
            push_keyframe(&b, &cut_short(&noise), n);
            // One at a time: none waits behind another (and is dropped).
            let reason = b.dropped.recv_timeout(Duration::from_secs(20));
            assert_eq!(reason, Ok("corrupt_keyframe"));
        }
        let msg = bus
            .timed_pop_filtered(gst::ClockTime::from_seconds(20), &[gst::MessageType::Error])
            .expect("an error on the camera's pipeline");
        let gst::MessageView::Error(e) = msg.view() else {
            unreachable!()
        };
        assert!(
            e.error()
                .to_string()
                .contains("keyframes in a row did not decode completely"),
            "{}",
            e.error()
        );
        assert!(b.frames.try_recv().is_err());
        assert_eq!(
            *b.sink.drops.lock(),
            vec!["corrupt_keyframe"; CORRUPT_IN_A_ROW as usize]
        );
    }

    /// A camera that sends keyframes far faster than the shared decoder
    /// decodes them loses its own (`decoder_behind`); another camera's
    /// keyframe sent behind the flood still comes back, and it loses none.
    /// (Before, the flood filled the line the cameras shared and the other
    /// camera's keyframe was the one dropped.)
    #[test]
    fn a_keyframe_flood_loses_the_flooders_keyframes_not_another_cameras() {
        gst::init().unwrap();
        let size = (640, 480);
        let flood = keyframes("snow", size, 8, "");
        let calm = keyframes("ball", size, 1, "").remove(0);
        let decoders = Arc::new(KeyframeDecoders::default());
        let f = camera("flood", &decoders);
        let a = camera("calm", &decoders);
        // Started with a keyframe each (the decoder built, both using it).
        push_keyframe(&a, &calm, 0);
        next_picture(&a);
        push_keyframe(&f, &flood[0], 0);
        next_picture(&f);
        for n in 1..200 {
            push_keyframe(&f, &flood[n as usize % flood.len()], n);
        }
        push_keyframe(&a, &calm, 1);
        next_picture(&a);
        assert!(a.sink.drops.lock().is_empty(), "{:?}", a.sink.drops.lock());
        let lost = f
            .sink
            .drops
            .lock()
            .iter()
            .filter(|r| **r == "decoder_behind")
            .count();
        assert!(
            lost > 0,
            "the flood lost nothing: {:?}",
            f.sink.drops.lock()
        );
        assert!(
            f.sink.drops.lock().iter().all(|r| *r == "decoder_behind"),
            "{:?}",
            f.sink.drops.lock()
        );
    }
}
