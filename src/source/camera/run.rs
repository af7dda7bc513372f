//! The camera at run time: one supervising OS thread per camera builds the
//! GStreamer pipeline, watches its bus and its frames, and tears it down and
//! rebuilds it after a failure. However many pipelines read the camera,
//! there is one GStreamer pipeline (one RTSP session) and one decoder;
//! frames leave from GStreamer's streaming thread (the appsink callback)
//! straight into each reader's queue (`fanout.rs`): no async hop, no copy
//! when the frame's rows are packed, one shared payload for all readers.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gstreamer as gst;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use tokio_util::sync::CancellationToken;

use super::elements::{decoder_elements, element_names, from_plan, has, launch};
use super::error::{CameraError, PERMANENT_RETRY};
use super::fanout::{
    Reader, Shared, add_decode_probe, add_gate_probe, add_key_units_probe, on_sample,
    take_raw_frames,
};
use super::keyframes::{KeyframeDecoders, decodes_alone, parser_end, share_keyframe_decoder};
use super::plan::{chain, rgb_tail, source_plan};
use super::rtsp;
use super::rtspsrc::add_rtspsrc;
use super::said::Said;
use super::{
    CameraDef, CameraUrl, Consumer, PARSER_NAME, Transport, asked_fps, pick_decoder,
    reconnect_backoff,
};
use crate::clock::clocks::{Clocks, RealClocks};
use crate::source::SourceError;

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

