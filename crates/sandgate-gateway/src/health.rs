//! `/healthz` (the process is up) and `/readyz` (it can serve: Postgres, and Docker and the
//! image with a node of its own, a live node registered without).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;

use crate::AppState;
pub use sandgate_service::health::Readiness;

/// `GET /healthz`: 200 as long as the process serves HTTP.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// `GET /readyz`: 200 when every dependency answers, 503 naming the ones that do not.
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Readiness>) {
    answer(state.readiness.check().await)
}

/// The answer to `/readyz` for `readiness` (the public and the private listener's).
pub(crate) fn answer(readiness: Readiness) -> (StatusCode, Json<Readiness>) {
    if !readiness.is_ready() {
        tracing::warn!(checks = ?readiness.checks, "not ready");
        return (StatusCode::SERVICE_UNAVAILABLE, Json(readiness));
    }
    (StatusCode::OK, Json(readiness))
}
