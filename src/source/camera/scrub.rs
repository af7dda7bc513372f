//! Credentials out of every text a camera shows (its name, its errors, the
//! log, `/v1/status`, `/v1/events`, the `camera_down` records).
//!
//! Two passes. Generic rules need no knowledge of the secrets: the user
//! info of any URL (`scheme://user:pass@` -> `scheme://***@`), the values
//! of query parameters named like secrets, `Authorization:` header values
//! (servers echo them in their errors), and rtspsrc's `user-id=` /
//! `user-pw=` in a hand-written pipeline. Then every known secret is
//! replaced wherever it appears, in each form a message may quote it: as
//! configured, percent-encoded, and the base64 of `user:pass` and of the
//! password (what a Basic `Authorization` header carries).

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};

use super::url::{percent_decode, redact_query, secret_key};
use super::{CameraDef, CameraUrl};

const MASK: &str = "***";

/// Takes a camera's credentials out of texts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scrubber {
    /// Longest first, so a secret containing another is replaced whole.
    secrets: Vec<String>,
}

/// Secrets shorter than this are left to the generic rules: replacing a
/// one- or two-letter user name everywhere would blank out the message.
const MIN_SECRET: usize = 3;

impl Scrubber {
    /// The scrubber for a camera's config: its URL's credentials, or those
    /// of every URL and rtspsrc property in a hand-written pipeline.
    pub fn for_camera(cfg: &CameraDef) -> Scrubber {
        let mut found = Found::default();
        if let Some(u) = &cfg.url {
            match CameraUrl::parse(u) {
                Ok(CameraUrl::Rtsp {
                    location,
                    user,
                    password,
                }) => {
                    found.pair(user, password);
                    found.query(&location);
                }
                Ok(_) => {}
                // Unparsed (refused by check): whatever the text holds.
                Err(_) => found.text(u),
            }
            if let Some((_, rest)) = u.split_once("://")
                && let Some((userinfo, _)) = authority(rest).rsplit_once('@')
            {
                // As written (percent-encoded), too.
                found.raw(userinfo);
            }
        }
        if let Some(p) = &cfg.pipeline {
            found.text(p);
        }
        Scrubber::new(found.0)
    }

    /// A scrubber for these secrets (and their encodings, added here).
    pub fn new(secrets: Vec<String>) -> Scrubber {
        let mut s: Vec<String> = secrets
            .into_iter()
            .filter(|x| x.len() >= MIN_SECRET)
            .collect();
        s.sort_by_key(|x| std::cmp::Reverse(x.len()));
        s.dedup();
        Scrubber { secrets: s }
    }

    /// `text` with every credential replaced by `***`.
    pub fn scrub(&self, text: &str) -> String {
        let mut t = scrub_urls(text);
        t = scrub_after(&t, "authorization", true);
        for key in ["user-pw", "user-id", "proxy-pw", "proxy-id"] {
            t = scrub_after(&t, key, false);
        }
        for s in &self.secrets {
            if t.contains(s.as_str()) {
                t = t.replace(s.as_str(), MASK);
            }
        }
        t
    }
}

/// Secrets collected from a config, with their encodings.
#[derive(Default)]
struct Found(Vec<String>);

impl Found {
    fn push(&mut self, s: &str) {
        if !s.is_empty() {
            self.0.push(s.to_string());
        }
    }

    /// Every form a Basic header or a message may carry the value in.
    fn encodings(&mut self, v: &str) {
        for e in [STANDARD, URL_SAFE] {
            self.push(&e.encode(v));
        }
        for e in [STANDARD_NO_PAD, URL_SAFE_NO_PAD] {
            self.push(&e.encode(v));
        }
    }

    fn pair(&mut self, user: Option<String>, password: Option<String>) {
        if let Some(u) = &user {
            self.push(u);
        }
        if let Some(p) = &password {
            self.push(p);
            self.encodings(p);
        }
        if user.is_some() || password.is_some() {
            let both = format!(
                "{}:{}",
                user.as_deref().unwrap_or(""),
                password.as_deref().unwrap_or("")
            );
            self.push(&both);
            self.encodings(&both);
        }
    }

    /// A URL's user info as written: `user:pa%40ss`.
    fn raw(&mut self, userinfo: &str) {
        self.push(userinfo);
        if let Some((u, p)) = userinfo.split_once(':') {
            self.push(u);
            self.push(p);
        }
    }

    /// Values of query parameters named like secrets.
    fn query(&mut self, url: &str) {
        if let Some((_, q)) = url.split_once('?') {
            for kv in q.split('&') {
                if let Some((k, v)) = kv.split_once('=')
                    && secret_key(k)
                {
                    self.push(v);
                }
            }
        }
    }

