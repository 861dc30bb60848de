//! OAuth clients: registration metadata (RFC 7591), client-ID metadata documents
//! (draft-ietf-oauth-client-id-metadata-document, as used by the MCP authorization spec) and
//! redirect-URI rules (OAuth 2.1 §2.3.1, RFC 8252 §7: exact matching, no fragments).

use serde::Deserialize;
use url::Url;

use crate::Scope;

/// Longest client name kept; longer names are refused rather than cut (a consent screen must
/// show what the client really calls itself).
pub const MAX_CLIENT_NAME_CHARS: usize = 100;
/// Most redirect URIs one client may register.
pub const MAX_REDIRECT_URIS: usize = 10;
/// Longest redirect URI accepted, bytes.
pub const MAX_REDIRECT_URI_BYTES: usize = 2000;

/// How a client authenticates at the token endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMethod {
    /// A public client (native app, browser app, CLI): no secret; PKCE protects its codes.
    None,
    /// `Authorization: Basic` with the client secret.
    ClientSecretBasic,
    /// `client_secret` in the form body.
    ClientSecretPost,
}

impl AuthMethod {
    /// The RFC 7591 name.
    pub fn as_str(self) -> &'static str {
        match self {
            AuthMethod::None => "none",
            AuthMethod::ClientSecretBasic => "client_secret_basic",
            AuthMethod::ClientSecretPost => "client_secret_post",
        }
    }

    /// Parses an RFC 7591 name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(AuthMethod::None),
            "client_secret_basic" => Some(AuthMethod::ClientSecretBasic),
            "client_secret_post" => Some(AuthMethod::ClientSecretPost),
            _ => None,
        }
    }
}

/// Registration metadata as a client sends it (RFC 7591 §2); unknown fields are ignored as the
/// RFC asks.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ClientMetadata {
    /// Where codes may be sent.
    #[serde(default)]
    pub redirect_uris: Vec<String>,
    /// Human name, shown on the consent screen.
    #[serde(default)]
    pub client_name: Option<String>,
    /// Token endpoint authentication.
    #[serde(default)]
    pub token_endpoint_auth_method: Option<String>,
    /// Grant types it will use.
    #[serde(default)]
    pub grant_types: Option<Vec<String>>,
    /// Response types it will use.
    #[serde(default)]
    pub response_types: Option<Vec<String>>,
    /// Scopes it may ask for.
    #[serde(default)]
    pub scope: Option<String>,
    /// A client-ID metadata document names its own URL here.
    #[serde(default)]
    pub client_id: Option<String>,
    /// The client's home page.
    #[serde(default)]
    pub client_uri: Option<String>,
}

/// Metadata that passed validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidClient {
    /// Name shown to people.
    pub name: String,
    /// Registered redirect URIs, exactly as given.
    pub redirect_uris: Vec<String>,
    /// Token endpoint authentication.
    pub auth_method: AuthMethod,
    /// Grant types (`authorization_code`, `refresh_token`).
    pub grant_types: Vec<String>,
    /// Scopes the client may ask for (None: any).
    pub scopes: Option<Vec<Scope>>,
}

/// Why metadata was refused: the RFC 7591 §3.2.2 error code and a description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// A redirect URI is unacceptable (`invalid_redirect_uri`).
    #[error("{0}")]
    InvalidRedirectUri(String),
    /// Other metadata is unacceptable (`invalid_client_metadata`).
    #[error("{0}")]
    InvalidMetadata(String),
}

impl ClientError {
    /// The RFC 7591 error code.
    pub fn code(&self) -> &'static str {
        match self {
            ClientError::InvalidRedirectUri(_) => "invalid_redirect_uri",
            ClientError::InvalidMetadata(_) => "invalid_client_metadata",
        }
    }
}

