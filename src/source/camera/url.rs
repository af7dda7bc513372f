//! Camera URLs: parsed into plain parts (a device path, a host, a port, a
//! path) or refused, and shown without their credentials (`scrub.rs` takes
//! them out of every other text).
//!
//! Every part is checked against the characters it may hold, so nothing a
//! URL says can reach GStreamer as anything but the value of one property
//! (the pipelines are built from elements: see `plan.rs`).

/// Why a camera URL is refused; each says what a plain one looks like.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("expected rtsp://host/path, v4l2:///dev/videoN or csi://N (no scheme)")]
    NoScheme,
    #[error("scheme `{0}` is not a camera (rtsp, v4l2 or csi)")]
    Scheme(String),
    #[error("rtsp url has no host")]
    NoHost,
    #[error("rtsp url contains spaces")]
    Spaces,
    /// The host part: `[` without `]`, not an address, odd characters.
    #[error("rtsp host{0}")]
    Host(String),
    #[error("rtsp port is not a port number (1 to 65535)")]
    Port,
    #[error("rtsp path{0}")]
    Path(String),
    #[error("rtsp {what} holds the control character {char}")]
    Credential { what: &'static str, char: String },
    #[error("v4l2 {0}")]
    Device(String),
    #[error("csi url is csi://N (the sensor id)")]
    Csi,
}

/// A parsed camera URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CameraUrl {
    Rtsp {
        /// Without the credentials: `rtsp://host:port/path?query`.
        location: String,
        user: Option<String>,
        password: Option<String>,
    },
    V4l2 {
        device: String,
    },
    Csi {
        sensor: u32,
    },
}

/// Characters a V4L2 device path may hold besides letters and digits
/// (`/dev/v4l/by-path/pci-0000:00:14.0-usb-0:1:1.0-video-index0`).
const DEVICE_PUNCT: &str = "/._-:+";
/// Characters an RTSP path and query may hold besides letters and digits:
/// RFC 3986's unreserved ones and the delimiters camera paths use
/// (`/Streaming/Channels/101`, `/cam/realmonitor?channel=1&subtype=0`).
const PATH_PUNCT: &str = "-._~/?&=%:@,;+";
/// Characters a host name may hold besides letters and digits.
const HOST_PUNCT: &str = ".-_";

/// The first character of `s` outside letters, digits and `punct`.
fn odd_char(s: &str, punct: &str) -> Option<char> {
    s.chars()
        .find(|c| !(c.is_ascii_alphanumeric() || punct.contains(*c)))
}

/// How a refused character is named: visible ones quoted, others by code.
fn named(c: char) -> String {
    if c == ' ' {
        "a space".into()
    } else if c.is_ascii_graphic() {
        format!("`{c}`")
    } else {
        format!("U+{:04X}", c as u32)
    }
}

