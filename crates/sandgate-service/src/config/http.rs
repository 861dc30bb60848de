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
    /// Most connections open at once from one client address (an IPv6 /64); beyond it new ones
    /// are closed at once. Behind a reverse proxy (`client_address_header` set): most requests
    /// in flight per client address. At most a quarter of `max_connections`; 0: no such cap.
    pub max_connections_per_address: usize,
    /// A connection on which no request carried a verified access token is closed (gracefully:
    /// what it is answering is finished) this long after it opened, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub anonymous_max_age_seconds: u64,
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
        if self.max_connections_per_address.saturating_mul(4) > self.max_connections {
            return Err((
                "http.max_connections_per_address".into(),
                format!(
                    "must be at most a quarter of http.max_connections ({}), so that two client \
                     addresses cannot hold every connection; raise max_connections (the process \
                     needs a file descriptor for each) or lower this",
                    self.max_connections
                ),
            ));
        }
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
