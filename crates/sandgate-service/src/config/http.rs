//! `[http]`: connection limits and timeouts of the HTTP listener.

use serde::Deserialize;

/// Connection settings (`[http]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Most connections open at once; beyond it new ones wait in the listen backlog.
    pub max_connections: usize,
    /// Most connections open at once from one client address; beyond it new ones are closed at
    /// once. 0: no per-address cap (behind a reverse proxy every peer is the proxy).
    pub max_connections_per_address: usize,
    /// Deadline for a request's headers (and an HTTP/1.1 keep-alive wait), seconds.
    pub header_read_timeout_seconds: u64,
    /// Deadline for reading a whole request body, seconds.
    pub body_read_timeout_seconds: u64,
    /// A connection on which nothing moved for this long, with no request being answered (from
    /// its arrival until its response head is ready), is closed, seconds.
    pub idle_timeout_seconds: u64,
    /// Header a trusted reverse proxy sets to the client's address; empty: the peer address.
    pub client_address_header: String,
}

impl HttpConfig {
    /// Checks the values; `Err((key, message))` names the offending key.
    pub fn validate(&self, sse_keep_alive_seconds: u64) -> Result<(), (String, String)> {
        let bad = |key: &str, message: &str| Err((format!("http.{key}"), message.to_owned()));
        if self.max_connections == 0 {
            return bad("max_connections", "must be at least 1");
        }
        if self.header_read_timeout_seconds == 0 {
            return bad("header_read_timeout_seconds", "must be at least 1");
        }
        if self.body_read_timeout_seconds == 0 {
            return bad("body_read_timeout_seconds", "must be at least 1");
        }
        if self.idle_timeout_seconds <= sse_keep_alive_seconds {
            return bad(
                "idle_timeout_seconds",
                "must be longer than mcp.sse_keep_alive_seconds (an open MCP stream sends a \
                 keep-alive that often and must not count as idle)",
            );
        }
        let header = &self.client_address_header;
        if !header.is_empty() && ::http::HeaderName::try_from(header.as_str()).is_err() {
            return bad("client_address_header", "is not a valid HTTP header name");
        }
        Ok(())
    }
}
