//! Configuration: built-in defaults → optional file → environment, validated as a whole.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use sandgate_sandbox::SandboxProfile;
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use url::Url;

mod http;
mod keys;
mod node;
mod oauth_limits;
mod packages;
mod retention;

pub use http::HttpConfig;
pub use keys::{DEVELOPMENT_SECRET, KeysConfig, LinksConfig, RETIRED_KEY_GRACE};
pub use node::NodeConfig;
pub use oauth_limits::OAuthLimitsConfig;
pub use packages::PackagesConfig;
pub use retention::RetentionConfig;

/// The defaults, with a comment on every key (the repository's `config/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../../../config/default.toml");

/// The whole configuration of a gateway process.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP server binds.
    pub listen: SocketAddr,
    /// The URL clients reach the gateway at; empty in the file means "derive from `listen`".
    #[serde(deserialize_with = "empty_url_is_none")]
    public_url: Option<Url>,
    /// Deployment name (container labels).
    pub instance: String,
    /// Postgres.
    pub database: DatabaseConfig,
    /// The Docker engine.
    pub docker: DockerConfig,
    /// The sandbox profile.
    pub sandbox: SandboxProfile,
    /// The warm pool.
    pub pool: PoolConfig,
    /// Default tenant limits and per-call bounds.
    pub limits: LimitsConfig,
    /// Reaper and reconciliation timing.
    pub lifecycle: LifecycleConfig,
    /// What is kept after a sandbox ends, for how long, and how much (transcripts).
    pub retention: RetentionConfig,
    /// The MCP endpoint.
    pub mcp: McpConfig,
    /// Connections: caps and timeouts.
    pub http: HttpConfig,
    /// The OAuth 2.1 authorization server (DESIGN §6).
    pub oauth: OAuthConfig,
    /// The deployment's secret and admin-issued tokens.
    pub keys: KeysConfig,
    /// Download links.
    pub links: LinksConfig,
    /// Logging.
    pub log: LogConfig,
    /// Packages on demand (`pip install` in a sandbox).
    pub packages: PackagesConfig,
    /// The sandbox node: its RPC listener, certificates, heartbeat, capacity.
    pub node: NodeConfig,
}

/// Postgres settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// Connection URL (secret: it may hold a password).
    pub url: SecretString,
    /// Most connections in the pool.
    pub max_connections: u32,
    /// How long a request waits for a connection, milliseconds.
    pub acquire_timeout_ms: u64,
}

/// Docker engine settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DockerConfig {
    /// Engine address; empty means the local default.
    pub host: String,
}

/// Warm pool settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Ready containers kept waiting however low the demand (the floor).
    pub min_ready: usize,
    /// Ready containers kept waiting at most however high the demand (the ceiling).
    pub max_ready: usize,
    /// Most containers started at once; 0 adapts it to the machine.
    pub max_concurrent_starts: usize,
    /// The window the lease rate is measured over: how long the pool stays grown after demand
    /// stops, seconds.
    pub demand_window_seconds: u64,
    /// How long a cold start waits for its place among the starts run at once before
    /// `create_sandbox` is refused with a retryable limit, seconds.
    pub start_wait_seconds: u64,
}

/// Processes one call in a sandbox may need at once (an agent thread, a shell, the command):
/// `limits.max_calls_per_sandbox` times this must fit in `sandbox.pids_limit`.
pub const PIDS_PER_CALL: i64 = 4;

/// Default tenant limits and per-call bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitsConfig {
    /// Most live sandboxes per tenant.
    pub max_sandboxes: u32,
    /// Default idle timeout, seconds.
    pub idle_timeout_seconds: u32,
    /// Longest idle timeout a caller may ask for, seconds.
    pub max_idle_timeout_seconds: u32,
    /// Hard lifetime, seconds.
    pub max_lifetime_seconds: u32,
    /// Most tool calls per tenant per minute.
    pub max_calls_per_minute: u32,
    /// Longest per-call timeout, seconds.
    pub max_call_timeout_seconds: u32,
    /// Per-call timeout when none is given, seconds.
    pub default_call_timeout_seconds: u32,
    /// Output kept per cell or command, bytes.
    pub output_limit_bytes: usize,
    /// Largest file moved by get_file / upload_file, bytes.
    pub max_file_bytes: u64,
    /// Largest file get_file returns inline; bigger ones come as a resource link, bytes.
    pub inline_file_bytes: u64,
    /// Most open MCP sessions (2025-11-25 era) per tenant.
    pub max_sessions: u32,
    /// Most tool calls per tenant running at once, across replicas.
    pub max_calls_in_flight: u32,
    /// Most tool calls running at once in one sandbox (below what its pids limit carries).
    pub max_calls_per_sandbox: u32,
    /// How long a call's in-flight slot outlives a replica that died mid-call, seconds (a live
    /// call renews its slot every third of this).
    pub call_slot_ttl_seconds: u32,
}

