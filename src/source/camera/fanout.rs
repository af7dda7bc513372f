//! One camera, many readers (feature `camera`): what GStreamer's streaming
//! thread does with each frame. At the parser, the decode gate decides
//! whether a compressed frame reaches the decoder at all (`decode.rs`);
//! before colour conversion each reader's `fps` gate decides whether it
//! wants the decoded frame (none: the frame is dropped there, unconverted);
//! at the appsink the frame is made once and handed to every reader that
//! wanted it, each into its own latest-frame queue.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use bytes::Bytes;
use gstreamer as gst;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use gstreamer_video as gst_video;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::decode::{DecodeGate, Verdict};
use super::error::CameraError;
use super::{CameraDef, CameraEvent, CameraState, FpsGate, Scrubber, store_event};
use crate::preprocess::raw::{RawFormat, RawImage};
use crate::source::{Frame, SourceCtx};

/// A pipeline reading the camera.
pub(super) struct Reader {
    pub(super) ctx: SourceCtx,
    stream: Arc<str>,
    pub(super) state: Arc<CameraState>,
    /// Frames per second it takes (`None`: every frame).
    fps: Option<f64>,
    gate: Mutex<FpsGate>,
}

impl Reader {
    pub(super) fn new(
        ctx: SourceCtx,
        fps: Option<f64>,
        stream: Option<String>,
        shown: &str,
    ) -> Reader {
        let state = ctx
            .camera
            .clone()
            .unwrap_or_else(|| Arc::new(CameraState::new(shown.to_string())));
        Reader {
            stream: Arc::from(stream.as_deref().unwrap_or(ctx.pipeline.as_str())),
            state,
            fps,
            gate: Mutex::new(FpsGate::new(fps)),
            ctx,
        }
    }
}

/// The pipelines reading the camera now, swapped whole when a reload
/// gives the camera the new generation's pipelines.
pub(super) struct Readers {
    /// In config order; never empty (a camera is started for its readers).
    pub(super) list: Vec<Reader>,
    pub(super) pipelines: Vec<String>,
    /// Their generation stopped: frames go to no one until the next one's
    /// readers come (the camera decodes on meanwhile).
    parked: AtomicBool,
}

impl Readers {
    fn new(list: Vec<Reader>) -> Readers {
        Readers {
            pipelines: list.iter().map(|r| r.ctx.pipeline.clone()).collect(),
            list,
            parked: AtomicBool::new(false),
        }
    }

    fn fps(&self) -> Vec<Option<f64>> {
        self.list.iter().map(|r| r.fps).collect()
    }

    pub(super) fn parked(&self) -> bool {
        self.parked.load(Ordering::Relaxed)
    }
}

/// What one camera's runs need to know, shared with GStreamer's threads.
pub(super) struct Shared {
    pub(super) def: CameraDef,
    readers: ArcSwap<Readers>,
    /// Stops the camera: its host's token, or its readers' generation's.
    stop: CancellationToken,
    /// The camera without credentials.
    pub(super) shown: String,
    /// Takes the camera's credentials out of every text it shows.
    pub(super) scrubber: Scrubber,
    /// Milliseconds since `epoch` of the last decoded frame (0: none yet in this run).
    pub(super) last_frame_ms: AtomicU64,
    /// ... and of the last compressed frame at the parser.
    pub(super) last_input_ms: AtomicU64,
    /// ... and of the last frame out of the decoder (wanted by a reader or not).
    pub(super) last_decoded_ms: AtomicU64,
    pub(super) epoch: Instant,
    /// The decoder chain logged once at info, then at debug on rebuilds.
    pub(super) logged: AtomicBool,
    pub(super) decode: Mutex<DecodeGate>,
    /// No shared decoder could take the camera's keyframes: its next
    /// connection decodes with a decoder of its own (`keyframes.rs`).
    pub(super) shared_decoder_failed: AtomicBool,
    /// Keyframes in a row that did not decode completely in the shared
    /// decoder (`keyframes.rs`).
    pub(super) corrupt_keyframes: AtomicU32,
    /// Which readers take the frame now between the fps gate and the
    /// appsink (by its timestamp): set and read on the one streaming
    /// thread that carries the frame through colour conversion.
    admitted: Mutex<Option<Admitted>>,
}

/// The fps gates' answers for one frame, with the readers they were asked of.
type Admitted = (Option<gst::ClockTime>, Arc<Readers>, Vec<bool>);

impl Shared {
    pub(super) fn new(def: CameraDef, readers: Vec<Reader>, stop: CancellationToken) -> Shared {
        let shown = def.shown();
        let readers = Readers::new(readers);
        for r in &readers.list {
            r.state
                .set_camera(&def.name, &readers.pipelines, def.decode);
        }
        Shared {
            scrubber: Scrubber::for_camera(&def),
            decode: Mutex::new(DecodeGate::new(def.decode, &readers.fps())),
            shared_decoder_failed: AtomicBool::new(false),
            corrupt_keyframes: AtomicU32::new(0),
            def,
            readers: ArcSwap::from_pointee(readers),
            stop,
            shown,
            last_frame_ms: AtomicU64::new(0),
            last_input_ms: AtomicU64::new(0),
            last_decoded_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            logged: AtomicBool::new(false),
            admitted: Mutex::new(None),
        }
    }

