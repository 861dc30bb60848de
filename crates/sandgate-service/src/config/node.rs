//! `[node]`: the sandbox node's RPC listener, its certificates, heartbeat and capacity
//! (docs/scale-out.md).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;
use validator::Validate;

use super::ConfigError;

/// The node side of a process: what `sandgate node` (and `sandgate serve` with `listen` set)
/// serves to gateways.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// The RPC address; empty: no RPC listener (`sandgate serve`'s node is then only its own).
    pub listen: String,
    /// What gateways dial; empty: `https://<listen>`.
    pub advertise_url: String,
    /// This process's certificate (PEM): presented as the node's server certificate, and as a
    /// gateway's client certificate.
    pub tls_cert: PathBuf,
    /// The key of `tls_cert` (PEM).
    pub tls_key: PathBuf,
    /// The deployment's private CA (PEM): peers must hold a certificate it signed.
    pub tls_ca: PathBuf,
    /// The CA's certificate revocation list (PEM); empty: none. Read again when it changes.
    pub tls_crl: PathBuf,
    /// How often the node heartbeats in Postgres, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub heartbeat_seconds: u64,
    /// A node silent this long is away (no new lease; calls on its sandboxes get a retryable
    /// answer naming it; their rows stay), seconds.
    pub away_after_seconds: u64,
    /// A node silent this long is lost (the sweep marks its sandboxes lost), seconds.
    pub lost_after_seconds: u64,
    /// Most leased sandboxes on the node; 0: the host's memory divided by the most one sandbox may
    /// use (`node_registry::derived_slots`).
    pub slots: u32,
    /// A draining node gets no new leases; its sandboxes run out.
    pub drain: bool,
    /// Most bytes the node holds at once for whole-file reads, over every gateway and tenant;
    /// a read beyond is refused with a retryable `capacity` error.
    #[validate(range(min = 1048576, message = "must be at least 1048576 (1 MiB)"))]
    pub read_bytes_in_flight: u64,
    /// Most bytes one whole-file read holds on the node (a bigger file is refused as too large).
    #[validate(range(min = 1024, message = "must be at least 1024"))]
    pub read_bytes_per_call: u64,
    /// Most bytes of images (decoded PNG) the node keeps from one cell.
    #[validate(range(min = 1024, message = "must be at least 1024"))]
    pub display_bytes_per_call: u64,
}

impl NodeConfig {
    /// The node's bounds on what it holds for calls.
    pub fn read_limits(&self) -> sandgate_node::ReadLimits {
        sandgate_node::ReadLimits {
            in_flight_bytes: self.read_bytes_in_flight,
            per_call_bytes: self.read_bytes_per_call,
            display_bytes_per_call: self.display_bytes_per_call,
        }
    }

    /// `(away_after_seconds, lost_after_seconds)`.
    pub fn liveness(&self) -> (u64, u64) {
        (self.away_after_seconds, self.lost_after_seconds)
    }

    /// The RPC address, when one is configured.
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        if self.listen.is_empty() {
            return None;
        }
        self.listen.parse().ok()
    }

    /// Whether the three TLS paths are set.
    pub fn has_tls(&self) -> bool {
        [&self.tls_cert, &self.tls_key, &self.tls_ca]
            .iter()
            .all(|p| !p.as_os_str().is_empty())
    }

    /// The node RPC's TLS material (`tls_cert`, `tls_key`, `tls_ca`, `tls_crl`), read again
    /// whenever a file changes; `None` without TLS.
    pub fn tls(&self) -> Result<Option<sandgate_node::NodeTls>, sandgate_node::TlsError> {
        if !self.has_tls() {
            return Ok(None);
        }
        let crl = Some(self.tls_crl.as_path()).filter(|p| !p.as_os_str().is_empty());
        sandgate_node::NodeTls::from_files_with_crl(
            &self.tls_cert,
            &self.tls_key,
            &self.tls_ca,
            crl,
        )
        .map(Some)
    }

    /// The URL gateways dial: `advertise_url`, else derived from `listen`.
    pub fn advertise_url(&self) -> Option<String> {
        if !self.advertise_url.is_empty() {
            return Some(self.advertise_url.clone());
        }
        let scheme = if self.has_tls() { "https" } else { "http" };
        self.listen_addr().map(|a| format!("{scheme}://{a}"))
    }

    pub(super) fn check_together(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: key.to_owned(),
            message,
        };
        let tls_set = [&self.tls_cert, &self.tls_key, &self.tls_ca]
            .iter()
            .filter(|p| !p.as_os_str().is_empty())
            .count();
        if tls_set != 0 && tls_set != 3 {
            return Err(invalid(
                "node.tls_cert",
                "node.tls_cert, node.tls_key and node.tls_ca go together: set all three or none"
                    .into(),
            ));
        }
        // Every process with a node heartbeats, and every process sweeps silent nodes.
        if self.away_after_seconds <= self.heartbeat_seconds {
            return Err(invalid(
                "node.away_after_seconds",
                format!(
                    "must be longer than node.heartbeat_seconds ({}), e.g. three heartbeats",
                    self.heartbeat_seconds
                ),
            ));
        }
        if self.lost_after_seconds < self.away_after_seconds {
            return Err(invalid(
                "node.lost_after_seconds",
                format!(
                    "must be at least node.away_after_seconds ({}): a node is away before it is \
                     lost",
                    self.away_after_seconds
                ),
            ));
        }
        if self.listen.is_empty() {
            return Ok(());
        }
        let Ok(addr) = self.listen.parse::<SocketAddr>() else {
            return Err(invalid(
                "node.listen",
                format!("{:?} is not an address like 127.0.0.1:7443", self.listen),
            ));
        };
        if !addr.ip().is_loopback() && !self.has_tls() {
            return Err(invalid(
                "node.listen",
                format!(
                    "{addr} is reachable from other hosts: set node.tls_cert, node.tls_key and \
                     node.tls_ca (mutual TLS with the deployment's CA) or listen on 127.0.0.1"
                ),
            ));
        }
        if let Some(url) = self.advertise_url() {
            check_advertise_url(&url, self.has_tls())
                .map_err(|why| invalid("node.advertise_url", format!("{url:?} {why}")))?;
        }
        Ok(())
    }
}

/// Whether `url` is one a gateway will dial for this node: `https://host[:port]` with TLS, or
/// `http://` to 127.0.0.1, [::1] or localhost without (gateways dial nothing else in cleartext);
/// no path, query or user. Why not, when not.
pub fn check_advertise_url(url: &str, tls: bool) -> Result<(), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("is not a URL like https://node-1.example:7443 ({e})"))?;
    let host = uri
        .host()
        .filter(|h| !h.is_empty())
        .ok_or("names no host")?;
    if uri.path_and_query().is_some_and(|p| p.as_str() != "/") || url.contains('@') {
        return Err("must be scheme://host[:port] only (no path, query or user)".into());
    }
    match (uri.scheme_str(), tls) {
        (Some("https"), true) => Ok(()),
        (Some("https"), false) => Err(
            "is https:// but node.tls_cert, node.tls_key and node.tls_ca are not set".into(),
        ),
        (Some("http"), true) => Err(
            "is http:// but this node serves TLS: advertise https:// and a name its certificate holds"
                .into(),
        ),
        (Some("http"), false) if sandgate_node::cleartext_allowed(url) => Ok(()),
        (Some("http"), false) => Err(format!(
            "is cleartext to {host}: gateways dial http:// only on 127.0.0.1, [::1] or localhost; \
             set node.tls_* and advertise https://"
        )),
        _ => Err("must start with https:// (or http:// on 127.0.0.1 without TLS)".into()),
    }
}
