//! Bearer-token authentication for `/mcp` (MCP authorization spec; RFC 6750, RFC 9728).
//!
//! Every request must carry `Authorization: Bearer <access token>`; the token is verified
//! (signature, issuer, audience = this MCP URL, expiry) on every request and its claims are put
//! into the request's extensions for the tool handlers. A refused request gets 401 with a
//! `WWW-Authenticate` challenge pointing at the protected-resource metadata.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sandgate_auth::{Scope, TokenError};

use crate::AppState;

/// The path of the protected-resource metadata for `/mcp` (RFC 9728 §3.1: the resource's path is
/// appended to the well-known prefix).
pub const RESOURCE_METADATA_PATH: &str = "/.well-known/oauth-protected-resource/mcp";

/// The axum middleware in front of the MCP service.
pub async fn require_bearer(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        })
        .filter(|t| !t.is_empty());
    let Some(token) = token else {
        return unauthorized(&state, None);
    };
    match state.keys.verify(token).await {
        Ok(claims) => {
            request.extensions_mut().insert(claims);
            next.run(request).await
        }
        Err(err) => {
            tracing::info!(reason = %err, "refused an access token");
            unauthorized(&state, Some(&err))
        }
    }
}

fn unauthorized(state: &AppState, err: Option<&TokenError>) -> Response {
    let metadata = format!("{}{}", state.config.public_url(), RESOURCE_METADATA_PATH);
    let scopes = Scope::ALL.map(Scope::as_str).join(" ");
    // RFC 6750 §3: no error code when the request had no credentials at all.
    let challenge = match err {
        None => format!(r#"Bearer resource_metadata="{metadata}", scope="{scopes}""#),
        Some(err) => format!(
            r#"Bearer resource_metadata="{metadata}", scope="{scopes}", error="invalid_token", error_description="{err}""#
        ),
    };
    let mut response = (
        StatusCode::UNAUTHORIZED,
        Json(serde_json::json!({
            "error": if err.is_some() { "invalid_token" } else { "unauthorized" },
            "error_description": err.map_or_else(
                || "this endpoint needs an access token: Authorization: Bearer <token>".to_owned(),
                ToString::to_string,
            ),
        })),
    )
        .into_response();
    if let Ok(value) = HeaderValue::from_str(&challenge) {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, value);
    }
    response
}

/// `GET /.well-known/oauth-protected-resource[/mcp]` (RFC 9728).
pub async fn resource_metadata(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "resource": state.config.mcp_url(),
        "authorization_servers": [state.config.public_url()],
        "scopes_supported": Scope::ALL.map(Scope::as_str),
        "bearer_methods_supported": ["header"],
        "resource_name": "sandgate",
    }))
}
