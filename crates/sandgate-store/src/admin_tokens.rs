//! Tokens issued by `sandgate admin token issue`: recorded so that they can be listed and
//! revoked.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A recorded admin-issued token (never the token itself).
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct AdminToken {
    /// The token's id (its `jti` claim).
    pub jti: String,
    /// The tenant it acts for.
    pub tenant_id: Uuid,
    /// Space-separated scopes.
    pub scopes: String,
    /// The signing key it was signed with.
    pub kid: String,
    /// When it was issued.
    pub created_at: DateTime<Utc>,
    /// When it expires.
    pub expires_at: DateTime<Utc>,
    /// When it was revoked, if it was.
    pub revoked_at: Option<DateTime<Utc>>,
}

/// Records a newly issued token.
#[tracing::instrument(skip_all, fields(tenant_id = %token.tenant_id))]
pub async fn record(conn: &mut PgConnection, token: &AdminToken) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO admin_tokens (jti, tenant_id, scopes, kid, created_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(&token.jti)
    .bind(token.tenant_id)
    .bind(&token.scopes)
    .bind(&token.kid)
    .bind(token.created_at)
    .bind(token.expires_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Admin-issued tokens, of one tenant or all, newest first; expired ones only with
/// `include_expired`.
#[tracing::instrument(skip_all)]
pub async fn list(
    conn: &mut PgConnection,
    tenant: Option<Uuid>,
    include_expired: bool,
) -> Result<Vec<AdminToken>, StoreError> {
    Ok(sqlx::query_as::<_, AdminToken>(
        "SELECT jti, tenant_id, scopes, kid, created_at, expires_at, revoked_at FROM admin_tokens
         WHERE ($1::uuid IS NULL OR tenant_id = $1) AND ($2 OR expires_at > now())
         ORDER BY created_at DESC",
    )
    .bind(tenant)
    .bind(include_expired)
    .fetch_all(conn)
    .await?)
}

/// Revokes a token by id: it is refused from now on (its jti joins the revoked access tokens
/// every request is checked against). Returns the token, or `None` when no token has that id.
/// Revoking twice keeps the first revocation time. Run it in a transaction.
#[tracing::instrument(skip_all)]
pub async fn revoke(conn: &mut PgConnection, jti: &str) -> Result<Option<AdminToken>, StoreError> {
    let token = sqlx::query_as::<_, AdminToken>(
        "UPDATE admin_tokens SET revoked_at = coalesce(revoked_at, now()) WHERE jti = $1
         RETURNING jti, tenant_id, scopes, kid, created_at, expires_at, revoked_at",
    )
    .bind(jti)
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(token) = &token {
        sqlx::query(
            "INSERT INTO revoked_access_tokens (jti, expires_at) VALUES ($1, $2)
             ON CONFLICT (jti) DO NOTHING",
        )
        .bind(&token.jti)
        .bind(token.expires_at)
        .execute(conn)
        .await?;
    }
    Ok(token)
}
