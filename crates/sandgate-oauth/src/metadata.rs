//! RFC 8414 authorization-server metadata and the JWKS that verifies our access tokens.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use sandgate_auth::Scope;

use super::paths;
use crate::AppState;

/// `GET /.well-known/oauth-authorization-server` (RFC 8414 §3).
pub async fn authorization_server(State(state): State<AppState>) -> Json<serde_json::Value> {
    let base = state.config.public_url();
    let oauth = &state.config.oauth;
    let mut doc = serde_json::json!({
        "issuer": base,
        "authorization_endpoint": format!("{base}{}", paths::AUTHORIZE),
        "token_endpoint": format!("{base}{}", paths::TOKEN),
        "revocation_endpoint": format!("{base}{}", paths::REVOKE),
        "jwks_uri": format!("{base}{}", paths::JWKS),
        "scopes_supported": Scope::ALL.map(Scope::as_str),
        "response_types_supported": ["code"],
        "response_modes_supported": ["query"],
        "grant_types_supported": ["authorization_code", "refresh_token", "client_credentials"],
        "token_endpoint_auth_methods_supported": ["none", "client_secret_basic", "client_secret_post"],
        "revocation_endpoint_auth_methods_supported": ["none", "client_secret_basic", "client_secret_post"],
        // OAuth 2.1 and the MCP spec: S256 only, never plain.
        "code_challenge_methods_supported": ["S256"],
        // RFC 9207: the authorization response carries `iss`.
        "authorization_response_iss_parameter_supported": true,
        "client_id_metadata_document_supported": oauth.client_metadata.enabled,
        "service_documentation": format!("{base}{}", paths::APPS),
    });
    if oauth.dynamic_registration {
        doc["registration_endpoint"] = format!("{base}{}", paths::REGISTER).into();
    }
    Json(doc)
}

/// `GET /oauth/jwks`: every key that may still verify a live token (RFC 7517, RFC 8037).
pub async fn jwks(State(state): State<AppState>) -> Response {
    state.keys.refresh_if_stale().await;
    let keys: Vec<_> = state
        .keys
        .public_keys()
        .iter()
        .map(|k| k.to_jwk())
        .collect();
    let mut response = Json(serde_json::json!({ "keys": keys })).into_response();
    response.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=60"),
    );
    response
}
