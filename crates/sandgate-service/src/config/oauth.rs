//! `[oauth]`: the OAuth 2.1 authorization server (DESIGN §6) and `[oauth.client_metadata]`;
//! `[oauth.limits]` is `oauth_limits.rs`.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use validator::{Validate, ValidationError};

use super::validation::problem;
use super::{ConfigError, OAuthLimitsConfig, RETIRED_KEY_GRACE};

/// OAuth authorization-server settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct OAuthConfig {
    /// Access token lifetime, seconds.
    #[validate(
        range(min = 1, message = "must be at least 1"),
        custom(function = within_key_grace)
    )]
    pub access_token_ttl_seconds: u64,
    /// Refresh token lifetime, seconds (each rotation starts a new one).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub refresh_token_ttl_seconds: u64,
    /// Authorization code lifetime, seconds.
    #[validate(range(
        min = 1,
        max = 600,
        message = "must be between 1 and 600 (codes are short-lived)"
    ))]
    pub code_ttl_seconds: u64,
    /// Browser session lifetime, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub session_ttl_seconds: u64,
    /// Key for signing session cookies; empty: a random key per process.
    pub cookie_secret: SecretString,
    /// Whether clients may register themselves (RFC 7591).
    pub dynamic_registration: bool,
    /// Client-ID metadata documents.
    #[validate(nested)]
    pub client_metadata: ClientMetadataConfig,
    /// Limits on the unauthenticated endpoints.
    #[validate(nested)]
    pub limits: OAuthLimitsConfig,
}

/// An access token outlives no retired key: it must verify until it expires.
fn within_key_grace(seconds: u64) -> Result<(), ValidationError> {
    let grace = RETIRED_KEY_GRACE.as_secs();
    if seconds > grace {
        return Err(problem(format!(
            "must be at most {grace} (a rotated key verifies that long)"
        )));
    }
    Ok(())
}

impl OAuthConfig {
    /// Checks the cookie secret's length. By hand, not declared: a secret is not handed to
    /// the validator, whose errors carry the value they refused.
    pub(super) fn check_cookie_secret(&self) -> Result<(), ConfigError> {
        let secret = self.cookie_secret.expose_secret();
        if !secret.is_empty() && secret.len() < 32 {
            return Err(ConfigError::Invalid {
                key: "oauth.cookie_secret".into(),
                message: "must be empty or at least 32 characters".into(),
            });
        }
        Ok(())
    }
}

/// Fetching client-ID metadata documents.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct ClientMetadataConfig {
    /// Whether `client_id` URLs are accepted at all.
    pub enabled: bool,
    /// Allow http URLs and private, loopback and link-local addresses (tests only).
    pub allow_private_addresses: bool,
    /// Whole-fetch timeout, milliseconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub fetch_timeout_ms: u64,
    /// Largest document, bytes.
    #[validate(range(min = 512, message = "must be at least 512"))]
    pub max_bytes: usize,
    /// How long a fetched document is used before it is fetched again, seconds.
    pub cache_seconds: u64,
}
