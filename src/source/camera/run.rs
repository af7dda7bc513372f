//! The camera at run time: one supervising OS thread per camera builds the
//! GStreamer pipeline, watches its bus and its frames, and tears it down and
//! rebuilds it after a failure. Frames leave from GStreamer's streaming
//! thread (the appsink callback) straight into the pipeline's queue: no
//! async hop, no copy when the frame's rows are packed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use gstreamer as gst;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use gstreamer_video as gst_video;

use super::plan::{CapsPlan, ElementPlan, Prop, chain, rgb_tail, source_plan};
use super::{
    CameraConfig, CameraState, CameraUrl, FpsGate, Scrubber, Transport, pick_decoder,
    reconnect_backoff, store_event,
};
use crate::preprocess::raw::{RawFormat, RawImage};
use crate::record::Event;
use crate::source::{Frame, SourceCtx, SourceError};

/// How often free heap memory goes back to the system while cameras run.
#[cfg(target_env = "gnu")]
const TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// Frames are megabytes, allocated and freed by GStreamer's streaming
/// threads, and every reconnect makes new threads. With glibc's defaults
/// each new thread may get an arena of its own (up to 8 per core), and the
/// frames freed in an arena stay there: RSS climbed ~1 MiB per reconnect in
/// a 10-minute run. Two arenas bound that; frames then reuse the memory of
/// the frames before them. (A fixed 128 KiB mmap threshold, tried before,
/// maps and unmaps every frame: at 1080p the page faults of those copies
/// cost more CPU per frame than the decoder's colour conversion.)
pub fn bounded_malloc() {
    #[cfg(target_env = "gnu")]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes allocator parameters; it is
            // thread-safe in glibc and takes plain integers.
            let ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, 2) == 1 };
            if !ok {
                tracing::warn!("mallopt refused the camera allocator settings");
            }
            // Freed frames stay in the arenas' free lists, and glibc gives
            // back only what lies at the top of the main heap: RSS crept up
            // ~2 MiB a minute at 640x480 x 15 fps while the live heap stayed
            // flat (heaptrack). Handing the free pages back every 30 s bounds
            // it; the cost is one walk of two arenas.
            let spawned = std::thread::Builder::new()
                .name("malloc-trim".into())
                .spawn(|| {
                    loop {
                        std::thread::sleep(TRIM_EVERY);
                        // SAFETY: malloc_trim only returns free memory to the
                        // system; it is thread-safe in glibc.
                        unsafe { libc::malloc_trim(0) };
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "cannot start the malloc-trim thread");
            }
        });
    }
}

fn has(element: &str) -> bool {
    gst::ElementFactory::find(element).is_some()
}

/// What one run of a built pipeline needs to know, shared with GStreamer's threads.
struct Shared {
    ctx: SourceCtx,
    stream: Arc<str>,
    state: Arc<CameraState>,
    /// Takes the camera's credentials out of every text it shows.
    scrubber: Scrubber,
    /// Milliseconds since `epoch` of the last frame (0: none yet in this run).
    last_frame_ms: AtomicU64,
    epoch: Instant,
    gate: Mutex<FpsGate>,
    /// The decoder chain logged once at info, then at debug on rebuilds.
    logged: AtomicBool,
}

pub(super) fn spawn(
    cfg: CameraConfig,
    ctx: SourceCtx,
) -> Result<tokio::task::JoinHandle<()>, SourceError> {
    let setup = |detail: String| SourceError::Setup {
        pipeline: ctx.pipeline.clone(),
        kind: "camera",
        detail,
    };
    gst::init().map_err(|e| setup(format!("GStreamer: {e}")))?;
    // Normally done at daemon start already (before any thread made an arena).
    bounded_malloc();
    let url = cfg
        .url
        .as_deref()
        .map(CameraUrl::parse)
        .transpose()
        .map_err(setup)?;
    let state = ctx
        .camera
        .clone()
        .unwrap_or_else(|| Arc::new(CameraState::new(cfg.shown())));
    let shared = Arc::new(Shared {
        stream: Arc::from(ctx.pipeline.as_str()),
        state,
        scrubber: Scrubber::for_camera(&cfg),
        last_frame_ms: AtomicU64::new(0),
        epoch: Instant::now(),
        gate: Mutex::new(FpsGate::new(cfg.fps)),
        logged: AtomicBool::new(false),
        ctx,
    });
    tracing::info!(
        pipeline = %shared.ctx.pipeline,
        camera = %shared.state.camera,
        fps = cfg.fps.unwrap_or(0.0),
        stall_timeout_s = cfg.stall_timeout.as_secs_f64(),
        queue = cfg.queue,
        "camera source"
    );
    let thread = tokio::task::spawn_blocking(move || supervise(&cfg, url.as_ref(), &shared));
    Ok(tokio::spawn(async move {
        let _ = thread.await;
    }))
}

