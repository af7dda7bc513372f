//! The local HTTP API (axum), bound to loopback by default:
//! `/healthz` (the process answers), `/readyz` (models warmed, outbox open,
//! sources started), `/metrics` (OpenMetrics), `/v1/status` (pipelines, models, outbox) and the http
//! source's `POST /v1/pipelines/{name}/infer`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

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
    pub scheduler: Scheduler,
    pub outbox: Outbox,
    pub device: String,
    pub boot: u64,
    pub metrics: Arc<prometheus_client::registry::Registry>,
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
    let pipelines: Vec<serde_json::Value> = s
        .scheduler
        .pipelines()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let st = &p.stats;
            serde_json::json!({
                "name": p.name(),
                "source": p.cfg.source.kind(),
                "priority": p.cfg.priority.as_str(),
                "model": p.model.id(),
                "provider": p.model.provider,
                "queue_depth": s.scheduler.queue_depth(i),
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
            })
        })
        .collect();
    let o = s.outbox.stats();
    serde_json::json!({
        "device": s.device,
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
        .with_state(state)
        .merge(infer_routes)
}