    /// Every URL with user info, and every `user-id=` / `user-pw=`, in a
    /// pipeline description or any text.
    fn text(&mut self, text: &str) {
        for (start, end) in urls(text) {
            let url = &text[start..end];
            let rest = url.split_once("://").map_or(url, |(_, r)| r);
            if let Some((userinfo, _)) = authority(rest).rsplit_once('@') {
                self.raw(userinfo);
                let (u, p) = match userinfo.split_once(':') {
                    Some((u, p)) => (u, Some(p)),
                    None => (userinfo, None),
                };
                self.pair(Some(percent_decode(u)), p.map(percent_decode));
            }
            self.query(url);
        }
        let mut user = None;
        let mut password = None;
        for (key, slot) in [("user-id", &mut user), ("user-pw", &mut password)] {
            for v in property_values(text, key) {
                *slot = Some(v);
            }
        }
        for key in ["proxy-id", "proxy-pw"] {
            for v in property_values(text, key) {
                self.push(&v);
            }
        }
        if user.is_some() || password.is_some() {
            self.pair(user, password);
        }
    }
}

/// The authority of a URL's text after `scheme://`.
fn authority(rest: &str) -> &str {
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    &rest[..end]
}

/// Characters that end a URL inside a message or a launch description
/// (what may follow it there: `(rtsp://..)` keeps its `)` in the path part,
/// which is passed on as it is).
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | '`')
}

/// Byte ranges of the `scheme://...` URLs in `text`.
fn urls(text: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find("://") {
        let at = from + i;
        let start = text[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
            .map_or(0, |j| j + 1);
        let end = text[at + 3..]
            .find(ends_url)
            .map_or(text.len(), |j| at + 3 + j);
        if start < at {
            out.push((start, end));
        }
        from = end.max(at + 3);
    }
    out
}

/// Generic pass over URLs: user info and secret-named query values masked.
fn scrub_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    for (start, end) in urls(text) {
        out.push_str(&text[last..start]);
        let url = &text[start..end];
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let auth = authority(rest);
        let (creds, hostport) = match auth.rsplit_once('@') {
            Some((_, h)) => (true, h),
            None => (false, auth),
        };
        let tail = &rest[auth.len()..];
        out.push_str(scheme);
        out.push_str("://");
        if creds {
            out.push_str(MASK);
            out.push('@');
        }
        out.push_str(hostport);
        out.push_str(&redact_query(tail));
        last = end;
    }
    out.push_str(&text[last..]);
    out
}

/// The values of `key=value` (or `key="value"`) in a text.
fn property_values(text: &str, key: &str) -> Vec<String> {
    let lower = text.to_ascii_lowercase();
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = lower[from..].find(key) {
        let at = from + i + key.len();
        from = at;
        let Some(rest) = text[at..].strip_prefix('=') else {
            continue;
        };
        let v = match rest.strip_prefix('"') {
            Some(q) => q.split('"').next().unwrap_or(""),
            None => rest
                .split(|c: char| c.is_whitespace() || c == '!')
                .next()
                .unwrap_or(""),
        };
        out.push(v.to_string());
    }
    out
}