/// Reaper and reconciliation timing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    /// Reaper interval, milliseconds.
    pub reaper_interval_ms: u64,
    /// Reconciliation interval, seconds.
    pub reconcile_interval_seconds: u64,
    /// Age below which an unknown container is left alone, seconds.
    pub orphan_grace_seconds: u64,
}

/// MCP endpoint settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// Largest request body, bytes.
    pub max_request_bytes: usize,
    /// SSE keep-alive interval, seconds.
    pub sse_keep_alive_seconds: u64,
    /// Extra allowed Origins.
    pub allowed_origins: Vec<String>,
    /// A 2025-11-25 session unused this long ends (and frees its tenant's session slot), seconds.
    pub session_idle_seconds: u64,
}

/// OAuth authorization-server settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuthConfig {
    /// Access token lifetime, seconds.
    pub access_token_ttl_seconds: u64,
    /// Refresh token lifetime, seconds (each rotation starts a new one).
    pub refresh_token_ttl_seconds: u64,
    /// Authorization code lifetime, seconds.
    pub code_ttl_seconds: u64,
    /// Browser session lifetime, seconds.
    pub session_ttl_seconds: u64,
    /// Key for signing session cookies; empty: a random key per process.
    pub cookie_secret: SecretString,
    /// Whether clients may register themselves (RFC 7591).
    pub dynamic_registration: bool,
    /// Client-ID metadata documents.
    pub client_metadata: ClientMetadataConfig,
    /// Limits on the unauthenticated endpoints.
    pub limits: OAuthLimitsConfig,
}

/// Fetching client-ID metadata documents.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientMetadataConfig {
    /// Whether `client_id` URLs are accepted at all.
    pub enabled: bool,
    /// Allow http URLs and private, loopback and link-local addresses (tests only).
    pub allow_private_addresses: bool,
    /// Whole-fetch timeout, milliseconds.
    pub fetch_timeout_ms: u64,
    /// Largest document, bytes.
    pub max_bytes: usize,
    /// How long a fetched document is used before it is fetched again, seconds.
    pub cache_seconds: u64,
}

/// Log settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// Output format.
    pub format: LogFormat,
    /// tracing filter directives.
    pub filter: String,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Text on a terminal, JSON otherwise.
    Auto,
    /// Human-readable text.
    Text,
    /// One JSON object per line.
    Json,
}

/// Configuration that could not be loaded; the message names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value could not be read or parsed.
    #[error("invalid configuration: {}", describe(.0))]
    Parse(#[from] Box<figment::Error>),
    /// Values parsed but do not make sense together or are out of range.
    #[error("invalid configuration: {key}: {message}")]
    Invalid {
        /// Dotted key, e.g. `sandbox.memory_mb`.
        key: String,
        /// What is wrong and what is accepted.
        message: String,
    },
}

