//! The local HTTP API (axum), bound to loopback by default:
//! `/healthz` (the process answers), `/readyz` (models warmed, outbox open,
//! sources started), `/metrics` (OpenMetrics), `/v1/status` (pipelines, models, outbox,
//! uplink, OTA, machine), `GET /v1/pipelines/{name}/tracks/{id}/snapshot.jpg` (a track's best crop),
//! `GET /v1/pipelines/{name}/snapshot.jpg[?stream=NAME]` (the latest frame,
//! annotated), the http source's `POST /v1/pipelines/{name}/infer`, and the local
//! console (`GET /`, `/v1/events`, `/v1/pipelines/{name}/records`). Every
//! request passes the [`guard`] first (Host names, cross-origin state
//! changes).

pub mod console;
pub mod guard;
pub mod live;
pub mod metrics;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwap;

pub mod serve;
pub mod status;
pub mod track_metrics;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::{get, post};

use crate::ota::stats::OtaStats;
use crate::outbox::Outbox;
use crate::pipeline::Scheduler;
use crate::pipeline::recent::RecentRecords;
use crate::source::http::{HttpIngress, infer};
use crate::uplink::UplinkStats;

/// What the API reads.
#[derive(Clone)]
pub struct ApiState {
    pub ready: Arc<AtomicBool>,
    /// The current generation's scheduler (replaced on reload).
    pub scheduler: Arc<ArcSwap<Scheduler>>,
    pub outbox: Outbox,
    pub device: String,
    pub boot: u64,
    pub metrics: Arc<prometheus_client::registry::Registry>,
    pub control: Control,
    /// The running daemon: version and OTA slot (`package`: not from a slot).
    pub daemon: (String, String),
    /// The uplink's figures (None: no uplink configured).
    pub uplink: Option<Arc<UplinkStats>>,
    /// The OTA agent's figures (None: OTA not configured).
    pub ota: Option<Arc<OtaStats>>,
    /// The last records of each pipeline (console, `/v1/pipelines/{name}/records`).
    pub recent: Arc<RecentRecords>,
    /// Cancelled when the daemon stops: ends the console's event streams,
    /// which would otherwise hold the graceful shutdown open.
    pub shutdown: tokio_util::sync::CancellationToken,
    /// The Modbus server and the modbus sources' PLC connections.
    pub floor: Arc<crate::floor::Floor>,
    /// The OPC UA server (None: no `[opcua]`, or a build without it).
    pub opcua: Option<Arc<dyn crate::output::ServerStatus>>,
}

impl ApiState {
    pub fn scheduler(&self) -> Arc<Scheduler> {
        self.scheduler.load_full()
    }
}

/// Why the API's state changes could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("api.token_file {}", .path.display())]
    TokenFile {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("api.token_file {}: the token must be at least 16 characters", .path.display())]
    TokenTooShort { path: std::path::PathBuf },
}

/// The answer to one `POST /v1/reload`: the reload's own error when it was
/// not applied (its causes make the reply's text).
pub type ReloadAnswer = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// An error and its causes, `: `-separated.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Requests that change the daemon's state: a bearer token guards them.
#[derive(Clone)]
pub struct Control {
    /// None: no token file configured, so every state change is refused.
    token: Option<Arc<String>>,
    reload: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<ReloadAnswer>>,
}

impl Control {
    pub fn from_config(
        cfg: &crate::config::ApiConfig,
        reload: tokio::sync::mpsc::Sender<tokio::sync::oneshot::Sender<ReloadAnswer>>,
    ) -> Result<Control, ControlError> {
        let token = match &cfg.token_file {
            Some(p) => {
                let t = std::fs::read_to_string(p).map_err(|source| ControlError::TokenFile {
                    path: p.clone(),
                    source,
                })?;
                let t = t.trim().to_string();
                if t.len() < 16 {
                    return Err(ControlError::TokenTooShort { path: p.clone() });
                }
                Some(Arc::new(t))
            }
            None => None,
        };
        Ok(Control { token, reload })
    }

    /// The bearer token, when one is set (the [`guard`] lets a cross-origin
    /// state change through with it).
    pub fn token(&self) -> Option<Arc<String>> {
        self.token.clone()
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
        if guard::bearer_matches(headers, want) {
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
            axum::Json(serde_json::json!({"reloaded": false, "error": error_chain(&*e)})),
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

/// Ready once started, and only while the outbox can store: a daemon that
/// must refuse every result is not ready, and says why.
async fn readyz(State(s): State<ApiState>) -> impl IntoResponse {
    if !s.ready.load(Ordering::SeqCst) {
        return (StatusCode::SERVICE_UNAVAILABLE, "starting\n".to_string());
    }
    let held = s.outbox.stats().held;
    match s.outbox.unavailable() {
        None => (StatusCode::OK, "ready\n".to_string()),
        // Records are kept in memory, not refused: say so, and how many.
        Some(why) if held.holding => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "not ready: the outbox is read-only: {why}; {} records held in memory ({} of {} bytes), {} dropped\n",
                held.records, held.bytes, held.max_bytes, held.dropped
            ),
        ),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: the outbox cannot store: {why}\n"),
        ),
    }
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
    axum::Json(status::Status::read(&s))
}

/// `?stream=NAME` of a snapshot: one camera of a pipeline over several.
#[derive(Debug, serde::Deserialize)]
struct SnapshotQuery {
    stream: Option<String>,
}

