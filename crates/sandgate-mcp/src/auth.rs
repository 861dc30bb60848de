//! Bearer-token authentication for `/mcp` (MCP authorization spec; RFC 6750, RFC 9728).
//!
//! Every request must carry `Authorization: Bearer <access token>`; the token is verified
//! (signature, issuer, audience = this MCP URL, expiry) on every request and its claims are put
//! into the request's extensions for the tool handlers. A refused request gets 401 with a
//! `WWW-Authenticate` challenge pointing at the protected-resource metadata.
//!
//! A token issued under an OAuth grant works only while the grant is live (disconnecting the
//! app stops it at once), and a revoked token (RFC 7009) stops too. A `tools/call` for a tool
//! outside the token's scopes gets 403 with an `insufficient_scope` challenge (RFC 6750 §3.1,
//! MCP authorization spec "scope challenge"), naming the scopes that would suffice.

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sandgate_auth::{AccessClaims, Scope};
use sandgate_service::audit::{ErrorKind, Outcome};

use crate::AppState;
use crate::refusal::{BearerError, OversizedBody, too_large};
use crate::tools::ToolName;

/// The path of the protected-resource metadata for `/mcp` (RFC 9728 §3.1: the resource's path is
/// appended to the well-known prefix).
pub const RESOURCE_METADATA_PATH: &str = "/.well-known/oauth-protected-resource/mcp";

/// Set on a request whose token's grant could not be checked because Postgres is unavailable:
/// tool calls carrying it are refused with a retryable error.
#[derive(Debug, Clone, Copy)]
pub struct GrantUnverified;

/// A connection's mark, put in each request's extensions by the accept loop: set once a request
/// on the connection carried a verified access token. A connection never marked is anonymous,
/// and the accept loop closes it by a stricter rule (`http.anonymous_max_age_seconds`).
#[derive(Debug, Clone, Default)]
pub struct ConnectionAuth(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl ConnectionAuth {
    /// Marks the connection as having carried an authenticated request.
    pub fn mark(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a request on the connection was authenticated.
    pub fn is_authenticated(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The axum middleware in front of the MCP service.
pub async fn require_bearer(
    State(state): State<AppState>,
    request: Request,
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
    let claims = match state.keys.verify(token).await {
        Ok(claims) => claims,
        Err(err) => {
            tracing::info!(reason = %err, "refused an access token");
            return unauthorized(&state, Some(&err.to_string()));
        }
    };
    let verified = match check_grant(&state, &claims).await {
        Ok(verified) => verified,
        Err(refused) => return refused,
    };
    if let Some(connection) = request.extensions().get::<ConnectionAuth>() {
        connection.mark();
    }
    if let Some(OversizedBody(max)) = request.extensions().get().copied() {
        tracing::info!(
            max_bytes = max,
            "refused an MCP request over the body limit"
        );
        // With Postgres away the refusal cannot be audited either.
        if verified {
            audit_refusal(&state, &claims, None, ErrorKind::RequestTooLarge);
        }
        return too_large(max);
    }
    let mut request = request;
    if !verified {
        request.extensions_mut().insert(GrantUnverified);
    }
    let (request, tool) = match called_tool(request, state.config.mcp.max_request_bytes).await {
        Ok(found) => found,
        Err(response) => return response,
    };
    // An unverified request's tool call is refused by the tool itself (retryably); its scope
    // is not checked here.
    if let Some(tool) = tool
        && verified
        && !claims.has_scope(tool.scope())
    {
        tracing::info!(
            tool = tool.as_str(),
            "refused a call outside the token's scopes"
        );
        audit_refusal(&state, &claims, Some(tool), ErrorKind::InsufficientScope);
        return insufficient_scope(&state, &claims, tool);
    }
    let mut request = request;
    request.extensions_mut().insert(claims);
    next.run(request).await
}

/// Whether the token's grant is live (`true`), or could not be checked because Postgres is
/// away (`false`); a revoked token or another failure is refused with the response to send.
async fn check_grant(state: &AppState, claims: &AccessClaims) -> Result<bool, Response> {
    let active = state
        .sandboxes
        .token_is_active(claims.grant, &claims.jti)
        .await;
    match active {
        Ok(true) => Ok(true),
        Ok(false) => {
            tracing::info!(grant_id = ?claims.grant, "refused a revoked token");
            Err(unauthorized(
                state,
                Some("the access token was revoked or its app was disconnected"),
            ))
        }
        // Postgres is away: nothing that touches a sandbox can run without it anyway, so let
        // the request through marked unverified. Tool calls then refuse with the same
        // retryable tool error as every other call during an outage (DESIGN: calls fail fast
        // and retryably, then work again by themselves); listing tools stays possible.
        Err(err) if err.is_unavailable() => {
            tracing::warn!(error = %err, "grant not checked: the database is unavailable");
            Ok(false)
        }
        Err(err) => {
            tracing::error!(error = ?err, "checking the token's grant failed");
            Err(BearerError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "temporarily_unavailable",
                "sandgate's database is unavailable; retry in a few seconds",
            )
            .into_response())
        }
    }
}

/// Audits a request refused after its token was verified (the caller is known): outcome
/// `refused`, the tool when one was named (else `mcp`), and why.
pub fn audit_refusal(
    state: &AppState,
    claims: &AccessClaims,
    tool: Option<ToolName>,
    kind: ErrorKind,
) {
    let event = sandgate_service::audit::AuditEvent {
        at: chrono::Utc::now(),
        tenant_id: claims.tenant,
        token_id: Some(claims.jti.clone()),
        subject: Some(claims.sub.clone()),
        conversation_id: None,
        sandbox_id: None,
        tool: tool.map_or("mcp", |t| t.as_str()).to_owned(),
        outcome: Outcome::Refused,
        error_kind: Some(kind),
        duration_ms: 0,
    };
    state.audit.record(event);
}

/// The tool a `tools/call` request names, if it is one of ours. Under 2026-07-28 the
/// `Mcp-Method`/`Mcp-Name` headers say it (rmcp checks they match the body); otherwise the
/// JSON-RPC body is read (bounded by `mcp.max_request_bytes`) and put back for rmcp.
async fn called_tool(
    request: Request,
    max_bytes: usize,
) -> Result<(Request, Option<ToolName>), Response> {
    if request.method() != Method::POST {
        return Ok((request, None));
    }
    if let Some(name) = header_tool_name(request.headers()) {
        return Ok((request, name.as_deref().and_then(ToolName::parse)));
    }
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, max_bytes).await.map_err(|_| {
        BearerError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body exceeds {max_bytes} bytes"),
        )
        .into_response()
    })?;
    let tool = tool_named_in(&bytes);
    Ok((Request::from_parts(parts, Body::from(bytes)), tool))
}

/// The tool a JSON-RPC `tools/call` body names, if it is one of ours; `None` for anything else
/// (another method, a batch, not JSON at all).
pub fn tool_named_in(body: &[u8]) -> Option<ToolName> {
    #[derive(serde::Deserialize)]
    struct Call<'a> {
        // A `Cow`, not a `&str`: a method written with JSON escapes (`"tools\/call"`) cannot be
        // borrowed, and must still be recognised (found by the fuzz target).
        #[serde(borrow)]
        method: Option<std::borrow::Cow<'a, str>>,
        params: Option<Params>,
    }
    #[derive(serde::Deserialize)]
    struct Params {
        name: Option<String>,
    }
    serde_json::from_slice::<Call<'_>>(body)
        .ok()
        .filter(|c| c.method.as_deref() == Some("tools/call"))
        .and_then(|c| c.params?.name)
        .and_then(|n| ToolName::parse(&n))
}

