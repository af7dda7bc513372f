//! HTTP: `POST /v1/pipelines/{name}/infer` on the local API. The body is the
//! payload; `?stream=NAME` names the stream (default `http`). The answer is
//! the records the frame produced (also stored like any other), as JSON.
//!
//! The answer says whether the records are durable (`"durable": true`):
//! it waits for the outbox's group commit that holds them (at most about
//! its `flush_interval`, sharing the fsync with every other record of that
//! window), as a QoS 1 MQTT source waits before acknowledging, so a record
//! answered `"durable": true` survives a crash or power loss that follows.
//! The wait follows `flush_interval` (plus [`COMMIT_MARGIN`] for the
//! commit itself), so a record stored in time is never answered 503 (which
//! tells the client to send it again), and it awaits the commit: a
//! waiting request holds no thread.
//! While the disk has failed and the outbox holds records in memory until
//! it is back, the answer is still `200` with `"durable": false` (kept, not
//! yet on disk); a commit that fails otherwise is answered `503` and the
//! frame may be sent again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{Frame, FrameError, FrameErrorKind, Source, SourceCtx, SourceError};
use crate::record::ResultRecord;

pub struct HttpSource;

impl Source for HttpSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        // Requests arrive through the local API; nothing to run here.
        Ok(tokio::spawn(async move { ctx.stopped().await }))
    }
}

/// Pipelines that accept frames over HTTP, by name.
#[derive(Clone)]
pub struct HttpIngress {
    /// Replaced on reload.
    pub pipelines: Arc<arc_swap::ArcSwap<HashMap<String, SourceCtx>>>,
    /// Larger bodies are answered 413 (`api.max_body_bytes`).
    pub max_body_bytes: usize,
    /// The whole body must arrive within this (`api.body_read_timeout`).
    pub body_read_timeout: Duration,
}

/// How long a request waits for its result before answering 504.
const RESULT_TIMEOUT: Duration = Duration::from_secs(30);

/// How long past `outbox.flush_interval` a request waits for the commit
/// that holds its records (the fsync itself, a slow disk) before it answers
/// 503.
pub const COMMIT_MARGIN: Duration = Duration::from_secs(30);

/// What a 503 tells the caller to wait before trying again, in seconds.
pub const RETRY_AFTER_S: u64 = 1;

/// Why a request gave no records, and the status that says it.
#[derive(Debug, thiserror::Error)]
pub enum InferError {
    #[error("no pipeline `{0}` with an http source")]
    UnknownPipeline(String),
    #[error("body over max_body_bytes ({0})")]
    TooLarge(usize),
    #[error("body not received in time")]
    BodyTimeout,
    #[error("body: {0}")]
    Body(String),
    #[error("{0}")]
    Frame(FrameError),
    #[error("frame dropped (queue full)")]
    QueueFull,
    #[error("stopping")]
    Stopping,
    #[error("no result in time")]
    Timeout,
    /// The records were made but could not be made durable (a full or
    /// failing disk): the caller should send the frame again.
    #[error("records not stored durably: {0}")]
    NotDurable(String),
}

impl InferError {
    pub fn status(&self) -> StatusCode {
        match self {
            InferError::UnknownPipeline(_) => StatusCode::NOT_FOUND,
            InferError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            InferError::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            InferError::Body(_) => StatusCode::BAD_REQUEST,
            InferError::Frame(e) => match e.kind {
                FrameErrorKind::Malformed => StatusCode::UNPROCESSABLE_ENTITY,
                FrameErrorKind::Engine | FrameErrorKind::Store => StatusCode::INTERNAL_SERVER_ERROR,
                FrameErrorKind::Unavailable | FrameErrorKind::Dropped => {
                    StatusCode::SERVICE_UNAVAILABLE
                }
            },
            InferError::QueueFull | InferError::Stopping | InferError::NotDurable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            InferError::Timeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }
}

impl IntoResponse for InferError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = axum::Json(serde_json::json!({"error": self.to_string()}));
        if status == StatusCode::SERVICE_UNAVAILABLE {
            (
                status,
                [(axum::http::header::RETRY_AFTER, RETRY_AFTER_S.to_string())],
                body,
            )
                .into_response()
        } else {
            (status, body).into_response()
        }
    }
}

