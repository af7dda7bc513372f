//! The local HTTP API (axum), bound to loopback by default:
//! `/healthz` (the process answers), `/readyz` (models warmed, outbox open,
//! sources started), `/metrics` (OpenMetrics), `/v1/status` (pipelines, models, outbox) and the http
//! source's `POST /v1/pipelines/{name}/infer`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};

use crate::outbox::Outbox;
use crate::pipeline::{PipelineStats, Scheduler};
use crate::source::http::{HttpIngress, infer};

/// What the API reads.
#[derive(Clone)]
pub struct ApiState {
    pub ready: Arc<AtomicBool>,
    /// The current generation's scheduler (replaced on reload).
    pub scheduler: Arc<RwLock<Scheduler>>,
    pub outbox: Outbox,
    pub device: String,
    pub boot: u64,
    pub metrics: Arc<prometheus_client::registry::Registry>,
    pub control: Control,
    /// The running daemon: version and OTA slot (`package`: not from a slot).
    pub daemon: (String, String),
}

impl ApiState {
    fn scheduler(&self) -> Scheduler {
        self.scheduler
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Requests that change the daemon's state: a bearer token guards them.
#[derive(Clone)]
pub struct Control {
    /// None: no token file configured, so every state change is refused.
    token: Option<Arc<String>>,
    reload: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<Result<(), String>>>,
}

impl Control {
    pub fn from_config(
        cfg: &crate::config::ApiConfig,
        reload: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<Result<(), String>>>,
    ) -> anyhow::Result<Control> {
        let token = match &cfg.token_file {
            Some(p) => {
                let t = std::fs::read_to_string(p)
                    .map_err(|e| anyhow::anyhow!("api.token_file {}: {e}", p.display()))?;
                let t = t.trim().to_string();
                if t.len() < 16 {
                    anyhow::bail!(
                        "api.token_file {}: the token must be at least 16 characters",
                        p.display()
                    );
                }
                Some(Arc::new(t))
            }
            None => None,
        };
        Ok(Control { token, reload })
    }

    /// Checks `Authorization: Bearer <token>` in constant time.
    fn authorize(
        &self,
        headers: &axum::http::HeaderMap,
    ) -> Result<(), (StatusCode, axum::Json<serde_json::Value>)> {
        let Some(want) = &self.token else {
            return Err((
                StatusCode::FORBIDDEN,
                axum::Json(
                    serde_json::json!({"error": "state changes are disabled: set api.token_file"}),
                ),
            ));
        };
        let given = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        let (a, b) = (given.as_bytes(), want.as_bytes());
        let mut diff = a.len() ^ b.len();
        for i in 0..a.len().max(b.len()) {
            diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0)) as usize;
        }
        if diff == 0 {
            Ok(())
        } else {
            Err((
                StatusCode::UNAUTHORIZED,
                axum::Json(serde_json::json!({"error": "missing or wrong bearer token"})),
            ))
        }
    }
}

async fn reload(
    State(s): State<ApiState>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    if let Err(e) = s.control.authorize(&headers) {
        return e.into_response();
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    if s.control.reload.send(tx).await.is_err() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": "stopping"})),
        )
            .into_response();
    }
    match rx.await {
        Ok(Ok(())) => (
            StatusCode::OK,
            axum::Json(serde_json::json!({"reloaded": true})),
        )
            .into_response(),
        Ok(Err(e)) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            axum::Json(serde_json::json!({"reloaded": false, "error": e})),
        )
            .into_response(),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": "stopping"})),
        )
            .into_response(),
    }
}

async fn pause(
    state: State<ApiState>,
    name: axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    pause_resume(state, name, headers, true)
}

async fn resume(
    state: State<ApiState>,
    name: axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    pause_resume(state, name, headers, false)
}

fn pause_resume(
    State(s): State<ApiState>,
    axum::extract::Path(name): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
    paused: bool,
) -> axum::response::Response {
    if let Err(e) = s.control.authorize(&headers) {
        return e.into_response();
    }
    if s.scheduler().set_paused(&name, paused) {
        (
            StatusCode::OK,
            axum::Json(serde_json::json!({"pipeline": name, "paused": paused})),
        )
            .into_response()
    } else {
        (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"error": format!("no pipeline `{name}`")})),
        )
            .into_response()
    }
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<ApiState>) -> impl IntoResponse {
    if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting\n")
    }
}

/// The daemon's state as JSON.
pub fn status_json(s: &ApiState) -> serde_json::Value {
    let sched = s.scheduler();
    let pipelines: Vec<serde_json::Value> = sched
        .pipelines()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let st = &p.stats;
            serde_json::json!({
                "name": p.name(),
                "source": p.cfg.source.kind(),
                "priority": p.cfg.priority.as_str(),
                "model": p.model().id(),
                "provider": p.model().provider,
                "provider_fallbacks": p.model().fallbacks,
                "queue_depth": sched.queue_depth(i),
                "paused": sched.is_paused(i),
                "queue_capacity": p.cfg.queue,
                "frames_in": PipelineStats::get(&st.frames_in),
                "frames_done": PipelineStats::get(&st.frames_done),
                "items": PipelineStats::get(&st.items),
                "records": PipelineStats::get(&st.records),
                "batches": PipelineStats::get(&st.batches),
                "batch_items": PipelineStats::get(&st.batch_items),
                "drops": st.drops(),
                "e2e_latency": st.e2e_us.summary(),
                "inference_latency": st.inference_us.summary(),
                "stage_latency": {
                    "queue": st.queue_us.summary(),
                    "decode": st.decode_us.summary(),
                    "inference": st.inference_us.summary(),
                    "output": st.output_us.summary(),
                },
            })
        })
        .collect();
    let o = s.outbox.stats();
    serde_json::json!({
        "device": s.device,
        "daemon": {"version": s.daemon.0, "slot": s.daemon.1},
        "boot": s.boot,
        "ready": s.ready.load(Ordering::SeqCst),
        "pipelines": pipelines,
        "outbox": {
            "records": o.records,
            "bytes": o.bytes,
            "oldest_age_s": o.oldest_age.map(|d| d.as_secs_f64()),
            "dead_letters": o.dead_letters,
            "appended_total": o.appended_total,
            "acked_total": o.acked_total,
            "max_bytes": o.max_bytes,
        },
    })
}

async fn metrics(State(s): State<ApiState>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        crate::telemetry::metrics::render(&s.metrics),
    )
}

async fn status(State(s): State<ApiState>) -> impl IntoResponse {
    axum::Json(status_json(&s))
}

pub fn router(state: ApiState, ingress: HttpIngress) -> Router {
    let infer_routes = Router::new()
        .route("/v1/pipelines/{name}/infer", post(infer))
        .with_state(ingress);
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/reload", post(reload))
        .route("/v1/pipelines/{name}/pause", post(pause))
        .route("/v1/pipelines/{name}/resume", post(resume))
        .with_state(state)
        .merge(infer_routes)
}
