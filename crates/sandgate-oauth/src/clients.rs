//! Clients: dynamic client registration (RFC 7591), client-ID metadata documents fetched from
//! the client's URL (with SSRF guards), and the lookup the other endpoints share.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use sandgate_auth::client::{self, ClientMetadata};
use sandgate_service::grants::{Client, GrantError, Registered};

use super::ratelimit::{ClientAddress, Limited};
use crate::AppState;

/// Why a client id could not be turned into a client.
#[derive(Debug, thiserror::Error)]
pub enum ClientLookupError {
    /// No such client, and it is not a metadata-document URL.
    #[error("unknown client_id {0:?}")]
    Unknown(String),
    /// Its metadata document could not be fetched or is invalid.
    #[error("the client's metadata document could not be used: {0}")]
    Document(String),
    /// Fetching its metadata document would exceed the caller's fetch rate.
    #[error("{}", .0.message())]
    Limited(Limited),
    /// The service failed (Postgres).
    #[error(transparent)]
    Grant(#[from] GrantError),
}

/// Finds a client by id; a client id that is a metadata-document URL is fetched (and cached for
/// `oauth.client_metadata.cache_seconds`; a failure is remembered for
/// `oauth.limits.metadata_failure_cache_seconds`). Fetches count against `address`'s rate.
pub async fn lookup(
    state: &AppState,
    client_id: &str,
    address: ClientAddress,
) -> Result<Client, ClientLookupError> {
    let meta = &state.config.oauth.client_metadata;
    if let Some(stored) = state.grants.stored_client(client_id).await? {
        return Ok(stored);
    }
    if !meta.enabled || !client::is_metadata_document_url(client_id, meta.allow_private_addresses) {
        return Err(ClientLookupError::Unknown(client_id.to_owned()));
    }
    let limits = &state.oauth.limits;
    if let Some(why) = limits.failed_document(client_id) {
        return Err(ClientLookupError::Document(why));
    }
    limits
        .metadata_fetch_from(address)
        .map_err(ClientLookupError::Limited)?;
    let valid = fetch_document(state, client_id).await.and_then(|document| {
        client::validate_metadata_document(client_id, &document)
            .map_err(|e| ClientLookupError::Document(e.to_string()))
    });
    let valid = match valid {
        Ok(valid) => valid,
        Err(ClientLookupError::Document(why)) => {
            limits.remember_failed_document(client_id, &why);
            return Err(ClientLookupError::Document(why));
        }
        Err(err) => return Err(err),
    };
    Ok(state.grants.save_document_client(client_id, &valid).await?)
}

#[tracing::instrument(skip_all, fields(client_id = url))]
async fn fetch_document(state: &AppState, url: &str) -> Result<ClientMetadata, ClientLookupError> {
    let meta = &state.config.oauth.client_metadata;
    let fail = |why: String| ClientLookupError::Document(why);
    let parsed = url::Url::parse(url).map_err(|e| fail(e.to_string()))?;
    // An IP literal never reaches the resolver, so it is checked here.
    let literal = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => Some(IpAddr::V4(ip)),
        Some(url::Host::Ipv6(ip)) => Some(IpAddr::V6(ip)),
        _ => None,
    };
    if let Some(ip) = literal
        && !meta.allow_private_addresses
        && !is_public(ip)
    {
        return Err(fail("its address is not a public one".into()));
    }
    let mut response = state
        .oauth
        .metadata_http
        .get(url)
        .header("accept", "application/json")
        .send()
        .await
        .map_err(|e| fail(format!("fetching it failed: {}", causes(&e))))?;
    if !response.status().is_success() {
        return Err(fail(format!(
            "fetching it returned HTTP {}",
            response.status()
        )));
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| fail(format!("reading it failed: {e}")))?
    {
        if body.len() + chunk.len() > meta.max_bytes {
            return Err(fail(format!("it is larger than {} bytes", meta.max_bytes)));
        }
        body.extend_from_slice(&chunk);
    }
    serde_json::from_slice(&body).map_err(|e| fail(format!("it is not valid JSON metadata: {e}")))
}

/// An error with its causes, `outer: inner: innermost` (reqwest hides the resolver's reason in
/// the chain).
fn causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(inner) = source {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        source = inner.source();
    }
    text
}

