//! `[oauth.limits]`: limits on the unauthenticated OAuth endpoints.

use serde::Deserialize;

/// `[oauth.limits]`: limits on the unauthenticated endpoints.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OAuthLimitsConfig {
    /// Sign-in attempts per client address per minute (also the burst).
    pub login_per_address_per_minute: u32,
    /// Sign-in attempts per account (email) per minute (also the burst).
    pub login_per_account_per_minute: u32,
    /// Consecutive failed sign-ins that lock an account.
    pub lockout_after_failures: u32,
    /// The first lock, seconds; doubled by each further failure.
    pub lockout_seconds: u32,
    /// The longest lock, seconds.
    pub lockout_max_seconds: u32,
    /// Password hashes computed at once.
    pub password_hash_concurrency: usize,
    /// Sign-ins waiting for a hashing slot at most; beyond, 503 at once.
    pub password_hash_queue: usize,
    /// Longest wait for a hashing slot, milliseconds; then 503.
    pub password_hash_wait_ms: u64,
    /// Client registrations per client address per hour (also the burst).
    pub register_per_address_per_hour: u32,
    /// Client-metadata-document fetches per client address per minute (also the burst).
    pub metadata_fetch_per_address_per_minute: u32,
    /// How long a failed metadata-document lookup is answered from memory, seconds.
    pub metadata_failure_cache_seconds: u64,
    /// Most dynamic clients (registered or metadata-document) that never completed a flow;
    /// a new one evicts the oldest of them.
    pub max_unused_dynamic_clients: u32,
    /// A dynamic client that never completed a flow is purged after this long, seconds.
    pub unused_client_ttl_seconds: u64,
    /// How often expired codes, sessions, refresh tokens and unused clients are purged, seconds.
    pub purge_interval_seconds: u64,
}

impl OAuthLimitsConfig {
    /// Checks the values; `Err((key, message))` names the offending key.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let positive = [
            (
                "login_per_address_per_minute",
                u64::from(self.login_per_address_per_minute),
            ),
            (
                "login_per_account_per_minute",
                u64::from(self.login_per_account_per_minute),
            ),
            (
                "lockout_after_failures",
                u64::from(self.lockout_after_failures),
            ),
            ("lockout_seconds", u64::from(self.lockout_seconds)),
            ("lockout_max_seconds", u64::from(self.lockout_max_seconds)),
            (
                "password_hash_concurrency",
                self.password_hash_concurrency as u64,
            ),
            (
                "register_per_address_per_hour",
                u64::from(self.register_per_address_per_hour),
            ),
            (
                "metadata_fetch_per_address_per_minute",
                u64::from(self.metadata_fetch_per_address_per_minute),
            ),
            (
                "max_unused_dynamic_clients",
                u64::from(self.max_unused_dynamic_clients),
            ),
            ("unused_client_ttl_seconds", self.unused_client_ttl_seconds),
            ("purge_interval_seconds", self.purge_interval_seconds),
        ];
        for (key, value) in positive {
            if value == 0 {
                return Err((format!("oauth.limits.{key}"), "must be at least 1".into()));
            }
        }
        if self.lockout_max_seconds < self.lockout_seconds {
            return Err((
                "oauth.limits.lockout_max_seconds".into(),
                "must be at least oauth.limits.lockout_seconds".into(),
            ));
        }
        Ok(())
    }
}
