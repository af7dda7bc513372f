//! An S3-compatible bucket as the place of a rollout's documents (the plan's
//! `[s3]` table): objects written with PUT Object, path-style addressing,
//! requests signed with SigV4 by rusty-s3 (which does no I/O: it hands
//! back a signed URL) and sent by reqwest.
//!
//! - Credentials come from the environment only (`AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, optionally `AWS_SESSION_TOKEN`); no message
//!   ever shows them or a signed URL (errors name the object's plain URL).
//! - A PUT is atomic: readers see the old object or the new one, so
//!   `manifest.json` is written last-writer-wins like the directory's
//!   rename.
//! - A failed request is an [`S3Error`] naming the endpoint, bucket and key,
//!   and the HTTP status with the S3 error code and message when the server
//!   answered; retrying is the caller's business.

use std::path::PathBuf;
use std::time::Duration;

use rusty_s3::S3Action as _;
use serde::{Deserialize, Serialize};

/// The plan's `[s3]` table.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Target {
    /// The server, `http(s)://HOST[:PORT]`; the bucket is addressed
    /// path-style (`{endpoint}/{bucket}/{key}`).
    pub endpoint: String,
    pub bucket: String,
    /// Put in front of every key (`site-7/` gives `site-7/manifest.json`).
    #[serde(default)]
    pub prefix: String,
    #[serde(default = "default_region")]
    pub region: String,
    /// CA certificates (PEM) for an https endpoint with a private CA;
    /// default: the system's roots.
    #[serde(default)]
    pub ca: Option<PathBuf>,
}

fn default_region() -> String {
    "us-east-1".into()
}

/// How long a signed URL is good for: it is used at once, so this only
/// has to cover clock skew between this host and the server.
const SIGNED_FOR: Duration = Duration::from_secs(15 * 60);

/// Per request: connect and whole-request limits.
const TIMEOUT: Duration = Duration::from_secs(30);

/// Error bodies read at most this far.
const MAX_ERROR_BODY: usize = 64 * 1024;

impl S3Target {
    /// Every problem at once (prefixed `s3.`).
    pub fn validate(&self) -> Vec<String> {
        let mut p = Vec::new();
        match reqwest::Url::parse(&self.endpoint) {
            Err(e) => p.push(format!("s3.endpoint: `{}`: {e}", self.endpoint)),
            Ok(u) => {
                if !matches!(u.scheme(), "http" | "https") {
                    p.push(format!("s3.endpoint: `{}` is not http(s)", self.endpoint));
                }
                if u.query().is_some() || !u.username().is_empty() || u.password().is_some() {
                    p.push(format!(
                        "s3.endpoint: `{}`: no query or credentials in the URL (credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)",
                        self.endpoint
                    ));
                }
            }
        }
        if self.bucket.is_empty() || self.bucket.contains('/') {
            p.push(format!("s3.bucket: `{}` is not a bucket name", self.bucket));
        }
        if self.prefix.starts_with('/') {
            p.push(format!(
                "s3.prefix: `{}` starts with `/` (keys have no leading slash)",
                self.prefix
            ));
        }
        if self.region.is_empty() {
            p.push("s3.region: empty".into());
        }
        p
    }

    /// The object key of a document.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// Where the bucket is, for messages: `bucket fleet at http://…`.
    pub fn describe(&self) -> String {
        format!(
            "bucket `{}` at {} (prefix `{}`)",
            self.bucket, self.endpoint, self.prefix
        )
    }
}

/// Why the bucket cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum S3Error {
    #[error("[s3]: {0}")]
    Setup(String),
    #[error(transparent)]
    Request(Box<Failed>),
}

/// A request that failed.
#[derive(Debug, thiserror::Error)]
#[error("{method} of key `{key}` in bucket `{bucket}` at {endpoint}: {why}")]
pub struct Failed {
    pub method: &'static str,
    pub endpoint: String,
    pub bucket: String,
    pub key: String,
    pub why: Why,
}

/// What went wrong with one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Why {
    /// No HTTP answer (connection refused, DNS, TLS, time-out).
    Unreachable(String),
    /// The server answered with an error status.
    Status {
        status: u16,
        /// The S3 error `Code` and `Message` of the body, when it has them.
        code: Option<String>,
        message: Option<String>,
    },
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Unreachable(e) => write!(f, "no answer from the endpoint: {e}"),
            Why::Status {
                status,
                code,
                message,
            } => {
                let reason = reqwest::StatusCode::from_u16(*status)
                    .ok()
                    .and_then(|s| s.canonical_reason())
                    .unwrap_or("");
                write!(f, "HTTP {status} {reason}")?;
                if let Some(c) = code {
                    write!(f, ", S3 error {c}")?;
                }
                if let Some(m) = message {
                    write!(f, ": {m}")?;
                }
                if let Some(h) = hint(code.as_deref()) {
                    write!(f, " ({h})")?;
                }
                Ok(())
            }
        }
    }
}