/// What the snapshot route reads: the API's state and the daemon's bound
/// on drawings at once.
#[derive(Clone)]
struct SnapshotState {
    api: ApiState,
    renders: crate::pipeline::snapshot::Renders,
}

/// The latest frame of an image pipeline with its boxes drawn (JPEG, at
/// most `MAX_SIDE` on its long side), of one stream with `?stream=NAME`;
/// 404 with a JSON error for an unknown pipeline or camera, or before such
/// a frame; 503 with `Retry-After` while the daemon draws its most
/// snapshots at once (a frame is drawn once, and the requests for it share
/// the drawing).
async fn snapshot(
    State(s): State<SnapshotState>,
    axum::extract::Path(name): axum::extract::Path<String>,
    axum::extract::Query(q): axum::extract::Query<SnapshotQuery>,
) -> axum::response::Response {
    use crate::pipeline::snapshot::{RETRY_AFTER_S, SnapshotError};
    let err = |code: StatusCode, msg: String| {
        (code, axum::Json(serde_json::json!({ "error": msg }))).into_response()
    };
    let sched = s.api.scheduler();
    let Some(p) = sched.pipelines().iter().find(|p| p.name() == name).cloned() else {
        return err(StatusCode::NOT_FOUND, format!("no pipeline `{name}`"));
    };
    let per_stream = p.snapshot_per_stream();
    let drawn = match p.snapshot().frame(q.stream.as_deref()) {
        Ok(Some(f)) => f.jpeg(&s.renders).await.map(Some),
        Ok(None) => Ok(None),
        Err(e) => Err(e),
    };
    match drawn {
        Ok(Some(jpeg)) => (
            [
                (axum::http::header::CONTENT_TYPE, "image/jpeg"),
                (axum::http::header::CACHE_CONTROL, "no-store"),
            ],
            jpeg,
        )
            .into_response(),
        Err(SnapshotError::UnknownStream(cam)) => err(
            StatusCode::NOT_FOUND,
            format!("pipeline `{name}` reads no camera `{cam}`"),
        ),
        Err(SnapshotError::Busy) => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(axum::http::header::RETRY_AFTER, RETRY_AFTER_S.to_string())],
            axum::Json(serde_json::json!({
                "error": format!("pipeline `{name}`: busy drawing other snapshots; try again")
            })),
        )
            .into_response(),
        Err(e) => err(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("pipeline `{name}`: cannot draw the latest frame: {e}"),
        ),
        Ok(None) => err(
            StatusCode::NOT_FOUND,
            match (&q.stream, per_stream) {
                (None, _) => format!("pipeline `{name}` has no image frame yet"),
                (Some(st), true) => {
                    format!("pipeline `{name}` has no image frame of camera `{st}` yet")
                }
                (Some(st), false) => format!(
                    "pipeline `{name}` has no image frame of stream `{st}` \
                     (it keeps only its newest frame, of any stream)"
                ),
            },
        ),
    }
}

/// The best crop of a track (JPEG), its id percent-encoded as one path
/// segment; 404 with a JSON error when none is kept.
async fn track_snapshot(
    State(s): State<ApiState>,
    axum::extract::Path((name, id)): axum::extract::Path<(String, String)>,
) -> axum::response::Response {
    let err = |msg: String| {
        (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({ "error": msg })),
        )
            .into_response()
    };
    let sched = s.scheduler();
    let Some(p) = sched.pipelines().iter().find(|p| p.name() == name).cloned() else {
        return err(format!("no pipeline `{name}`"));
    };
    let Some(t) = p.tracking().cloned() else {
        return err(format!("pipeline `{name}` does not track"));
    };
    match tokio::task::spawn_blocking(move || t.snapshot(&id)).await {
        Ok(Some(jpeg)) => (
            [
                (axum::http::header::CONTENT_TYPE, "image/jpeg"),
                (axum::http::header::CACHE_CONTROL, "no-store"),
            ],
            jpeg,
        )
            .into_response(),
        _ => err(format!("pipeline `{name}` keeps no snapshot of that track")),
    }
}

/// The API's routes, every one behind the [`guard`]. Starts the console's
/// sampler (one for every console), so it is called inside the tokio runtime.
pub fn router(state: ApiState, ingress: HttpIngress, guard: Arc<guard::Guard>) -> Router {
    let infer_routes = Router::new()
        .route("/v1/pipelines/{name}/infer", post(infer))
        .with_state(ingress);
    let live = live::Live::start(state.clone());
    let snapshot_routes = Router::new()
        .route("/v1/pipelines/{name}/snapshot.jpg", get(snapshot))
        .with_state(SnapshotState {
            api: state.clone(),
            renders: crate::pipeline::snapshot::Renders::default(),
        });
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
        .route("/v1/reload", post(reload))
        .route("/v1/pipelines/{name}/pause", post(pause))
        .route("/v1/pipelines/{name}/resume", post(resume))
        .route(
            "/v1/pipelines/{name}/tracks/{id}/snapshot.jpg",
            get(track_snapshot),
        )
        .with_state(state)
        .merge(infer_routes)
        .merge(snapshot_routes)
        .merge(console::routes(live))
        .layer(axum::middleware::from_fn_with_state(guard, guard::guard))
}