/// A started camera: what its host keeps to give it a reload's readers
/// or to stop it.
pub(super) struct Running {
    shared: Arc<Shared>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Running {
    /// The camera's readers from now on (a reload's pipelines); its
    /// pipeline, session and decoder run on.
    pub(super) fn swap(&self, consumers: Vec<Consumer>) {
        let sh = &self.shared;
        sh.swap(readers(consumers, &sh.shown));
        tracing::info!(
            camera = %sh.shown,
            name = %sh.def.name,
            pipelines = %sh.pipelines(),
            "camera kept across the reload: its session and decoder run on"
        );
    }

    /// Its readers' generation stopped: no frame goes to them.
    pub(super) fn park(&self) {
        self.shared.park();
    }

    /// Tells the camera to stop.
    pub(super) fn cancel(&self) {
        self.stop.cancel();
    }

    /// Waits until the camera has stopped (its pipeline torn down).
    pub(super) async fn join(self) {
        let _ = self.task.await;
    }

    /// The task that ends when the camera has stopped.
    pub(super) fn task(self) -> tokio::task::JoinHandle<()> {
        self.task
    }
}

fn readers(consumers: Vec<Consumer>, shown: &str) -> Vec<Reader> {
    consumers
        .into_iter()
        .map(|c| Reader::new(c.ctx, c.fps, c.stream, shown))
        .collect()
}

/// Starts a camera for its readers (at least one); `stop` stops it.
pub(super) fn spawn(
    def: CameraDef,
    consumers: Vec<Consumer>,
    stop: CancellationToken,
    decoders: Arc<KeyframeDecoders>,
) -> Result<Running, SourceError> {
    let first = consumers
        .first()
        .map(|c| c.ctx.pipeline.clone())
        .unwrap_or_default();
    let setup = |detail: String| SourceError::Setup {
        pipeline: first.clone(),
        kind: "camera",
        detail,
    };
    if consumers.is_empty() {
        return Err(setup(format!("camera `{}` has no reader", def.name)));
    }
    gst::init().map_err(|e| setup(format!("GStreamer: {e}")))?;
    // Normally done at daemon start already (before any thread made an arena).
    bounded_malloc();
    let url = def
        .url
        .as_deref()
        .map(CameraUrl::parse)
        .transpose()
        .map_err(|e| setup(e.to_string()))?;
    let shown = def.shown();
    let fps: Vec<Option<f64>> = consumers.iter().map(|c| c.fps).collect();
    // What the camera itself is asked for (CSI): the fastest reader's rate.
    let max_fps = asked_fps(&consumers);
    let shared = Arc::new(Shared::new(def, readers(consumers, &shown), stop.clone()));
    tracing::info!(
        camera = %shared.shown,
        name = %shared.def.name,
        pipelines = %shared.pipelines(),
        fps = %fps.iter().map(|f| f.map_or("all".to_string(), |f| f.to_string())).collect::<Vec<_>>().join(","),
        decode = shared.def.decode.as_str(),
        stall_timeout_s = shared.def.stall_timeout.as_secs_f64(),
        "camera source"
    );
    let sh = shared.clone();
    let thread = tokio::task::spawn_blocking(move || {
        supervise(url.as_ref(), max_fps, &sh, &decoders, &RealClocks)
    });
    Ok(Running {
        shared,
        stop,
        task: tokio::spawn(async move {
            let _ = thread.await;
        }),
    })
}

/// Why a run of the pipeline ended.
enum End {
    Stop,
    Failed { error: CameraError, streamed: bool },
}

/// Builds, watches and rebuilds the camera's pipeline until the daemon stops.
fn supervise(
    url: Option<&CameraUrl>,
    max_fps: Option<f64>,
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
    clocks: &dyn Clocks,
) {
    let mut backoff = reconnect_backoff();
    let mut said = Said::new(clocks);
    loop {
        if sh.stopping() {
            return;
        }
        // A panic while the camera runs (in what parses the camera's
        // answers, say) is this camera's failure, and it reconnects.
        let end = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_once(url, max_fps, sh, decoders, &mut said)
        }))
        .unwrap_or_else(|p| End::Failed {
            error: CameraError::Panic(
                crate::panics::message(p.as_ref())
                    .unwrap_or("a panic")
                    .to_string(),
            ),
            streamed: false,
        });
        let (error, streamed) = match end {
            End::Stop => return,
            End::Failed { error, streamed } => (error, streamed),
        };
        if streamed {
            backoff.reset();
        }
        // The variant decides: the network's pace, or slowly for a failure
        // another try cannot mend (a missing plugin, a bad launch line).
        let permanent = !error.retriable();
        let delay = if permanent {
            PERMANENT_RETRY
        } else {
            backoff.next_delay()
        };
        // Scrubbed here, where it is stored, logged and shown.
        let text = sh.scrubber.scrub(&error.to_string());
        sh.each(|s| {
            s.reconnects.fetch_add(1, Ordering::Relaxed);
            s.set_failure(&text, permanent, delay);
        });
        sh.set_state(if permanent { "failed" } else { "reconnecting" });
        said.down(sh, &text, delay, permanent);
        let until = Instant::now() + delay;
        while Instant::now() < until {
            if sh.stopping() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50).min(until - Instant::now()));
        }
    }
}

