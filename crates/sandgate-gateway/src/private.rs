//! The private listener (`metrics.listen`): `/metrics`, `/healthz` and `/readyz` on an address of
//! their own, kept off the public port, so a proxy in front never exposes the metrics and a
//! `sandgate node` (which has no public HTTP at all) answers its probes and is scraped.

use std::net::SocketAddr;

use axum::Json;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use axum::routing::get;
use sandgate_service::PgPool;
use sandgate_service::health::{Readiness, ReadinessProbe};
use tokio::net::TcpListener;

use crate::metrics::Metrics;
use crate::sandboxes::SandboxService;
use crate::{Config, StartError, health, metrics};

/// What the private listener's routes read. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PrivateState {
    /// What `/readyz` checks.
    pub readiness: ReadinessProbe,
    /// The registry `/metrics` renders.
    pub metrics: Metrics,
    /// For every registered node's numbers.
    pub db: PgPool,
    /// For this process's own pool.
    pub sandboxes: SandboxService,
    /// The sandbox profile whose pool is exported.
    pub profile: String,
}

/// The private routes.
pub fn router(state: PrivateState) -> Router {
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(render))
        .with_state(state)
}

async fn readyz(State(state): State<PrivateState>) -> (StatusCode, Json<Readiness>) {
    health::answer(state.readiness.check().await)
}

async fn render(State(state): State<PrivateState>) -> Response {
    metrics::answer(&state.metrics, &state.db, &state.sandboxes, &state.profile).await
}

/// A bound private listener.
#[derive(Debug)]
pub struct PrivateListener {
    listener: TcpListener,
}

impl PrivateListener {
    /// Binds `metrics.listen`; `None` when it is empty.
    pub async fn bind(config: &Config) -> Result<Option<Self>, StartError> {
        let Some(addr) = config.metrics.listen_addr() else {
            return Ok(None);
        };
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })?;
        Ok(Some(Self { listener }))
    }

    /// The address bound (the real port with port 0).
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves `state` until `shutdown` resolves.
    pub fn spawn(
        self,
        state: PrivateState,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let addr = self.local_addr();
        tokio::spawn(async move {
            let served = axum::serve(self.listener, router(state))
                .with_graceful_shutdown(shutdown)
                .await;
            if let Err(err) = served {
                tracing::error!(error = %err, ?addr, "the private metrics listener stopped");
            }
        })
    }
}