pub async fn infer(
    State(ingress): State<HttpIngress>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: axum::body::Body,
) -> Response {
    match infer_inner(ingress, name, q, body).await {
        Ok((records, durable)) => (
            StatusCode::OK,
            axum::Json(serde_json::json!({"records": records, "durable": durable})),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

/// Reads the body within the size and time bounds.
async fn read_body(ingress: &HttpIngress, body: axum::body::Body) -> Result<Bytes, InferError> {
    let max = ingress.max_body_bytes;
    let limited = http_body_util::Limited::new(body, max);
    match tokio::time::timeout(
        ingress.body_read_timeout,
        http_body_util::BodyExt::collect(limited),
    )
    .await
    {
        Err(_) => Err(InferError::BodyTimeout),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => Err(InferError::TooLarge(max)),
        Ok(Err(e)) => Err(InferError::Body(e.to_string())),
    }
}

async fn infer_inner(
    ingress: HttpIngress,
    name: String,
    q: HashMap<String, String>,
    body: axum::body::Body,
) -> Result<(Vec<ResultRecord>, bool), InferError> {
    let ctx = ingress.pipelines.load().get(&name).cloned();
    let Some(ctx) = ctx else {
        return Err(InferError::UnknownPipeline(name));
    };
    let body = read_body(&ingress, body).await?;
    let stream = q
        .get("stream")
        .cloned()
        .unwrap_or_else(|| "http".to_string());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut frame = Frame::new(stream, body);
    frame.reply = Some(tx);
    if !ctx.submit(frame).await {
        return Err(InferError::Stopping);
    }
    let records = match tokio::time::timeout(RESULT_TIMEOUT, rx).await {
        Ok(Ok(r)) => r.map_err(InferError::Frame)?,
        // The frame was dropped from a full queue or the daemon is stopping.
        Ok(Err(_)) => return Err(InferError::QueueFull),
        Err(_) => return Err(InferError::Timeout),
    };
    let mut kept = true;
    if !records.is_empty()
        && let Some(outbox) = ctx.outbox.clone()
    {
        kept = durable(outbox).await?;
    }
    Ok((records, kept))
}

/// How long a request waits for the commit of its records: the outbox's
/// `flush_interval` and [`COMMIT_MARGIN`].
pub fn commit_wait(flush_interval: Duration) -> Duration {
    flush_interval.saturating_add(COMMIT_MARGIN)
}

/// Waits until what the outbox holds now (this frame's records) is
/// durable: the regular group commit, no fsync of its own, awaited (no
/// thread held). `false`: the disk has failed and the records are held
/// in memory.
async fn durable(outbox: crate::outbox::Outbox) -> Result<bool, InferError> {
    let wait = commit_wait(outbox.flush_interval());
    match tokio::time::timeout(wait, outbox.committed()).await {
        // Held in memory, a commit has nothing of them to make durable.
        Ok(Ok(())) => Ok(!outbox.holding_in_memory()),
        Ok(Err(_)) if outbox.holding_in_memory() => Ok(false),
        Ok(Err(e)) => Err(InferError::NotDurable(e.to_string())),
        Err(_) => Err(InferError::NotDurable(format!(
            "the commit did not end within {wait:?} (outbox.flush_interval + {COMMIT_MARGIN:?})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_has_its_status() {
        let f = |kind| InferError::Frame(FrameError::new(kind, "x")).status();
        assert_eq!(
            f(FrameErrorKind::Malformed),
            StatusCode::UNPROCESSABLE_ENTITY
        );
        assert_eq!(f(FrameErrorKind::Engine), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(
            f(FrameErrorKind::Unavailable),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(f(FrameErrorKind::Dropped), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            InferError::UnknownPipeline("p".into()).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            InferError::TooLarge(1).status(),
            StatusCode::PAYLOAD_TOO_LARGE
        );
        let r = InferError::QueueFull.into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(r.headers().contains_key(axum::http::header::RETRY_AFTER));
    }

    /// Issue 50, item 8: `check` takes a `flush_interval` of up to 60 s,
    /// and the wait for the commit was a fixed 30 s, so with 45 s every
    /// record was stored and answered 503. The wait follows the interval.
    #[test]
    fn the_commit_wait_outlasts_every_interval_check_accepts() {
        for s in [0, 10, 30, 45, 60] {
            let i = Duration::from_secs(s);
            assert!(commit_wait(i) >= i + Duration::from_secs(30), "{s}");
        }
    }
}