impl Config {
    /// Loads the configuration: defaults, then `file` if given, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::from_figment(Self::figment(file, Self::env()))
    }

    /// The `SANDGATE_*` environment provider. Variables that belong to the scripts and the CLI
    /// rather than to the configuration (`SANDGATE_CONFIG`, `SANDGATE_CACHE`,
    /// `SANDGATE_PG_PORT`, and the test suite's `SANDGATE_TEST_*`) are skipped; any other unknown
    /// one is an error (a typo must not silently do nothing).
    pub fn env() -> Env {
        Env::prefixed("SANDGATE_")
            .ignore(&["config", "cache", "pg_port"])
            // SANDGATE_TEST_*: settings of the test suite (interpreter, runtime), not of the gateway.
            .filter(|key| !key.starts_with("test_"))
            .split("__")
    }

    /// The layered sources, with `env` as the top layer (tests pass their own).
    pub fn figment(file: Option<&Path>, env: Env) -> Figment {
        let mut figment = Figment::from(Toml::string(DEFAULT_TOML));
        if let Some(file) = file {
            figment = figment.merge(Toml::file_exact(file));
        }
        // DATABASE_URL is what every Postgres tool speaks; SANDGATE_DATABASE__URL still wins.
        if let Ok(url) = std::env::var("DATABASE_URL") {
            figment = figment.merge(Serialized::default("database.url", url));
        }
        figment.merge(env)
    }

    /// Extracts and validates a configuration from layered sources.
    pub fn from_figment(figment: Figment) -> Result<Self, ConfigError> {
        let config: Config = figment.extract().map_err(Box::new)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values together; the first problem is reported with its key.
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_basics()?;
        self.validate_limits()?;
        self.validate_mcp()?;
        self.validate_oauth()?;
        self.validate_lifecycle()?;
        self.node.validate()?;
        self.packages
            .validate()
            .map_err(|(key, message)| ConfigError::Invalid { key, message })
    }

    /// `database`, `instance` and `public_url`.
    fn validate_basics(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: key.to_owned(),
            message,
        };
        if self.database.url.expose_secret().is_empty() {
            return Err(invalid(
                "database.url",
                "no Postgres URL: set SANDGATE_DATABASE__URL or DATABASE_URL (scripts/stack.sh prints one)".into(),
            ));
        }
        if !self.database.url.expose_secret().starts_with("postgres") {
            return Err(invalid(
                "database.url",
                "must be a postgres:// or postgresql:// URL".into(),
            ));
        }
        if self.instance.is_empty()
            || !self
                .instance
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return Err(invalid(
                "instance",
                format!(
                    "{:?} must be non-empty letters, digits, '-', '_' or '.'",
                    self.instance
                ),
            ));
        }
        if self.database.max_connections == 0 {
            return Err(invalid(
                "database.max_connections",
                "must be at least 1".into(),
            ));
        }
        if let Some(url) = &self.public_url {
            if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
                return Err(invalid(
                    "public_url",
                    format!("{url} must be an http(s) URL with a host"),
                ));
            }
            if url.path() != "/" || url.query().is_some() {
                return Err(invalid(
                    "public_url",
                    format!(
                        "{url} must have no path or query; the MCP endpoint is <public_url>/mcp"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `limits`.
    fn validate_limits(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: key.to_owned(),
            message,
        };
        let l = &self.limits;
        for (key, value) in [
            ("limits.max_sandboxes", l.max_sandboxes),
            ("limits.idle_timeout_seconds", l.idle_timeout_seconds),
            (
                "limits.max_idle_timeout_seconds",
                l.max_idle_timeout_seconds,
            ),
            ("limits.max_lifetime_seconds", l.max_lifetime_seconds),
            ("limits.max_calls_per_minute", l.max_calls_per_minute),
            ("limits.max_sessions", l.max_sessions),
            ("limits.max_calls_in_flight", l.max_calls_in_flight),
            ("limits.max_calls_per_sandbox", l.max_calls_per_sandbox),
            (
                "limits.max_call_timeout_seconds",
                l.max_call_timeout_seconds,
            ),
            (
                "limits.default_call_timeout_seconds",
                l.default_call_timeout_seconds,
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1".into()));
            }
        }
        if l.idle_timeout_seconds > l.max_idle_timeout_seconds {
            return Err(invalid(
                "limits.idle_timeout_seconds",
                format!(
                    "{} exceeds limits.max_idle_timeout_seconds ({})",
                    l.idle_timeout_seconds, l.max_idle_timeout_seconds
                ),
            ));
        }
        if l.default_call_timeout_seconds > l.max_call_timeout_seconds {
            return Err(invalid(
                "limits.default_call_timeout_seconds",
                format!(
                    "{} exceeds limits.max_call_timeout_seconds ({})",
                    l.default_call_timeout_seconds, l.max_call_timeout_seconds
                ),
            ));
        }
        if l.output_limit_bytes < 1024 {
            return Err(invalid(
                "limits.output_limit_bytes",
                "must be at least 1024".into(),
            ));
        }
        // A call in a sandbox can take a thread of the agent, a shell and the command's own
        // process: leave the pids limit room for them all, plus the kernel and background jobs.
        let carried = self.sandbox.pids_limit / PIDS_PER_CALL;
        if i64::from(l.max_calls_per_sandbox) > carried {
            return Err(invalid(
                "limits.max_calls_per_sandbox",
                format!(
                    "{} is more than sandbox.pids_limit ({}) can carry; at most {carried} \
                     ({PIDS_PER_CALL} processes per call)",
                    l.max_calls_per_sandbox, self.sandbox.pids_limit
                ),
            ));
        }
        if l.call_slot_ttl_seconds < 3 {
            return Err(invalid(
                "limits.call_slot_ttl_seconds",
                "must be at least 3".into(),
            ));
        }
        Ok(())
    }

    /// `mcp`.
    fn validate_mcp(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: key.to_owned(),
            message,
        };
        if self.mcp.session_idle_seconds == 0 {
            return Err(invalid(
                "mcp.session_idle_seconds",
                "must be at least 1".into(),
            ));
        }
        for origin in &self.mcp.allowed_origins {
            let ok = Url::parse(origin).is_ok_and(|u| {
                u.host().is_some()
                    && u.path() == "/"
                    && u.as_str().trim_end_matches('/') == origin.trim_end_matches('/')
            });
            if !ok {
                return Err(invalid(
                    "mcp.allowed_origins",
                    format!("{origin:?} is not an origin (scheme://host[:port])"),
                ));
            }
        }
        Ok(())
    }

    /// `oauth`.
    fn validate_oauth(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: key.to_owned(),
            message,
        };
        let o = &self.oauth;
        for (key, value) in [
            ("oauth.access_token_ttl_seconds", o.access_token_ttl_seconds),
            (
                "oauth.refresh_token_ttl_seconds",
                o.refresh_token_ttl_seconds,
            ),
            ("oauth.code_ttl_seconds", o.code_ttl_seconds),
            ("oauth.session_ttl_seconds", o.session_ttl_seconds),
            (
                "oauth.client_metadata.fetch_timeout_ms",
                o.client_metadata.fetch_timeout_ms,
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1".into()));
            }
        }
        if o.access_token_ttl_seconds > RETIRED_KEY_GRACE.as_secs() {
            return Err(invalid(
                "oauth.access_token_ttl_seconds",
                format!(
                    "must be at most {} (a rotated key verifies that long)",
                    RETIRED_KEY_GRACE.as_secs()
                ),
            ));
        }
        if o.code_ttl_seconds > 600 {
            return Err(invalid(
                "oauth.code_ttl_seconds",
                "must be at most 600 (codes are short-lived)".into(),
            ));
        }
        let secret = o.cookie_secret.expose_secret();
        if !secret.is_empty() && secret.len() < 32 {
            return Err(invalid(
                "oauth.cookie_secret",
                "must be empty or at least 32 characters".into(),
            ));
        }
        // A per-process random cookie key would log users out at every replica change.
        if !self.is_loopback() && self.cookie_key().is_none() {
            return Err(invalid(
                "oauth.cookie_secret",
                "is required when the public URL is not loopback, unless keys.secret is set (the \
                 cookie key is then derived from it): a key of its own per process would not \
                 let one replica read another's login cookies. Set SANDGATE_KEYS__SECRET (or \
                 SANDGATE_OAUTH__COOKIE_SECRET) to at least 32 random characters, the same on \
                 every replica"
                    .into(),
            ));
        }
        if o.client_metadata.max_bytes < 512 {
            return Err(invalid(
                "oauth.client_metadata.max_bytes",
                "must be at least 512".into(),
            ));
        }
        Ok(())
    }

    /// `lifecycle`, `pool` and `sandbox`.
    fn validate_lifecycle(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            key: key.to_owned(),
            message,
        };
        if self.lifecycle.reaper_interval_ms < 100 {
            return Err(invalid(
                "lifecycle.reaper_interval_ms",
                "must be at least 100".into(),
            ));
        }
        if self.lifecycle.reconcile_interval_seconds == 0 {
            return Err(invalid(
                "lifecycle.reconcile_interval_seconds",
                "must be at least 1".into(),
            ));
        }
        if self.pool.start_wait_seconds < 1 {
            return Err(invalid(
                "pool.start_wait_seconds",
                "must be at least 1".into(),
            ));
        }
        if self.pool.demand_window_seconds < 6 {
            return Err(invalid(
                "pool.demand_window_seconds",
                format!(
                    "{} is too short; at least 6 (the short window is a sixth of it)",
                    self.pool.demand_window_seconds
                ),
            ));
        }
        if self.pool.max_ready < self.pool.min_ready {
            return Err(invalid(
                "pool.max_ready",
                format!(
                    "{} is below pool.min_ready ({}); the ceiling must be at least the floor",
                    self.pool.max_ready, self.pool.min_ready
                ),
            ));
        }
        self.http
            .validate(self.mcp.sse_keep_alive_seconds)
            .and_then(|()| self.oauth.limits.validate())
            .map_err(|(key, message)| invalid(&key, message))?;
        self.sandbox
            .validate()
            .map_err(|err| invalid(&format!("sandbox.{}", err.field()), err.to_string()))?;
        self.retention.validate()?;
        self.keys
            .validate(self.is_loopback())
            .and_then(|()| self.links.validate())
            .map_err(|(key, message)| invalid(&key, message))?;
        Ok(())
    }

    /// The public base URL, without a trailing slash.
    pub fn public_url(&self) -> String {
        match &self.public_url {
            Some(url) => url.as_str().trim_end_matches('/').to_owned(),
            None => format!("http://{}", self.listen),
        }
    }

    /// The MCP endpoint URL (`<public_url>/mcp`), also the access tokens' audience.
    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.public_url())
    }

    /// Whether the public URL is https (cookies are then `Secure` in any case).
    pub fn is_https(&self) -> bool {
        self.public_url
            .as_ref()
            .is_some_and(|u| u.scheme() == "https")
    }

    /// The key that signs login-session cookies, the same on every replica configured alike:
    /// from `oauth.cookie_secret` when set, else derived from `keys.secret` (domain-separated,
    /// so it is no other key derived from it). `None` only when neither is set, which
    /// validation allows on a loopback deployment alone: the caller then uses a random key per
    /// process (sessions end at a restart and are not shared between replicas).
    pub fn cookie_key(&self) -> Option<[u8; 32]> {
        use hmac::{Hmac, Mac};
        use sha2::Digest;
        let cookie_secret = self.oauth.cookie_secret.expose_secret();
        if !cookie_secret.is_empty() {
            return Some(sha2::Sha256::digest(cookie_secret.as_bytes()).into());
        }
        let secret = self.keys.secret.expose_secret();
        if secret.is_empty() {
            return None;
        }
        let mut mac =
            Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
        mac.update(b"sandgate login session cookies v1");
        Some(mac.finalize().into_bytes().into())
    }

    /// Whether the public host is a loopback address or `localhost`.
    pub fn is_loopback(&self) -> bool {
        match &self.public_url {
            Some(url) => match url.host() {
                Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
                Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
                Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
                None => false,
            },
            None => self.listen.ip().is_loopback(),
        }
    }

    /// A pool on `database.url` with the migrations applied (the operator commands' way in).
    pub async fn migrated_pool(
        &self,
    ) -> Result<sandgate_store::PgPool, sandgate_store::StoreError> {
        let db =
            sandgate_store::connect_lazy(self.database.url.expose_secret(), &self.pool_settings())?;
        sandgate_store::migrate(&db).await?;
        Ok(db)
    }

    /// The Postgres pool settings.
    pub fn pool_settings(&self) -> sandgate_store::PoolSettings {
        sandgate_store::PoolSettings {
            max_connections: self.database.max_connections,
            acquire_timeout: Duration::from_millis(self.database.acquire_timeout_ms),
        }
    }
}

