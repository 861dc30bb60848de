//! Grants (the "connections" a user sees and can disconnect), the authorization codes and
//! refresh tokens issued under them, and revoked access tokens.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A grant row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Grant {
    /// Id (the `grant` claim of its access tokens).
    pub id: Uuid,
    /// Tenant.
    pub tenant_id: Uuid,
    /// The user who approved it (None for client credentials).
    pub user_id: Option<Uuid>,
    /// The client.
    pub client_id: String,
    /// Space-separated scopes.
    pub scopes: String,
    /// When first approved.
    pub created_at: DateTime<Utc>,
    /// When last approved or changed.
    pub updated_at: DateTime<Utc>,
    /// Last MCP request made with it.
    pub last_used_at: Option<DateTime<Utc>>,
    /// When revoked (disconnected), if so.
    pub revoked_at: Option<DateTime<Utc>>,
    /// Why it was revoked.
    pub revoke_reason: Option<String>,
}

const COLUMNS: &str = "id, tenant_id, user_id, client_id, scopes, created_at, updated_at, last_used_at, \
                       revoked_at, revoke_reason";

/// The live grant of a user (or, with `user_id` None, of a tenant's client credentials) to a
/// client, if any.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn live_for(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    user_id: Option<Uuid>,
    client_id: &str,
) -> Result<Option<Grant>, StoreError> {
    Ok(sqlx::query_as::<_, Grant>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM grants
         WHERE tenant_id = $1 AND user_id IS NOT DISTINCT FROM $2 AND client_id = $3 AND revoked_at IS NULL"
    )))
    .bind(tenant_id)
    .bind(user_id)
    .bind(client_id)
    .fetch_optional(conn)
    .await?)
}

/// Records an approval: the live grant for (tenant, user, client) gets `scopes`, or a new one is
/// made. Returns the grant.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn approve(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    user_id: Option<Uuid>,
    client_id: &str,
    scopes: &str,
) -> Result<Grant, StoreError> {
    if let Some(existing) = live_for(conn, tenant_id, user_id, client_id).await? {
        return Ok(sqlx::query_as::<_, Grant>(sqlx::AssertSqlSafe(format!(
            "UPDATE grants SET scopes = $2, updated_at = now() WHERE id = $1 RETURNING {COLUMNS}"
        )))
        .bind(existing.id)
        .bind(scopes)
        .fetch_one(conn)
        .await?);
    }
    Ok(sqlx::query_as::<_, Grant>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO grants (id, tenant_id, user_id, client_id, scopes) VALUES ($1, $2, $3, $4, $5)
         RETURNING {COLUMNS}"
    )))
    .bind(Uuid::now_v7())
    .bind(tenant_id)
    .bind(user_id)
    .bind(client_id)
    .bind(scopes)
    .fetch_one(conn)
    .await?)
}

/// A grant by id.
#[tracing::instrument(skip_all)]
pub async fn get(conn: &mut PgConnection, id: Uuid) -> Result<Option<Grant>, StoreError> {
    Ok(sqlx::query_as::<_, Grant>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM grants WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// A grant with its client's name, for the connected-apps page.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Connection {
    /// The grant id.
    pub id: Uuid,
    /// The client's id.
    pub client_id: String,
    /// The client's name.
    pub client_name: String,
    /// Space-separated scopes.
    pub scopes: String,
    /// When approved.
    pub created_at: DateTime<Utc>,
    /// When last used.
    pub last_used_at: Option<DateTime<Utc>>,
}

/// The live connections a user sees: the ones they approved.
#[tracing::instrument(skip_all)]
pub async fn connections_of_user(
    conn: &mut PgConnection,
    user_id: Uuid,
) -> Result<Vec<Connection>, StoreError> {
    Ok(sqlx::query_as::<_, Connection>(
        "SELECT g.id, g.client_id, c.name AS client_name, g.scopes, g.created_at, g.last_used_at
         FROM grants g JOIN oauth_clients c ON c.id = g.client_id
         WHERE g.user_id = $1 AND g.revoked_at IS NULL ORDER BY g.created_at DESC",
    )
    .bind(user_id)
    .fetch_all(conn)
    .await?)
}

/// Revokes a grant and every refresh token under it. Returns false if it was not live.
/// `user_id`, when given, must own the grant (a user can only disconnect their own apps).
#[tracing::instrument(skip_all)]
pub async fn revoke(
    conn: &mut PgConnection,
    id: Uuid,
    user_id: Option<Uuid>,
    reason: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE grants SET revoked_at = now(), revoke_reason = $3
         WHERE id = $1 AND revoked_at IS NULL AND ($2::uuid IS NULL OR user_id = $2)",
    )
    .bind(id)
    .bind(user_id)
    .bind(reason)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if done {
        sqlx::query("UPDATE refresh_tokens SET revoked_at = now() WHERE grant_id = $1 AND revoked_at IS NULL")
            .bind(id)
            .execute(conn)
            .await?;
    }
    Ok(done)
}

