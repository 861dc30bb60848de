//! The sandgate gateway: the HTTP faces of the service. What happens to tenants, sandboxes,
//! keys and the audit trail is decided by `sandgate-service`; this crate turns HTTP and MCP into
//! calls on it and its answers (and errors) back into HTTP and MCP.
//!
//! - [`connections`]: the accept loop: connection cap, header/body/idle timeouts.
//! - [`telemetry`]: logging set-up.
//! - [`health`]: `/healthz` and `/readyz`.
//! - [`mcp`]: the MCP endpoint at `/mcp` and its bearer-token guard (the `sandgate-mcp` crate).
//! - [`metrics`]: Prometheus metrics at `/metrics`.
//! - [`files`]: expiring download links for files in sandboxes (and transcripts).
//! - [`handoff`]: transcript downloads and the logged-in users' transcripts page.
//! - [`console`]: where a tenant's users take over the bot's live sandbox.
//! - [`headers`]: the headers every download carries.
//! - [`error`]: the mapping of errors to HTTP answers.
//! - [`oauth`]: the OAuth 2.1 authorization server (the `sandgate-oauth` crate).
//! - [`config`], [`sandboxes`], [`lifecycle`], [`audit`], [`keys`], [`admin`], [`transcripts`],
//!   [`retention`]: the service layer (the `sandgate-service` crate), re-exported here.
//! - [`App`]: build the state and router, bind, run until a shutdown signal.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::{HeaderName, Request};
use axum::routing::get;
use sandgate_mcp::LocalSessionManager;
use sandgate_service::PgPool;
use sandgate_service::health::ReadinessProbe;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub mod connections;
pub mod console;
pub mod error;
pub mod files;
pub mod handoff;
pub mod headers;
pub mod health;
pub mod metrics;
pub mod node;
pub mod private;
pub mod telemetry;

// The service layer lives in its own crate; its modules stay reachable under the old paths so
// the binary and the tests read the same.
pub use sandgate_mcp as mcp;
pub use sandgate_oauth as oauth;
pub use sandgate_service::{
    Config, admin, audit, config, egress, erasure, keys, lifecycle, resource_uri, retention,
    sandboxes, transcripts,
};

use crate::keys::KeyRing;
use crate::sandboxes::SandboxService;
use sandgate_service::grants::Grants;
pub use sandgate_service::startup::Role;

