//! Configuration: built-in defaults → optional file → environment, validated as a whole.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};
use sandgate_sandbox::SandboxProfile;
use secrecy::ExposeSecret;
use serde::Deserialize;
use url::Url;
use validator::{Validate, ValidationError};

use validation::problem;

mod database;
mod egress;
mod http;
mod keys;
mod lifecycle;
mod limits;
mod mcp;
mod node;
mod oauth;
mod oauth_limits;
mod packages;
mod retention;
mod snapshots;
mod validation;

pub use database::{DatabaseConfig, DockerConfig, LeanSettings};
pub use egress::EgressConfig;
pub use http::HttpConfig;
pub use keys::{DEVELOPMENT_SECRET, KeysConfig, LinksConfig, RETIRED_KEY_GRACE};
pub use lifecycle::{LifecycleConfig, PoolConfig};
pub use limits::{LimitsConfig, PIDS_PER_CALL};
pub use mcp::McpConfig;
pub use node::{NodeConfig, check_advertise_url};
pub use oauth::{ClientMetadataConfig, OAuthConfig};
pub use oauth_limits::OAuthLimitsConfig;
pub use packages::PackagesConfig;
pub use retention::RetentionConfig;
pub use snapshots::{S3StoreConfig, SnapshotsConfig, StoreKind, StoreSettings};

/// The defaults, with a comment on every key (the repository's `config/default.toml`).
pub const DEFAULT_TOML: &str = include_str!("../../../../config/default.toml");

/// The whole configuration of a gateway process.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP server binds.
    pub listen: SocketAddr,
    /// The URL clients reach the gateway at; empty in the file means "derive from `listen`".
    #[serde(deserialize_with = "empty_url_is_none")]
    #[validate(custom(function = an_origin_url))]
    public_url: Option<Url>,
    /// Deployment name (container labels).
    #[validate(custom(function = a_label))]
    pub instance: String,
    /// Postgres.
    #[validate(nested)]
    pub database: DatabaseConfig,
    /// The Docker engine.
    pub docker: DockerConfig,
    /// The lean engine.
    pub lean: LeanSettings,
    /// The sandbox profile.
    pub sandbox: SandboxProfile,
    /// The warm pool.
    #[validate(nested)]
    pub pool: PoolConfig,
    /// Snapshots of sandboxes and the pool's template.
    #[validate(nested)]
    pub snapshots: SnapshotsConfig,
    /// Default tenant limits and per-call bounds.
    #[validate(nested)]
    pub limits: LimitsConfig,
    /// Reaper and reconciliation timing.
    #[validate(nested)]
    pub lifecycle: LifecycleConfig,
    /// What is kept after a sandbox ends, for how long, and how much (transcripts).
    #[validate(nested)]
    pub retention: RetentionConfig,
    /// The MCP endpoint.
    #[validate(nested)]
    pub mcp: McpConfig,
    /// Connections: caps and timeouts.
    #[validate(nested)]
    pub http: HttpConfig,
    /// The OAuth 2.1 authorization server (DESIGN §6).
    #[validate(nested)]
    pub oauth: OAuthConfig,
    /// The deployment's secret and admin-issued tokens.
    #[validate(nested)]
    pub keys: KeysConfig,
    /// Download links.
    #[validate(nested)]
    pub links: LinksConfig,
    /// Logging.
    pub log: LogConfig,
    /// The private listener for `/metrics` (and a node's `/healthz` and `/readyz`).
    pub metrics: MetricsConfig,
    /// Packages on demand (`pip install` in a sandbox).
    #[validate(nested)]
    pub packages: PackagesConfig,
    /// The sandbox node: its RPC listener, certificates, heartbeat, capacity.
    #[validate(nested)]
    pub node: NodeConfig,
    /// Egress a tenant chooses: the key its secrets are sealed under, the dial timeout, the
    /// tests' host overrides.
    #[validate(nested)]
    pub egress: EgressConfig,
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