    /// The pipelines reading the camera now.
    pub(super) fn readers(&self) -> Arc<Readers> {
        self.readers.load_full()
    }

    /// Their names, for the log.
    pub(super) fn pipelines(&self) -> String {
        self.readers.load().pipelines.join(",")
    }

    pub(super) fn stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// The readers' generation stopped: no frame goes to them any more.
    pub(super) fn park(&self) {
        self.readers.load().parked.store(true, Ordering::Relaxed);
    }

    /// A reload's new pipelines read the camera from now on: they take
    /// over its state as the old ones show it, and the decoder gets what
    /// their rates need (a change of mode waits for a keyframe, as ever).
    pub(super) fn swap(&self, readers: Vec<Reader>) {
        let old = self.readers.load_full();
        let readers = Readers::new(readers);
        for r in &readers.list {
            if let Some(o) = old.list.first() {
                r.state.take_over(&o.state);
            }
            r.state
                .set_camera(&self.def.name, &readers.pipelines, self.def.decode);
            r.ctx.set_state(r.state.state());
        }
        self.decode.lock().set_need(&readers.fps());
        old.parked.store(true, Ordering::Relaxed);
        self.readers.store(Arc::new(readers));
    }

    /// Applies `f` to every reader's view of the camera.
    pub(super) fn each(&self, f: impl Fn(&CameraState)) {
        for r in &self.readers.load().list {
            f(&r.state);
        }
    }

    fn add(&self, counter: impl Fn(&CameraState) -> &AtomicU64) {
        self.each(|s| {
            counter(s).fetch_add(1, Ordering::Relaxed);
        });
    }

    /// The camera's state, in its status and in every reader's source state.
    pub(super) fn set_state(&self, state: &'static str) {
        for r in &self.readers.load().list {
            r.state.set_state(state);
            r.ctx.set_state(state);
        }
    }

    /// Stores a `camera_up` / `camera_down` record, once for the camera,
    /// under its first reader's pipeline.
    pub(super) fn event(&self, error: Option<&str>) {
        let readers = self.readers.load();
        let cam = CameraEvent {
            camera: &self.shown,
            name: &self.def.name,
            pipelines: &readers.pipelines,
        };
        if let Some(first) = readers.list.first() {
            store_event(&first.ctx, &cam, error);
        }
    }

    /// A new run of the pipeline: the stream is watched afresh.
    pub(super) fn restart(&self) {
        self.last_frame_ms.store(0, Ordering::Relaxed);
        self.last_input_ms.store(0, Ordering::Relaxed);
        self.last_decoded_ms.store(0, Ordering::Relaxed);
        self.corrupt_keyframes.store(0, Ordering::Relaxed);
        let mut d = self.decode.lock();
        d.reset();
        let (mode, iv) = (d.mode(), d.interval_ns());
        drop(d);
        self.each(|s| s.set_decode(mode, iv.map(Duration::from_nanos)));
        *self.admitted.lock() = None;
    }

    /// Whether the decoder gets keyframes only now.
    pub(super) fn keyframes_only(&self) -> bool {
        self.decode.lock().mode() == "keyframes"
    }

    /// One compressed frame at stream time `t_ns` (`key`: it decodes
    /// alone), before the decoder: whether it goes on. Counts it, and the
    /// delta frames skipped; the caller counts what reaches the decoder.
    pub(super) fn gate(&self, t_ns: u64, key: bool) -> Verdict {
        self.last_input_ms.store(self.now_ms(), Ordering::Relaxed);
        let mut d = self.decode.lock();
        let before = d.mode();
        let verdict = d.frame(t_ns, key);
        let (mode, iv) = (d.mode(), d.interval_ns());
        drop(d);
        self.add(|s| &s.encoded_frames);
        if key || mode != before {
            self.each(|s| s.set_decode(mode, iv.map(Duration::from_nanos)));
        }
        if verdict == Verdict::Skip {
            self.add(|s| &s.delta_frames_skipped);
        }
        verdict
    }

    /// A compressed frame handed to the decoder.
    pub(super) fn count_decoder_input(&self) {
        self.add(|s| &s.decoder_frames_in);
    }

    /// The camera sent more than its bound; the connection is closed.
    pub(super) fn count_oversize(&self, what: &super::guard::Oversize) {
        self.add(|s| &s.oversize);
        tracing::warn!(camera = %self.shown, name = %self.def.name, kind = what.kind(), "{what}");
    }