/// What the gateway shares with every request handler. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// The Postgres pool.
    pub db: PgPool,
    /// What `/readyz` checks (with a node of its own: its Docker engine and the image).
    pub readiness: ReadinessProbe,
    /// Signing and verifying keys for access tokens.
    pub keys: KeyRing,
    /// Tenant-scoped sandboxes.
    pub sandboxes: SandboxService,
    /// The authorization server's own state (cookie key, metadata-document fetcher).
    pub oauth: oauth::OAuthState,
    /// The OAuth grant rules (codes, tokens, approvals, clients, sessions).
    pub grants: Grants,
    /// The audit trail's writer.
    pub audit: audit::AuditLog,
    /// Prometheus metrics.
    pub metrics: metrics::Metrics,
    /// Expiring download links (`get_file`, `export_transcript`).
    pub links: files::DownloadLinks,
    /// Opens download links (revocation, rate limits, the audit trail).
    pub link_service: files::LinkService,
    /// Transcripts of what ran in sandboxes.
    pub transcripts: transcripts::Transcripts,
    /// Who owns each MCP session (Postgres, keyed hashes of the ids).
    pub sessions: sandgate_service::sessions::SessionBindings,
    /// rmcp's sessions of this process (2025-11-25 era).
    pub mcp_sessions: Arc<LocalSessionManager>,
    /// Cancelled at shutdown: ends open MCP streams so shutdown is not held up by them.
    pub shutdown: CancellationToken,
    /// Cancelled after the server stopped: ends the background work (reaper, reconciliation).
    background_stop: CancellationToken,
    /// The background work.
    background: TaskTracker,
}

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The service layer (Postgres, keys, Docker, the sandbox manager) could not start.
    #[error(transparent)]
    Services(#[from] sandgate_service::startup::StartError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The configured address.
        addr: SocketAddr,
        /// Why binding failed.
        #[source]
        source: std::io::Error,
    },
    /// The authorization server could not be set up.
    #[error("cannot set up the OAuth authorization server")]
    OAuth(#[source] oauth::SetupError),
    /// The server failed while running.
    #[error("the HTTP server failed")]
    Serve(#[source] std::io::Error),
    /// The node RPC could not start.
    #[error("cannot serve the sandbox node")]
    Node(#[source] sandgate_service::node_rpc::NodeRpcError),
}

const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

impl AppState {
    /// Connects to Postgres, migrates, loads keys and, with a node of its own (`role`), starts
    /// it: Docker, the registration and the sandbox manager (which begins filling the warm pool
    /// in the background).
    pub async fn start(config: Config, role: Role) -> Result<Self, StartError> {
        // Its node.tls_cert is its client certificate to the nodes, and its node RPC's server
        // certificate when it serves one.
        let mut certificate_uses = vec![sandgate_service::metrics::CertificateKind::gateway_client];
        if matches!(role, Role::Node { .. }) && !config.node.listen.is_empty() {
            certificate_uses.push(sandgate_service::metrics::CertificateKind::node_server);
        }
        let certificates = sandgate_service::metrics::Certificates::of(&config, certificate_uses);
        let services = sandgate_service::Services::start(&config, role).await?;
        let oauth = oauth::OAuthState::new(&config).map_err(StartError::OAuth)?;
        let links = files::DownloadLinks::new(config.keys.secret_bytes(), &config.public_url());
        let link_service = files::LinkService::new(
            links.clone(),
            files::LinkLimits::new(&config.links),
            services.db.clone(),
            services.sandboxes.clone(),
            services.transcripts.clone(),
        );
        let readiness = ReadinessProbe::of(&services, &config);
        let sessions = sandgate_service::sessions::SessionBindings::new(
            services.db.clone(),
            config.keys.secret_bytes(),
            std::time::Duration::from_secs(config.mcp.session_idle_seconds),
        );
        let mcp_sessions = mcp::session_manager(&config);
        let (stop, background) = (&services.background_stop, &services.background);
        link_service.start_housekeeping(stop.clone(), background);
        let config = Arc::new(config);
        let grants = Grants::new(
            services.db.clone(),
            services.keys.clone(),
            services.sandboxes.clone(),
            config.clone(),
        );
        grants.start_purge(stop.clone(), background);
        oauth.limits.start_housekeeping(
            std::time::Duration::from_secs(60),
            stop.clone(),
            background,
        );
        Ok(Self {
            config,
            db: services.db,
            readiness,
            keys: services.keys,
            sandboxes: services.sandboxes,
            oauth,
            grants,
            audit: services.audit,
            metrics: metrics::Metrics::with_certificates(certificates),
            links,
            link_service,
            transcripts: services.transcripts,
            sessions,
            mcp_sessions,
            shutdown: CancellationToken::new(),
            background_stop: services.background_stop,
            background: services.background,
        })
    }
}

impl AppState {
    /// The part of the state the private listener's routes use.
    fn private_state(&self) -> private::PrivateState {
        private::PrivateState {
            readiness: self.readiness.clone(),
            metrics: self.metrics.clone(),
            db: self.db.clone(),
            sandboxes: self.sandboxes.clone(),
            profile: self.config.sandbox.name.clone(),
        }
    }

    /// The part of the state the authorization server's routes use.
    pub fn oauth_app(&self) -> oauth::AppState {
        oauth::AppState {
            config: self.config.clone(),
            keys: self.keys.clone(),
            grants: self.grants.clone(),
            oauth: self.oauth.clone(),
        }
    }

    /// The part of the state the MCP endpoint uses.
    fn mcp_app(&self) -> mcp::AppState {
        mcp::AppState {
            config: self.config.clone(),
            db: self.db.clone(),
            keys: self.keys.clone(),
            sandboxes: self.sandboxes.clone(),
            audit: self.audit.clone(),
            metrics: self.metrics.tools().clone(),
            links: self.links.clone(),
            transcripts: self.transcripts.clone(),
            sessions: self.sessions.clone(),
            mcp_sessions: self.mcp_sessions.clone(),
        }
    }
}

/// The router with every route and the cross-cutting layers (request ids, tracing).
pub fn router(state: AppState) -> Router {
    let mcp = state.mcp_app();
    let console_upload_bytes =
        usize::try_from(state.config.limits.max_file_bytes).unwrap_or(usize::MAX);
    let body_timeout = std::time::Duration::from_secs(state.config.http.body_read_timeout_seconds);
    let mcp_routes = mcp::routes::endpoint(mcp.clone(), state.shutdown.child_token())
        // Outside the bearer check: a body over the limit is answered (and audited) by it once
        // it knows who sent it.
        .layer(axum::middleware::from_fn_with_state(
            connections::BodyLimits {
                timeout: body_timeout,
                max_bytes: state.config.mcp.max_request_bytes,
                defer_too_large: true,
            },
            connections::body_deadline,
        ));
    Router::new()
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::metrics))
        .route("/files/{token}", get(files::download))
        // A signed-in page that shows fresh download links: the OAuth pages' headers (no
        // framing, no referrer, no caching, a CSP that loads nothing).
        .merge(oauth::html::with_security_headers(
            Router::new().route(handoff::PAGE, get(handoff::page)),
        ))
        .merge(mcp::routes::metadata().with_state(mcp))
        .merge(oauth::routes().with_state(state.oauth_app()))
        .layer(axum::middleware::from_fn_with_state(
            connections::BodyLimits {
                timeout: body_timeout,
                max_bytes: oauth::MAX_BODY_BYTES,
                defer_too_large: false,
            },
            connections::body_deadline,
        ))
        .merge(
            console::routes(console_upload_bytes).layer(axum::middleware::from_fn_with_state(
                connections::BodyLimits {
                    timeout: body_timeout,
                    max_bytes: console_upload_bytes,
                    defer_too_large: false,
                },
                connections::body_deadline,
            )),
        )
        .with_state(state.clone())
        .merge(mcp_routes)
        .layer(axum::middleware::from_fn_with_state(
            state.metrics.clone(),
            metrics::count_refusals,
        ))
        .layer(PropagateRequestIdLayer::new(REQUEST_ID))
        .layer(
            TraceLayer::new_for_http().make_span_with(|request: &Request<_>| {
                let request_id = request
                    .headers()
                    .get(REQUEST_ID)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                tracing::info_span!(
                    "request",
                    method = %request.method(),
                    path = %logged_path(request.uri().path()),
                    request_id,
                )
            }),
        )
        .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
}