/// Whether an access token may still be used: its grant (if any) is live and its jti was not
/// revoked. Marks the grant used (at most once a minute, to keep writes rare).
#[tracing::instrument(skip_all)]
pub async fn token_is_active(
    conn: &mut PgConnection,
    grant_id: Option<Uuid>,
    jti: &str,
) -> Result<bool, StoreError> {
    let revoked: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM revoked_access_tokens WHERE jti = $1)")
            .bind(jti)
            .fetch_one(&mut *conn)
            .await?;
    if revoked {
        return Ok(false);
    }
    let Some(grant_id) = grant_id else {
        return Ok(true);
    };
    let live: Option<(Option<DateTime<Utc>>,)> =
        sqlx::query_as("SELECT last_used_at FROM grants WHERE id = $1 AND revoked_at IS NULL")
            .bind(grant_id)
            .fetch_optional(&mut *conn)
            .await?;
    match live {
        None => Ok(false),
        Some((last_used,)) => {
            if last_used.is_none_or(|t| Utc::now() - t > chrono::Duration::seconds(60)) {
                sqlx::query("UPDATE grants SET last_used_at = now() WHERE id = $1")
                    .bind(grant_id)
                    .execute(conn)
                    .await?;
            }
            Ok(true)
        }
    }
}

/// Revokes one access token by jti until `expires_at`.
#[tracing::instrument(skip_all)]
pub async fn revoke_access_token(
    conn: &mut PgConnection,
    jti: &str,
    expires_at: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO revoked_access_tokens (jti, expires_at) VALUES ($1, $2) ON CONFLICT DO NOTHING")
        .bind(jti)
        .bind(expires_at)
        .execute(&mut *conn)
        .await?;
    sqlx::query("DELETE FROM revoked_access_tokens WHERE expires_at < now() - interval '1 hour'")
        .execute(conn)
        .await?;
    Ok(())
}

/// An authorization code as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AuthCode {
    /// The grant it was issued under.
    pub grant_id: Uuid,
    /// The client it was issued to.
    pub client_id: String,
    /// The redirect URI of the authorization request.
    pub redirect_uri: String,
    /// PKCE S256 challenge.
    pub code_challenge: String,
    /// The resource (audience) asked for.
    pub resource: String,
    /// Space-separated scopes.
    pub scopes: String,
    /// Expiry.
    pub expires_at: DateTime<Utc>,
    /// When it was redeemed (a second redemption is a replay).
    pub used_at: Option<DateTime<Utc>>,
}

/// A code to store.
#[derive(Debug, Clone)]
pub struct NewAuthCode<'a> {
    /// SHA-256 of the code.
    pub code_hash: &'a [u8],
    /// Grant.
    pub grant_id: Uuid,
    /// Client.
    pub client_id: &'a str,
    /// Redirect URI.
    pub redirect_uri: &'a str,
    /// PKCE challenge.
    pub code_challenge: &'a str,
    /// Resource.
    pub resource: &'a str,
    /// Scopes.
    pub scopes: &'a str,
    /// Expiry.
    pub expires_at: DateTime<Utc>,
}