    /// Keyframes stopped while only they were decoded: the next run decodes
    /// every frame until they come steadily again.
    pub(super) fn fall_back_to_every_frame(&self) {
        self.decode.lock().fall_back();
    }

    /// Logs the decoder chain: at info the first time, at debug on rebuilds.
    pub(super) fn log_chain(&self, chain: &str) {
        if !self.logged.swap(true, Ordering::Relaxed) {
            tracing::info!(camera = %self.shown, name = %self.def.name, elements = %chain, "camera elements");
        } else {
            tracing::debug!(name = %self.def.name, elements = %chain, "camera elements");
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        (self.epoch.elapsed().as_millis() as u64).max(1)
    }
}

/// Drops delta frames at the parser's source pad while keyframes alone
/// serve every reader, and counts what the decoder gets.
pub(super) fn add_decode_probe(parser: &gst::Element, sh: &Arc<Shared>) -> Result<(), CameraError> {
    let g = sh.clone();
    add_key_units_probe(parser, move || g.keyframes_only())?;
    let pad = parser
        .static_pad("src")
        .ok_or(CameraError::Shape("the parser has no source pad"))?;
    let g = sh.clone();
    pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        let Some(buf) = info.buffer() else {
            return gst::PadProbeReturn::Ok;
        };
        let key = !buf.flags().contains(gst::BufferFlags::DELTA_UNIT);
        // Stream time where the buffer has one: keyframe intervals measured
        // on it are free of the network's and the machine's jitter.
        let t = buf
            .pts()
            .map(|p| p.nseconds())
            .unwrap_or_else(|| g.epoch.elapsed().as_nanos() as u64);
        match g.gate(t, key) {
            Verdict::Decode => {
                g.count_decoder_input();
                gst::PadProbeReturn::Ok
            }
            Verdict::Skip => consume(info),
        }
    });
    Ok(())
}

/// While the decoder gets keyframes only, its input segment says so
/// (`TRICKMODE_KEY_UNITS`): GStreamer's video decoders then hand each
/// keyframe on as soon as it is decoded. Without the flag a decoder holds
/// frames for the reordering the stream declares (B-frames): libav held
/// each keyframe until two more had come, two keyframe intervals (seconds)
/// of frame age. The flag changes only at a keyframe, by a new segment
/// event sent to the decoder before that keyframe; segments coming from
/// upstream get the flag as it stands.
pub(super) fn add_key_units_probe(
    parser: &gst::Element,
    keyframes_only: impl Fn() -> bool + Send + Sync + 'static,
) -> Result<(), CameraError> {
    let pad = parser
        .static_pad("src")
        .ok_or(CameraError::Shape("the parser has no source pad"))?;
    let flagged = AtomicBool::new(false);
    let kinds = gst::PadProbeType::BUFFER | gst::PadProbeType::EVENT_DOWNSTREAM;
    pad.add_probe(kinds, move |pad, info| {
        match &mut info.data {
            Some(gst::PadProbeData::Event(ev)) => {
                if let gst::EventView::Segment(s) = ev.view() {
                    let want = flagged.load(Ordering::Relaxed);
                    if let Some(seg) = key_units(s.segment(), want) {
                        *ev = gst::event::Segment::new(&seg);
                    }
                }
            }
            Some(gst::PadProbeData::Buffer(buf)) => {
                // Only a keyframe may change the flag: delta frames pass
                // without asking (the question takes the gate's lock).
                if buf.flags().contains(gst::BufferFlags::DELTA_UNIT) {
                    return gst::PadProbeReturn::Ok;
                }
                let want = keyframes_only();
                if flagged.swap(want, Ordering::Relaxed) != want
                    && let Some(peer) = pad.peer()
                    && let Some(current) = peer.sticky_event::<gst::event::Segment>(0)
                    && let Some(seg) = key_units(current.segment(), want)
                    && !peer.send_event(gst::event::Segment::new(&seg))
                {
                    tracing::debug!("the decoder refused its new segment");
                }
            }
            _ => {}
        }
        gst::PadProbeReturn::Ok
    });
    Ok(())
}

/// `seg` with `TRICKMODE_KEY_UNITS` set (`on`) or cleared; None when it is
/// so already.
fn key_units(seg: &gst::Segment, on: bool) -> Option<gst::Segment> {
    let flag = gst::SegmentFlags::TRICKMODE_KEY_UNITS;
    if seg.flags().contains(flag) == on {
        return None;
    }
    let mut seg = seg.clone();
    let flags = if on {
        seg.flags() | flag
    } else {
        seg.flags() - flag
    };
    seg.set_flags(flags);
    Some(seg)
}

/// Drops the probe's buffer by taking it (`Handled`): returning `Drop`
/// with the buffer still in the probe made GStreamer 1.22 unref a NULL
/// buffer after the bindings had released it, one GStreamer-CRITICAL in
/// the log per dropped frame.
pub(super) fn consume(info: &mut gst::PadProbeInfo<'_>) -> gst::PadProbeReturn {
    drop(info.take_buffer());
    gst::PadProbeReturn::Handled
}

