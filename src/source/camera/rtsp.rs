//! `rtsp://` cameras on the daemon's own RTSP client (retina): RTSP, RTP
//! and H.264 / H.265 depacketising on one thread per camera with a
//! single-threaded async runtime. Whole compressed frames (Annex B, the
//! parameter sets before every keyframe) go into an `appsrc` that feeds the
//! parser and decoder; the decode gate runs here, so the delta frames that
//! keyframe-only decoding drops never enter GStreamer at all.
//!
//! Why not `rtspsrc`: at 1 fps on keyframes its receive path (a wake-up
//! per TCP packet, then the jitter buffer's hand-off) cost more than
//! decoding did; this client reads whole interleaved packets off one socket
//! and wakes about once per frame; while only keyframes are decoded it
//! sleeps through most of the gap between two and reads the delta frames
//! it drops in bursts (`NAP`). `rtsps://` (TLS) and RTP over UDP stay
//! on `rtspsrc` (`run.rs`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures_util::{FutureExt, StreamExt};
use gstreamer as gst;
use gstreamer::prelude::*;
use gstreamer_app as gst_app;
use retina::client::{
    Credentials, Demuxed, PlayOptions, Session, SessionGroup, SessionOptions, SetupOptions,
    TcpTransportOptions,
};
use retina::codec::{CodecItem, FrameFormat};

use super::decode::Verdict;
use super::error::RtspError;
use super::fanout::Shared;
use super::relay::{self, Cut, Refused};

/// Compressed frames waiting in the appsrc beyond which the decoder is
/// behind: frames are dropped from there to the next keyframe (a delta
/// frame without its references would decode to garbage), so the camera is
/// never read slower than it sends and the socket never backs up.
const BEHIND: u64 = 60;

/// While only keyframes are decoded, the delta frames between two of them
/// are read only to be dropped: rather than wake for each packet of them
/// (about 60 times a second at 4 Mbit/s over TCP), the client reads them
/// in bursts, sleeping up to this long between and then taking only what
/// the socket buffered meanwhile (about 50 kB at 4 Mbit/s). Never longer
/// than a quarter of `stall_timeout`, so that a sleep never looks like a
/// stall.
const NAP: Duration = Duration::from_millis(100);

/// ...and it is awake from this long before the next keyframe is due, so
/// that the keyframe is read as it arrives.
const AWAKE_BEFORE: Duration = Duration::from_millis(150);

/// How long a TEARDOWN may take when the session closes (for servers
/// known to keep a session whose TCP connection closed).
const TEARDOWN_WAIT: Duration = Duration::from_secs(2);

impl RtspError {
    /// A client error, or what the relay cut when the client saw only the
    /// connection close.
    fn from_client(e: retina::Error, cut: &Cut) -> RtspError {
        match cut.reason() {
            Some(o) => RtspError::Oversize(o),
            None => RtspError::Camera(text(e)),
        }
    }
}

/// A session playing, with the runtime that drives it.
pub(super) struct Connected {
    rt: tokio::runtime::Runtime,
    demuxed: Demuxed,
    group: Arc<SessionGroup>,
    cut: Arc<Cut>,
    /// `H264` or `H265`.
    pub(super) encoding: String,
}

/// What a camera is asked for.
pub(super) struct Target<'a> {
    pub location: &'a str,
    pub user: Option<&'a str>,
    pub password: Option<&'a str>,
    /// The largest message body or frame the camera may send.
    pub max_frame_bytes: u64,
}

