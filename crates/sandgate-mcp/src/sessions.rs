//! MCP sessions belong to the principal that opened them (issue 11): the HTTP face of
//! [`sandgate_service::sessions`], an axum middleware between the bearer check
//! and rmcp's Streamable HTTP service.
//!
//! - A response to a request without `Mcp-Session-Id` that opens a session (`initialize`, 2025-11-25
//!   era) records the caller (tenant, subject, client) as its owner, unless the tenant is at its
//!   `max_sessions`: then the session rmcp just opened is closed again and the request gets 429
//!   with `Retry-After`, a JSON-RPC error naming the limit, an audit row and a metric.
//! - A request (POST, GET or DELETE) with `Mcp-Session-Id` reaches rmcp only when the caller owns
//!   that session; otherwise it gets rmcp's own 404 "session not found", so another principal's
//!   session looks exactly like one that does not exist, and nothing about it changes.
//! - A successful DELETE forgets the binding: the tenant's slot is free.
//!
//! The session's keyed hash is put into the request's extensions: the tool handlers use it as
//! the conversation key, so the id itself is never stored.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rmcp::transport::streamable_http_server::session::SessionManager;
use sandgate_auth::AccessClaims;
use sandgate_service::audit::ErrorKind;
use sandgate_service::sessions::{Ownership, Principal, SessionError};

use crate::AppState;

/// The session header (MCP 2025-11-25, Streamable HTTP §"Session Management").
const SESSION_ID: &str = "mcp-session-id";

/// The axum middleware; see the module documentation.
pub async fn bind_sessions(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    // The bearer check runs first and puts the claims here; without them there is nothing to
    // bind (the request was refused already).
    let Some(claims) = request.extensions().get::<AccessClaims>().cloned() else {
        return next.run(request).await;
    };
    let principal = Principal {
        tenant_id: claims.tenant,
        subject: claims.sub.clone(),
        client_id: claims.client_id.clone(),
    };
    match request.headers().get(SESSION_ID).cloned() {
        Some(id) => use_session(&state, &principal, id, request, next).await,
        None => {
            let response = next.run(request).await;
            match response.headers().get(SESSION_ID).cloned() {
                Some(id) => opened_session(&state, &claims, &principal, id, response).await,
                None => response,
            }
        }
    }
}

/// A request naming a session: through to rmcp only for its owner.
async fn use_session(
    state: &AppState,
    principal: &Principal,
    id: HeaderValue,
    mut request: Request,
    next: Next,
) -> Response {
    let session = state.sessions.hash(id.as_bytes());
    match state.sessions.check(session, principal).await {
        Ok(Ownership::Owner) => {}
        Ok(Ownership::NotFound) => {
            tracing::info!("refused a request naming a session the caller does not own");
            return session_not_found();
        }
        Err(err) => return unavailable(&err),
    }
    let is_delete = request.method() == Method::DELETE;
    request.extensions_mut().insert(session);
    let response = next.run(request).await;
    if is_delete
        && response.status().is_success()
        && let Err(err) = state.sessions.forget(session).await
    {
        // The binding expires by itself after the idle timeout.
        tracing::warn!(error = %err, "forgetting a closed MCP session failed");
    }
    response
}

/// rmcp opened a session: record its owner under the tenant's cap, or close it again.
async fn opened_session(
    state: &AppState,
    claims: &AccessClaims,
    principal: &Principal,
    id: HeaderValue,
    response: Response,
) -> Response {
    let session = state.sessions.hash(id.as_bytes());
    let bound = match state.sandboxes.limits(claims.tenant).await {
        Ok(limits) => {
            state
                .sessions
                .bind(session, principal, limits.max_sessions)
                .await
        }
        Err(err) => {
            tracing::warn!(error = %err, "reading the tenant's session limit failed");
            close(state, &id).await;
            return refusal(None);
        }
    };
    if let Err(err) = bound {
        close(state, &id).await;
        if let SessionError::OverCap { .. } = err {
            state.metrics.record_quota_refusal("max_sessions");
            crate::auth::audit_refusal(state, claims, None, ErrorKind::SessionLimit);
        } else {
            tracing::warn!(error = %err, "recording an MCP session's owner failed");
        }
        return refusal(Some(&err));
    }
    response
}

/// Closes a session rmcp opened but nobody may use (it has no recorded owner), and forgets the
/// state rmcp saved for other replicas (unusable without an owner anyway; purged later if this
/// fails).
async fn close(state: &AppState, id: &HeaderValue) {
    if let Ok(id) = id.to_str()
        && let Err(err) = state.mcp_sessions.close_session(&id.into()).await
    {
        tracing::warn!(error = %err, "closing a refused MCP session failed");
    }
    if let Err(err) = state
        .sessions
        .delete_state(state.sessions.hash(id.as_bytes()))
        .await
    {
        tracing::warn!(error = %err, "forgetting a refused MCP session's state failed");
    }
}

/// The answer rmcp gives for a session it does not know (MCP: 404 for unknown sessions), so
/// another principal's session and a missing one look the same.
fn session_not_found() -> Response {
    Response::builder()
        .status(StatusCode::NOT_FOUND)
        .body(Body::from("Not Found: Session not found"))
        .expect("a valid response")
}

/// Postgres did not answer: the owner could not be checked, so the request is not served.
fn unavailable(err: &SessionError) -> Response {
    tracing::warn!(error = %err, "checking an MCP session's owner failed");
    refusal(None)
}

/// A JSON-RPC error (the request's id is unknown here: `null`) with the status and
/// `Retry-After` of the refusal: the session cap (`Some(OverCap)`), else Postgres being away.
fn refusal(err: Option<&SessionError>) -> Response {
    let (status, message, data) = match err {
        Some(
            over @ SessionError::OverCap {
                max,
                retry_after_seconds,
            },
        ) => (
            StatusCode::TOO_MANY_REQUESTS,
            over.to_string(),
            serde_json::json!({
                "error": "quota_exceeded",
                "limit": "max_sessions",
                "value": max,
                "retry_after_seconds": retry_after_seconds,
            }),
        ),
        _ => (
            StatusCode::SERVICE_UNAVAILABLE,
            "sandgate's database is temporarily unavailable; retry in a few seconds".to_owned(),
            serde_json::json!({ "retry_after_seconds": 2 }),
        ),
    };
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": { "code": -32000, "message": message, "data": data },
    });
    let retry_after = data["retry_after_seconds"].to_string();
    (
        status,
        [(header::RETRY_AFTER, retry_after)],
        axum::Json(body),
    )
        .into_response()
}