/// `[metrics]`: where `/metrics` is served, off the public port.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// The private listener's address (`/metrics`, `/healthz`, `/readyz`); empty: none. With one,
    /// a gateway serves `/metrics` there and no longer on its public listener; `sandgate node`
    /// serves its only HTTP there.
    pub listen: String,
}

impl MetricsConfig {
    /// The private listener's address, when one is configured (checked at load).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.listen.parse().ok()
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.listen.is_empty() || self.listen.parse::<SocketAddr>().is_ok() {
            return Ok(());
        }
        Err(ConfigError::Invalid {
            key: "metrics.listen".into(),
            message: format!(
                "{:?} is not an address with a port (e.g. \"127.0.0.1:9464\"), nor empty",
                self.listen
            ),
        })
    }
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

/// Which kind of process a configuration is for: what it must hold differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Process {
    /// A gateway (`serve`, `migrate`, `admin`): signing keys, cookies, download links.
    Gateway,
    /// A sandbox node (`sandgate node`): no keys and no secrets, so none are required.
    Node,
    /// `sandgate migrate`: the schema only; no keys and no secrets required.
    Migrator,
}

impl Config {
    /// Loads the configuration: defaults, then `file` if given, then the process environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_for(file, Process::Gateway)
    }

    /// [`Config::load`] for a `process` of the given kind: a node's is valid without
    /// `keys.secret` or `oauth.cookie_secret` wherever it listens.
    pub fn load_for(file: Option<&Path>, process: Process) -> Result<Self, ConfigError> {
        let config: Config = Self::figment(file, Self::env())
            .extract()
            .map_err(Box::new)?;
        config.validate_for(process)?;
        Ok(config)
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

    /// Checks the values: the range and shape checks declared beside each field
    /// (`#[validate(…)]`), then the checks that compare fields or sections, or read a secret;
    /// the first problem is reported with its key.
    fn validate(&self) -> Result<(), ConfigError> {
        self.validate_for(Process::Gateway)
    }

    /// [`Config::validate`] for a `process` of the given kind.
    fn validate_for(&self, process: Process) -> Result<(), ConfigError> {
        // The most common mistake first: no database named at all.
        self.database.check_url()?;
        if let Err(errors) = Validate::validate(self)
            && let Some(problem) = validation::first_problem(&errors)
        {
            return Err(problem);
        }
        self.oauth.check_cookie_secret()?;
        self.check_together(process)
    }

    /// The checks that compare fields or sections with each other.
    fn check_together(&self, process: Process) -> Result<(), ConfigError> {
        let invalid = |(key, message): (String, String)| ConfigError::Invalid { key, message };
        let gateway = process == Process::Gateway;
        self.limits.check_together(self.sandbox.pids_limit)?;
        // A per-process random cookie key would log users out at every replica change.
        if gateway && !self.only_loopback() && self.cookie_key().is_none() {
            return Err(ConfigError::Invalid {
                key: "oauth.cookie_secret".into(),
                message: "is required when the public URL or the listen address is not loopback, unless keys.secret is \
                          set (the cookie key is then derived from it): a key of its own per \
                          process would not let one replica read another's login cookies. Set \
                          SANDGATE_KEYS__SECRET (or SANDGATE_OAUTH__COOKIE_SECRET) to at least \
                          32 random characters, the same on every replica"
                    .into(),
            });
        }
        self.pool.check_together()?;
        self.http
            .check_together(self.mcp.sse_keep_alive_seconds)
            .and_then(|()| self.oauth.limits.check_together())
            .and_then(|()| self.packages.check_together())
            .and_then(|()| self.snapshots.check_store(gateway))
            .map_err(invalid)?;
        self.sandbox
            .validate()
            .map_err(|err| ConfigError::Invalid {
                key: format!("sandbox.{}", err.field()),
                message: err.to_string(),
            })?;
        if gateway {
            self.keys
                .check_secret(self.only_loopback())
                .and_then(|()| self.egress.check_secrets_key(self.only_loopback()))
                .map_err(invalid)?;
        }
        self.metrics.check()?;
        self.node.check_together()
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

    /// Whether nothing but this host can reach the gateway: the public URL is loopback *and* the
    /// listener is bound to a loopback address. Only then are the public development secret and
    /// a per-process cookie key accepted (a loopback `public_url` says nothing about who can
    /// connect to a listener on `0.0.0.0`).
    pub fn only_loopback(&self) -> bool {
        self.is_loopback() && self.listen.ip().is_loopback()
    }

    /// The sealer of tenants' egress secrets (`egress.secrets_key`; the public development key
    /// only on a loopback-only deployment, like `keys.secret`'s); `None` when the key is empty
    /// off loopback, where secrets cannot be set.
    pub fn egress_sealer(&self) -> Option<crate::egress::SecretSealer> {
        self.egress.sealer(self.only_loopback())
    }

    /// A pool on `database.url` with the migrations applied (`database.auto_migrate`) or checked
    /// to be (the operator commands' way in).
    pub async fn migrated_pool(
        &self,
    ) -> Result<sandgate_store::PgPool, sandgate_store::schema::SchemaError> {
        let db =
            sandgate_store::connect_lazy(self.database.url.expose_secret(), &self.pool_settings())?;
        if self.database.auto_migrate {
            sandgate_store::migrate(&db).await?;
        } else {
            sandgate_store::schema::check(&db).await?;
        }
        Ok(db)
    }

    /// Empties the secrets only a gateway uses (`keys.secret`, `oauth.cookie_secret`,
    /// `egress.secrets_key`, the snapshot store's `snapshots.s3` credentials), for a
    /// process that must hold none (`sandgate node`); returns the keys of those that were set.
    pub fn drop_gateway_secrets(&mut self) -> Vec<&'static str> {
        let mut dropped = Vec::new();
        for (key, secret) in [
            ("keys.secret", &mut self.keys.secret),
            ("oauth.cookie_secret", &mut self.oauth.cookie_secret),
            ("egress.secrets_key", &mut self.egress.secrets_key),
            (
                "snapshots.s3.access_key_id",
                &mut self.snapshots.s3.access_key_id,
            ),
            (
                "snapshots.s3.secret_access_key",
                &mut self.snapshots.s3.secret_access_key,
            ),
        ] {
            if !secret.expose_secret().is_empty() {
                *secret = secrecy::SecretString::from(String::new());
                dropped.push(key);
            }
        }
        dropped
    }

    /// The Postgres pool settings.
    pub fn pool_settings(&self) -> sandgate_store::PoolSettings {
        sandgate_store::PoolSettings {
            max_connections: self.database.max_connections,
            acquire_timeout: Duration::from_millis(self.database.acquire_timeout_ms),
        }
    }
}

