//! `[database]` (Postgres) and `[docker]` (the engine).

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use validator::Validate;

use super::ConfigError;

/// Postgres settings.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Connection URL (secret: it may hold a password).
    pub url: SecretString,
    /// Most connections in the pool.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_connections: u32,
    /// How long a request waits for a connection, milliseconds.
    pub acquire_timeout_ms: u64,
    /// Whether `serve` and the admin commands apply pending migrations (else they only check the
    /// schema: [`sandgate_store::schema::check`]).
    pub auto_migrate: bool,
}

impl DatabaseConfig {
    /// Checks the URL. By hand, not declared: a secret is not handed to the validator, whose
    /// errors carry the value they refused.
    pub(super) fn check_url(&self) -> Result<(), ConfigError> {
        let url = self.url.expose_secret();
        let message = if url.is_empty() {
            "no Postgres URL: set SANDGATE_DATABASE__URL or DATABASE_URL (scripts/stack.sh prints one)"
        } else if !url.starts_with("postgres") {
            "must be a postgres:// or postgresql:// URL"
        } else {
            return Ok(());
        };
        Err(ConfigError::Invalid {
            key: "database.url".into(),
            message: message.into(),
        })
    }
}

/// The lean engine's settings (`[lean]`): used by a node whose profile's runtime is `lean`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeanSettings {
    /// Where the node unpacks each sandbox image's root filesystem, once per image version.
    pub dir: std::path::PathBuf,
    /// The lean engine's library (`libsandgate_lean.so`); empty: next to the running binary.
    pub library: String,
}

/// Docker engine settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerConfig {
    /// Engine address; empty means the local default.
    pub host: String,
}
