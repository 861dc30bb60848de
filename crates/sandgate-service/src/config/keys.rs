//! `[keys]`: the deployment's secret (signing-key seeds sealed at rest, download links sealed)
//! and admin-issued tokens; `[links]`: download-link rate limits.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use validator::Validate;

/// Key settings (`[keys]`).
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct KeysConfig {
    /// The deployment's secret: the key-encryption key of the signing-key seeds in Postgres and
    /// the key of download links are derived from it. Empty: a fixed development secret,
    /// accepted only when the public URL and the listen address are both loopback.
    pub secret: SecretString,
    /// Longest lifetime of a token from `sandgate admin token issue`, seconds.
    #[validate(range(
        min = 60,
        max = 31_622_400,
        message = "must be between 60 and 31622400 (366 days): retired signing keys keep \
                   verifying that long"
    ))]
    pub admin_token_max_ttl_seconds: u64,
}

/// Download-link settings (`[links]`).
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct LinksConfig {
    /// Opens of one link per minute (also the burst); beyond: 429 + Retry-After.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub per_link_per_minute: u32,
    /// Opens of a tenant's links per minute (also the burst); beyond: 429 + Retry-After.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub per_tenant_per_minute: u32,
}

/// The least time a retired key keeps verifying: longer than any OAuth access token lives. It
/// keeps verifying longer when admin-issued tokens may live longer (`crate::keys::KeySettings`); `oauth.access_token_ttl_seconds` may
/// be no longer.
pub const RETIRED_KEY_GRACE: Duration = Duration::from_secs(24 * 3600);

/// The development secret used when `keys.secret` is empty on a loopback deployment. Public:
/// anything it protects is protected only by the host's loopback interface.
pub const DEVELOPMENT_SECRET: &str =
    "sandgate development secret: loopback only, never for a deployment reachable by others";

impl KeysConfig {
    /// The secret in force: the configured one, or the development secret on loopback.
    pub fn secret_bytes(&self) -> &[u8] {
        let secret = self.secret.expose_secret();
        if secret.is_empty() {
            DEVELOPMENT_SECRET.as_bytes()
        } else {
            secret.as_bytes()
        }
    }

    /// Checks the secret (by hand, not declared: a secret is not handed to the validator,
    /// whose errors carry the value they refused); `Err((key, message))` names the key.
    pub fn check_secret(&self, loopback: bool) -> Result<(), (String, String)> {
        let secret = self.secret.expose_secret();
        if secret.is_empty() && !loopback {
            return Err((
                "keys.secret".into(),
                "is required when the public URL or the listen address is not loopback: it encrypts the token-signing \
                 keys stored in Postgres and seals download links. Set SANDGATE_KEYS__SECRET (or \
                 keys.secret in the configuration file) to at least 32 random characters, e.g. \
                 the output of `openssl rand -base64 48`, the same on every replica"
                    .into(),
            ));
        }
        if !secret.is_empty() && secret.len() < 32 {
            return Err((
                "keys.secret".into(),
                "must be at least 32 characters (e.g. `openssl rand -base64 48`)".into(),
            ));
        }
        Ok(())
    }
}