/// DESCRIBE, SETUP of the first video track (RTP interleaved on the RTSP
/// connection), PLAY. `Ok(None)`: the daemon stops.
pub(super) fn connect(t: &Target<'_>, sh: &Arc<Shared>) -> Result<Option<Connected>, RtspError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(RtspError::Runtime)?;
    let group = Arc::new(SessionGroup::default());
    let wait = sh.def.stall_timeout;
    let answer = rt.block_on(async {
        tokio::select! {
            r = tokio::time::timeout(wait, open(t, group.clone(), refused(sh))) => Some(r),
            () = stopped(sh) => None,
        }
    });
    match answer {
        None => Ok(None),
        Some(Err(_)) => Err(RtspError::NoAnswer(wait.as_secs_f64())),
        Some(Ok(Err(e))) => Err(e),
        Some(Ok(Ok((demuxed, encoding, cut)))) => Ok(Some(Connected {
            rt,
            demuxed,
            group,
            cut,
            encoding,
        })),
    }
}

async fn stopped(sh: &Shared) {
    while !sh.stopping() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Counts and logs a connection to the camera's relay port that was not
/// the daemon's client.
fn refused(sh: &Arc<Shared>) -> relay::OnRefused {
    let sh = sh.clone();
    Box::new(move |why: &Refused| {
        sh.each(|s| {
            s.relay_refused.fetch_add(1, Ordering::Relaxed);
        });
        tracing::warn!(camera = %sh.shown, name = %sh.def.name, "{why}");
    })
}

async fn open(
    t: &Target<'_>,
    group: Arc<SessionGroup>,
    refused: relay::OnRefused,
) -> Result<(Demuxed, String, Arc<Cut>), RtspError> {
    // rtspt:// is RTSP with the media interleaved on its TCP connection,
    // which is how this client always receives it.
    let location = match t.location.strip_prefix("rtspt://") {
        Some(rest) => format!("rtsp://{rest}"),
        None => t.location.to_string(),
    };
    let url =
        ::url::Url::parse(&location).map_err(|e| RtspError::Camera(format!("camera url: {e}")))?;
    // The camera's bytes reach the client only through the bound.
    let relayed = relay::open(&url, t.max_frame_bytes, refused).await?;
    let cut = relayed.cut;
    let err = |e: retina::Error| RtspError::from_client(e, &cut);
    let creds = t.user.map(|u| Credentials {
        username: u.to_string(),
        password: t.password.unwrap_or_default().to_string(),
    });
    let options = SessionOptions::default()
        .creds(creds)
        .user_agent(format!("outpost/{}", env!("CARGO_PKG_VERSION")))
        .session_group(group);
    let mut session = Session::describe(relayed.url, options).await.map_err(err)?;
    let streams = session.streams();
    let Some(i) = streams.iter().position(|s| s.media() == "video") else {
        let tracks: Vec<String> = streams
            .iter()
            .map(|s| format!("{}/{}", s.media(), s.encoding_name().to_ascii_uppercase()))
            .collect();
        return Err(RtspError::NoVideo(if tracks.is_empty() {
            "none".to_string()
        } else {
            tracks.join(", ")
        }));
    };
    let encoding = streams[i].encoding_name().to_ascii_uppercase();
    if !matches!(encoding.as_str(), "H264" | "H265") {
        return Err(RtspError::Codec(encoding));
    }
    let transport = retina::client::Transport::Tcp(TcpTransportOptions::default());
    session
        .setup(
            i,
            SetupOptions::default()
                .transport(transport)
                .frame_format(FrameFormat::SIMPLE),
        )
        .await
        .map_err(err)?;
    let playing = session.play(PlayOptions::default()).await.map_err(err)?;
    let demuxed = playing.demuxed().map_err(err)?;
    Ok((demuxed, encoding, cut))
}

/// The first line of a client error (the rest is connection and packet
/// context), with the status's reason where the camera answered one.
fn text(e: retina::Error) -> String {
    let full = e.to_string();
    // The first line: a framing error goes on with a hex dump of what the
    // peer sent ("...; buffered:" and the bytes).
    let line = full.lines().next().unwrap_or(&full).trim();
    let first = line
        .strip_suffix("; buffered:")
        .unwrap_or(line)
        .trim_end_matches(':')
        .to_string();
    match e.status_code() {
        Some(code) => format!("the camera answered {code} {}: {first}", reason(code)),
        None => first,
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        453 => "Not Enough Bandwidth",
        454 => "Session Not Found",
        455 => "Method Not Valid in This State",
        461 => "Unsupported Transport",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        _ => "",
    }
}

/// Whether the decoder keeps up: once [`BEHIND`] frames wait for it,
/// frames are dropped until a keyframe finds the queue at half that.
#[derive(Debug, Default)]
struct Backlog {
    behind: bool,
}

impl Backlog {
    /// A frame (`key`: a keyframe) with `level` frames waiting: whether it
    /// goes to the decoder.
    fn admit(&mut self, level: u64, key: bool) -> bool {
        if self.behind && key && level < BEHIND / 2 {
            self.behind = false;
        } else if !self.behind && level >= BEHIND {
            self.behind = true;
        }
        !self.behind
    }
}

/// Sleeps the client's thread, not a task on it: a task asleep would still
/// wake with every packet the socket receives (the runtime polls it), and
/// waking less often is the point. The runtime is this camera's alone, with
/// nothing else on it to hold up; the session's keepalive waits at most a
/// nap. Then it yields once, so that the runtime looks at the socket (a
/// poll of the epoll set that does not wait) and what came meanwhile can be
/// read: without it the socket would still count as empty and nothing would
/// be read until the client next waited. Whether the client was told to
/// stop meanwhile.
async fn doze(d: Duration, stop: &mut tokio::sync::oneshot::Receiver<()>) -> bool {
    std::thread::sleep(d);
    tokio::task::yield_now().await;
    !matches!(
        stop.try_recv(),
        Err(tokio::sync::oneshot::error::TryRecvError::Empty)
    )
}

/// How long the client may sleep after a delta frame it dropped at `now`:
/// only while keyframes alone are decoded, and not into the time the next
/// keyframe is due (the last one's arrival plus the stream's keyframe
/// interval). `None`: read on.
fn nap(sh: &Shared, last_key: Option<Instant>, now: Instant) -> Option<Duration> {
    if !sh.keyframes_only() {
        return None;
    }
    let interval = Duration::from_nanos(sh.decode.lock().interval_ns()?);
    nap_length(interval, last_key?, now, sh.def.stall_timeout)
}

fn nap_length(
    interval: Duration,
    last_key: Instant,
    now: Instant,
    stall_timeout: Duration,
) -> Option<Duration> {
    let wake_by = (last_key + interval).checked_sub(AWAKE_BEFORE)?;
    let left = wake_by.checked_duration_since(now)?;
    let d = left.min(NAP).min(stall_timeout / 4);
    (d >= Duration::from_millis(5)).then_some(d)
}

/// The stream time of a frame, in nanoseconds since the session's start.
fn stream_ns(ts: retina::Timestamp) -> u64 {
    let rate = u64::from(ts.clock_rate().get());
    let ticks = u64::try_from(ts.elapsed()).unwrap_or(0);
    (u128::from(ticks) * 1_000_000_000 / u128::from(rate)) as u64
}

/// Feeds the session's frames into `src` on a thread of their own until the
/// session ends (an error or the end of the stream, both posted on the
/// pipeline's bus, where the camera's watch sees them) or `stop` fires. A
/// panic on the thread (the RTSP client's, on what a camera sent) is posted
/// as the camera's error too, so the camera reconnects.
pub(super) fn pump(
    c: Connected,
    src: gst_app::AppSrc,
    sh: Arc<Shared>,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("rtsp-{}", sh.def.name))
        .spawn(move || {
            let Connected {
                rt,
                mut demuxed,
                group,
                cut,
                ..
            } = c;
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                rt.block_on(async {
                    feed(&mut demuxed, &src, &sh, &cut, stop).await;
                    drop(demuxed);
                    let _ = tokio::time::timeout(TEARDOWN_WAIT, group.await_teardown()).await;
                });
            }));
            if let Err(p) = ran {
                let why = sh.scrubber.scrub(&format!(
                    "the RTSP client failed: {}",
                    crate::panics::message(p.as_ref()).unwrap_or("a panic")
                ));
                gst::element_error!(src, gst::ResourceError::Read, ["{}", why]);
            }
        })
}