/// A request's path as logged: a download link's token is a bearer secret (whoever has it
/// downloads), so it never reaches a log line.
fn logged_path(path: &str) -> &str {
    if path.starts_with("/files/") {
        "/files/<token>"
    } else {
        path
    }
}

/// Runs the migrations embedded in the binary.
pub async fn migrate(config: &Config) -> Result<(), StartError> {
    Ok(sandgate_service::startup::migrate(config).await?)
}

/// A bound, ready-to-run gateway.
#[derive(Debug)]
pub struct App {
    listener: TcpListener,
    state: AppState,
    /// The node RPC, when `node.listen` is set: other gateways reach this process's sandboxes.
    node_rpc: Option<sandgate_service::node_rpc::NodeRpc>,
    /// The private listener for `/metrics`, when `metrics.listen` is set.
    private: Option<private::PrivateListener>,
}

impl App {
    /// Binds the listen address, then starts the state (migrations, keys, this process's own
    /// node: its registration and sandbox manager, and its RPC when `node.listen` is set).
    pub async fn build(config: Config) -> Result<Self, StartError> {
        Self::build_as(config, false).await
    }

    /// Like [`App::build`] without a node of its own (`sandgate serve --gateway-only`): no
    /// Docker, no pool; sandboxes are leased on and reached at the registered nodes.
    pub async fn build_gateway_only(config: Config) -> Result<Self, StartError> {
        Self::build_as(config, true).await
    }