/// `Some(name)` when the 2026-07-28 headers mark a `tools/call`; `None` when they do not apply.
pub fn header_tool_name(headers: &HeaderMap) -> Option<Option<String>> {
    let method = headers.get("mcp-method")?.to_str().ok()?;
    if method != "tools/call" {
        // Another method: nothing to check, and no need to read the body.
        return Some(None);
    }
    let raw = headers.get("mcp-name")?.to_str().ok()?;
    let name = match raw
        .strip_prefix("=?base64?")
        .and_then(|r| r.strip_suffix("?="))
    {
        Some(b64) => {
            String::from_utf8(base64::engine::general_purpose::STANDARD.decode(b64).ok()?).ok()?
        }
        None => raw.to_owned(),
    };
    Some(Some(name))
}

fn insufficient_scope(state: &AppState, claims: &AccessClaims, tool: ToolName) -> Response {
    let metadata = format!("{}{}", state.config.public_url(), RESOURCE_METADATA_PATH);
    let needed = tool.scope();
    // The token's scopes plus the missing one: re-authorizing for these keeps what the client
    // already has.
    let mut scopes = claims.scopes();
    scopes.push(needed);
    scopes.sort();
    scopes.dedup();
    let scope_list = scopes
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    let description = format!(
        "calling {} needs the {} scope, which this token does not hold",
        tool.as_str(),
        needed.as_str()
    );
    let challenge = format!(
        r#"Bearer error="insufficient_scope", scope="{scope_list}", resource_metadata="{metadata}", error_description="{description}""#
    );
    BearerError::new(StatusCode::FORBIDDEN, "insufficient_scope", description)
        .with_scope(scope_list)
        .with_challenge(challenge)
        .into_response()
}

fn unauthorized(state: &AppState, err: Option<&str>) -> Response {
    let metadata = format!("{}{}", state.config.public_url(), RESOURCE_METADATA_PATH);
    let scopes = Scope::ALL.map(Scope::as_str).join(" ");
    // RFC 6750 §3: no error code when the request had no credentials at all.
    let challenge = match err {
        None => format!(r#"Bearer resource_metadata="{metadata}", scope="{scopes}""#),
        Some(err) => format!(
            r#"Bearer resource_metadata="{metadata}", scope="{scopes}", error="invalid_token", error_description="{err}""#
        ),
    };
    let (error, description) = match err {
        Some(err) => ("invalid_token", err.to_owned()),
        None => (
            "unauthorized",
            "this endpoint needs an access token: Authorization: Bearer <token>".to_owned(),
        ),
    };
    BearerError::new(StatusCode::UNAUTHORIZED, error, description)
        .with_challenge(challenge)
        .into_response()
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