/// Renders figment's errors with the key in the configuration's own spelling (`listen`,
/// `sandbox.memory_mb`) and the source it came from.
fn describe(err: &figment::Error) -> String {
    err.clone()
        .into_iter()
        .map(|e| {
            let key = e.path.join(".").to_lowercase();
            let source = e
                .metadata
                .as_ref()
                .map(|m| match &m.source {
                    Some(source) => format!(" (from {} {source})", m.name),
                    None => format!(" (from {})", m.name),
                })
                .unwrap_or_default();
            if key.is_empty() {
                format!("{}{source}", e.kind)
            } else {
                format!("{key}: {}{source}", e.kind)
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn empty_url_is_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Url>, D::Error> {
    let s = String::deserialize(d)?;
    if s.is_empty() {
        return Ok(None);
    }
    Url::parse(&s)
        .map(Some)
        .map_err(|e| serde::de::Error::custom(format!("{s:?} is not a URL: {e}")))
}

#[cfg(test)]
#[allow(clippy::result_large_err)] // figment's Jail closures must return figment::Error
mod tests {
    use figment::Jail;

    use super::*;

    fn load_in(jail: &Jail) -> Result<Config, ConfigError> {
        let _ = jail;
        // Config::env(): the same filter as production, so variables the test scripts export
        // (SANDGATE_TEST_PYTHON) do not break these tests.
        Config::from_figment(Config::figment(None, Config::env()))
    }

    #[test]
    fn defaults_load_once_a_database_is_named() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            let config = load_in(jail).expect("defaults are valid");
            assert_eq!(config.listen.to_string(), "127.0.0.1:8080");
            assert_eq!(config.mcp_url(), "http://127.0.0.1:8080/mcp");
            Ok(())
        });
    }

    #[test]
    fn the_sandbox_profiles_default_is_the_default_files() {
        let profile: SandboxProfile = Figment::from(Toml::string(DEFAULT_TOML))
            .extract_inner("sandbox")
            .expect("config/default.toml has a valid [sandbox] table");
        assert_eq!(
            profile,
            SandboxProfile::default(),
            "SandboxProfile::default() must say what config/default.toml's [sandbox] says"
        );
    }

    #[test]
    fn replicas_configured_alike_share_the_cookie_key_and_off_loopback_one_is_required() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_PUBLIC_URL", "https://mcp.example.com");
            jail.set_env("SANDGATE_KEYS__SECRET", "a".repeat(40));
            let first = load_in(jail).expect("valid").cookie_key();
            let second = load_in(jail).expect("valid").cookie_key();
            assert!(first.is_some(), "a key derived from keys.secret");
            assert_eq!(
                first, second,
                "two replicas with one keys.secret share the key"
            );
            jail.set_env("SANDGATE_KEYS__SECRET", "b".repeat(40));
            let other = load_in(jail).expect("valid").cookie_key();
            assert_ne!(
                first, other,
                "another deployment's secret gives another key"
            );
            jail.set_env("SANDGATE_OAUTH__COOKIE_SECRET", "c".repeat(40));
            let own = load_in(jail).expect("valid").cookie_key();
            assert!(
                own.is_some() && own != other,
                "oauth.cookie_secret wins when set"
            );
            Ok(())
        });
    }

    #[test]
    fn on_loopback_without_secrets_the_cookie_key_is_left_to_the_process() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            let config = load_in(jail).expect("defaults are valid");
            assert_eq!(config.cookie_key(), None);
            Ok(())
        });
    }

    #[test]
    fn off_loopback_without_secrets_start_up_is_refused_naming_a_setting() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_PUBLIC_URL", "https://mcp.example.com");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("oauth.cookie_secret") || err.contains("keys.secret"),
                "the refusal names the setting: {err}"
            );
            assert!(
                err.contains("SANDGATE_KEYS__SECRET"),
                "and says how to set it: {err}"
            );
            Ok(())
        });
    }

    #[test]
    fn a_bad_listen_address_names_the_key() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_LISTEN", "nonsense");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("listen: "),
                "error should name `listen`: {err}"
            );
            assert!(
                err.contains("SANDGATE_"),
                "error should say where the value came from: {err}"
            );
            Ok(())
        });
    }

    #[test]
    fn a_node_reachable_from_other_hosts_needs_tls_and_tls_comes_whole() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_NODE__LISTEN", "0.0.0.0:7443");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("node.listen") && err.contains("node.tls_ca"),
                "a reachable node without TLS names the keys: {err}"
            );
            jail.set_env("SANDGATE_NODE__LISTEN", "127.0.0.1:7443");
            let config = load_in(jail).expect("cleartext on loopback is allowed");
            assert_eq!(
                config.node.advertise_url().as_deref(),
                Some("http://127.0.0.1:7443")
            );
            jail.set_env("SANDGATE_NODE__TLS_CERT", "/etc/sandgate/node.crt");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("set all three or none"),
                "a partial TLS setting is refused: {err}"
            );
            Ok(())
        });
    }

    #[test]
    fn out_of_range_profile_values_name_the_key() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_SANDBOX__MEMORY_MB", "1");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("sandbox.memory_mb"),
                "error should name the key: {err}"
            );
            Ok(())
        });
    }

    #[test]
    fn calls_per_sandbox_must_fit_in_its_pids_limit() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_SANDBOX__PIDS_LIMIT", "64");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(err.contains("limits.max_calls_per_sandbox"), "{err}");
            assert!(err.contains("at most 16"), "{err}");
            jail.set_env("SANDGATE_LIMITS__MAX_CALLS_PER_SANDBOX", "16");
            assert!(load_in(jail).is_ok());
            Ok(())
        });
    }

    #[test]
    fn an_unknown_runtime_names_the_key_and_the_accepted_ones() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_SANDBOX__RUNTIME", "kata");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(err.contains("sandbox.runtime"), "{err}");
            assert!(err.contains("kata"), "{err}");
            assert!(err.contains("runc") && err.contains("runsc"), "{err}");
            jail.set_env("SANDGATE_SANDBOX__RUNTIME", "runsc");
            let config = load_in(jail).expect("runsc is accepted");
            assert_eq!(config.sandbox.runtime, sandgate_sandbox::OciRuntime::Runsc);
            Ok(())
        });
    }

    #[test]
    fn files_cannot_outlive_their_sandbox_and_the_error_says_why() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_RETENTION__FILES_SECONDS", "3600");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(err.contains("retention.files_seconds"), "{err}");
            assert!(err.contains("removed when the sandbox ends"), "{err}");
            Ok(())
        });
    }

    #[test]
    fn the_audit_trail_is_kept_at_least_a_day() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            assert_eq!(
                load_in(jail).expect("defaults").retention.audit_seconds,
                31_536_000
            );
            jail.set_env("SANDGATE_RETENTION__AUDIT_SECONDS", "3600");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(err.contains("retention.audit_seconds"), "{err}");
            assert!(err.contains("86400"), "{err}");
            jail.set_env("SANDGATE_RETENTION__AUDIT_SECONDS", "86400");
            assert_eq!(
                load_in(jail).expect("a day").retention.audit_seconds,
                86_400
            );
            Ok(())
        });
    }

    #[test]
    fn a_file_overrides_defaults_and_env_overrides_the_file() {
        Jail::expect_with(|jail| {
            jail.create_file(
                "sandgate.toml",
                "listen = \"127.0.0.1:9000\"\npublic_url = \"https://sandgate.example\"\n[pool]\nmin_ready = 5\n\
                 [keys]\nsecret = \"0123456789abcdefghijklmnopqrstuvwxyz\"\n",
            )?;
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_POOL__MIN_READY", "7");
            let config = Config::from_figment(Config::figment(
                Some(Path::new("sandgate.toml")),
                Config::env(),
            ))
            .expect("valid");
            assert_eq!(config.listen.port(), 9000);
            assert_eq!(config.pool.min_ready, 7);
            assert_eq!(config.mcp_url(), "https://sandgate.example/mcp");
            Ok(())
        });
    }

    #[test]
    fn off_loopback_a_secret_is_required_and_the_error_says_how_to_set_it() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_PUBLIC_URL", "https://sandgate.example");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("keys.secret") && err.contains("SANDGATE_KEYS__SECRET"),
                "{err}"
            );
            jail.set_env("SANDGATE_KEYS__SECRET", "too short");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(err.contains("at least 32 characters"), "{err}");
            jail.set_env(
                "SANDGATE_KEYS__SECRET",
                "0123456789abcdefghijklmnopqrstuvwxyz",
            );
            load_in(jail).expect("a long enough secret");
            Ok(())
        });
    }

    #[test]
    fn unknown_keys_are_refused() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env("SANDGATE_POOL__MIN_REDY", "7");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("min_redy"),
                "error should name the unknown key: {err}"
            );
            Ok(())
        });
    }
}