async fn feed(
    demuxed: &mut Demuxed,
    src: &gst_app::AppSrc,
    sh: &Shared,
    cut: &Cut,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let mut backlog = Backlog::default();
    // When the last keyframe that went to the decoder arrived.
    let mut last_key: Option<Instant> = None;
    // Between naps: reading only what has come meanwhile, never waiting.
    let mut draining = false;
    loop {
        let item = if draining {
            match demuxed.next().now_or_never() {
                Some(item) => item,
                None => {
                    // All that came is read: sleep again, or wait for the keyframe.
                    draining = match nap(sh, last_key, Instant::now()) {
                        Some(d) => {
                            if doze(d, &mut stop).await {
                                return;
                            }
                            true
                        }
                        None => false,
                    };
                    continue;
                }
            }
        } else {
            tokio::select! {
                _ = &mut stop => return,
                item = demuxed.next() => item,
            }
        };
        let frame = match item {
            None => {
                let _ = src.end_of_stream();
                return;
            }
            Some(Err(e)) => {
                let e = RtspError::from_client(e, cut);
                if let RtspError::Oversize(o) = &e {
                    sh.count_oversize(o);
                }
                let why = sh.scrubber.scrub(&e.to_string());
                gst::element_error!(src, gst::ResourceError::Read, ["{}", why]);
                return;
            }
            Some(Ok(CodecItem::VideoFrame(f))) => f,
            Some(Ok(_)) => continue,
        };
        let key = frame.is_random_access_point();
        if sh.gate(stream_ns(frame.timestamp()), key) == Verdict::Skip {
            if !draining && let Some(d) = nap(sh, last_key, Instant::now()) {
                if doze(d, &mut stop).await {
                    return;
                }
                draining = true;
            }
            continue;
        }
        if key {
            last_key = Some(Instant::now());
        }
        if !backlog.admit(src.property::<u64>("current-level-buffers"), key) {
            for r in &sh.readers().list {
                r.ctx.count_drop(
                    "decoder_behind",
                    "the decoder fell behind the camera: frames dropped to the next keyframe",
                );
            }
            continue;
        }
        let mut buf = gst::Buffer::from_mut_slice(frame.into_data());
        if !key && let Some(b) = buf.get_mut() {
            b.set_flags(gst::BufferFlags::DELTA_UNIT);
        }
        sh.count_decoder_input();
        if src.push_buffer(buf).is_err() {
            // Flushing: the pipeline is being stopped.
            return;
        }
    }
}