/// Why a run of the pipeline ended.
enum End {
    Stop,
    Failed { error: String, streamed: bool },
}

/// Builds, watches and rebuilds the camera's pipeline until the daemon stops.
fn supervise(cfg: &CameraConfig, url: Option<&CameraUrl>, sh: &Arc<Shared>) {
    let mut backoff = reconnect_backoff();
    // None: nothing reported yet; Some(up).
    let mut reported: Option<bool> = None;
    loop {
        if sh.ctx.stopping() {
            return;
        }
        let end = run_once(cfg, url, sh, &mut reported);
        let (error, streamed) = match end {
            End::Stop => return,
            // Once more here, where it is stored, logged and shown: the
            // network diagnosis was added after the first pass.
            End::Failed { error, streamed } => (sh.scrubber.scrub(&error), streamed),
        };
        if streamed {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        sh.state.reconnects.fetch_add(1, Ordering::Relaxed);
        sh.state.set_error(&error);
        sh.state.set_state("reconnecting");
        sh.ctx.set_state("reconnecting");
        tracing::warn!(
            pipeline = %sh.ctx.pipeline,
            camera = %sh.state.camera,
            error = %error,
            retry_in_ms = delay.as_millis() as u64,
            "camera down; reconnecting"
        );
        if reported != Some(false) {
            store_event(&sh.ctx, Event::camera_down(&sh.state.camera, &error));
            reported = Some(false);
        }
        let until = Instant::now() + delay;
        while Instant::now() < until {
            if sh.ctx.stopping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
        }
    }
}

/// One pipeline's life: built, played, watched until it fails or the daemon
/// stops, then set to NULL and dropped (every socket and buffer released).
fn run_once(
    cfg: &CameraConfig,
    url: Option<&CameraUrl>,
    sh: &Arc<Shared>,
    reported: &mut Option<bool>,
) -> End {
    let failed = |error: String, streamed: bool| End::Failed {
        error: sh.scrubber.scrub(&error),
        streamed,
    };
    let pipeline = match build(cfg, url, sh) {
        Ok(p) => p,
        Err(e) => return failed(e, false),
    };
    sh.last_frame_ms.store(0, Ordering::Relaxed);
    let started = Instant::now();
    let bus = pipeline.bus();
    let end = match pipeline.set_state(gst::State::Playing) {
        Err(_) => {
            // The reason is on the bus.
            let why = bus
                .as_ref()
                .and_then(|b| {
                    b.timed_pop_filtered(gst::ClockTime::ZERO, &[gst::MessageType::Error])
                })
                .map(|m| message_text(&m))
                .unwrap_or_else(|| "the pipeline refused to start".into());
            failed(why, false)
        }
        Ok(_) => watch(cfg, sh, &pipeline, bus.as_ref(), started, reported),
    };
    let end = match (end, url) {
        // rtspsrc says only "Failed to connect": ask the network why.
        (End::Failed { error, streamed }, Some(CameraUrl::Rtsp { location, .. }))
            if error.contains("Failed to connect") =>
        {
            End::Failed {
                error: format!("{error}: {}", diagnose_connect(location)),
                streamed,
            }
        }
        (end, _) => end,
    };
    // NULL joins the streaming threads and closes the sockets.
    let _ = pipeline.set_state(gst::State::Null);
    let weak = pipeline.downgrade();
    drop(bus);
    drop(pipeline);
    if weak.upgrade().is_some() {
        // Something still holds it: its buffers and decoder would leak with it.
        tracing::warn!(pipeline = %sh.ctx.pipeline, "camera pipeline still referenced after teardown");
    }
    end
}

/// Watches a playing pipeline: bus messages, first frame, stalls, shutdown.
fn watch(
    cfg: &CameraConfig,
    sh: &Arc<Shared>,
    pipeline: &gst::Pipeline,
    bus: Option<&gst::Bus>,
    started: Instant,
    reported: &mut Option<bool>,
) -> End {
    let mut streaming = false;
    let failed = |error: String, streaming: bool| End::Failed {
        error: sh.scrubber.scrub(&error),
        streamed: streaming,
    };
    loop {
        if sh.ctx.stopping() {
            return End::Stop;
        }
        if let Some(msg) = bus.and_then(|b| b.timed_pop(gst::ClockTime::from_mseconds(100))) {
            match msg.view() {
                gst::MessageView::Error(_) => return failed(message_text(&msg), streaming),
                gst::MessageView::Eos(_) => {
                    return failed("end of stream (the camera closed it)".into(), streaming);
                }
                gst::MessageView::Warning(w) => {
                    tracing::debug!(pipeline = %sh.ctx.pipeline, warning = %sh.scrubber.scrub(&w.error().to_string()), "camera warning");
                }
                _ => {}
            }
        }
        let last = sh.last_frame_ms.load(Ordering::Relaxed);
        if last != 0 && !streaming {
            streaming = true;
            sh.state.set_state("streaming");
            sh.ctx.set_state("streaming");
            tracing::info!(pipeline = %sh.ctx.pipeline, camera = %sh.state.camera, "camera streaming");
            if *reported != Some(true) {
                store_event(&sh.ctx, Event::camera_up(&sh.state.camera));
                *reported = Some(true);
            }
        }
        let since = if last == 0 {
            started
        } else {
            sh.epoch + Duration::from_millis(last)
        };
        if since.elapsed() > cfg.stall_timeout {
            let what = if streaming {
                "no frame"
            } else {
                "no first frame"
            };
            return failed(
                format!(
                    "{what} for {} s (stall_timeout)",
                    cfg.stall_timeout.as_secs_f64()
                ),
                streaming,
            );
        }
        let _ = pipeline;
    }
}

/// Why a TCP connection to an RTSP location fails (refused, unreachable,
/// name not found, timeout), in the operating system's words.
fn diagnose_connect(location: &str) -> String {
    use std::net::ToSocketAddrs;
    let rest = location.split_once("://").map_or(location, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let target = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        authority.to_string()
    } else {
        format!("{authority}:554")
    };
    let addrs = match target.to_socket_addrs() {
        Ok(a) => a.collect::<Vec<_>>(),
        Err(e) => return format!("cannot resolve {target}: {e}"),
    };
    let Some(addr) = addrs.first() else {
        return format!("{target} resolves to no address");
    };
    match std::net::TcpStream::connect_timeout(addr, Duration::from_secs(2)) {
        Ok(_) => format!("{target} accepts connections now"),
        Err(e) => format!("connect {target}: {e}"),
    }
}

fn message_text(msg: &gst::Message) -> String {
    match msg.view() {
        gst::MessageView::Error(e) => {
            let src = msg
                .src()
                .map(|s| s.name().to_string())
                .unwrap_or_else(|| "pipeline".into());
            match e.debug() {
                Some(d) => format!("{src}: {} ({})", e.error(), first_line(&d)),
                None => format!("{src}: {}", e.error()),
            }
        }
        _ => format!("{:?}", msg.type_()),
    }
}

/// GStreamer's debug strings start with the source file and function; the
/// part after the last newline is the human one.
fn first_line(d: &str) -> &str {
    d.rsplit('\n').next().unwrap_or(d).trim()
}

/// Builds the pipeline for the config: RTSP with its decoder chosen when
/// the stream's track is known, V4L2 and CSI from their element plans, a
/// custom `pipeline` from its launch description.
fn build(
    cfg: &CameraConfig,
    url: Option<&CameraUrl>,
    sh: &Arc<Shared>,
) -> Result<gst::Pipeline, String> {
    let size = cfg.width.zip(cfg.height);
    let pipeline = match (url, &cfg.pipeline) {
        (Some(CameraUrl::Rtsp { .. }), _) => {
            let p = from_plan(&rgb_tail(size))?;
            add_rtspsrc(&p, cfg, url, sh)?;
            p
        }
        (Some(u), _) => {
            if matches!(u, CameraUrl::Csi { .. }) && !has("nvarguscamerasrc") {
                return Err(
                    "csi:// needs nvarguscamerasrc (a Jetson with its GStreamer plugins)".into(),
                );
            }
            let plan = source_plan(cfg, u).ok_or("no element plan for this camera")?;
            let p = from_plan(&plan)?;
            sh.state
                .set_elements(&plan.iter().map(|e| e.factory).collect::<Vec<_>>());
            log_chain(sh, &chain(&plan));
            p
        }
        (None, Some(desc)) => {
            let p = launch(desc)?;
            let names = element_names(&p);
            sh.state
                .set_elements(&names.iter().map(String::as_str).collect::<Vec<_>>());
            log_chain(sh, "custom pipeline");
            p
        }
        (None, None) => return Err("no url and no pipeline".into()),
    };
    let sink = pipeline
        .by_name("outpost")
        .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
        .ok_or("the pipeline has no `appsink name=outpost`")?;
    // The fps gate sits before colour conversion when there is one of ours.
    let gate_pad = pipeline
        .by_name("outpost_convert")
        .and_then(|c| c.static_pad("sink"))
        .or_else(|| sink.static_pad("sink"))
        .ok_or("the appsink has no sink pad")?;
    let g = sh.clone();
    gate_pad.add_probe(gst::PadProbeType::BUFFER, move |_, _| {
        g.state.frames_in.fetch_add(1, Ordering::Relaxed);
        let t = g.epoch.elapsed().as_nanos() as u64;
        let admit = g.gate.lock().unwrap_or_else(|p| p.into_inner()).admit(t);
        if admit {
            gst::PadProbeReturn::Ok
        } else {
            g.state.subsampled.fetch_add(1, Ordering::Relaxed);
            gst::PadProbeReturn::Drop
        }
    });
    // I420 straight from a software decoder (videoconvert passes it
    // through), RGB from anything else: see `preprocess::raw`.
    sink.set_caps(Some(
        &gst_video::VideoCapsBuilder::new()
            .format_list([gst_video::VideoFormat::I420, gst_video::VideoFormat::Rgb])
            .build(),
    ));
    // Latest frame: the appsink keeps none of its own beyond one, and never
    // waits for the clock.
    sink.set_max_buffers(1);
    sink.set_drop(true);
    sink.set_sync(false);
    let s = sh.clone();
    sink.set_callbacks(
        gst_app::AppSinkCallbacks::builder()
            .new_sample(move |sink| {
                if let Ok(sample) = sink.pull_sample() {
                    on_sample(&s, sink, &sample);
                }
                Ok(gst::FlowSuccess::Ok)
            })
            .build(),
    );
    Ok(pipeline)
}

/// Makes a plan's elements in a new pipeline and links them in order. An
/// element whose source pad appears only once the stream is known
/// (`decodebin`) is linked when it appears.
fn from_plan(plan: &[ElementPlan]) -> Result<gst::Pipeline, String> {
    let p = gst::Pipeline::new();
    let mut prev: Option<gst::Element> = None;
    for ep in plan {
        let e = make(ep)?;
        p.add(&e).map_err(|x| format!("{}: {x}", ep.factory))?;
        if let Some(a) = prev.take() {
            link(&a, &e)?;
        }
        prev = Some(e);
    }
    Ok(p)
}

fn make(ep: &ElementPlan) -> Result<gst::Element, String> {
    let mut b = gst::ElementFactory::make(ep.factory);
    if let Some(n) = ep.name {
        b = b.name(n);
    }
    let e = b
        .build()
        .map_err(|_| format!("GStreamer element `{}` is missing", ep.factory))?;
    for (key, v) in &ep.props {
        set_prop(&e, ep.factory, key, v)?;
    }
    Ok(e)
}

/// Sets a property as its own type, or says why not (never a type
/// mismatch for GLib to abort on).
fn set_prop(e: &gst::Element, factory: &str, key: &str, v: &Prop) -> Result<(), String> {
    use gst::glib::{self, prelude::ToValue};
    let pspec = e
        .find_property(key)
        .ok_or_else(|| format!("`{factory}` has no property `{key}`"))?;
    let t = pspec.value_type();
    let range = |_| format!("`{factory}` {key}: value out of range");
    let value = match v {
        Prop::Text(s) if t == glib::Type::STRING => s.to_value(),
        Prop::Int(n) if t == glib::Type::I32 => i32::try_from(*n).map_err(range)?.to_value(),
        Prop::Int(n) if t == glib::Type::U32 => u32::try_from(*n).map_err(range)?.to_value(),
        Prop::Int(n) if t == glib::Type::I64 => n.to_value(),
        Prop::Int(n) if t == glib::Type::U64 => u64::try_from(*n).map_err(range)?.to_value(),
        Prop::Caps(c) if t == gst::Caps::static_type() => caps(c)?.to_value(),
        _ => {
            return Err(format!(
                "`{factory}` {key} is a {t}, not the value outpost sets"
            ));
        }
    };
    e.set_property_from_value(key, &value);
    Ok(())
}

fn caps(plan: &[CapsPlan]) -> Result<gst::Caps, String> {
    let int = |n: u32| i32::try_from(n).map_err(|_| format!("caps value {n} out of range"));
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
fn link(a: &gst::Element, b: &gst::Element) -> Result<(), String> {
    let dynamic = a.static_pad("src").is_none()
        && a.pad_template_list().iter().any(|t| {
            t.direction() == gst::PadDirection::Src && t.presence() == gst::PadPresence::Sometimes
        });
    if !dynamic {
        return a.link(b).map_err(|_| {
            format!(
                "cannot link {} to {}",
                a.factory()
                    .map(|f| f.name().to_string())
                    .unwrap_or_default(),
                b.factory()
                    .map(|f| f.name().to_string())
                    .unwrap_or_default()
            )
        });
    }
    let sink = b
        .static_pad("sink")
        .ok_or("an element without a sink pad")?;
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

fn launch(desc: &str) -> Result<gst::Pipeline, String> {
    let e = gst::parse::launch(desc).map_err(|e| format!("pipeline `{desc}`: {e}"))?;
    match e.downcast::<gst::Pipeline>() {
        Ok(p) => Ok(p),
        Err(e) => {
            // A single element: wrap it.
            let p = gst::Pipeline::new();
            p.add(&e).map_err(|x| x.to_string())?;
            Ok(p)
        }
    }
}

fn element_names(p: &gst::Pipeline) -> Vec<String> {
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

fn log_chain(sh: &Shared, chain: &str) {
    if !sh.logged.swap(true, Ordering::Relaxed) {
        tracing::info!(pipeline = %sh.ctx.pipeline, camera = %sh.state.camera, elements = %chain, "camera elements");
    } else {
        tracing::debug!(pipeline = %sh.ctx.pipeline, elements = %chain, "camera elements");
    }
}

/// `rtspsrc` with its credentials as properties; the depayloader, parser and
/// decoder are chosen and linked when the server announces its tracks.
fn add_rtspsrc(
    p: &gst::Pipeline,
    cfg: &CameraConfig,
    url: Option<&CameraUrl>,
    sh: &Arc<Shared>,
) -> Result<(), String> {
    let Some(CameraUrl::Rtsp {
        location,
        user,
        password,
    }) = url
    else {
        return Err("not an rtsp url".into());
    };
    if !has("rtspsrc") {
        return Err(
            "GStreamer element `rtspsrc` is missing (Debian: gstreamer1.0-plugins-good)".into(),
        );
    }
    let (protocols, latency) = match cfg.transport {
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
    let src = b.build().map_err(|e| format!("rtspsrc: {e}"))?;
    // Before the server answers, status shows the H.264 chain this machine would use.
    if let Ok(planned) = pick_decoder("H264", has) {
        let mut v = vec!["rtspsrc"];
        v.extend(planned);
        sh.state.set_elements(&v);
    }
    let video = Arc::new(AtomicBool::new(false));
    let tracks = Arc::new(Mutex::new(Vec::<String>::new()));
    let (s, v, t) = (sh.clone(), video.clone(), tracks.clone());
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
        t.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(format!("{media}/{encoding}"));
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
        let linked = (|| -> Result<(), String> {
            let dec = gst::parse::bin_from_description(&chain.join(" ! "), true)
                .map_err(|e| e.to_string())?;
            bin.add(&dec).map_err(|e| e.to_string())?;
            let convert = bin
                .by_name("outpost_convert")
                .ok_or("no outpost_convert element")?;
            dec.link(&convert).map_err(|e| e.to_string())?;
            dec.sync_state_with_parent().map_err(|e| e.to_string())?;
            let sink = dec
                .static_pad("sink")
                .ok_or("decoder bin has no sink pad")?;
            pad.link(&sink).map_err(|e| format!("{e:?}"))?;
            Ok(())
        })();
        if let Err(e) = linked {
            gst::element_error!(
                src,
                gst::CoreError::Negotiation,
                ["linking the decoder: {}", e]
            );
            return;
        }
        let mut names = vec!["rtspsrc"];
        names.extend(chain.iter().copied());
        s.state.set_elements(&names);
        log_chain(&s, &names.join(" ! "));
    });
    let (v, t) = (video, tracks);
    src.connect_no_more_pads(move |src| {
        if !v.load(Ordering::SeqCst) {
            let tracks = t.lock().unwrap_or_else(|p| p.into_inner()).join(", ");
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
    p.add(&src).map_err(|e| e.to_string())?;
    Ok(())
}

/// A decoded frame (RGB, or I420 straight from the decoder): into the
/// pipeline's queue, with its capture time.
fn on_sample(sh: &Shared, sink: &gst_app::AppSink, sample: &gst::Sample) {
    let now = SystemTime::now();
    sh.last_frame_ms.store(
        (sh.epoch.elapsed().as_millis() as u64).max(1),
        Ordering::Relaxed,
    );
    let (Some(buffer), Some(caps)) = (sample.buffer_owned(), sample.caps()) else {
        return;
    };
    let Ok(info) = gst_video::VideoInfo::from_caps(caps) else {
        sh.ctx.count_drop("bad_frame", "caps are not raw video");
        return;
    };
    // Capture time: the buffer's running time against the pipeline clock's
    // now, so decode and transfer delays count in the frame's age.
    let lag = (|| {
        let clock = sink.clock()?;
        let base = sink.base_time()?;
        let now_rt = clock.time().checked_sub(base)?;
        let seg = sample.segment()?.downcast_ref::<gst::ClockTime>()?;
        let rt = seg.to_running_time(buffer.pts()?)?;
        now_rt.checked_sub(rt)
    })()
    .map(|d| Duration::from_nanos(d.nseconds()))
    .filter(|d| *d < Duration::from_secs(10))
    .unwrap_or_default();
    let captured = now.checked_sub(lag).unwrap_or(now);
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
            sh.ctx.count_drop(
                "bad_frame",
                &format!(
                    "frames in {other:?}, not RGB or I420 (end a custom pipeline with videoconvert)"
                ),
            );
            return;
        }
    };
    // Packed planes, each row without padding: (offset, stride, row bytes, rows).
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
        (
            info.offset().get(i).copied().unwrap_or(0),
            info.stride().get(i).copied().unwrap_or(0).max(0) as usize,
            row,
            rows,
        )
    })
    .collect();
    let need = raw.len();
    // Already packed (rows without padding, planes back to back): the
    // GStreamer buffer is the payload, no copy.
    let mut at = 0;
    let packed = planes.iter().all(|&(offset, stride, row, rows)| {
        let ok = offset == at && stride == row;
        at += row * rows;
        ok
    });
    let payload = if packed {
        match buffer.into_mapped_buffer_readable() {
            Ok(m) if m.len() >= need => Bytes::from_owner(m).slice(..need),
            _ => {
                sh.ctx
                    .count_drop("bad_frame", "frame shorter than its caps");
                return;
            }
        }
    } else {
        // Padded rows or planes apart: pack them.
        let Ok(m) = buffer.map_readable() else {
            return;
        };
        let mut out = Vec::with_capacity(need);
        for &(offset, stride, row, rows) in &planes {
            for y in 0..rows {
                let at = offset + y * stride;
                match m.get(at..at + row) {
                    Some(r) => out.extend_from_slice(r),
                    None => {
                        sh.ctx
                            .count_drop("bad_frame", "frame shorter than its caps");
                        return;
                    }
                }
            }
        }
        Bytes::from(out)
    };
    let mut frame = Frame::new(sh.stream.clone(), payload);
    frame.raw = Some(raw);
    frame.captured = Some(captured);
    sh.state.set_size(w, h);
    // The camera's queue drops its oldest frame: submit never waits.
    if sh.ctx.sink.offer(frame).is_err() {
        sh.ctx.count_drop("stale", "queue full");
    }
}

#[cfg(test)]
mod tests {
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
        let cfg = CameraConfig {
            url: None,
            pipeline: None,
            fps: None,
            width: Some(320),
            height: Some(240),
            transport: Transport::Tcp,
            stall_timeout: Duration::from_secs(5),
            queue: 1,
        };
        let plan = source_plan(
            &cfg,
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
        assert!(e.unwrap_err().contains("no property"));
        let e = make(&ElementPlan {
            factory: "capsfilter",
            name: None,
            props: vec![("caps", Prop::Text("video/x-raw".into()))],
        });
        assert!(e.unwrap_err().contains("not the value"));
    }
}