impl Shared {
    /// A decoded frame at `pts`: counted, and each reader's fps gate asked
    /// whether it takes it (`None`: the readers are parked, no one does).
    fn admit(&self, pts: Option<gst::ClockTime>) -> Option<(Arc<Readers>, Vec<bool>)> {
        self.add(|s| &s.frames_in);
        self.last_decoded_ms.store(self.now_ms(), Ordering::Relaxed);
        // The stream's own clock where frames carry it: the decoder's
        // varying delay (its first frame is slow) must not make a frame
        // look early and lose it, least of all when only keyframes come.
        let t = pts
            .map(|p| p.nseconds())
            .unwrap_or_else(|| self.epoch.elapsed().as_nanos() as u64);
        let readers = self.readers();
        if readers.parked() {
            return None;
        }
        let admitted = readers
            .list
            .iter()
            .map(|r| {
                let a = r.gate.lock().admit(t);
                if !a {
                    r.state.subsampled.fetch_add(1, Ordering::Relaxed);
                }
                a
            })
            .collect();
        Some((readers, admitted))
    }
}

/// Counts decoded frames and asks each reader's fps gate about them, before
/// colour conversion: a frame no reader wants goes no further. With `drop`
/// false (the gate on the appsink's own pad: a custom pipeline) such a
/// frame is let through and `on_sample` passes it by: GStreamer 1.22 unrefs
/// a buffer dropped there twice (a GStreamer-CRITICAL per dropped frame).
pub(super) fn add_gate_probe(pad: &gst::Pad, sh: &Arc<Shared>, drop: bool) {
    let g = sh.clone();
    pad.add_probe(gst::PadProbeType::BUFFER, move |_, info| {
        let pts = info.buffer().and_then(|b| b.pts());
        let (readers, admitted) = match g.admit(pts) {
            Some(a) => a,
            // Between generations: no one takes it.
            None => {
                let readers = g.readers();
                (readers.clone(), vec![false; readers.list.len()])
            }
        };
        if drop && !admitted.contains(&true) {
            return consume(info);
        }
        *g.admitted.lock() = Some((pts, readers, admitted));
        gst::PadProbeReturn::Ok
    });
}

/// When a frame at `pts` (in `segment`) was captured: now, less how far
/// the element's pipeline clock has run past the frame's running time, so
/// that decode and transfer delays count in the frame's age.
pub(super) fn capture_time(
    element: &gst::Element,
    segment: Option<&gst::Segment>,
    pts: Option<gst::ClockTime>,
) -> SystemTime {
    let now = SystemTime::now();
    let lag = (|| {
        let clock = element.clock()?;
        let base = element.base_time()?;
        let now_rt = clock.time().checked_sub(base)?;
        let seg = segment?.downcast_ref::<gst::ClockTime>()?;
        let rt = seg.to_running_time(pts?)?;
        now_rt.checked_sub(rt)
    })()
    .map(|d| Duration::from_nanos(d.nseconds()))
    .filter(|d| *d < Duration::from_secs(10))
    .unwrap_or_default();
    now.checked_sub(lag).unwrap_or(now)
}

/// A decoded frame (RGB, or I420 straight from the decoder): made once, and
/// into the queue of every reader whose gate took it, with its capture time.
pub(super) fn on_sample(sh: &Shared, sink: &gst_app::AppSink, sample: &gst::Sample) {
    let (Some(buffer), Some(caps)) = (sample.buffer_owned(), sample.caps()) else {
        return;
    };
    let captured = capture_time(sink.upcast_ref(), sample.segment(), buffer.pts());
    let admitted = sh.admitted.lock().take();
    let (readers, admitted) = match admitted {
        Some((pts, readers, a)) if pts == buffer.pts() => (readers, Some(a)),
        // Not through the gate (not expected: the gate sits on the same
        // thread just before): every reader gets it rather than none.
        _ => (sh.readers(), None),
    };
    deliver(sh, &readers, admitted.as_deref(), buffer, caps, captured);
}

/// A keyframe back from a decoder shared with other cameras
/// (`keyframes.rs`), with its own timestamp: through the readers' fps
/// gates and into their queues, as a frame of the camera's own decoder.
pub(super) fn on_decoded(
    sh: &Shared,
    buffer: gst::Buffer,
    caps: &gst::CapsRef,
    captured: SystemTime,
) {
    if let Some((readers, admitted)) = sh.admit(buffer.pts())
        && admitted.contains(&true)
    {
        deliver(sh, &readers, Some(&admitted), buffer, caps, captured);
    }
}