/// Masks what follows `key` (case-insensitive) and `:` or `=`: a header
/// value (`header`: the scheme word stays, its credentials go; a Digest
/// header's parameters go up to the end of the line) or one property value.
fn scrub_after(text: &str, key: &str, header: bool) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut last = 0;
    let mut from = 0;
    while let Some(i) = lower[from..].find(key) {
        let at = from + i + key.len();
        from = at;
        let rest = &text[at..];
        let Some(sep) = rest.chars().next().filter(|c| *c == ':' || *c == '=') else {
            continue;
        };
        let mut v = at + sep.len_utf8();
        v += text[v..].len() - text[v..].trim_start_matches([' ', '\t']).len();
        let value = &text[v..];
        let end = if header {
            // A scheme word (`Basic`, `Digest`, `Bearer`) followed by more
            // is kept; a lone token is all credentials.
            let word = value
                .find(|c: char| !c.is_ascii_alphanumeric())
                .unwrap_or(value.len());
            let after = &value[word..];
            let more = after.trim_start_matches(' ');
            let scheme = word > 0
                && after.starts_with(' ')
                && more.chars().next().is_some_and(|c| c != '\r' && c != '\n');
            let (creds, creds_at) = if scheme {
                (more, v + word + (after.len() - more.len()))
            } else {
                (value, v)
            };
            out.push_str(&text[last..creds_at]);
            let line_end = creds.find(['\r', '\n']).unwrap_or(creds.len());
            let len = if creds[..line_end].contains('=') && creds[..line_end].contains(',') {
                line_end
            } else {
                creds
                    .find(|c: char| c.is_whitespace() || matches!(c, ')' | '"' | '\'' | ']' | ','))
                    .unwrap_or(creds.len())
            };
            creds_at + len
        } else {
            out.push_str(&text[last..v]);
            let len = match value.strip_prefix('"') {
                Some(q) => q.find('"').map_or(value.len(), |j| j + 2),
                None => value
                    .find(|c: char| c.is_whitespace() || c == '!')
                    .unwrap_or(value.len()),
            };
            v + len
        };
        out.push_str(MASK);
        last = end;
        from = end.max(from);
    }
    out.push_str(&text[last..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn camera(url: Option<&str>, pipeline: Option<&str>) -> CameraDef {
        CameraDef {
            name: "c".into(),
            url: url.map(str::to_string),
            pipeline: pipeline.map(str::to_string),
            width: None,
            height: None,
            transport: Default::default(),
            stall_timeout: std::time::Duration::from_secs(5),
            decode: Default::default(),
            max_frame_bytes: 8 << 20,
            fps: None,
        }
    }

    fn leaks(text: &str, secrets: &[&str]) -> Vec<String> {
        secrets
            .iter()
            .filter(|s| text.contains(**s))
            .map(|s| s.to_string())
            .collect()
    }

    /// A server that echoed the Authorization header put the base64 of
    /// `user:pass` in the camera's error (status, events, log, records).
    #[test]
    fn an_echoed_authorization_header_is_scrubbed() {
        let s = Scrubber::for_camera(&camera(
            Some("rtsp://viewer:right-horse@127.0.0.1:8554/cam"),
            None,
        ));
        let b64 = STANDARD.encode("viewer:right-horse");
        let msg = format!(
            "outpost_rtspsrc: Unhandled error (Forbidden (Authorization: Basic {b64}) (403))"
        );
        let out = s.scrub(&msg);
        assert_eq!(
            out,
            "outpost_rtspsrc: Unhandled error (Forbidden (Authorization: Basic ***) (403))"
        );
        // The base64 alone, and of the password alone, anywhere.
        let pw = STANDARD_NO_PAD.encode("right-horse");
        let out = s.scrub(&format!("token {b64} and {pw} and right-horse"));
        assert!(leaks(&out, &[&b64, &pw, "right-horse"]).is_empty(), "{out}");
        // A header with no known secret (another camera's): generic rule.
        let anon = Scrubber::default();
        assert_eq!(
            anon.scrub("(Authorization: dXNlcjpwYXNz)"),
            "(Authorization: ***)"
        );
        let out = anon.scrub("Authorization: Bearer eyJhbGciOi.x.y\r\nnext");
        assert_eq!(out, "Authorization: Bearer ***\r\nnext");
        let out = anon.scrub(
            "proxy-authorization=Digest username=\"u\", realm=\"r\", response=\"abc\"\nrest",
        );
        assert_eq!(out, "proxy-authorization=Digest ***\nrest");
    }

    /// A hand-written pipeline's rtspsrc location held user:pass and was
    /// shown as it was.
    #[test]
    fn a_custom_pipeline_is_scrubbed() {
        let p = "rtspsrc location=rtsp://admin:s%40cret@10.0.0.9:554/live?token=t0ken&ch=2 ! rtph264depay ! avdec_h264 ! videoconvert ! appsink name=outpost";
        let s = Scrubber::for_camera(&camera(None, Some(p)));
        let out = s.scrub(p);
        assert!(
            out.starts_with(
                "rtspsrc location=rtsp://***@10.0.0.9:554/live?token=***&ch=2 ! rtph264depay"
            ),
            "{out}"
        );
        let b64 = STANDARD.encode("admin:s@cret");
        let err = format!(
            "Could not open resource rtsp://10.0.0.9:554/live as admin, s@cret, {b64}, t0ken"
        );
        let out = s.scrub(&err);
        assert!(
            leaks(&out, &["s@cret", "s%40cret", &b64, "t0ken", "admin"]).is_empty(),
            "{out}"
        );
        // rtspsrc's own properties.
        let p =
            "rtspsrc location=rtsp://10.0.0.9/x user-id=operator user-pw=\"long pass\" ! fakesink";
        let s = Scrubber::for_camera(&camera(None, Some(p)));
        let out = s.scrub(p);
        assert_eq!(
            out,
            "rtspsrc location=rtsp://10.0.0.9/x user-id=*** user-pw=*** ! fakesink"
        );
        let b64 = STANDARD.encode("operator:long pass");
        assert!(s.scrub(&b64).eq(MASK));
    }

    #[test]
    fn urls_in_any_text_lose_their_user_info() {
        let anon = Scrubber::default();
        assert_eq!(
            anon.scrub("failed: rtsp://u:p@cam/x, then http://a:b@h:80/y?password=z&q=1 (x)"),
            "failed: rtsp://***@cam/x, then http://***@h:80/y?password=***&q=1 (x)"
        );
        assert_eq!(anon.scrub("no url here: a@b"), "no url here: a@b");
        assert_eq!(anon.scrub("rtsp://cam/x"), "rtsp://cam/x");
        assert_eq!(anon.scrub("://"), "://");
        // A URL form camera: raw (percent-encoded) and decoded forms.
        let s = Scrubber::for_camera(&camera(Some("rtsp://admin:p%40ss@cam/x"), None));
        let out = s.scrub("p%40ss p@ss admin:p@ss");
        assert!(leaks(&out, &["p%40ss", "p@ss"]).is_empty(), "{out}");
    }
}