fn check_device(device: &str) -> Result<(), UrlError> {
    if !device.starts_with("/dev/") || device.len() == "/dev/".len() {
        return Err(UrlError::Device("url is v4l2:///dev/videoN".into()));
    }
    if let Some(c) = odd_char(device, DEVICE_PUNCT) {
        return Err(UrlError::Device(format!(
            "device path holds {}: a device path is letters, digits and `{DEVICE_PUNCT}` only",
            named(c)
        )));
    }
    if device.split('/').any(|seg| seg == "..") {
        return Err(UrlError::Device("device path holds `..`".into()));
    }
    Ok(())
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`.
fn check_authority(hostport: &str) -> Result<(), UrlError> {
    let (host, port) = if let Some(rest) = hostport.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return Err(UrlError::Host(": `[` without `]`".into()));
        };
        if v6.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(UrlError::Host(format!(": `{v6}` is not an IPv6 address")));
        }
        match after {
            "" => (v6, None),
            p => match p.strip_prefix(':') {
                Some(p) => (v6, Some(p)),
                None => {
                    return Err(UrlError::Host(
                        ": text after `]` that is not `:port`".into(),
                    ));
                }
            },
        }
    } else {
        match hostport.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err(UrlError::NoHost);
    }
    if !hostport.starts_with('[')
        && let Some(c) = odd_char(host, HOST_PUNCT)
    {
        return Err(UrlError::Host(format!(
            " holds {}: a host is a name or an address (letters, digits, `{HOST_PUNCT}`)",
            named(c)
        )));
    }
    if let Some(p) = port {
        let ok = !p.is_empty()
            && p.chars().all(|c| c.is_ascii_digit())
            && p.parse::<u16>().is_ok_and(|n| n > 0);
        if !ok {
            // Not quoted: text a misplaced `/` cut from a password may land here.
            return Err(UrlError::Port);
        }
    }
    Ok(())
}

fn check_path(path: &str) -> Result<(), UrlError> {
    if let Some(c) = odd_char(path, PATH_PUNCT) {
        return Err(UrlError::Path(format!(
            " holds {}: a path is letters, digits and `{PATH_PUNCT}` (percent-encode anything else)",
            named(c)
        )));
    }
    let b = path.as_bytes();
    for (i, _) in path.match_indices('%') {
        let hex = b.get(i + 1..i + 3);
        if !hex.is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit)) {
            return Err(UrlError::Path(
                ": `%` not followed by two hex digits".into(),
            ));
        }
    }
    Ok(())
}

/// The user name or password after percent-decoding: no control
/// characters (a CR LF would reach the RTSP request's headers).
fn check_credential(what: &'static str, v: &str) -> Result<(), UrlError> {
    if let Some(c) = v.chars().find(|c| c.is_control()) {
        return Err(UrlError::Credential {
            what,
            char: named(c),
        });
    }
    Ok(())
}

impl CameraUrl {
    pub fn parse(url: &str) -> Result<CameraUrl, UrlError> {
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(UrlError::NoScheme);
        };
        match scheme.to_ascii_lowercase().as_str() {
            s @ ("rtsp" | "rtsps" | "rtspt") => {
                let (authority, path) = match rest.find('/') {
                    Some(i) => rest.split_at(i),
                    None => (rest, ""),
                };
                let (userinfo, host) = match authority.rfind('@') {
                    Some(i) => (Some(&authority[..i]), &authority[i + 1..]),
                    None => (None, authority),
                };
                if host.is_empty() {
                    return Err(UrlError::NoHost);
                }
                if url.chars().any(char::is_whitespace) {
                    return Err(UrlError::Spaces);
                }
                check_authority(host)?;
                check_path(path)?;
                let (user, password) = match userinfo {
                    Some(ui) => {
                        let (u, p) = match ui.split_once(':') {
                            Some((u, p)) => (u, Some(p)),
                            None => (ui, None),
                        };
                        (Some(percent_decode(u)), p.map(percent_decode))
                    }
                    None => (None, None),
                };
                if let Some(u) = &user {
                    check_credential("user", u)?;
                }
                if let Some(p) = &password {
                    check_credential("password", p)?;
                }
                Ok(CameraUrl::Rtsp {
                    location: format!("{s}://{host}{path}"),
                    user,
                    password,
                })
            }
            "v4l2" => {
                check_device(rest)?;
                Ok(CameraUrl::V4l2 {
                    device: rest.to_string(),
                })
            }
            "csi" => {
                let n = rest.trim_end_matches('/');
                if n.is_empty() || !n.chars().all(|c| c.is_ascii_digit()) {
                    return Err(UrlError::Csi);
                }
                n.parse::<u32>()
                    .map(|sensor| CameraUrl::Csi { sensor })
                    .map_err(|_| UrlError::Csi)
            }
            other => Err(UrlError::Scheme(other.to_string())),
        }
    }

    /// The URL as logs and status show it: credentials replaced by `***`,
    /// and the values of query parameters that look like secrets too.
    pub fn shown(&self) -> String {
        match self {
            CameraUrl::Rtsp {
                location,
                user,
                password,
            } => {
                let (scheme, rest) = location.split_once("://").unwrap_or(("rtsp", location));
                let creds = if user.is_some() || password.is_some() {
                    "***@"
                } else {
                    ""
                };
                format!("{scheme}://{creds}{}", redact_query(rest))
            }
            CameraUrl::V4l2 { device } => format!("v4l2://{device}"),
            CameraUrl::Csi { sensor } => format!("csi://{sensor}"),
        }
    }
}

pub(super) fn secret_key(k: &str) -> bool {
    let k = k.to_ascii_lowercase();
    [
        "user", "pass", "pwd", "token", "key", "auth", "secret", "sig",
    ]
    .iter()
    .any(|s| k.contains(s))
}

/// `rest` with the values of secret-named query parameters masked.
pub(super) fn redact_query(rest: &str) -> String {
    let Some((head, q)) = rest.split_once('?') else {
        return rest.to_string();
    };
    let q: Vec<String> = q
        .split('&')
        .map(|kv| match kv.split_once('=') {
            Some((k, _)) if secret_key(k) => format!("{k}=***"),
            _ => kv.to_string(),
        })
        .collect();
    format!("{head}?{}", q.join("&"))
}

pub(super) fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(v) = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_split_off_and_never_shown() {
        let u =
            CameraUrl::parse("rtsp://admin:s%40cret@10.0.0.7:554/stream1?token=abc&ch=1").unwrap();
        let CameraUrl::Rtsp {
            location,
            user,
            password,
        } = &u
        else {
            panic!()
        };
        assert_eq!(location, "rtsp://10.0.0.7:554/stream1?token=abc&ch=1");
        assert_eq!(user.as_deref(), Some("admin"));
        assert_eq!(password.as_deref(), Some("s@cret"));
        let shown = u.shown();
        assert_eq!(shown, "rtsp://***@10.0.0.7:554/stream1?token=***&ch=1");
        let msg = "Could not connect to rtsp://10.0.0.7:554/stream1?token=abc as admin with s@cret";
        let cfg = super::super::CameraDef {
            name: "c".into(),
            url: Some("rtsp://admin:s%40cret@10.0.0.7:554/stream1?token=abc&ch=1".into()),
            pipeline: None,
            width: None,
            height: None,
            transport: Default::default(),
            stall_timeout: std::time::Duration::from_secs(5),
            decode: Default::default(),
            max_frame_bytes: 8 << 20,
            fps: None,
        };
        let s = super::super::Scrubber::for_camera(&cfg).scrub(msg);
        for secret in ["abc", "admin", "s@cret"] {
            assert!(!s.contains(secret), "{s}");
        }
        assert_eq!(
            CameraUrl::parse("rtsp://cam/x").unwrap().shown(),
            "rtsp://cam/x"
        );
        assert!(CameraUrl::parse("rtsp:///x").is_err());
        assert!(CameraUrl::parse("v4l2://video0").is_err());
        assert!(CameraUrl::parse("csi://a").is_err());
        assert_eq!(
            CameraUrl::parse("v4l2:///dev/video2").unwrap(),
            CameraUrl::V4l2 {
                device: "/dev/video2".into()
            }
        );
    }

    /// A device path that carried pipeline syntax ran any pipeline (it was
    /// pasted into a launch string): now every part must be plain.
    #[test]
    fn url_parts_that_are_not_plain_are_refused() {
        let attack = "v4l2:///dev/null ! fakesink videotestsrc num-buffers=3 ! tee name=t ! queue ! filesink location=/tmp/VICTIM t. ! queue";
        let e = CameraUrl::parse(attack).unwrap_err();
        assert!(matches!(e, UrlError::Device(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("device path") && e.contains("a space"), "{e}");
        for bad in [
            "v4l2:///dev/video0!fakesink",
            "v4l2:///dev/video0 ",
            "v4l2:///dev/../etc/passwd",
            "v4l2:///dev/",
            "v4l2:///dev/video0\"",
            "v4l2:///dev/video0?x=1",
            "rtsp://cam/x y",
            "rtsp://cam/x!y",
            "rtsp://cam/x\"y",
            "rtsp://cam/x#frag",
            "rtsp://cam/x%zz",
            "rtsp://ca!m/x",
            "rtsp://cam:port/x",
            "rtsp://cam:0/x",
            "rtsp://cam:70000/x",
            "rtsp://[::1/x",
            "rtsp://[zz]/x",
            "rtsp://[::1]x/x",
            "rtsp://u:p%0d%0aX-Evil:%201@cam/x",
            "csi://+1",
            "csi://1 ! fakesink",
        ] {
            assert!(CameraUrl::parse(bad).is_err(), "{bad} was taken");
        }
        for good in [
            "v4l2:///dev/video0",
            "v4l2:///dev/v4l/by-path/pci-0000:00:14.0-usb-0:1:1.0-video-index0",
            "v4l2:///dev/v4l/by-id/usb-046d_HD_Pro_Webcam_C920_ABC-video-index0",
            "rtsp://10.0.0.7:554/Streaming/Channels/101",
            "rtsp://cam.site-1.local/cam/realmonitor?channel=1&subtype=0",
            "rtsp://user:p%40ss!word@[fe80::1]:8554/live.sdp",
            "rtsp://cam/user=admin_password=x_channel=1_stream=0.sdp?real_stream",
            "rtsp://cam",
            "csi://0",
            "csi://1/",
        ] {
            assert!(
                CameraUrl::parse(good).is_ok(),
                "{good}: {:?}",
                CameraUrl::parse(good)
            );
        }
    }
}
