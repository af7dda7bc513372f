//! The local console: one page for the technician next to the box, served
//! by the daemon itself. Its HTML, CSS and JavaScript are compiled into the
//! binary (no CDN, no download, works with the site offline); it reads
//! `/v1/events` (see [`super::live`]) and `/v1/pipelines/{name}/records`,
//! and changes state only through the token-checked endpoints of the API.

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use super::live::{self, Live};

const INDEX_HTML: &str = include_str!("assets/index.html");
const CONSOLE_CSS: &str = include_str!("assets/console.css");
const CONSOLE_JS: &str = include_str!("assets/console.js");
/// The pictures: snapshots with their overlays, one per camera of a
/// pipeline over several (loaded before `console.js`, which uses it).
const VIEWS_JS: &str = include_str!("assets/views.js");

/// Only the daemon's own scripts, styles and connections; images from the
/// API or inline (the placeholder).
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut r = body.into_response();
    let h = r.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    // The assets change with the binary (an OTA update): always revalidate.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    r
}

async fn index() -> Response {
    asset(INDEX_HTML, "text/html; charset=utf-8")
}

async fn css() -> Response {
    asset(CONSOLE_CSS, "text/css; charset=utf-8")
}

async fn js() -> Response {
    asset(CONSOLE_JS, "text/javascript; charset=utf-8")
}

async fn views_js() -> Response {
    asset(VIEWS_JS, "text/javascript; charset=utf-8")
}

/// `GET /v1/pipelines/{name}/records`: its last records, newest first.
async fn records(State(live): State<Arc<Live>>, Path(name): Path<String>) -> Response {
    let known = live
        .state
        .scheduler()
        .pipelines()
        .iter()
        .any(|p| p.name() == name);
    if !known {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"error": format!("no pipeline `{name}`")})),
        )
            .into_response();
    }
    let body = live
        .state
        .recent
        .latest_json(&name, crate::pipeline::recent::PER_PIPELINE);
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The console's routes, with the live feed they read.
pub fn routes(live: Arc<Live>) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/console.css", get(css))
        .route("/console.js", get(js))
        .route("/views.js", get(views_js))
        .route("/v1/events", get(live::events))
        .route("/v1/pipelines/{name}/records", get(records))
        .with_state(live)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_names_only_its_own_assets() {
        // Offline sites: nothing may come from elsewhere.
        let js = CONSOLE_JS.replace("'http://www.w3.org/2000/svg'", "");
        let views = VIEWS_JS.replace("'http://www.w3.org/2000/svg'", "");
        for text in [INDEX_HTML, CONSOLE_CSS, js.as_str(), views.as_str()] {
            assert!(!text.contains("http://"), "absolute URL in an asset");
            assert!(!text.contains("https://"), "absolute URL in an asset");
            assert!(!text.contains("//cdn"), "CDN in an asset");
        }
        assert!(INDEX_HTML.contains("/console.js"));
        assert!(INDEX_HTML.contains("/views.js"));
        assert!(VIEWS_JS.contains("snapshot.jpg"));
        assert!(INDEX_HTML.contains("/console.css"));
        assert!(CONSOLE_JS.contains("/v1/events"));
    }
}
