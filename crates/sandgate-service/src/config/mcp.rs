//! `[mcp]`: the MCP endpoint.

use serde::Deserialize;
use url::Url;
use validator::{Validate, ValidationError};

use super::validation::problem;

/// MCP endpoint settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// Largest request body, bytes.
    pub max_request_bytes: usize,
    /// SSE keep-alive interval, seconds.
    pub sse_keep_alive_seconds: u64,
    /// Extra allowed Origins.
    #[validate(custom(function = origins))]
    pub allowed_origins: Vec<String>,
    /// A 2025-11-25 session unused this long ends (and frees its tenant's session slot), seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub session_idle_seconds: u64,
}

/// Each entry is an origin: `scheme://host[:port]`, no path.
fn origins(origins: &[String]) -> Result<(), ValidationError> {
    for origin in origins {
        let ok = Url::parse(origin).is_ok_and(|u| {
            u.host().is_some()
                && u.path() == "/"
                && u.as_str().trim_end_matches('/') == origin.trim_end_matches('/')
        });
        if !ok {
            return Err(problem(format!(
                "{origin:?} is not an origin (scheme://host[:port])"
            )));
        }
    }
    Ok(())
}
