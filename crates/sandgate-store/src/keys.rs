//! Signing keys for access tokens.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::StoreError;

/// A stored signing key.
#[derive(Clone, sqlx::FromRow)]
pub struct SigningKeyRow {
    /// Key id.
    pub kid: String,
    /// Ed25519 private seed (32 bytes) in clear: only in rows written before seeds were sealed,
    /// until the gateway seals them at start-up ([`clear_seeds`], [`seal`]).
    pub seed: Option<Vec<u8>>,
    /// The seed sealed with the key-encryption key (the service's `keys::SeedSealer`).
    pub sealed_seed: Option<Vec<u8>>,
    /// Ed25519 public key (32 bytes).
    pub public_key: Vec<u8>,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it stopped signing (it still verifies for a while).
    pub retired_at: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for SigningKeyRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKeyRow")
            .field("kid", &self.kid)
            .field("created_at", &self.created_at)
            .field("retired_at", &self.retired_at)
            .finish_non_exhaustive()
    }
}

/// Keys that may verify tokens: the active one and those retired after `retired_after`.
#[tracing::instrument(skip_all)]
pub async fn verifying(
    conn: &mut PgConnection,
    retired_after: DateTime<Utc>,
) -> Result<Vec<SigningKeyRow>, StoreError> {
    Ok(sqlx::query_as::<_, SigningKeyRow>(
        "SELECT kid, seed, sealed_seed, public_key, created_at, retired_at FROM signing_keys
         WHERE retired_at IS NULL OR retired_at > $1 ORDER BY created_at DESC",
    )
    .bind(retired_after)
    .fetch_all(conn)
    .await?)
}

/// The key that signs new tokens (the newest unretired one), if any.
#[tracing::instrument(skip_all)]
pub async fn active(conn: &mut PgConnection) -> Result<Option<SigningKeyRow>, StoreError> {
    Ok(sqlx::query_as::<_, SigningKeyRow>(
        "SELECT kid, seed, sealed_seed, public_key, created_at, retired_at FROM signing_keys
         WHERE retired_at IS NULL ORDER BY created_at DESC LIMIT 1",
    )
    .fetch_optional(conn)
    .await?)
}

/// Serialises concurrent rotations and first-key creations across gateways (until the
/// transaction ends).
async fn lock(conn: &mut PgConnection) -> Result<(), StoreError> {
    sqlx::query("LOCK TABLE signing_keys IN SHARE ROW EXCLUSIVE MODE")
        .execute(conn)
        .await?;
    Ok(())
}

async fn insert(
    conn: &mut PgConnection,
    kid: &str,
    sealed_seed: &[u8],
    public_key: &[u8],
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO signing_keys (kid, sealed_seed, public_key) VALUES ($1, $2, $3)")
        .bind(kid)
        .bind(sealed_seed)
        .bind(public_key)
        .execute(conn)
        .await?;
    Ok(())
}

/// Stores a new key and retires every other active one (rotation). Run it in a transaction.
#[tracing::instrument(skip_all)]
pub async fn insert_and_retire_others(
    conn: &mut PgConnection,
    kid: &str,
    sealed_seed: &[u8],
    public_key: &[u8],
) -> Result<(), StoreError> {
    lock(conn).await?;
    sqlx::query("UPDATE signing_keys SET retired_at = now() WHERE retired_at IS NULL")
        .execute(&mut *conn)
        .await?;
    insert(conn, kid, sealed_seed, public_key).await
}

/// Stores `kid` as the first key unless an active key exists already; returns the active key.
/// Run it in a transaction.
#[tracing::instrument(skip_all)]
pub async fn ensure_active(
    conn: &mut PgConnection,
    kid: &str,
    sealed_seed: &[u8],
    public_key: &[u8],
) -> Result<SigningKeyRow, StoreError> {
    lock(conn).await?;
    if let Some(existing) = active(conn).await? {
        return Ok(existing);
    }
    insert(conn, kid, sealed_seed, public_key).await?;
    active(conn)
        .await?
        .ok_or(StoreError::NotFound("signing key"))
}

/// Keys whose seed is still stored in clear (written before seeds were sealed), locked for the
/// caller's transaction so that two starting replicas do not seal the same row twice.
#[tracing::instrument(skip_all)]
pub async fn clear_seeds(conn: &mut PgConnection) -> Result<Vec<SigningKeyRow>, StoreError> {
    Ok(sqlx::query_as::<_, SigningKeyRow>(
        "SELECT kid, seed, sealed_seed, public_key, created_at, retired_at FROM signing_keys
         WHERE seed IS NOT NULL FOR UPDATE",
    )
    .fetch_all(conn)
    .await?)
}

/// Replaces a key's clear seed by its sealed form.
#[tracing::instrument(skip_all)]
pub async fn seal(
    conn: &mut PgConnection,
    kid: &str,
    sealed_seed: &[u8],
) -> Result<(), StoreError> {
    sqlx::query("UPDATE signing_keys SET sealed_seed = $2, seed = NULL WHERE kid = $1")
        .bind(kid)
        .bind(sealed_seed)
        .execute(conn)
        .await?;
    Ok(())
}
