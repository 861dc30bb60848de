//! `/healthz` (the process is up) and `/readyz` (it can serve: Postgres, Docker, image).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;

use crate::AppState;

/// How long one readiness check may take before it counts as failed.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The body of `/readyz`.
#[derive(Debug, Serialize)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    /// One entry per dependency.
    pub checks: Checks,
}

/// Each dependency's check.
#[derive(Debug, Serialize)]
pub struct Checks {
    /// Postgres answers a query.
    pub postgres: Check,
    /// The Docker engine answers a ping.
    pub docker: Check,
    /// The sandbox image exists on the engine.
    pub sandbox_image: Check,
}

/// The outcome of one check.
#[derive(Debug, Serialize)]
pub struct Check {
    /// Whether it passed.
    pub ok: bool,
    /// What failed and what to do, when it did not pass.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Check {
    fn from_result<E: std::fmt::Display>(
        result: Result<Result<(), E>, tokio::time::error::Elapsed>,
    ) -> Self {
        match result {
            Ok(Ok(())) => Check {
                ok: true,
                error: None,
            },
            Ok(Err(e)) => Check {
                ok: false,
                error: Some(e.to_string()),
            },
            Err(_) => Check {
                ok: false,
                error: Some(format!("no answer within {} s", CHECK_TIMEOUT.as_secs())),
            },
        }
    }
}

/// `GET /healthz`: 200 as long as the process serves HTTP.
pub async fn healthz() -> Json<serde_json::Value> {
    Json(serde_json::json!({ "status": "ok" }))
}

/// `GET /readyz`: 200 when every dependency answers, 503 naming the ones that do not.
pub async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Readiness>) {
    let image = state.config.sandbox.image.clone();
    let (postgres, docker, sandbox_image) = tokio::join!(
        tokio::time::timeout(CHECK_TIMEOUT, sandgate_store::ping(&state.db)),
        tokio::time::timeout(CHECK_TIMEOUT, state.docker.ping()),
        tokio::time::timeout(CHECK_TIMEOUT, state.docker.ensure_image(&image)),
    );
    let checks = Checks {
        postgres: Check::from_result(postgres),
        docker: Check::from_result(docker),
        sandbox_image: Check::from_result(sandbox_image),
    };
    let ready = checks.postgres.ok && checks.docker.ok && checks.sandbox_image.ok;
    if !ready {
        tracing::warn!(?checks, "not ready");
    }
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(Readiness {
            status: if ready { "ready" } else { "not_ready" },
            checks,
        }),
    )
}
