//! HTTP refusals of `/mcp` requests, before any tool runs: RFC 6750 JSON bodies
//! (`{"error", "error_description"[, "scope"]}`) with an optional `WWW-Authenticate` challenge.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// An RFC 6750 §3 error: `{"error", "error_description"[, "scope"]}` with an optional
/// `WWW-Authenticate` challenge.
#[derive(Debug, Serialize)]
pub struct BearerError {
    #[serde(skip)]
    status: StatusCode,
    error: &'static str,
    error_description: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    scope: Option<String>,
    #[serde(skip)]
    challenge: Option<String>,
}

impl BearerError {
    /// A refusal with `status`, the machine-readable `error` and a description saying what to do.
    pub fn new(status: StatusCode, error: &'static str, description: impl Into<String>) -> Self {
        Self {
            status,
            error,
            error_description: description.into(),
            scope: None,
            challenge: None,
        }
    }

    /// Adds the scopes that would do (`insufficient_scope`).
    pub fn with_scope(mut self, scope: String) -> Self {
        self.scope = Some(scope);
        self
    }

    /// Adds the `WWW-Authenticate` challenge.
    pub fn with_challenge(mut self, challenge: String) -> Self {
        self.challenge = Some(challenge);
        self
    }
}

impl IntoResponse for BearerError {
    fn into_response(self) -> Response {
        let challenge = self
            .challenge
            .as_deref()
            .and_then(|c| HeaderValue::from_str(c).ok());
        let mut response = (self.status, Json(&self)).into_response();
        if let Some(value) = challenge {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, value);
        }
        response
    }
}

/// Marks a request whose body exceeded its limit (the body was dropped). Whoever reads the body
/// in front of `/mcp` inserts it instead of answering, so that the bearer guard answers (and
/// audits) the refusal once it knows who sent the request.
#[derive(Debug, Clone, Copy)]
pub struct OversizedBody(pub usize);

/// The 413 answer for a body over `max_bytes`.
pub fn too_large(max_bytes: usize) -> Response {
    BearerError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request_too_large",
        format!("the request body exceeds {max_bytes} bytes"),
    )
    .into_response()
}
