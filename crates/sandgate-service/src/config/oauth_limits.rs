//! `[oauth.limits]`: limits on the unauthenticated OAuth endpoints.

use serde::Deserialize;
use validator::Validate;

/// `[oauth.limits]`: limits on the unauthenticated endpoints.
#[derive(Debug, Clone, Deserialize, Validate)]
#[serde(deny_unknown_fields)]
pub struct OAuthLimitsConfig {
    /// Sign-in attempts per client address per minute (also the burst).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub login_per_address_per_minute: u32,
    /// Sign-in attempts per account (email) per minute (also the burst).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub login_per_account_per_minute: u32,
    /// Consecutive failed sign-ins that lock an account.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub lockout_after_failures: u32,
    /// The first lock, seconds; doubled by each further failure.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub lockout_seconds: u32,
    /// The longest lock, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub lockout_max_seconds: u32,
    /// Password hashes computed at once.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub password_hash_concurrency: usize,
    /// Sign-ins waiting for a hashing slot at most; beyond, 503 at once.
    pub password_hash_queue: usize,
    /// Longest wait for a hashing slot, milliseconds; then 503.
    pub password_hash_wait_ms: u64,
    /// Client registrations per client address per hour (also the burst).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub register_per_address_per_hour: u32,
    /// Client-metadata-document fetches per client address per minute (also the burst).
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub metadata_fetch_per_address_per_minute: u32,
    /// How long a failed metadata-document lookup is answered from memory, seconds.
    pub metadata_failure_cache_seconds: u64,
    /// Most dynamic clients (registered or metadata-document) that never completed a flow;
    /// a new one evicts the oldest of them.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub max_unused_dynamic_clients: u32,
    /// A dynamic client that never completed a flow is purged after this long, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub unused_client_ttl_seconds: u64,
    /// How often expired codes, sessions, refresh tokens and unused clients are purged, seconds.
    #[validate(range(min = 1, message = "must be at least 1"))]
    pub purge_interval_seconds: u64,
}

impl OAuthLimitsConfig {
    /// The check that compares fields; `Err((key, message))` names the key.
    pub fn check_together(&self) -> Result<(), (String, String)> {
        if self.lockout_max_seconds < self.lockout_seconds {
            return Err((
                "oauth.limits.lockout_max_seconds".into(),
                "must be at least oauth.limits.lockout_seconds".into(),
            ));
        }
        Ok(())
    }
}