/// The appsrc a session's frames enter: live, stamped with the running
/// time at arrival (so a frame's age counts decoding), unbounded (the
/// pump bounds it by [`BEHIND`] and never blocks).
pub(super) fn appsrc(encoding: &str) -> Result<gst_app::AppSrc, RtspError> {
    let media = if encoding == "H265" {
        "video/x-h265"
    } else {
        "video/x-h264"
    };
    let caps = gst::Caps::builder(media)
        .field("stream-format", "byte-stream")
        .field("alignment", "au")
        .build();
    let src = gst_app::AppSrc::builder()
        .name("outpost_rtsp")
        .caps(&caps)
        .is_live(true)
        .format(gst::Format::Time)
        .do_timestamp(true)
        .max_bytes(0)
        .block(false)
        .build();
    if src.find_property("current-level-buffers").is_none() {
        return Err(RtspError::OldGstreamer);
    }
    Ok(src)
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    #[test]
    fn stream_time_is_the_rtp_clock_since_the_session_start_in_nanoseconds() {
        let rate = NonZeroU32::new(90_000).unwrap();
        let ts = |t: i64, start: u32| retina::Timestamp::new(t, rate, start).unwrap();
        assert_eq!(stream_ns(ts(90_000, 0)), 1_000_000_000);
        assert_eq!(stream_ns(ts(10_003_000, 10_000_000)), 33_333_333);
        // An hour and more of 90 kHz ticks past the 32-bit wrap stays exact.
        let hours = 5 * 3600 * 90_000i64;
        assert_eq!(stream_ns(ts(hours + 7, 7)), 5 * 3600 * 1_000_000_000);
        // Before the start (a reordered first packet): time zero, not a wrap.
        assert_eq!(stream_ns(ts(-5, 0)), 0);
    }

    #[test]
    fn naps_end_before_the_next_keyframe_is_due_and_never_look_like_a_stall() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let ms = Duration::from_millis;
        let stall = Duration::from_secs(5);
        // Just after a keyframe a second apart: the longest nap.
        assert_eq!(nap_length(s, t0, t0 + ms(40), stall), Some(NAP));
        // Close to the next one: only up to AWAKE_BEFORE ahead of it...
        assert_eq!(nap_length(s, t0, t0 + ms(800), stall), Some(ms(50)));
        // ...and none from there on, nor once it is late.
        assert_eq!(nap_length(s, t0, t0 + ms(860), stall), None);
        assert_eq!(nap_length(s, t0, t0 + ms(1500), stall), None);
        // Keyframes closer than AWAKE_BEFORE: never a nap.
        assert_eq!(nap_length(ms(100), t0, t0 + ms(1), stall), None);
        // A short stall_timeout bounds it.
        assert_eq!(nap_length(s, t0, t0 + ms(40), ms(200)), Some(ms(50)));
    }

    #[test]
    fn what_came_during_a_nap_is_read_right_after_it_without_waiting() {
        use std::io::Write;
        use tokio::io::AsyncReadExt;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .enable_time()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        ours.set_nonblocking(true).unwrap();
        let (_tx, mut stop) = tokio::sync::oneshot::channel::<()>();
        rt.block_on(async {
            let mut sock = tokio::net::TcpStream::from_std(ours).unwrap();
            let mut buf = [0u8; 64];
            // Nothing yet: the runtime now counts the socket as empty.
            assert!(sock.read(&mut buf).now_or_never().is_none());
            // The camera sends while the client sleeps.
            peer.write_all(b"delta frames").unwrap();
            assert!(!doze(Duration::from_millis(20), &mut stop).await);
            let n = sock.read(&mut buf).now_or_never();
            assert!(
                matches!(n, Some(Ok(12))),
                "the bytes sent during the nap were not readable after it: {n:?}"
            );
        });
    }

    #[test]
    fn a_decoder_behind_gets_frames_again_only_from_a_keyframe_on_a_shorter_queue() {
        let mut b = Backlog::default();
        assert!(b.admit(0, true));
        assert!(b.admit(BEHIND - 1, false));
        // Full: this frame and every delta frame after it are dropped...
        assert!(!b.admit(BEHIND, false));
        assert!(!b.admit(1, false));
        // ...and a keyframe too while the queue is still half full.
        assert!(!b.admit(BEHIND / 2, true));
        // A keyframe on a short queue starts the decoder again.
        assert!(b.admit(BEHIND / 2 - 1, true));
        assert!(b.admit(BEHIND / 2, false));
    }

    #[test]
    fn every_status_a_camera_sends_for_a_refusal_has_its_reason() {
        for code in [400, 401, 403, 404, 454, 461, 500, 503] {
            assert!(!reason(code).is_empty(), "{code}");
        }
        assert_eq!(reason(401), "Unauthorized");
        assert_eq!(reason(404), "Not Found");
        assert_eq!(reason(299), "");
    }

    #[test]
    fn status_shows_the_client_and_the_chain_without_the_depayloader() {
        assert_eq!(
            crate::source::camera::run::retina_elements(&[
                "rtph264depay",
                "h264parse",
                "avdec_h264"
            ]),
            ["retina", "appsrc", "h264parse", "avdec_h264"]
        );
    }
}
