//! Why a camera's pipeline could not be built or stopped running, by what
//! failed: an element, a property, a link, a launch line, the RTSP session,
//! a bus message. The variant decides whether another try can help
//! ([`CameraError::retriable`]): a network outage is retried at the
//! reconnect backoff's pace, a missing plugin or a pipeline GStreamer
//! cannot build only slowly ([`PERMANENT_RETRY`]), and said to be permanent.

use std::time::Duration;

use gstreamer::prelude::*;

use super::DecoderError;
use super::guard::Oversize;
use super::relay::RelayError;

/// How long a camera whose failure is permanent waits before it tries
/// again: long enough not to spin on a missing plugin, short enough that a
/// plugin installed while the daemon runs is picked up.
pub(super) const PERMANENT_RETRY: Duration = Duration::from_secs(300);

/// Why a session could not start or went on no longer.
#[derive(Debug, thiserror::Error)]
pub(super) enum RtspError {
    /// The camera sent more than the bound (`guard.rs`): counted.
    #[error("{0}")]
    Oversize(Oversize),
    /// The camera's answer, or the network's, in words.
    #[error("{0}")]
    Camera(String),
    /// The camera could not be reached, or the client not pointed at it.
    #[error("{0}")]
    Relay(#[from] RelayError),
    #[error("no answer from the camera for {0} s (stall_timeout)")]
    NoAnswer(f64),
    #[error("the stream has no video track (tracks: {0})")]
    NoVideo(String),
    #[error("the camera's video is {0}; outpost decodes H.264 and H.265")]
    Codec(String),
    #[error("cannot start the RTSP client: {0}")]
    Runtime(std::io::Error),
    #[error("appsrc lacks current-level-buffers (GStreamer 1.20 or newer is needed)")]
    OldGstreamer,
}

/// Why a camera's pipeline could not be made, or its run ended.
#[derive(Debug, thiserror::Error)]
pub(super) enum CameraError {
    /// No element of this factory here: its plugin is not installed.
    #[error("GStreamer element `{factory}` is missing{}", hint.map(|h| format!(" ({h})")).unwrap_or_default())]
    MissingElement {
        factory: String,
        hint: Option<&'static str>,
    },
    #[error("`{factory}` has no property `{property}`")]
    NoProperty { factory: String, property: String },
    #[error("`{factory}` {property}: value out of range")]
    PropertyRange { factory: String, property: String },
    #[error("`{factory}` {property} is a {found}, not the value outpost sets")]
    PropertyType {
        factory: String,
        property: String,
        found: String,
    },
    #[error("caps value {0} out of range")]
    CapsRange(u32),
    #[error("cannot link {from} to {to}")]
    Link { from: String, to: String },
    #[error("cannot add `{element}` to the pipeline: {reason}")]
    Add { element: String, reason: String },
    /// A hand-written pipeline GStreamer cannot parse (the line without
    /// credentials).
    #[error("pipeline `{line}`: {reason}")]
    Launch { line: String, reason: String },
    /// The pipeline lacks a part outpost needs (`appsink name=outpost`, a
    /// pad), or the camera's config names none it can build.
    #[error("{0}")]
    Shape(&'static str),
    /// No decoder chain for the stream on this machine.
    #[error("{0}")]
    Decoder(#[from] DecoderError),
    /// The daemon's RTSP client: the camera's answer or the network's.
    #[error("{0}")]
    Rtsp(#[from] RtspError),
    /// rtspsrc could not connect; `diagnosis` is the network's reason.
    #[error("{error}: {diagnosis}")]
    Connect {
        error: Box<CameraError>,
        diagnosis: String,
    },
    /// An error message on the pipeline's bus.
    #[error("{element}: {message}{}", debug.as_ref().map(|d| format!(" ({d})")).unwrap_or_default())]
    Bus {
        element: String,
        message: String,
        debug: Option<String>,
        fault: BusFault,
    },
    /// A step of a running pipeline GStreamer refused (a state change, a
    /// pad link, feeding the shared decoder).
    #[error("{what}: {reason}")]
    Runtime { what: &'static str, reason: String },
    #[error("cannot start {what}: {source}")]
    Thread {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("end of stream (the camera closed it)")]
    Eos,
    /// No frame (or no keyframe) for longer than the camera's limit.
    #[error("{0}")]
    Stalled(String),
    #[error("the camera's thread failed: {0}")]
    Panic(String),
    #[error("the pipeline refused to start")]
    Refused,
}

/// What kind of bus error, as far as retrying goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BusFault {
    /// A plugin or codec this machine lacks: permanent.
    MissingPlugin,
    /// rtspsrc could not open its connection.
    Connect,
    Other,
}

impl CameraError {
    /// Whether another try may succeed without anyone changing the
    /// machine or the config: the network, the camera, a stall. An element
    /// or plugin missing, a property, a link or a launch line GStreamer
    /// refuses are permanent.
    pub(super) fn retriable(&self) -> bool {
        use CameraError as E;
        match self {
            E::MissingElement { .. }
            | E::NoProperty { .. }
            | E::PropertyRange { .. }
            | E::PropertyType { .. }
            | E::CapsRange(_)
            | E::Link { .. }
            | E::Add { .. }
            | E::Launch { .. }
            | E::Shape(_)
            | E::Decoder(_) => false,
            E::Bus { fault, .. } => *fault != BusFault::MissingPlugin,
            E::Rtsp(_)
            | E::Connect { .. }
            | E::Runtime { .. }
            | E::Thread { .. }
            | E::Eos
            | E::Stalled(_)
            | E::Panic(_)
            | E::Refused => true,
        }
    }

    /// A missing element: `factory`'s plugin is not installed.
    pub(super) fn missing(factory: &str) -> CameraError {
        CameraError::MissingElement {
            factory: factory.to_string(),
            hint: None,
        }
    }

    /// GStreamer's own error for a step of a running pipeline.
    pub(super) fn runtime(what: &'static str, e: impl std::fmt::Display) -> CameraError {
        CameraError::Runtime {
            what,
            reason: e.to_string(),
        }
    }

    /// The error a bus message carries (`None`: not an error message).
    pub(super) fn from_bus(msg: &gstreamer::Message) -> Option<CameraError> {
        let gstreamer::MessageView::Error(e) = msg.view() else {
            return None;
        };
        let element = msg
            .src()
            .map(|s| s.name().to_string())
            .unwrap_or_else(|| "pipeline".into());
        let err = e.error();
        let fault = if err.matches(gstreamer::CoreError::MissingPlugin)
            || err.matches(gstreamer::StreamError::CodecNotFound)
        {
            BusFault::MissingPlugin
        } else if err.matches(gstreamer::ResourceError::OpenReadWrite)
            || err.matches(gstreamer::ResourceError::OpenRead)
        {
            BusFault::Connect
        } else {
            BusFault::Other
        };
        Some(CameraError::Bus {
            element,
            message: err.to_string(),
            debug: e.debug().map(|d| last_line(&d).to_string()),
            fault,
        })
    }

    /// Whether rtspsrc could not connect (the network is asked why).
    pub(super) fn is_connect(&self) -> bool {
        matches!(
            self,
            CameraError::Bus {
                fault: BusFault::Connect,
                ..
            }
        )
    }
}

/// GStreamer's debug strings start with the source file and function; the
/// part after the last newline is the human one.
fn last_line(d: &str) -> &str {
    d.rsplit('\n').next().unwrap_or(d).trim()
}

#[cfg(test)]
mod tests {
    use super::super::relay::RelayError;
    use super::*;

    #[test]
    fn a_missing_element_is_permanent() {
        let e = CameraError::missing("nosuchelement");
        assert!(!e.retriable());
        assert!(e.to_string().contains("`nosuchelement` is missing"), "{e}");
    }

    #[test]
    fn a_refused_connection_is_retriable() {
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let e = CameraError::Rtsp(RtspError::Relay(RelayError::Connect {
            target: "127.0.0.1:9".into(),
            source: refused,
        }));
        assert!(e.retriable());
        assert!(e.to_string().contains("connect 127.0.0.1:9"), "{e}");
        let e = CameraError::Connect {
            error: Box::new(CameraError::Bus {
                element: "outpost_rtspsrc".into(),
                message: "Could not open resource for reading and writing.".into(),
                debug: Some("Failed to connect. (Generic error)".into()),
                fault: BusFault::Connect,
            }),
            diagnosis: "connect 127.0.0.1:9: Connection refused".into(),
        };
        assert!(e.retriable());
    }

    #[test]
    fn a_launch_line_gstreamer_cannot_parse_is_permanent() {
        gstreamer::init().unwrap();
        let e = super::super::elements::launch(
            "rtspsrc location=rtsp://admin:hunter22@cam/ ! nosuchelement ! appsink name=outpost",
        )
        .unwrap_err();
        assert!(!e.retriable(), "{e:?}");
        assert!(matches!(e, CameraError::Launch { .. }), "{e:?}");
        assert!(!e.to_string().contains("hunter22"), "{e}");
    }

    #[test]
    fn property_link_and_shape_faults_are_permanent_stalls_and_eos_are_not() {
        let permanent = [
            CameraError::NoProperty {
                factory: "videoconvert".into(),
                property: "x".into(),
            },
            CameraError::Link {
                from: "videotestsrc".into(),
                to: "appsink".into(),
            },
            CameraError::Shape("the pipeline has no `appsink name=outpost`"),
            CameraError::Decoder(DecoderError::Missing("h264parse")),
            CameraError::Bus {
                element: "decodebin0".into(),
                message: "missing plugin".into(),
                debug: None,
                fault: BusFault::MissingPlugin,
            },
        ];
        for e in permanent {
            assert!(!e.retriable(), "{e:?}");
        }
        let retriable = [
            CameraError::Eos,
            CameraError::Stalled("no frame for 5 s (stall_timeout)".into()),
            CameraError::Refused,
            CameraError::Bus {
                element: "outpost_rtspsrc".into(),
                message: "the stream has no video track".into(),
                debug: None,
                fault: BusFault::Other,
            },
        ];
        for e in retriable {
            assert!(e.retriable(), "{e:?}");
        }
    }
}
