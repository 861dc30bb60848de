//! The MCP endpoint's routes. The gateway mounts them and puts its body limits in front.

use axum::Router;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::AppState;
use crate::auth::{RESOURCE_METADATA_PATH, require_bearer, resource_metadata};

/// `/mcp`: rmcp's Streamable HTTP service behind the bearer guard and the session binding. `shutdown` ends its open
/// streams so that shutdown is not held up by them.
pub fn endpoint(state: AppState, shutdown: CancellationToken) -> Router {
    let service = crate::service(
        &state.config,
        state.sandboxes.clone(),
        state.audit.clone(),
        state.metrics.clone(),
        state.links.clone(),
        state.transcripts.clone(),
        state.mcp_sessions.clone(),
        state.sessions.clone(),
        shutdown,
    );
    Router::new()
        .nest_service("/mcp", service)
        // After the bearer check (it needs the caller), before rmcp sees a session id.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::sessions::bind_sessions,
        ))
        .layer(axum::middleware::from_fn(
            crate::session_deleted_is_no_content,
        ))
        .layer(axum::middleware::from_fn_with_state(state, require_bearer))
}

/// The protected-resource metadata of `/mcp` (RFC 9728), at the well-known path with and without
/// the resource's path appended.
pub fn metadata() -> Router<AppState> {
    Router::new()
        .route(
            "/.well-known/oauth-protected-resource",
            get(resource_metadata),
        )
        .route(RESOURCE_METADATA_PATH, get(resource_metadata))
}
