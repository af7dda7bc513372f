//! HTTP: `POST /v1/pipelines/{name}/infer` on the local API. The body is the
//! payload; `?stream=NAME` names the stream (default `http`). The answer is
//! the records the frame produced (also stored like any other), as JSON.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::{Frame, Source, SourceCtx, SourceError};

pub struct HttpSource;

impl Source for HttpSource {
    fn spawn(self: Box<Self>, ctx: SourceCtx) -> Result<tokio::task::JoinHandle<()>, SourceError> {
        // Requests arrive through the local API; nothing to run here.
        Ok(tokio::spawn(async move { ctx.stopped().await }))
    }
}

/// Pipelines that accept frames over HTTP, by name.
#[derive(Clone, Default)]
pub struct HttpIngress {
    /// Replaced on reload.
    pub pipelines: Arc<std::sync::RwLock<HashMap<String, SourceCtx>>>,
}

/// How long a request waits for its result before answering 504.
const RESULT_TIMEOUT: Duration = Duration::from_secs(30);

pub async fn infer(
    State(ingress): State<HttpIngress>,
    Path(name): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> Response {
    let ctx = ingress
        .pipelines
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&name)
        .cloned();
    let Some(ctx) = ctx else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(
                serde_json::json!({"error": format!("no pipeline `{name}` with an http source")}),
            ),
        )
            .into_response();
    };
    let stream = q
        .get("stream")
        .cloned()
        .unwrap_or_else(|| "http".to_string());
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut frame = Frame::new(stream, body);
    frame.reply = Some(tx);
    if !ctx.submit(frame).await {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": "stopping"})),
        )
            .into_response();
    }
    match tokio::time::timeout(RESULT_TIMEOUT, rx).await {
        Ok(Ok(Ok(records))) => (
            StatusCode::OK,
            axum::Json(serde_json::json!({"records": records})),
        )
            .into_response(),
        Ok(Ok(Err(e))) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::Json(serde_json::json!({"error": e})),
        )
            .into_response(),
        // The frame was dropped from a full queue (drop_oldest) or the daemon is stopping.
        Ok(Err(_)) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": "frame dropped (queue full)"})),
        )
            .into_response(),
        Err(_) => (
            StatusCode::GATEWAY_TIMEOUT,
            axum::Json(serde_json::json!({"error": "no result in time"})),
        )
            .into_response(),
    }
}
