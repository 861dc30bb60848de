//! `[http]`: connection limits and timeouts of the HTTP listener.

use serde::Deserialize;
use validator::{Validate, ValidationError};

use super::validation::problem;

/// Connection settings (`[http]`).
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Most connections open at once; beyond it new ones wait in the listen backlog.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_connections: usize,
    /// Most connections open at once from one client address; beyond it new ones are closed at
    /// once. 0: no per-address cap (behind a reverse proxy every peer is the proxy).
    pub max_connections_per_address: usize,
    /// Deadline for a request's headers (and an HTTP/1.1 keep-alive wait), seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub header_read_timeout_seconds: u64,
    /// Deadline for reading a whole request body, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub body_read_timeout_seconds: u64,
    /// A connection on which nothing moved for this long, with no request being answered (from
    /// its arrival until its response head is ready), is closed, seconds.
    pub idle_timeout_seconds: u64,
    /// Header a trusted reverse proxy sets to the client's address; empty: the peer address.
    #[validate(custom(function = header_name))]
    pub client_address_header: String,
}

impl HttpConfig {
    /// The check that compares with another section; `Err((key, message))` names the key.
    pub fn check_together(&self, sse_keep_alive_seconds: u64) -> Result<(), (String, String)> {
        if self.idle_timeout_seconds <= sse_keep_alive_seconds {
            return Err((
                "http.idle_timeout_seconds".into(),
                "must be longer than mcp.sse_keep_alive_seconds (an open MCP stream sends a \
                 keep-alive that often and must not count as idle)"
                    .into(),
            ));
        }
        Ok(())
    }
}

/// Empty, or a valid HTTP header name.
fn header_name(header: &str) -> Result<(), ValidationError> {
    if !header.is_empty() && ::http::HeaderName::try_from(header).is_err() {
        return Err(problem("is not a valid HTTP header name"));
    }
    Ok(())
}