/// Hands a decoded frame to the readers `admitted` names (`None`: all).
fn deliver(
    sh: &Shared,
    readers: &Readers,
    admitted: Option<&[bool]>,
    buffer: gst::Buffer,
    caps: &gst::CapsRef,
    captured: SystemTime,
) {
    sh.last_frame_ms.store(sh.now_ms(), Ordering::Relaxed);
    if readers.parked() {
        return;
    }
    let takers: Vec<&Reader> = match admitted {
        Some(a) => readers
            .list
            .iter()
            .zip(a)
            .filter_map(|(r, a)| a.then_some(r))
            .collect(),
        None => readers.list.iter().collect(),
    };
    if takers.is_empty() {
        return;
    }
    let bad = |detail: &str| {
        for r in &takers {
            r.ctx.count_drop("bad_frame", detail);
        }
    };
    let Ok(info) = gst_video::VideoInfo::from_caps(caps) else {
        bad("caps are not raw video");
        return;
    };
    let (w, h) = (info.width(), info.height());
    let raw = match info.format() {
        gst_video::VideoFormat::Rgb => RawImage::rgb(w, h),
        gst_video::VideoFormat::I420 => RawImage {
            width: w,
            height: h,
            format: RawFormat::I420 {
                bt709: info.colorimetry().matrix() == gst_video::VideoColorMatrix::Bt709,
            },
        },
        other => {
            bad(&format!(
                "frames in {other:?}, not RGB or I420 (end a custom pipeline with videoconvert)"
            ));
            return;
        }
    };
    let Some(payload) = packed_payload(&info, &raw, buffer) else {
        bad("frame shorter than its caps");
        return;
    };
    sh.each(|s| s.set_size(w, h));
    for r in takers {
        // The payload is shared (a reference count), not copied.
        let mut frame = Frame::new(r.stream.clone(), payload.clone());
        frame.raw = Some(raw);
        frame.captured = Some(captured);
        // Each reader's queue drops its oldest frame: offering never waits,
        // so a slow reader never holds back the others.
        if r.ctx.sink.offer(frame).is_err() {
            r.ctx.count_drop("stale", "queue full");
        }
    }
}

/// The camera appsink's side of a frame: I420 straight from a software
/// decoder (videoconvert passes it through), RGB from anything else (see
/// `preprocess::raw`), in system memory with plane offsets from a video
/// meta where the decoder has one, never waiting for the clock.
pub(super) fn take_raw_frames(sink: &gst_app::AppSink) {
    if let Some(pad) = sink.static_pad("sink") {
        add_video_meta_probe(&pad);
    }
    sink.set_caps(Some(
        &gst_video::VideoCapsBuilder::new()
            .format_list([gst_video::VideoFormat::I420, gst_video::VideoFormat::Rgb])
            .build(),
    ));
    sink.set_sync(false);
}

/// Plane `i`'s (offset, stride) in bytes: from the buffer's video meta when
/// it has one, else from the caps.
fn plane_layout(
    info: &gst_video::VideoInfo,
    meta: Option<&(Vec<usize>, Vec<i32>)>,
    i: usize,
) -> (usize, usize) {
    let (offsets, strides) = match meta {
        Some((o, s)) => (o.as_slice(), s.as_slice()),
        None => (info.offset(), info.stride()),
    };
    (
        offsets.get(i).copied().unwrap_or(0),
        strides.get(i).copied().unwrap_or(0).max(0) as usize,
    )
}

/// Declares on the appsink's pad that frames may carry a video meta (plane
/// offsets and strides), for frames in system memory. An element whose
/// buffers are laid out otherwise than the caps say (padded rows, planes
/// apart: a V4L2 driver's stride, a decoder's aligned pool) may then push
/// them as they are instead of copying each into a tight buffer, and
/// `packed_payload` reads the planes where the meta puts them, only for
/// frames a pipeline takes. (gst-libav 1.22 copies every decoded H.264
/// frame all the same: out of libavcodec's buffer, or, decoding into a
/// pool, when it stamps a frame libavcodec still holds as a reference.)
fn add_video_meta_probe(pad: &gst::Pad) {
    pad.add_probe(gst::PadProbeType::QUERY_DOWNSTREAM, |_, info| {
        if let Some(q) = info.query_mut()
            && let gst::QueryViewMut::Allocation(a) = q.view_mut()
        {
            declare_video_meta(a);
        }
        gst::PadProbeReturn::Ok
    });
}

fn declare_video_meta(a: &mut gst::query::Allocation) {
    let system = match a.get() {
        (Some(caps), _) => caps
            .features(0)
            .is_none_or(|f| f.is_empty() || f.contains(gst::CAPS_FEATURE_MEMORY_SYSTEM_MEMORY)),
        (None, _) => false,
    };
    if system && a.find_allocation_meta::<gst_video::VideoMeta>().is_none() {
        a.add_allocation_meta::<gst_video::VideoMeta>(None);
    }
}