/// `instance`: a name fit for container labels.
fn a_label(instance: &str) -> Result<(), ValidationError> {
    let fits = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
    if instance.is_empty() || !instance.chars().all(fits) {
        return Err(problem(format!(
            "{instance:?} must be non-empty letters, digits, '-', '_' or '.'"
        )));
    }
    Ok(())
}

/// `public_url`: an http(s) origin; the MCP endpoint is `<public_url>/mcp`.
fn an_origin_url(url: &Url) -> Result<(), ValidationError> {
    if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
        return Err(problem(format!("{url} must be an http(s) URL with a host")));
    }
    if url.path() != "/" || url.query().is_some() {
        return Err(problem(format!(
            "{url} must have no path or query; the MCP endpoint is <public_url>/mcp"
        )));
    }
    Ok(())
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
    fn an_advertise_url_is_one_gateways_dial() {
        for (url, tls) in [
            ("https://node-1.example:9443", true),
            ("https://10.1.2.3:9443", true),
            ("http://127.0.0.1:7443", false),
            ("http://[::1]:7443", false),
            ("http://localhost:7443", false),
        ] {
            assert_eq!(check_advertise_url(url, tls), Ok(()), "{url} (tls: {tls})");
        }
        for (url, tls, why) in [
            ("http://127.0.0.2:7443", false, "cleartext to 127.0.0.2"),
            ("http://10.1.2.3:7443", false, "cleartext to 10.1.2.3"),
            ("http://127.0.0.1:7443", true, "serves TLS"),
            ("https://node:9443", false, "are not set"),
            ("https://node:9443/path", true, "no path"),
            ("ftp://node:9443", true, "must start with https://"),
        ] {
            let err = check_advertise_url(url, tls).expect_err(url);
            assert!(err.contains(why), "{url}: expected {why:?}, got {err}");
        }
    }

    #[test]
    fn each_declared_check_refuses_naming_its_key() {
        for (var, value, key) in [
            ("SANDGATE_INSTANCE", "two words", "instance"),
            (
                "SANDGATE_PUBLIC_URL",
                "https://mcp.example.com/sub",
                "public_url",
            ),
            (
                "SANDGATE_DATABASE__MAX_CONNECTIONS",
                "0",
                "database.max_connections",
            ),
            (
                "SANDGATE_LIMITS__MAX_SANDBOXES",
                "0",
                "limits.max_sandboxes",
            ),
            (
                "SANDGATE_LIMITS__OUTPUT_LIMIT_BYTES",
                "10",
                "limits.output_limit_bytes",
            ),
            (
                "SANDGATE_POOL__DEMAND_WINDOW_SECONDS",
                "5",
                "pool.demand_window_seconds",
            ),
            (
                "SANDGATE_LIFECYCLE__REAPER_INTERVAL_MS",
                "10",
                "lifecycle.reaper_interval_ms",
            ),
            (
                "SANDGATE_MCP__SESSION_IDLE_SECONDS",
                "0",
                "mcp.session_idle_seconds",
            ),
            (
                "SANDGATE_HTTP__CLIENT_ADDRESS_HEADER",
                "no spaces",
                "http.client_address_header",
            ),
            (
                "SANDGATE_OAUTH__ACCESS_TOKEN_TTL_SECONDS",
                "90000",
                "oauth.access_token_ttl_seconds",
            ),
            (
                "SANDGATE_OAUTH__CODE_TTL_SECONDS",
                "601",
                "oauth.code_ttl_seconds",
            ),
            (
                "SANDGATE_OAUTH__CLIENT_METADATA__MAX_BYTES",
                "10",
                "oauth.client_metadata.max_bytes",
            ),
            (
                "SANDGATE_OAUTH__LIMITS__LOCKOUT_SECONDS",
                "0",
                "oauth.limits.lockout_seconds",
            ),
            (
                "SANDGATE_KEYS__ADMIN_TOKEN_MAX_TTL_SECONDS",
                "59",
                "keys.admin_token_max_ttl_seconds",
            ),
            (
                "SANDGATE_LINKS__PER_LINK_PER_MINUTE",
                "0",
                "links.per_link_per_minute",
            ),
            (
                "SANDGATE_RETENTION__TRANSCRIPT_MAX_BYTES",
                "10",
                "retention.transcript_max_bytes",
            ),
            (
                "SANDGATE_PACKAGES__INDEX_URL",
                "ftp://index.example",
                "packages.index_url",
            ),
            (
                "SANDGATE_PACKAGES__FETCH_TIMEOUT_SECONDS",
                "0",
                "packages.fetch_timeout_seconds",
            ),
            (
                "SANDGATE_NODE__HEARTBEAT_SECONDS",
                "0",
                "node.heartbeat_seconds",
            ),
        ] {
            Jail::expect_with(|jail| {
                jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
                jail.set_env(var, value);
                let err = load_in(jail).expect_err(var).to_string();
                assert!(
                    err.starts_with(&format!("invalid configuration: {key}: ")),
                    "{var}={value} is refused naming {key}: {err}"
                );
                Ok(())
            });
        }
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
    fn snapshots_default_to_templates_without_a_tmpfs_and_the_gvisor_example_uses_runsc2024() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            // stack.env may name one; the default names none.
            jail.set_env("SANDGATE_SNAPSHOTS__PLAIN_DIR", "");
            let config = load_in(jail).expect("the defaults load");
            assert_eq!(config.snapshots.plain_dir(), None, "no tmpfs: no snapshots");
            let templates = config.snapshots.templates();
            assert!(templates.enabled);
            assert_eq!(templates.max_age, Duration::from_secs(6 * 3600));
            jail.set_env("SANDGATE_SNAPSHOTS__TEMPLATE_MAX_AGE_SECONDS", "5");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(err.contains("snapshots.template_max_age_seconds"), "{err}");
            jail.set_env("SANDGATE_SNAPSHOTS__TEMPLATE_MAX_AGE_SECONDS", "3600");
            let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config/gvisor.toml");
            let config = Config::from_figment(Config::figment(Some(&example), Config::env()))
                .expect("the gVisor example loads");
            assert_eq!(
                config.sandbox.runtime,
                sandgate_sandbox::OciRuntime::Runsc2024
            );
            assert!(config.snapshots.templates);
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
    fn egress_test_hosts_are_accepted_on_loopback_only_and_reach_loopback_only() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.set_env(
                "SANDGATE_EGRESS__TEST_HOSTS",
                "shop.sandgate.test=127.0.0.1:4443, api.sandgate.test=127.0.0.1:4444",
            );
            load_in(jail).expect("test hosts on a loopback-only deployment");
            // A name with an address and no port only resolves (to test the address checks).
            jail.set_env(
                "SANDGATE_EGRESS__TEST_HOSTS",
                "private.sandgate.test=10.1.2.3, private.sandgate.test=127.0.0.1:4443",
            );
            load_in(jail).expect("resolve-only entries, a name listed twice");
            for (hosts, why) in [
                ("shop.sandgate.test=10.0.0.1:443", "loopback addresses only"),
                ("shop.sandgate.test", "not name=127.0.0.1:port"),
                (
                    "shop.sandgate.test=127.0.0.1:x",
                    "not an address (and port)",
                ),
                ("shop.sandgate.test=nowhere", "not an address (and port)"),
            ] {
                jail.set_env("SANDGATE_EGRESS__TEST_HOSTS", hosts);
                let err = load_in(jail).unwrap_err().to_string();
                assert!(
                    err.contains("egress.test_hosts") && err.contains(why),
                    "{hosts}: refused saying {why:?}: {err}"
                );
            }
            jail.set_env(
                "SANDGATE_EGRESS__TEST_HOSTS",
                "shop.sandgate.test=127.0.0.1:4443",
            );
            jail.set_env("SANDGATE_KEYS__SECRET", "k".repeat(40));
            jail.set_env("SANDGATE_PUBLIC_URL", "https://sandgate.example");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("egress.test_hosts") && err.contains("refused"),
                "off loopback the overrides are refused at start: {err}"
            );
            Ok(())
        });
    }

    #[test]
    fn the_egress_test_ca_is_read_on_loopback_only() {
        Jail::expect_with(|jail| {
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            jail.create_file("test-ca.pem", "-----BEGIN CERTIFICATE-----\n")?;
            let path = jail.directory().join("test-ca.pem");
            jail.set_env("SANDGATE_EGRESS__TEST_CA_FILE", path.display().to_string());
            let loaded = load_in(jail).expect("a test CA on a loopback-only deployment");
            assert!(
                loaded
                    .egress
                    .test_ca_pem(loaded.only_loopback())
                    .expect("read")
                    .is_some_and(|pem| pem.contains("BEGIN CERTIFICATE")),
                "its certificates are read on loopback"
            );
            jail.set_env("SANDGATE_EGRESS__TEST_CA_FILE", "/nonexistent/test-ca.pem");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("egress.test_ca_file") && err.contains("cannot be read"),
                "a file that cannot be read is named: {err}"
            );
            // Reachable from elsewhere (a public URL and a secret of its own): refused at start,
            // so no deployment others reach trusts a CA besides the system's.
            jail.set_env("SANDGATE_EGRESS__TEST_CA_FILE", path.display().to_string());
            jail.set_env("SANDGATE_KEYS__SECRET", "k".repeat(40));
            jail.set_env("SANDGATE_PUBLIC_URL", "https://sandgate.example");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("egress.test_ca_file") && err.contains("for tests only"),
                "off loopback the test CA is refused at start: {err}"
            );
            Ok(())
        });
    }

    #[test]
    fn the_egress_development_key_serves_only_a_loopback_only_deployment() {
        Jail::expect_with(|jail| {
            use crate::egress::DEVELOPMENT_SECRETS_KEY;
            let tenant = uuid::Uuid::new_v4();
            jail.set_env("SANDGATE_DATABASE__URL", "postgres://u@127.0.0.1:1/db");
            // Loopback only, no key: the development key seals.
            let dev = load_in(jail).expect("defaults").egress_sealer();
            let dev = dev.expect("a sealer on loopback");
            let sealed = dev.seal(tenant, "SHOP_TOKEN", 1, b"v");
            assert!(
                crate::egress::SecretSealer::new(DEVELOPMENT_SECRETS_KEY.as_bytes())
                    .open(tenant, "SHOP_TOKEN", 1, &sealed)
                    .is_ok(),
                "on loopback the empty key is the development key"
            );
            // Off loopback (a public URL, or a listener on every interface), no key: no sealer.
            jail.set_env("SANDGATE_KEYS__SECRET", "k".repeat(40));
            for (key, value) in [
                ("SANDGATE_PUBLIC_URL", "https://sandgate.example"),
                ("SANDGATE_LISTEN", "0.0.0.0:8080"),
            ] {
                jail.set_env(key, value);
                let config = load_in(jail).expect("an empty key is valid off loopback");
                assert!(
                    config.egress_sealer().is_none(),
                    "{key}: off loopback the development key is never used"
                );
                // The development key written out is refused at start, naming the setting.
                jail.set_env("SANDGATE_EGRESS__SECRETS_KEY", DEVELOPMENT_SECRETS_KEY);
                let err = load_in(jail).unwrap_err().to_string();
                assert!(
                    err.contains("egress.secrets_key")
                        && err.contains("SANDGATE_EGRESS__SECRETS_KEY")
                        && !err.contains(DEVELOPMENT_SECRETS_KEY),
                    "{key}: refused naming the key, without echoing it: {err}"
                );
                jail.set_env("SANDGATE_EGRESS__SECRETS_KEY", "");
                jail.set_env(
                    key,
                    if key == "SANDGATE_LISTEN" {
                        "127.0.0.1:8080"
                    } else {
                        ""
                    },
                );
            }
            jail.set_env("SANDGATE_PUBLIC_URL", "https://sandgate.example");
            jail.set_env("SANDGATE_EGRESS__SECRETS_KEY", "short");
            let err = load_in(jail).unwrap_err().to_string();
            assert!(
                err.contains("egress.secrets_key") && err.contains("at least 32"),
                "{err}"
            );
            let own = "an egress key of this deployment, 32+ characters";
            jail.set_env("SANDGATE_EGRESS__SECRETS_KEY", own);
            let sealer = load_in(jail).expect("a key of its own").egress_sealer();
            let sealed = sealer
                .expect("a sealer")
                .seal(tenant, "SHOP_TOKEN", 1, b"v");
            assert!(
                dev.open(tenant, "SHOP_TOKEN", 1, &sealed).is_err(),
                "the configured key is not the development key"
            );
            // A node holds no egress key, whatever its environment says.
            let mut node = load_in(jail).expect("valid");
            assert!(node.drop_gateway_secrets().contains(&"egress.secrets_key"));
            assert!(node.egress.secrets_key.expose_secret().is_empty());
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