/// Checks a redirect URI a client wants to register: an absolute URI without fragment or
/// userinfo; `https`, `http` only on a loopback host (RFC 8252 §7.3), or a private-use scheme
/// with a dot in it (RFC 8252 §7.1, e.g. `com.example.app:/cb`).
pub fn check_redirect_uri(uri: &str) -> Result<(), ClientError> {
    if uri.len() > MAX_REDIRECT_URI_BYTES {
        return Err(ClientError::InvalidRedirectUri(format!(
            "a redirect URI is {} bytes long; at most {MAX_REDIRECT_URI_BYTES} are accepted",
            uri.len()
        )));
    }
    let bad = |why: &str| ClientError::InvalidRedirectUri(format!("redirect URI {uri:?} {why}"));
    let url = Url::parse(uri).map_err(|_| bad("is not an absolute URI"))?;
    if url.fragment().is_some() || uri.contains('#') {
        return Err(bad("must not contain a fragment"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad("must not contain userinfo"));
    }
    match url.scheme() {
        "https" => {
            if url.host().is_none() {
                return Err(bad("has no host"));
            }
        }
        "http" => {
            if !is_loopback_host(&url) {
                return Err(bad("uses http on a host that is not loopback; use https"));
            }
        }
        "javascript" | "data" | "file" | "vbscript" | "blob" | "about" => {
            return Err(bad("uses a forbidden scheme"));
        }
        scheme if scheme.contains('.') => {}
        _ => {
            return Err(bad(
                "must be https, http on a loopback address, or a reverse-domain private-use scheme",
            ));
        }
    }
    Ok(())
}

fn is_loopback_host(url: &Url) -> bool {
    match url.host() {
        Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    }
}

/// Exact redirect-URI matching (OAuth 2.1 §4.1.3): the string given must equal a registered one
/// character for character. No normalisation: a trailing slash, a change of case, an extra query
/// parameter or added userinfo is a different URI.
pub fn redirect_uri_matches(registered: &[String], given: &str) -> bool {
    registered.iter().any(|r| r == given)
}

/// Validates registration metadata (RFC 7591 §2). `secret_allowed` is false for client-ID
/// metadata documents, whose clients cannot hold a secret we issued.
pub fn validate(meta: &ClientMetadata, secret_allowed: bool) -> Result<ValidClient, ClientError> {
    let invalid = |m: String| ClientError::InvalidMetadata(m);
    if meta.redirect_uris.is_empty() {
        return Err(ClientError::InvalidRedirectUri(
            "redirect_uris is required and must not be empty".into(),
        ));
    }
    if meta.redirect_uris.len() > MAX_REDIRECT_URIS {
        return Err(ClientError::InvalidRedirectUri(format!(
            "at most {MAX_REDIRECT_URIS} redirect URIs"
        )));
    }
    for uri in &meta.redirect_uris {
        check_redirect_uri(uri)?;
    }
    let auth_method = match meta.token_endpoint_auth_method.as_deref() {
        // RFC 7591 §2 makes client_secret_basic the default; MCP clients that want no secret say
        // "none". A client-ID metadata document cannot receive a secret, so it defaults to none.
        None if secret_allowed => AuthMethod::ClientSecretBasic,
        None => AuthMethod::None,
        Some(m) => AuthMethod::parse(m).ok_or_else(|| {
            invalid(format!(
                "token_endpoint_auth_method {m:?} is not supported; use none, client_secret_basic or client_secret_post"
            ))
        })?,
    };
    if !secret_allowed && auth_method != AuthMethod::None {
        return Err(invalid(
            "a client-ID metadata document must use token_endpoint_auth_method \"none\"".into(),
        ));
    }
    let grant_types = meta
        .grant_types
        .clone()
        .unwrap_or_else(|| vec!["authorization_code".into()]);
    for g in &grant_types {
        if g != "authorization_code" && g != "refresh_token" {
            return Err(invalid(format!(
                "grant type {g:?} cannot be registered; use authorization_code and refresh_token"
            )));
        }
    }
    if !grant_types.iter().any(|g| g == "authorization_code") {
        return Err(invalid(
            "grant_types must include authorization_code".into(),
        ));
    }
    if let Some(types) = &meta.response_types
        && types.iter().any(|t| t != "code")
    {
        return Err(invalid("response_types must be [\"code\"]".into()));
    }
    let scopes = match &meta.scope {
        Some(s) => Some(Scope::parse_list(s).map_err(|e| invalid(e.to_string()))?),
        None => None,
    };
    let name = meta
        .client_name
        .as_deref()
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .unwrap_or_else(|| "Unnamed app".to_owned());
    if name.chars().count() > MAX_CLIENT_NAME_CHARS {
        return Err(invalid(format!(
            "client_name must be at most {MAX_CLIENT_NAME_CHARS} characters"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid(
            "client_name must not contain control characters".into(),
        ));
    }
    Ok(ValidClient {
        name,
        redirect_uris: meta.redirect_uris.clone(),
        auth_method,
        grant_types,
        scopes,
    })
}

/// Whether a `client_id` is a client-ID metadata document URL: `https` (or `http` when
/// `allow_http`, for tests) with a path other than `/`, no fragment, no userinfo, no dot
/// segments.
pub fn is_metadata_document_url(client_id: &str, allow_http: bool) -> bool {
    let Ok(url) = Url::parse(client_id) else {
        return false;
    };
    let scheme_ok = url.scheme() == "https" || (allow_http && url.scheme() == "http");
    scheme_ok
        && url.host().is_some()
        && url.fragment().is_none()
        && url.username().is_empty()
        && url.password().is_none()
        && url.path() != "/"
        && !client_id.contains("/./")
        && !client_id.contains("/../")
        // The URL must be exactly as given: no normalisation hides in a client id.
        && url.as_str() == client_id
}

/// Validates a fetched client-ID metadata document for `url`: its `client_id` must be that URL.
pub fn validate_metadata_document(
    url: &str,
    meta: &ClientMetadata,
) -> Result<ValidClient, ClientError> {
    if meta.client_id.as_deref() != Some(url) {
        return Err(ClientError::InvalidMetadata(format!(
            "the metadata document's client_id must be its own URL {url:?}"
        )));
    }
    validate(meta, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CB: &str = "https://app.example/callback";

    #[test]
    fn only_the_exact_registered_uri_matches() {
        let registered = vec![CB.to_owned()];
        assert!(redirect_uri_matches(&registered, CB));
        for variant in [
            "https://app.example/callback/",
            "https://APP.example/callback",
            "https://app.example/Callback",
            "https://app.example/callback?x=1",
            "https://user@app.example/callback",
            "https://evil.example/callback",
            "https://app.example.evil.example/callback",
        ] {
            assert!(!redirect_uri_matches(&registered, variant), "{variant}");
        }
    }

    #[test]
    fn registration_refuses_unsafe_redirect_uris() {
        for (uri, ok) in [
            (CB, true),
            ("http://127.0.0.1:33418/callback", true),
            ("http://localhost/cb", true),
            ("http://[::1]:8000/cb", true),
            ("com.example.app:/oauth", true),
            ("http://app.example/cb", false),
            ("https://app.example/cb#frag", false),
            ("https://u:p@app.example/cb", false),
            ("javascript:alert(1)", false),
            ("myapp:/cb", false),
            ("/relative", false),
        ] {
            assert_eq!(check_redirect_uri(uri).is_ok(), ok, "{uri}");
        }
        let long = format!("{CB}?{}", "a".repeat(MAX_REDIRECT_URI_BYTES));
        let err = check_redirect_uri(&long).unwrap_err().to_string();
        assert!(err.contains("at most 2000"), "{err}");
        assert!(err.len() < 200, "a long URI is not echoed back: {err}");
    }

    #[test]
    fn metadata_defaults_and_refusals() {
        let meta = ClientMetadata {
            redirect_uris: vec![CB.into()],
            client_name: Some("Claude".into()),
            token_endpoint_auth_method: Some("none".into()),
            ..Default::default()
        };
        let client = validate(&meta, true).unwrap();
        assert_eq!(client.auth_method, AuthMethod::None);
        assert_eq!(client.grant_types, vec!["authorization_code".to_owned()]);
        let mut bad = meta.clone();
        bad.grant_types = Some(vec!["password".into()]);
        assert_eq!(
            validate(&bad, true).unwrap_err().code(),
            "invalid_client_metadata"
        );
        let mut bad = meta.clone();
        bad.redirect_uris = vec![];
        assert_eq!(
            validate(&bad, true).unwrap_err().code(),
            "invalid_redirect_uri"
        );
        let mut secret = meta.clone();
        secret.token_endpoint_auth_method = Some("client_secret_post".into());
        assert!(
            validate(&secret, false).is_err(),
            "CIMD clients hold no secret"
        );
    }

    #[test]
    fn metadata_document_urls() {
        assert!(is_metadata_document_url(
            "https://app.example/oauth/client.json",
            false
        ));
        assert!(!is_metadata_document_url("https://app.example/", false));
        assert!(!is_metadata_document_url(
            "http://app.example/c.json",
            false
        ));
        assert!(is_metadata_document_url("http://127.0.0.1:9/c.json", true));
        assert!(!is_metadata_document_url(
            "https://app.example/a/../c.json",
            false
        ));
        assert!(!is_metadata_document_url("not a url", false));
    }
}