/// The frame's planes back to back, rows without padding: the GStreamer
/// buffer itself when it is laid out so (no copy), else packed.
fn packed_payload(
    info: &gst_video::VideoInfo,
    raw: &RawImage,
    buffer: gst::Buffer,
) -> Option<Bytes> {
    let (w, h) = (raw.width, raw.height);
    // A decoder that writes into its own padded pool (1080p is 1088 rows
    // there) says where the planes lie in the buffer's video meta; the caps'
    // layout holds only for buffers without one.
    let meta = buffer
        .meta::<gst_video::VideoMeta>()
        .filter(|m| m.width() == w && m.height() == h)
        .map(|m| (m.offset().to_vec(), m.stride().to_vec()));
    // (offset, stride, row bytes, rows) of each plane.
    let planes: Vec<(usize, usize, usize, usize)> = match raw.format {
        RawFormat::Rgb => vec![(0, w as usize * 3, h as usize)],
        RawFormat::I420 { .. } => {
            let (cw, ch) = raw.chroma_size();
            vec![
                (0, w as usize, h as usize),
                (1, cw as usize, ch as usize),
                (2, cw as usize, ch as usize),
            ]
        }
    }
    .into_iter()
    .map(|(i, row, rows)| {
        let (offset, stride) = plane_layout(info, meta.as_ref(), i);
        (offset, stride, row, rows)
    })
    .collect();
    let need = raw.len();
    let mut at = 0;
    let packed = planes.iter().all(|&(offset, stride, row, rows)| {
        let ok = offset == at && stride == row;
        at += row * rows;
        ok
    });
    if packed {
        return match buffer.into_mapped_buffer_readable() {
            Ok(m) if m.len() >= need => Some(Bytes::from_owner(m).slice(..need)),
            _ => None,
        };
    }
    // Padded rows or planes apart: pack them.
    let m = buffer.map_readable().ok()?;
    let mut out = Vec::with_capacity(need);
    for &(offset, stride, row, rows) in &planes {
        for y in 0..rows {
            let at = offset + y * stride;
            out.extend_from_slice(m.get(at..at + row)?);
        }
    }
    Some(Bytes::from(out))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn i420(w: u32, h: u32) -> RawImage {
        RawImage {
            width: w,
            height: h,
            format: RawFormat::I420 { bt709: false },
        }
    }

    /// A padded pool's buffer (strides wider than a row, the luma plane
    /// taller than the picture) packs to the picture's bytes when its video
    /// meta says where the planes lie, though the caps say otherwise.
    #[test]
    fn planes_are_read_where_the_video_meta_puts_them() {
        gst::init().unwrap();
        let (w, h) = (6u32, 4u32);
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::I420, w, h)
            .build()
            .unwrap();
        // Luma: stride 8, 6 rows (2 of padding); chroma: stride 4, 2 rows each.
        let offsets = [0usize, 48, 56];
        let strides = [8i32, 4, 4];
        let mut data = vec![0xEEu8; 64];
        let mut want = Vec::new();
        for (p, (&off, &stride)) in offsets.iter().zip(&strides).enumerate() {
            let (row, rows) = if p == 0 { (6, 4) } else { (3, 2) };
            for y in 0..rows {
                for x in 0..row {
                    let v = (p * 100 + y * 10 + x) as u8;
                    data[off + y * stride as usize + x] = v;
                    want.push(v);
                }
            }
        }
        let mut buffer = gst::Buffer::from_mut_slice(data);
        gst_video::VideoMeta::add_full(
            buffer.get_mut().unwrap(),
            gst_video::VideoFrameFlags::empty(),
            gst_video::VideoFormat::I420,
            w,
            h,
            &offsets,
            &strides,
        )
        .unwrap();
        let got = packed_payload(&info, &i420(w, h), buffer).unwrap();
        assert_eq!(&got[..], &want[..]);
    }

    /// A tight buffer without a meta is handed on as it is; one shorter than
    /// its caps is refused.
    #[test]
    fn tight_buffers_pass_and_short_ones_are_refused() {
        gst::init().unwrap();
        let (w, h) = (8u32, 2u32);
        let info = gst_video::VideoInfo::builder(gst_video::VideoFormat::I420, w, h)
            .build()
            .unwrap();
        let raw = i420(w, h);
        let data: Vec<u8> = (0..raw.len() as u8).collect();
        let got = packed_payload(&info, &raw, gst::Buffer::from_slice(data.clone())).unwrap();
        assert_eq!(&got[..], &data[..]);
        let short = gst::Buffer::from_slice(data[..raw.len() - 1].to_vec());
        assert!(packed_payload(&info, &raw, short).is_none());
    }

    /// The appsink's pad answers an allocation query for frames in system
    /// memory with the video meta; one for device memory it leaves alone.
    #[test]
    fn the_appsink_declares_the_video_meta_for_system_memory() {
        gst::init().unwrap();
        let sink = gst::ElementFactory::make("appsink").build().unwrap();
        let pad = sink.static_pad("sink").unwrap();
        add_video_meta_probe(&pad);
        let caps = |feature: Option<&str>| {
            let b = gst_video::VideoCapsBuilder::new()
                .format(gst_video::VideoFormat::I420)
                .width(1920)
                .height(1080)
                .framerate(gst::Fraction::new(30, 1));
            match feature {
                Some(f) => b.features([f]).build(),
                None => b.build(),
            }
        };
        let mut q = gst::query::Allocation::new(Some(&caps(None)), true);
        let _ = pad.query(&mut q);
        assert!(q.find_allocation_meta::<gst_video::VideoMeta>().is_some());
        let mut q = gst::query::Allocation::new(Some(&caps(Some("memory:NVMM"))), true);
        let _ = pad.query(&mut q);
        assert!(q.find_allocation_meta::<gst_video::VideoMeta>().is_none());
    }

    /// Frames out of a real H.264 decoder at 1080p (padded to 1088 rows in
    /// its pool), through the tail every built-in camera pipeline ends
    /// with, pack to the same bytes with the meta declared as without.
    #[test]
    fn decoded_frames_pack_the_same_with_and_without_the_meta() {
        gst::init().unwrap();
        const FRAMES: usize = 8;
        let run = |declare: bool| {
            let p = gst::parse::launch(&format!(
                "videotestsrc num-buffers={FRAMES} pattern=ball ! \
                 video/x-raw,format=I420,width=1920,height=1080,framerate=30/1 ! \
                 x264enc speed-preset=ultrafast tune=zerolatency threads=1 ! h264parse ! \
                 avdec_h264 ! videoconvert ! videoscale ! \
                 capsfilter caps=video/x-raw,format={{I420,RGB}} ! appsink name=outpost"
            ))
            .unwrap()
            .downcast::<gst::Pipeline>()
            .unwrap();
            let sink = p
                .by_name("outpost")
                .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
                .unwrap();
            if declare {
                add_video_meta_probe(&sink.static_pad("sink").unwrap());
            }
            p.set_state(gst::State::Playing).unwrap();
            let mut frames = Vec::new();
            while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(30)) {
                let info = gst_video::VideoInfo::from_caps(sample.caps().unwrap()).unwrap();
                let buffer = sample.buffer_owned().unwrap();
                let shape = (
                    buffer.size(),
                    buffer.meta::<gst_video::VideoMeta>().is_some(),
                );
                let raw = i420(info.width(), info.height());
                frames.push((packed_payload(&info, &raw, buffer).unwrap(), shape));
            }
            let _ = p.set_state(gst::State::Null);
            frames
        };
        let tight = 1920 * 1080 * 3 / 2;
        let plain = run(false);
        let declared = run(true);
        assert_eq!(plain.len(), FRAMES);
        assert_eq!(declared.len(), FRAMES);
        assert!(
            plain.iter().all(|(_, shape)| *shape == (tight, false)),
            "without the declaration frames are tight and carry no meta: {:?}",
            plain.iter().map(|f| f.1).collect::<Vec<_>>()
        );
        assert!(
            declared.iter().all(|(_, (_, meta))| *meta),
            "with it they carry one"
        );
        for (i, (a, b)) in plain.iter().zip(&declared).enumerate() {
            assert_eq!(a.0.len(), tight);
            assert!(a.0 == b.0, "frame {i} packs differently");
        }
    }

    /// One H.264 access unit: bytes, pts, dts, keyframe.
    pub(in crate::source::camera) type Unit = (
        Vec<u8>,
        Option<gst::ClockTime>,
        Option<gst::ClockTime>,
        bool,
    );

    /// A stream with B-frames (the decoder must reorder), a keyframe every
    /// 10 frames, as access units in decode order.
    pub(in crate::source::camera) fn b_frame_stream() -> Vec<Unit> {
        let p = gst::parse::launch(
            "videotestsrc num-buffers=60 pattern=ball ! \
             video/x-raw,format=I420,width=320,height=240,framerate=25/1 ! \
             x264enc speed-preset=fast bframes=2 b-adapt=false key-int-max=10 threads=1 ! \
             h264parse config-interval=-1 ! \
             video/x-h264,stream-format=byte-stream,alignment=au ! appsink name=out sync=false",
        )
        .unwrap()
        .downcast::<gst::Pipeline>()
        .unwrap();
        let sink = p
            .by_name("out")
            .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
            .unwrap();
        p.set_state(gst::State::Playing).unwrap();
        let mut units = Vec::new();
        while let Some(sample) = sink.try_pull_sample(gst::ClockTime::from_seconds(30)) {
            let b = sample.buffer().unwrap();
            let key = !b.flags().contains(gst::BufferFlags::DELTA_UNIT);
            let data = b.map_readable().unwrap().as_slice().to_vec();
            units.push((data, b.pts(), b.dts(), key));
        }
        let _ = p.set_state(gst::State::Null);
        units
    }

    /// A pad of the test's linked into `parse`, `p` playing, the stream
    /// started with H.264 access-unit caps and a time segment: each push
    /// returns once the elements downstream are done with the buffer.
    pub(in crate::source::camera) fn feed(
        p: &gst::Pipeline,
        parse: &gst::Element,
        stream: &str,
    ) -> gst::Pad {
        let feed = gst::Pad::builder(gst::PadDirection::Src)
            .name("feed")
            .build();
        feed.link(&parse.static_pad("sink").unwrap()).unwrap();
        feed.set_active(true).unwrap();
        p.set_state(gst::State::Playing).unwrap();
        assert!(feed.push_event(gst::event::StreamStart::new(stream)));
        let caps = gst::Caps::builder("video/x-h264")
            .field("stream-format", "byte-stream")
            .field("alignment", "au")
            .build();
        assert!(feed.push_event(gst::event::Caps::new(&caps)));
        let seg = gst::FormattedSegment::<gst::ClockTime>::new();
        assert!(feed.push_event(gst::event::Segment::new(&seg)));
        feed
    }

    /// Pushes `units` through parser and decoder synchronously (the test's
    /// own pad: each push returns once the decoder is done with the unit)
    /// and says how many frames had come out after each. `key_units`: the
    /// probe, asked through the flag whether keyframes only are decoded.
    fn decode(units: &[&Unit], key_units: Option<Arc<AtomicBool>>, then: &[&Unit]) -> Vec<usize> {
        let p = gst::Pipeline::new();
        let parse = gst::ElementFactory::make("h264parse").build().unwrap();
        let dec = gst::ElementFactory::make("avdec_h264")
            .property("max-threads", 1i32)
            .build()
            .unwrap();
        let sink = gst_app::AppSink::builder().sync(false).build();
        sink.set_property("async", false);
        sink.set_property("wait-on-eos", false);
        p.add_many([&parse, &dec, sink.upcast_ref()]).unwrap();
        gst::Element::link_many([&parse, &dec, sink.upcast_ref()]).unwrap();
        if let Some(flag) = &key_units {
            let f = flag.clone();
            add_key_units_probe(&parse, move || f.load(Ordering::SeqCst)).unwrap();
        }
        let feed = feed(&p, &parse, "b-frames");
        let mut out = 0;
        let mut seen = Vec::new();
        let mut push = |u: &Unit, seen: &mut Vec<usize>| {
            let mut b = gst::Buffer::from_slice(u.0.clone());
            {
                let b = b.get_mut().unwrap();
                b.set_pts(u.1);
                b.set_dts(u.2);
                if !u.3 {
                    b.set_flags(gst::BufferFlags::DELTA_UNIT);
                }
            }
            feed.push(b).unwrap();
            while sink.try_pull_sample(gst::ClockTime::ZERO).is_some() {
                out += 1;
            }
            seen.push(out);
        };
        for u in units {
            push(u, &mut seen);
        }
        if let Some(flag) = &key_units {
            flag.store(false, Ordering::SeqCst);
        }
        for u in then {
            push(u, &mut seen);
        }
        assert!(feed.push_event(gst::event::Eos::new()));
        while sink.try_pull_sample(gst::ClockTime::ZERO).is_some() {
            out += 1;
        }
        seen.push(out);
        let _ = p.set_state(gst::State::Null);
        seen
    }

    /// Keyframes alone into a decoder of a stream with B-frames: each one
    /// comes out as it goes in with the probe (without it the decoder held
    /// each for two more, seconds of delay at one keyframe a second); once
    /// every frame is decoded again (the flag cleared at a keyframe), no
    /// delta frame is lost to the decoder's keyframe mode.
    #[test]
    fn each_keyframe_leaves_the_decoder_as_it_enters_while_only_keyframes_are_decoded() {
        gst::init().unwrap();
        let units = b_frame_stream();
        assert!(
            units.windows(2).any(|w| w[1].1 < w[0].1),
            "the stream has no B-frames (presentation order = decode order)"
        );
        let keys: Vec<&Unit> = units.iter().filter(|u| u.3).collect();
        assert!(keys.len() >= 5, "{} keyframes", keys.len());
        let (first, last) = keys.split_at(4);
        // The last GOP whole: its keyframe and every frame up to the end.
        let at = units.iter().position(|u| std::ptr::eq(u, last[0])).unwrap();
        let gop: Vec<&Unit> = units[at..]
            .iter()
            .take_while(|u| !u.3 || std::ptr::eq(*u, last[0]))
            .collect();

        let held = decode(first, None, &[]);
        assert!(
            held[..4].iter().zip(1..).any(|(n, k)| *n < k),
            "without the probe the decoder should hold keyframes back: {held:?}"
        );
        let flag = Arc::new(AtomicBool::new(true));
        let seen = decode(first, Some(flag), &gop);
        assert_eq!(&seen[..4], &[1, 2, 3, 4], "a keyframe held back: {seen:?}");
        assert_eq!(
            seen.last().copied(),
            Some(4 + gop.len()),
            "frames of the whole GOP decoded after keyframes only: {seen:?}"
        );
    }
}