/// Stores an authorization code.
#[tracing::instrument(skip_all)]
pub async fn insert_code(conn: &mut PgConnection, c: &NewAuthCode<'_>) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO auth_codes (code_hash, grant_id, client_id, redirect_uri, code_challenge, resource, scopes, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(c.code_hash)
    .bind(c.grant_id)
    .bind(c.client_id)
    .bind(c.redirect_uri)
    .bind(c.code_challenge)
    .bind(c.resource)
    .bind(c.scopes)
    .bind(c.expires_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Locks a code's row for redemption and returns it. Run it in a transaction, then either
/// [`mark_code_used`] (tokens issued) or [`delete_code`] (redemption refused: the code is burnt).
#[tracing::instrument(skip_all)]
pub async fn lock_code(
    conn: &mut PgConnection,
    code_hash: &[u8],
) -> Result<Option<AuthCode>, StoreError> {
    Ok(sqlx::query_as::<_, AuthCode>(
        "SELECT grant_id, client_id, redirect_uri, code_challenge, resource, scopes, expires_at, used_at
         FROM auth_codes WHERE code_hash = $1 FOR UPDATE",
    )
    .bind(code_hash)
    .fetch_optional(conn)
    .await?)
}

/// Marks a code redeemed: presenting it again is a replay.
#[tracing::instrument(skip_all)]
pub async fn mark_code_used(conn: &mut PgConnection, code_hash: &[u8]) -> Result<(), StoreError> {
    sqlx::query("UPDATE auth_codes SET used_at = now() WHERE code_hash = $1")
        .bind(code_hash)
        .execute(conn)
        .await?;
    Ok(())
}

/// Deletes a code whose redemption was refused (it issued nothing, so there is nothing to revoke
/// if it comes back; it is simply unknown).
#[tracing::instrument(skip_all)]
pub async fn delete_code(conn: &mut PgConnection, code_hash: &[u8]) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM auth_codes WHERE code_hash = $1")
        .bind(code_hash)
        .execute(conn)
        .await?;
    Ok(())
}

/// A refresh token as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RefreshToken {
    /// Rotation family.
    pub family_id: Uuid,
    /// Grant.
    pub grant_id: Uuid,
    /// Client.
    pub client_id: String,
    /// Space-separated scopes.
    pub scopes: String,
    /// Resource (audience).
    pub resource: String,
    /// Expiry.
    pub expires_at: DateTime<Utc>,
    /// When it was rotated (a later use is a reuse).
    pub used_at: Option<DateTime<Utc>>,
    /// When revoked.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A refresh token to store.
#[derive(Debug, Clone)]
pub struct NewRefreshToken<'a> {
    /// SHA-256 of the token.
    pub token_hash: &'a [u8],
    /// Family.
    pub family_id: Uuid,
    /// Grant.
    pub grant_id: Uuid,
    /// Client.
    pub client_id: &'a str,
    /// Scopes.
    pub scopes: &'a str,
    /// Resource.
    pub resource: &'a str,
    /// Expiry.
    pub expires_at: DateTime<Utc>,
}

/// Stores a refresh token.
#[tracing::instrument(skip_all)]
pub async fn insert_refresh(
    conn: &mut PgConnection,
    t: &NewRefreshToken<'_>,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO refresh_tokens (token_hash, family_id, grant_id, client_id, scopes, resource, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(t.token_hash)
    .bind(t.family_id)
    .bind(t.grant_id)
    .bind(t.client_id)
    .bind(t.scopes)
    .bind(t.resource)
    .bind(t.expires_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Takes a refresh token for rotation: locks its row, returns it as it was and marks it used.
/// The caller checks `used_at` (reuse), `revoked_at` and expiry; run it in a transaction.
#[tracing::instrument(skip_all)]
pub async fn take_refresh(
    conn: &mut PgConnection,
    token_hash: &[u8],
) -> Result<Option<RefreshToken>, StoreError> {
    let token = sqlx::query_as::<_, RefreshToken>(
        "SELECT family_id, grant_id, client_id, scopes, resource, expires_at, used_at, revoked_at
         FROM refresh_tokens WHERE token_hash = $1 FOR UPDATE",
    )
    .bind(token_hash)
    .fetch_optional(&mut *conn)
    .await?;
    if token.as_ref().is_some_and(|t| t.used_at.is_none()) {
        sqlx::query("UPDATE refresh_tokens SET used_at = now() WHERE token_hash = $1")
            .bind(token_hash)
            .execute(conn)
            .await?;
    }
    Ok(token)
}

/// A refresh token by hash, without changing it (revocation).
#[tracing::instrument(skip_all)]
pub async fn refresh_by_hash(
    conn: &mut PgConnection,
    token_hash: &[u8],
) -> Result<Option<RefreshToken>, StoreError> {
    Ok(sqlx::query_as::<_, RefreshToken>(
        "SELECT family_id, grant_id, client_id, scopes, resource, expires_at, used_at, revoked_at
         FROM refresh_tokens WHERE token_hash = $1",
    )
    .bind(token_hash)
    .fetch_optional(conn)
    .await?)
}

/// Revokes every refresh token of a family (reuse detected, or RFC 7009 revocation).
#[tracing::instrument(skip_all)]
pub async fn revoke_family(conn: &mut PgConnection, family_id: Uuid) -> Result<u64, StoreError> {
    Ok(sqlx::query(
        "UPDATE refresh_tokens SET revoked_at = now() WHERE family_id = $1 AND revoked_at IS NULL",
    )
    .bind(family_id)
    .execute(conn)
    .await?
    .rows_affected())
}
