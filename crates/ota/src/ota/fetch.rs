//! HTTP(S): the fleet's manifest document (with ETag / If-None-Match) and
//! bundle downloads that resume (Range) and keep under a bandwidth cap.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::document::{self, DocumentError, Opened};
use super::machine::Offer;
use reqwest::header::{CONTENT_RANGE, ETAG, IF_NONE_MATCH, RANGE};

pub struct Fetcher {
    client: reqwest::Client,
    /// The manifest document; None when updates arrive only as commands.
    url: Option<reqwest::Url>,
    etag: Option<String>,
    last: Opened,
    /// How documents are taken (signatures, replays).
    policy: document::Policy,
}

/// Why the fetcher could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum FetcherError {
    #[error("manifest_url: {0}")]
    Url(<reqwest::Url as std::str::FromStr>::Err),
    #[error("{path}: {source}")]
    Ca {
        path: String,
        source: rustls::pki_types::pem::Error,
    },
    #[error("TLS: no CA certificate")]
    NoCa,
    #[error("TLS: {0}")]
    Tls(rustls::Error),
    /// The client's error with its causes, as reqwest words them.
    #[error("HTTP client: {0}")]
    Client(String),
}

/// An offer's URL that cannot be fetched.
#[derive(Debug, thiserror::Error)]
pub enum BadUrl {
    #[error("bundle URL `{url}`: {source}")]
    Parse {
        url: String,
        source: <reqwest::Url as std::str::FromStr>::Err,
    },
    #[error("bundle URL `{0}` is not http or https")]
    Scheme(String),
}

/// Why a download stopped: the partial file stays for a resume.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The device's disk (its kind tells a full disk from a permission).
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// The client's error with its causes, as reqwest words them.
    #[error("{0}")]
    Transfer(String),
    #[error("{url}: HTTP {status}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
    },
    #[error("stopping")]
    Stopping,
    #[error("{url}: more than the {size} bytes offered")]
    TooLong { url: String, size: u64 },
    #[error("{url}: connection ended at {have} of {size} bytes")]
    Short { url: String, have: u64, size: u64 },
}

fn disk(path: &Path) -> impl FnOnce(std::io::Error) -> DownloadError {
    let path = path.display().to_string();
    move |source| DownloadError::Io { path, source }
}