    async fn build_as(mut config: Config, gateway_only: bool) -> Result<Self, StartError> {
        let addr = config.listen;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })?;
        // With port 0 the kernel picks the port; everything derived from `listen` (the public
        // URL when none is configured) must use the real one.
        config.listen = listener
            .local_addr()
            .map_err(|source| StartError::Bind { addr, source })?;
        let private = private::PrivateListener::bind(&config).await?;
        // A gateway dials nodes with a gateway certificate (a node's own is refused by them).
        sandgate_service::node_rpc::check_gateway_identity(&config.node)
            .map_err(StartError::Node)?;
        let (node_rpc, role) = if gateway_only {
            (None, Role::GatewayOnly)
        } else {
            let rpc = sandgate_service::node_rpc::NodeRpc::bind(&config.node)
                .await
                .map_err(StartError::Node)?;
            let advertise_url = node::advertise_url(&config, rpc.as_ref());
            if let Some(rpc) = &rpc {
                rpc.check_advertised(&advertise_url)
                    .map_err(StartError::Node)?;
            }
            (rpc, Role::Node { advertise_url })
        };
        let state = AppState::start(config, role).await?;
        Ok(Self {
            listener,
            state,
            node_rpc,
            private,
        })
    }

    /// The node RPC's address, when it serves one.
    pub fn node_addr(&self) -> Option<SocketAddr> {
        self.node_rpc.as_ref().and_then(|rpc| rpc.local_addr())
    }

    /// The private listener's address (`metrics.listen`), when it serves one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.private.as_ref().and_then(|p| p.local_addr())
    }

    /// The MCP endpoint URL this gateway serves.
    pub fn mcp_url(&self) -> String {
        self.state.config.mcp_url()
    }

    /// The address actually bound (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves, then finishes in-flight requests. Leased sandboxes keep
    /// running for the next start to re-attach to; warm ones recorded in Postgres stay for the
    /// next start (or another replica) to lease.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), StartError> {
        let state = self.state.clone();
        let stop = state.shutdown.clone();
        let node_rpc = match (self.node_rpc, state.sandboxes.nodes().local()) {
            (Some(rpc), Some(manager)) => {
                let manager = manager.clone();
                let stopped = stop.clone().cancelled_owned();
                Some(tokio::spawn(async move {
                    if let Err(err) = rpc.run(manager, stopped).await {
                        tracing::error!(error = %err, "the node RPC stopped");
                    }
                }))
            }
            _ => None,
        };
        let private = self
            .private
            .map(|listener| listener.spawn(state.private_state(), stop.clone().cancelled_owned()));
        let app = router(self.state);
        let http = state.config.http.clone();
        connections::serve(self.listener, app, &http, async move {
            shutdown.await;
            stop.cancel();
        })
        .await;
        if let Some(node_rpc) = node_rpc {
            let _ = node_rpc.await;
        }
        if let Some(private) = private {
            let _ = private.await;
        }
        // Stops the reaper and reconciliation first (nothing is closed while shutting down),
        // then the pool; the audit writer flushes what is still queued.
        state.background_stop.cancel();
        state.sandboxes.shutdown().await;
        state.background.close();
        state.background.wait().await;
        Ok(())
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut sig) => {
                sig.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
    // Sandboxes stay running: the next start re-attaches to them.
    tracing::info!("shutdown signal received; finishing in-flight requests");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_token_never_reaches_a_request_span() {
        assert_eq!(logged_path("/files/v1.secret-token"), "/files/<token>");
        assert_eq!(logged_path("/mcp"), "/mcp");
    }
}