/// The HTTP client for metadata documents: no redirects, no proxies, a whole-request timeout,
/// and (unless `allow_private`) a resolver that refuses names resolving to private, loopback,
/// link-local or otherwise non-public addresses (DNS rebinding cannot slip past: the
/// connection uses exactly the addresses checked).
pub fn metadata_client(allow_private: bool, timeout: Duration) -> reqwest::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(timeout)
        .connect_timeout(timeout)
        .user_agent(concat!("sandgate/", env!("CARGO_PKG_VERSION")));
    if !allow_private {
        builder = builder.dns_resolver(Arc::new(PublicOnlyResolver));
    }
    builder.build()
}

struct PublicOnlyResolver;

impl reqwest::dns::Resolve for PublicOnlyResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0))
                .await?
                .filter(|a| is_public(a.ip()))
                .collect();
            if addrs.is_empty() {
                return Err(format!("{host} resolves to no public address").into());
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Whether an address is on the public internet (not loopback, private, link-local, shared,
/// documentation, multicast, reserved…).
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_documentation()
                || v4.is_multicast()
                || o[0] == 0
                || (o[0] == 100 && (64..128).contains(&o[1])) // shared address space (CGNAT)
                || (o[0] == 192 && o[1] == 0 && o[2] == 0) // IETF protocol assignments
                || (o[0] == 198 && (18..20).contains(&o[1])) // benchmarking
                || o[0] >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] == 0x2001 && s[1] == 0x0db8) // documentation
                || (s[0] == 0x64 && s[1] == 0xff9b)) // NAT64: may reach IPv4 private space
        }
    }
}

/// `POST /oauth/register` (RFC 7591 §3).
pub async fn register(
    State(state): State<AppState>,
    address: ClientAddress,
    body: axum::body::Bytes,
) -> Response {
    if !state.config.oauth.dynamic_registration {
        return registration_error(
            StatusCode::FORBIDDEN,
            "access_denied",
            "dynamic client registration is disabled on this server",
        );
    }
    if let Err(limited) = state.oauth.limits.register_from(address) {
        tracing::info!(
            retry_after = limited.retry_after_seconds(),
            "refused a registration: rate limit"
        );
        return limited.json("too_many_requests");
    }
    let meta: ClientMetadata = match serde_json::from_slice(&body) {
        Ok(meta) => meta,
        Err(e) => {
            return registration_error(
                StatusCode::BAD_REQUEST,
                "invalid_client_metadata",
                &format!("the body must be a JSON object of client metadata: {e}"),
            );
        }
    };
    let valid = match client::validate(&meta, true) {
        Ok(valid) => valid,
        Err(e) => return registration_error(StatusCode::BAD_REQUEST, e.code(), &e.to_string()),
    };
    let Registered {
        client,
        client_secret,
    } = match state.grants.register_client(&valid).await {
        Ok(registered) => registered,
        Err(err) => {
            super::log_failure(&err);
            return registration_error(
                StatusCode::SERVICE_UNAVAILABLE,
                "temporarily_unavailable",
                "registration failed; retry later",
            );
        }
    };
    let mut answer = serde_json::json!({
        "client_id": client.id,
        "client_id_issued_at": client.created_at.timestamp(),
        "client_name": client.name,
        "redirect_uris": client.redirect_uris,
        "grant_types": client.grant_types,
        "response_types": ["code"],
        "token_endpoint_auth_method": client.auth_method,
    });
    if let Some(scopes) = &client.scopes {
        answer["scope"] = scopes.clone().into();
    }
    if let Some(secret) = client_secret {
        answer["client_secret"] = secret.into();
        answer["client_secret_expires_at"] = 0.into();
    }
    (StatusCode::CREATED, Json(answer)).into_response()
}

fn registration_error(status: StatusCode, code: &str, description: &str) -> Response {
    (
        status,
        Json(serde_json::json!({ "error": code, "error_description": description })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_public_addresses_pass() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            assert!(!is_public(ip.parse().unwrap()), "{ip} must be refused");
        }
        for ip in ["93.184.216.34", "2606:4700:4700::1111", "1.1.1.1"] {
            assert!(is_public(ip.parse().unwrap()), "{ip} is public");
        }
    }
}