/// Why a poll gave no offers.
#[derive(Debug, thiserror::Error)]
pub enum PollError {
    #[error("{0}")]
    Fetch(String),
    #[error(transparent)]
    Document(#[from] DocumentError),
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// The client's TLS settings. Built for plain http too: reqwest is built
/// without a default crypto provider and wants one for every client.
fn tls(ca: Option<&Path>, https: bool) -> Result<rustls::ClientConfig, FetcherError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some(p) => {
            let pem = |source| FetcherError::Ca {
                path: p.display().to_string(),
                source,
            };
            let certs = CertificateDer::pem_file_iter(p)
                .map_err(pem)?
                .collect::<Result<Vec<_>, _>>()
                .map_err(pem)?;
            roots.add_parsable_certificates(certs);
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    if roots.is_empty() && https {
        return Err(FetcherError::NoCa);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    // Checked against the later of the system clock and the last known good time.
    Ok(
        rustls::ClientConfig::builder_with_details(provider, Arc::new(crate::clock::TrustedTime))
            .with_safe_default_protocol_versions()
            .map_err(FetcherError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

impl Fetcher {
    pub fn new(
        url: Option<&str>,
        ca: Option<&Path>,
        timeout: Duration,
    ) -> Result<Fetcher, FetcherError> {
        let url = url
            .map(|u| reqwest::Url::parse(u).map_err(FetcherError::Url))
            .transpose()?;
        let https = url.as_ref().is_some_and(|u| u.scheme() == "https");
        // The timeout applies per read, not to a whole (possibly capped, long) download.
        let b = reqwest::Client::builder()
            .connect_timeout(timeout)
            .read_timeout(timeout)
            .no_proxy()
            .tls_backend_preconfigured(tls(ca, https)?);
        let client = b.build().map_err(|e| FetcherError::Client(chain(&e)))?;
        Ok(Fetcher {
            client,
            url,
            etag: None,
            last: Opened::default(),
            policy: document::Policy::default(),
        })
    }

    /// The keys that sign documents, whether plain ones are refused, and
    /// how far ahead of this device's clock a signed one may be dated.
    pub fn set_document_policy(
        &mut self,
        trusted: Vec<ed25519_dalek::VerifyingKey>,
        require_signed: bool,
        max_skew: Duration,
    ) {
        self.policy.trusted = trusted;
        self.policy.require_signed = require_signed;
        self.policy.max_skew_ms = u64::try_from(max_skew.as_millis()).unwrap_or(u64::MAX);
    }

    /// `issued_ms` of the last signed document accepted (from state.json).
    pub fn set_last_signed(&mut self, last: Option<u64>) {
        self.policy.last_signed = last;
    }

    pub fn last_signed(&self) -> Option<u64> {
        self.policy.last_signed
    }

    /// The document's offers now (the last document again on 304 Not
    /// Modified); a new document's skipped entries are listed once.
    pub async fn poll(&mut self) -> Result<Opened, PollError> {
        let Some(url) = self.url.clone() else {
            return Err(PollError::Fetch("no manifest_url configured".into()));
        };
        let mut req = self.client.get(url);
        if let Some(e) = &self.etag {
            req = req.header(IF_NONE_MATCH, e);
        }
        let resp = req.send().await.map_err(|e| PollError::Fetch(chain(&e)))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_MODIFIED {
            return Ok(Opened {
                skipped: Vec::new(),
                ..self.last.clone()
            });
        }
        if !status.is_success() {
            return Err(PollError::Fetch(format!("manifest: HTTP {status}")));
        }
        let etag = resp
            .headers()
            .get(ETAG)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = resp
            .bytes()
            .await
            .map_err(|e| PollError::Fetch(chain(&e)))?;
        let now = super::command::unix_ms_now();
        let mut opened = document::open(&body, &self.policy, now)?;
        if opened.signed.is_some() {
            self.policy.last_signed = opened.signed;
        }
        opened.offers = self.resolved(&opened.offers);
        self.etag = etag;
        self.last = opened.clone();
        Ok(opened)
    }

    /// Offers with their URLs made absolute against the document's.
    fn resolved(&self, offers: &[Offer]) -> Vec<Offer> {
        offers
            .iter()
            .filter_map(|o| match self.resolve(o.clone()) {
                Ok(o) => Some(o),
                Err(e) => {
                    tracing::warn!(url = %o.url, error = %e, "OTA: offer with a bad URL skipped");
                    None
                }
            })
            .collect()
    }

    /// An offer's URL made absolute: against the manifest document's URL
    /// when there is one, else it must be absolute (http or https).
    pub fn resolve(&self, mut o: Offer) -> Result<Offer, BadUrl> {
        let u = match &self.url {
            Some(base) => base.join(&o.url),
            None => reqwest::Url::parse(&o.url),
        }
        .map_err(|e| BadUrl::Parse {
            url: o.url.clone(),
            source: e,
        })?;
        if !matches!(u.scheme(), "http" | "https") {
            return Err(BadUrl::Scheme(u.to_string()));
        }
        o.url = u.to_string();
        Ok(o)
    }

    /// Downloads `offer` into `part`, resuming what is there. Bounded by
    /// the offer's size; `cap` in bytes per second.
    pub async fn download(
        &self,
        offer: &Offer,
        part: &Path,
        cap: Option<u64>,
        shutdown: &tokio_util::sync::CancellationToken,
        progress: &std::sync::atomic::AtomicU64,
    ) -> Result<(), DownloadError> {
        use std::sync::atomic::Ordering;
        if let Some(d) = part.parent() {
            std::fs::create_dir_all(d).map_err(disk(d))?;
        }
        let mut have = std::fs::metadata(part).map(|m| m.len()).unwrap_or(0);
        if have > offer.size {
            have = 0;
        }
        if have == offer.size && have > 0 {
            return Ok(());
        }
        let mut req = self.client.get(&offer.url);
        if have > 0 {
            req = req.header(RANGE, format!("bytes={have}-"));
        }
        let mut resp = req
            .send()
            .await
            .map_err(|e| DownloadError::Transfer(chain(&e)))?;
        let status = resp.status();
        let resumed = status == reqwest::StatusCode::PARTIAL_CONTENT
            && resp
                .headers()
                .get(CONTENT_RANGE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with(&format!("bytes {have}-")));
        if !status.is_success() {
            return Err(DownloadError::Status {
                url: offer.url.clone(),
                status,
            });
        }
        if !resumed {
            // The server sends the whole file: start over.
            have = 0;
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed)
            .truncate(!resumed)
            .open(part)
            .map_err(disk(part))?;
        if resumed {
            tracing::info!(bundle = %offer.id(), from = have, "OTA: resuming download");
        }
        let t0 = Instant::now();
        let start = have;
        let mut logged = Instant::now();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| DownloadError::Transfer(chain(&e)))?
        {
            if shutdown.is_cancelled() {
                return Err(DownloadError::Stopping);
            }
            if have + chunk.len() as u64 > offer.size {
                return Err(DownloadError::TooLong {
                    url: offer.url.clone(),
                    size: offer.size,
                });
            }
            // Under a cap, write and pace in slices of ~1/20 s, so the rate
            // is smooth and what is on disk is what was paid for in time.
            let slice = cap
                .filter(|c| *c > 0)
                .map_or(chunk.len(), |c| (c as usize / 20).max(1024));
            for part_bytes in chunk.chunks(slice.max(1)) {
                f.write_all(part_bytes).map_err(disk(part))?;
                have += part_bytes.len() as u64;
                progress.store(have, Ordering::Relaxed);
                if let Some(cap) = cap.filter(|c| *c > 0) {
                    // Sleep until the average since the start is under the cap.
                    let due = Duration::from_secs_f64((have - start) as f64 / cap as f64);
                    if let Some(wait) = due.checked_sub(t0.elapsed()) {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
            if logged.elapsed() >= Duration::from_secs(2) {
                logged = Instant::now();
                tracing::info!(
                    bundle = %offer.id(),
                    bytes = have,
                    total = offer.size,
                    percent = (have * 100) / offer.size.max(1),
                    "OTA: downloading"
                );
            }
        }
        f.sync_all().map_err(disk(part))?;
        if have != offer.size {
            return Err(DownloadError::Short {
                url: offer.url.clone(),
                have,
                size: offer.size,
            });
        }
        tracing::info!(bundle = %offer.id(), bytes = have, seconds = t0.elapsed().as_secs_f64(), "OTA: downloaded");
        Ok(())
    }
}