/// One pipeline's life: built, played, watched until it fails or the daemon
/// stops, then set to NULL and dropped (every socket and buffer released).
fn run_once(
    url: Option<&CameraUrl>,
    max_fps: Option<f64>,
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
    said: &mut Said<'_>,
) -> End {
    let failed = |error: CameraError, streamed: bool| End::Failed { error, streamed };
    sh.restart();
    // rtsp:// on the daemon's client: connected first (the track's codec
    // picks the parser and decoder), fed into the pipeline once it plays.
    let mut session = None;
    if let Some(target) = retina_target(url, sh) {
        if let Ok(planned) = pick_decoder("H264", has) {
            sh.each(|s| s.set_elements(&retina_elements(&planned)));
        }
        match rtsp::connect(&target, sh) {
            Ok(Some(c)) => session = Some(c),
            Ok(None) => return End::Stop,
            Err(e) => {
                if let super::error::RtspError::Oversize(o) = &e {
                    sh.count_oversize(o);
                }
                return failed(e.into(), false);
            }
        }
    }
    let encoding = session.as_ref().map(|c| c.encoding.clone());
    let pipeline = match build(url, max_fps, sh, decoders, encoding.as_deref()) {
        Ok(p) => p,
        Err(e) => return failed(e, false),
    };
    let mut feed = None;
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
                .and_then(|m| CameraError::from_bus(&m))
                .unwrap_or(CameraError::Refused);
            failed(why, false)
        }
        Ok(_) => match session.map(|c| start_feed(c, &pipeline, sh)) {
            Some(Err(e)) => failed(e, false),
            started_feed => {
                feed = started_feed.and_then(Result::ok);
                watch(sh, bus.as_ref(), started, said)
            }
        },
    };
    let end = match (end, url) {
        // rtspsrc says only that it could not connect: ask the network why.
        (End::Failed { error, streamed }, Some(CameraUrl::Rtsp { location, .. }))
            if error.is_connect() =>
        {
            End::Failed {
                error: CameraError::Connect {
                    error: Box::new(error),
                    diagnosis: diagnose_connect(location),
                },
                streamed,
            }
        }
        (end, _) => end,
    };
    // The session first (its thread pushes into the pipeline), then NULL,
    // which joins the streaming threads and closes the sockets.
    if let Some((thread, stop)) = feed {
        drop(stop);
        if thread.join().is_err() {
            tracing::warn!(camera = %sh.def.name, "the RTSP client thread panicked");
        }
    }
    let _ = pipeline.set_state(gst::State::Null);
    let weak = pipeline.downgrade();
    drop(bus);
    drop(pipeline);
    if weak.upgrade().is_some() {
        // Something still holds it: its buffers and decoder would leak with it.
        tracing::warn!(camera = %sh.def.name, "camera pipeline still referenced after teardown");
    }
    end
}

/// The rtsp:// cameras the daemon's own client reads: RTP interleaved on
/// the RTSP connection. `rtsps://` (TLS) and RTP over UDP stay on rtspsrc:
/// its jitter buffer puts reordered datagrams back in order, and it takes
/// them from whichever port the server sends from (the client's UDP socket
/// is connected to the advertised `server_port`, and a gst-rtsp-server
/// shared media set up by two clients at once sent from another port:
/// no frame, in one start of four here).
fn retina_target<'a>(url: Option<&'a CameraUrl>, sh: &Shared) -> Option<rtsp::Target<'a>> {
    match url {
        Some(CameraUrl::Rtsp {
            location,
            user,
            password,
        }) if !location.starts_with("rtsps://")
            && (sh.def.transport == Transport::Tcp || location.starts_with("rtspt://")) =>
        {
            Some(rtsp::Target {
                location,
                user: user.as_deref(),
                password: password.as_deref(),
                max_frame_bytes: sh.def.max_frame_bytes,
            })
        }
        _ => None,
    }
}