/// What to look at for the usual refusals.
fn hint(code: Option<&str>) -> Option<&'static str> {
    Some(match code? {
        "InvalidAccessKeyId" | "SignatureDoesNotMatch" | "NotSignedUp" => {
            "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        }
        "AccessDenied" => "the credentials lack GetObject/PutObject on the bucket and prefix",
        "NoSuchBucket" => "create the bucket first, or fix s3.bucket",
        "PermanentRedirect"
        | "AuthorizationHeaderMalformed"
        | "AuthorizationQueryParametersError" => "check s3.region and s3.endpoint",
        "RequestTimeTooSkewed" => "this host's clock is off",
        _ => return None,
    })
}

/// The `Code` and `Message` of an S3 error body
/// (`<Error><Code>…</Code><Message>…</Message>…</Error>`).
pub fn error_fields(body: &str) -> (Option<String>, Option<String>) {
    fn tag(body: &str, name: &str) -> Option<String> {
        let open = format!("<{name}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find(&format!("</{name}>"))? + start;
        let v = body[start..end].trim();
        (!v.is_empty()).then(|| unescape(v))
    }
    // Only the first `<Error>` element counts.
    let scope = body.find("<Error>").map_or(body, |i| &body[i..]);
    (tag(scope, "Code"), tag(scope, "Message"))
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

/// The reqwest error with its causes, without the URL (a signed URL
/// carries the access key id and the signature).
fn chain(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(&e);
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// A bucket to write documents to.
pub struct Bucket {
    target: S3Target,
    bucket: rusty_s3::Bucket,
    credentials: rusty_s3::Credentials,
    client: reqwest::Client,
}

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the credentials.
        f.debug_struct("Bucket")
            .field("target", &self.target)
            .finish()
    }
}

impl Bucket {
    /// Credentials from the environment.
    pub fn from_env(target: &S3Target) -> Result<Bucket, S3Error> {
        let credentials = rusty_s3::Credentials::from_env().ok_or_else(|| {
            S3Error::Setup(
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set in the environment".into(),
            )
        })?;
        Bucket::new(target, credentials)
    }

    pub fn new(target: &S3Target, credentials: rusty_s3::Credentials) -> Result<Bucket, S3Error> {
        let problems = target.validate();
        if !problems.is_empty() {
            return Err(S3Error::Setup(problems.join("; ")));
        }
        let endpoint = reqwest::Url::parse(&target.endpoint)
            .map_err(|e| S3Error::Setup(format!("endpoint `{}`: {e}", target.endpoint)))?;
        let https = endpoint.scheme() == "https";
        let bucket = rusty_s3::Bucket::new(
            endpoint,
            rusty_s3::UrlStyle::Path,
            target.bucket.clone(),
            target.region.clone(),
        )
        .map_err(|e| S3Error::Setup(format!("endpoint `{}`: {e}", target.endpoint)))?;
        // reqwest is built without a default crypto provider: it wants a
        // TLS config for plain http too.
        let tls = if https {
            crate::uplink::tls::client_config(target.ca.as_deref(), None, None)
        } else {
            crate::uplink::tls::trust_nothing()
        }
        .map_err(|e| S3Error::Setup(e.to_string()))?;
        let client = reqwest::Client::builder()
            .connect_timeout(TIMEOUT)
            .timeout(TIMEOUT)
            .no_proxy()
            .tls_backend_preconfigured(tls)
            .build()
            .map_err(|e| S3Error::Setup(format!("HTTP client: {}", chain(e))))?;
        Ok(Bucket {
            target: target.clone(),
            bucket,
            credentials,
            client,
        })
    }

    pub fn target(&self) -> &S3Target {
        &self.target
    }

    fn failed(&self, method: &'static str, key: &str, why: Why) -> S3Error {
        S3Error::Request(Box::new(Failed {
            method,
            endpoint: self.target.endpoint.clone(),
            bucket: self.target.bucket.clone(),
            key: key.to_string(),
            why,
        }))
    }

    /// The error of a non-success answer, its body read (bounded) for the S3 code.
    async fn refusal(&self, method: &'static str, key: &str, resp: reqwest::Response) -> S3Error {
        let status = resp.status().as_u16();
        let mut body = Vec::new();
        let mut resp = resp;
        while body.len() < MAX_ERROR_BODY {
            match resp.chunk().await {
                Ok(Some(c)) => body.extend_from_slice(&c),
                _ => break,
            }
        }
        let (code, message) = error_fields(&String::from_utf8_lossy(&body));
        self.failed(
            method,
            key,
            Why::Status {
                status,
                code,
                message,
            },
        )
    }

    /// PUT Object `{prefix}{name}` (JSON; not to be cached by a CDN in
    /// front without asking the bucket again).
    pub async fn put(&self, name: &str, body: Vec<u8>) -> Result<(), S3Error> {
        let key = self.target.key(name);
        let mut action = self.bucket.put_object(Some(&self.credentials), &key);
        action
            .headers_mut()
            .insert("content-type", "application/json");
        action.headers_mut().insert("cache-control", "no-cache");
        let url = action.sign(SIGNED_FOR);
        let resp = self
            .client
            .put(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::CACHE_CONTROL, "no-cache")
            .body(body)
            .send()
            .await
            .map_err(|e| self.failed("PUT", &key, Why::Unreachable(chain(e))))?;
        if resp.status().is_success() {
            Ok(())
        } else {
            Err(self.refusal("PUT", &key, resp).await)
        }
    }

    /// GET Object `{prefix}{name}`: its bytes, or None when there is no such key.
    pub async fn get(&self, name: &str) -> Result<Option<Vec<u8>>, S3Error> {
        let key = self.target.key(name);
        let url = self
            .bucket
            .get_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let resp = self
            .client
            .get(url)
            .send()
            .await
            .map_err(|e| self.failed("GET", &key, Why::Unreachable(chain(e))))?;
        if resp.status().is_success() {
            let b = resp
                .bytes()
                .await
                .map_err(|e| self.failed("GET", &key, Why::Unreachable(chain(e))))?;
            return Ok(Some(b.to_vec()));
        }
        match self.refusal("GET", &key, resp).await {
            S3Error::Request(f) if matches!(&f.why, Why::Status { status: 404, code, .. } if code.as_deref() == Some("NoSuchKey")) => {
                Ok(None)
            }
            e => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> S3Target {
        toml::from_str(
            "endpoint = \"http://127.0.0.1:9000\"\nbucket = \"fleet\"\nprefix = \"outpost/\"\n",
        )
        .unwrap()
    }

    #[test]
    fn the_table_has_defaults_and_its_problems_are_named() {
        let t = target();
        assert!(t.validate().is_empty(), "{:?}", t.validate());
        assert_eq!(t.region, "us-east-1");
        assert_eq!(t.key("wave-1.json"), "outpost/wave-1.json");
        let bad = S3Target {
            endpoint: "ftp://x".into(),
            bucket: "a/b".into(),
            prefix: "/p".into(),
            region: String::new(),
            ca: None,
        };
        assert_eq!(bad.validate().len(), 4, "{:?}", bad.validate());
        let creds_in_url = S3Target {
            endpoint: "http://key:secret@127.0.0.1:9000".into(),
            ..target()
        };
        assert!(creds_in_url.validate()[0].contains("AWS_ACCESS_KEY_ID"));
        // Credentials have no place in the table.
        assert!(
            toml::from_str::<S3Target>(
                "endpoint = \"http://h\"\nbucket = \"b\"\naccess_key = \"k\"\n"
            )
            .is_err()
        );
    }

    #[test]
    fn s3_error_bodies_give_their_code_and_message() {
        let body = r#"<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>SignatureDoesNotMatch</Code><Message>The request signature we calculated does not match &amp; so on</Message><RequestId>1</RequestId></Error>"#;
        assert_eq!(
            error_fields(body),
            (
                Some("SignatureDoesNotMatch".into()),
                Some("The request signature we calculated does not match & so on".into())
            )
        );
        assert_eq!(error_fields(""), (None, None));
        assert_eq!(error_fields("<html>bad gateway</html>"), (None, None));
        let why = Why::Status {
            status: 403,
            code: Some("InvalidAccessKeyId".into()),
            message: None,
        };
        assert_eq!(
            why.to_string(),
            "HTTP 403 Forbidden, S3 error InvalidAccessKeyId (check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
        );
        let e = S3Error::Request(Box::new(Failed {
            method: "PUT",
            endpoint: "http://127.0.0.1:9000".into(),
            bucket: "fleet".into(),
            key: "outpost/manifest.json".into(),
            why: Why::Status {
                status: 404,
                code: Some("NoSuchBucket".into()),
                message: Some("The specified bucket does not exist".into()),
            },
        }));
        assert_eq!(
            e.to_string(),
            "PUT of key `outpost/manifest.json` in bucket `fleet` at http://127.0.0.1:9000: HTTP 404 Not Found, S3 error NoSuchBucket: The specified bucket does not exist (create the bucket first, or fix s3.bucket)"
        );
    }

    #[test]
    fn signed_urls_carry_the_key_and_a_sigv4_signature_and_debug_hides_the_secret() {
        let b = Bucket::new(
            &target(),
            rusty_s3::Credentials::new("AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"),
        )
        .unwrap();
        let url = b
            .bucket
            .put_object(Some(&b.credentials), &b.target.key("manifest.json"))
            .sign(SIGNED_FOR);
        assert_eq!(url.path(), "/fleet/outpost/manifest.json");
        let q = url.query().unwrap();
        assert!(q.contains("X-Amz-Algorithm=AWS4-HMAC-SHA256"), "{q}");
        assert!(q.contains("us-east-1%2Fs3%2Faws4_request"), "{q}");
        assert!(!q.contains("wJalrXUtnFEMI"), "{q}");
        assert!(!format!("{b:?}").contains("wJalrXUtnFEMI"));
    }
}