/// What status shows for a camera on the daemon's client: the client, the
/// appsrc, then the parser and decoder (`chain` without its depayloader).
pub(super) fn retina_elements(chain: &[&'static str]) -> Vec<&'static str> {
    let mut v = vec!["retina", "appsrc"];
    v.extend(chain.iter().skip(1).copied());
    v
}

type Feed = (
    std::thread::JoinHandle<()>,
    tokio::sync::oneshot::Sender<()>,
);

/// Starts the session's frames into the playing pipeline's appsrc.
fn start_feed(
    c: rtsp::Connected,
    p: &gst::Pipeline,
    sh: &Arc<Shared>,
) -> Result<Feed, CameraError> {
    let src = p
        .by_name("outpost_rtsp")
        .and_then(|e| e.downcast::<gst_app::AppSrc>().ok())
        .ok_or(CameraError::Shape(
            "the pipeline has no appsrc for the RTSP session",
        ))?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread = rtsp::pump(c, src, sh.clone(), rx).map_err(|source| CameraError::Thread {
        what: "the RTSP client thread",
        source,
    })?;
    Ok((thread, tx))
}

/// The appsrc of a session, its parser (named for outpost), decoder and,
/// on a Jetson, the converter out of device memory, linked into the
/// pipeline's colour conversion.
fn add_retina_chain(
    p: &gst::Pipeline,
    encoding: &str,
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
) -> Result<(), CameraError> {
    let chain = pick_decoder(encoding, has)?;
    let src = rtsp::appsrc(encoding)?;
    let mut elements: Vec<gst::Element> = vec![src.upcast()];
    let alone = decodes_alone(&chain, sh);
    if alone {
        // [appsrc, parser, fakesink]: keyframes leave at the parser.
        elements.extend(decoder_elements(&chain[..2], 1)?);
        elements.push(parser_end()?);
    } else {
        elements.extend(decoder_elements(&chain, 1)?);
    }
    for e in &elements {
        p.add(e).map_err(|x| CameraError::Add {
            element: e.name().to_string(),
            reason: x.to_string(),
        })?;
    }
    if !alone {
        let convert = p
            .by_name("outpost_convert")
            .ok_or(CameraError::Shape("no outpost_convert element"))?;
        elements.push(convert);
    }
    gst::Element::link_many(&elements).map_err(|_| CameraError::Link {
        from: "appsrc".into(),
        to: chain.join(" ! "),
    })?;
    // [appsrc, parser, decoder, ...]
    if let Some(parser) = elements.get(1) {
        let g = sh.clone();
        add_key_units_probe(parser, move || g.keyframes_only())?;
        share_keyframe_decoder(parser, &chain, sh, decoders, !alone)?;
    }
    let names = retina_elements(&chain);
    sh.each(|s| s.set_elements(&names));
    sh.log_chain(&names.join(" ! "));
    Ok(())
}

/// Watches a playing pipeline: bus messages, first frame, stalls, shutdown.
fn watch(sh: &Arc<Shared>, bus: Option<&gst::Bus>, started: Instant, said: &mut Said<'_>) -> End {
    let mut streaming = false;
    let failed = |error: CameraError, streaming: bool| End::Failed {
        error,
        streamed: streaming,
    };
    loop {
        if sh.stopping() {
            return End::Stop;
        }
        if let Some(msg) = bus.and_then(|b| b.timed_pop(gst::ClockTime::from_mseconds(100))) {
            match msg.view() {
                gst::MessageView::Error(_) => {
                    let error = CameraError::from_bus(&msg).unwrap_or(CameraError::Refused);
                    return failed(error, streaming);
                }
                gst::MessageView::Eos(_) => return failed(CameraError::Eos, streaming),
                gst::MessageView::Warning(w) => {
                    tracing::debug!(camera = %sh.def.name, warning = %sh.scrubber.scrub(&w.error().to_string()), "camera warning");
                }
                _ => {}
            }
        }
        let last = sh.last_frame_ms.load(Ordering::Relaxed);
        if last != 0 && !streaming {
            streaming = true;
            sh.set_state("streaming");
            said.up(sh);
        }
        if let Some(error) = stalled(sh, started, streaming) {
            return failed(CameraError::Stalled(error), streaming);
        }
    }
}

/// Whether the camera stalled: why, in words. Only decoded frames show a
/// camera alive: compressed frames that decode to nothing do not. Decoding
/// keyframes only, a frame comes once a keyframe interval, which may be
/// longer than `stall_timeout`: the limit is then twice the interval last
/// seen (four times `stall_timeout` until one was), and a camera that
/// keeps sending delta frames but no keyframe is down all the same. Its
/// next run decodes every frame until keyframes come again.
fn stalled(sh: &Shared, started: Instant, streaming: bool) -> Option<String> {
    let stall_timeout = sh.def.stall_timeout;
    let decoded = sh.last_decoded_ms.load(Ordering::Relaxed);
    let last = sh.last_frame_ms.load(Ordering::Relaxed).max(decoded);
    let keyframes = sh.keyframes_only();
    let limit = if keyframes {
        let interval = sh
            .decode
            .lock()
            .last_interval_ns()
            .map(Duration::from_nanos);
        interval.map_or(stall_timeout * 4, |iv| (iv * 2).max(stall_timeout))
    } else {
        stall_timeout
    };
    let since = if last == 0 {
        started
    } else {
        sh.epoch + Duration::from_millis(last)
    };
    if since.elapsed() <= limit {
        return None;
    }
    let input = sh.last_input_ms.load(Ordering::Relaxed);
    if keyframes && input > last {
        sh.fall_back_to_every_frame();
        return Some(format!(
            "no keyframe for {:.1} s while decoding keyframes only (other frames kept coming): \
             decoding every frame until keyframes return",
            limit.as_secs_f64()
        ));
    }
    let what = if streaming {
        "no frame"
    } else {
        "no first frame"
    };
    Some(format!(
        "{what} for {} s (stall_timeout)",
        limit.as_secs_f64()
    ))
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

/// Builds the pipeline for the camera: RTSP from the daemon's client into
/// an appsrc (`session`: its encoding), `rtsps://` on rtspsrc with its
/// decoder chosen when the stream's track is known, V4L2 and CSI from their element plans, a
/// custom `pipeline` from its launch description.
fn build(
    url: Option<&CameraUrl>,
    max_fps: Option<f64>,
    sh: &Arc<Shared>,
    decoders: &Arc<KeyframeDecoders>,
    session: Option<&str>,
) -> Result<gst::Pipeline, CameraError> {
    let def = &sh.def;
    let size = def.width.zip(def.height);
    let pipeline = match (url, &def.pipeline) {
        // A session on the daemon's client, of this encoding.
        (Some(CameraUrl::Rtsp { .. }), _) if let Some(encoding) = session => {
            let p = from_plan(&rgb_tail(size))?;
            add_retina_chain(&p, encoding, sh, decoders)?;
            p
        }
        (Some(CameraUrl::Rtsp { .. }), _) => {
            let p = from_plan(&rgb_tail(size))?;
            add_rtspsrc(&p, url, sh, decoders)?;
            p
        }
        (Some(u), _) => {
            if matches!(u, CameraUrl::Csi { .. }) && !has("nvarguscamerasrc") {
                return Err(CameraError::MissingElement {
                    factory: "nvarguscamerasrc".into(),
                    hint: Some("csi:// needs a Jetson with its GStreamer plugins"),
                });
            }
            let plan = source_plan(def, max_fps, u)
                .ok_or(CameraError::Shape("no element plan for this camera"))?;
            let p = from_plan(&plan)?;
            let names: Vec<&str> = plan.iter().map(|e| e.factory).collect();
            sh.each(|s| s.set_elements(&names));
            sh.log_chain(&chain(&plan));
            p
        }
        (None, Some(desc)) => {
            let p = launch(desc)?;
            let names = element_names(&p);
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            sh.each(|s| s.set_elements(&names));
            sh.log_chain("custom pipeline");
            // A parser the pipeline names for outpost: keyframe-only decoding there.
            if let Some(parser) = p.by_name(PARSER_NAME) {
                add_decode_probe(&parser, sh)?;
            }
            p
        }
        (None, None) => return Err(CameraError::Shape("no url and no pipeline")),
    };
    let sink = pipeline
        .by_name("outpost")
        .and_then(|e| e.downcast::<gst_app::AppSink>().ok())
        .ok_or(CameraError::Shape(
            "the pipeline has no `appsink name=outpost`",
        ))?;
    // The fps gates sit before colour conversion when there is one of ours.
    let ours = pipeline
        .by_name("outpost_convert")
        .and_then(|c| c.static_pad("sink"));
    let dropping = ours.is_some();
    let gate_pad = ours
        .or_else(|| sink.static_pad("sink"))
        .ok_or(CameraError::Shape("the appsink has no sink pad"))?;
    add_gate_probe(&gate_pad, sh, dropping);
    take_raw_frames(&sink);
    // Latest frame: the appsink keeps none of its own beyond one, and never
    // waits for the clock.
    sink.set_max_buffers(1);
    sink.set_drop(true);
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
