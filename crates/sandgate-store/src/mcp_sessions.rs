//! Who opened each 2025-11-25 MCP session, keyed by a keyed hash of its id (the id itself never
//! reaches Postgres). A row is an open session of its tenant until it is deleted or expires.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// The principal that opened a session: only requests of the same principal may use it.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SessionOwner {
    /// The tenant.
    pub tenant_id: Uuid,
    /// The token's subject.
    pub subject: String,
    /// The OAuth client the token was issued to, if any.
    pub client_id: Option<String>,
}

/// Records `owner` as the owner of the session `id_hash`, unless its tenant already has
/// `max_open` open sessions; `true` when recorded. The tenant's expired sessions are deleted
/// on the way. Takes a transaction-scoped advisory lock per tenant, so concurrent `initialize`s
/// on any replica count each other: call it inside a transaction.
#[tracing::instrument(skip_all, fields(tenant_id = %owner.tenant_id))]
pub async fn bind_under_cap(
    conn: &mut PgConnection,
    id_hash: &[u8],
    owner: &SessionOwner,
    max_open: u32,
    expires_at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('mcp_sessions:' || $1::text, 0))")
        .bind(owner.tenant_id)
        .execute(&mut *conn)
        .await?;
    sqlx::query("DELETE FROM mcp_sessions WHERE tenant_id = $1 AND expires_at <= now()")
        .bind(owner.tenant_id)
        .execute(&mut *conn)
        .await?;
    let bound = sqlx::query(
        "INSERT INTO mcp_sessions (id_hash, tenant_id, subject, client_id, expires_at)
         SELECT $1, $2, $3, $4, $5
          WHERE (SELECT count(*) FROM mcp_sessions WHERE tenant_id = $2) < $6",
    )
    .bind(id_hash)
    .bind(owner.tenant_id)
    .bind(&owner.subject)
    .bind(&owner.client_id)
    .bind(expires_at)
    .bind(i64::from(max_open))
    .execute(&mut *conn)
    .await?;
    Ok(bound.rows_affected() == 1)
}

/// The owner of an open (unexpired) session; `None` when there is no such session.
#[tracing::instrument(skip_all)]
pub async fn owner(
    conn: &mut PgConnection,
    id_hash: &[u8],
) -> Result<Option<SessionOwner>, StoreError> {
    Ok(sqlx::query_as::<_, SessionOwner>(
        "SELECT tenant_id, subject, client_id FROM mcp_sessions
          WHERE id_hash = $1 AND expires_at > now()",
    )
    .bind(id_hash)
    .fetch_optional(conn)
    .await?)
}

/// Moves an open session's expiry to `expires_at` (it is in use).
#[tracing::instrument(skip_all)]
pub async fn renew(
    conn: &mut PgConnection,
    id_hash: &[u8],
    expires_at: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE mcp_sessions SET expires_at = $2 WHERE id_hash = $1 AND expires_at > now()",
    )
    .bind(id_hash)
    .bind(expires_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Forgets a session (it was closed): its slot is free.
#[tracing::instrument(skip_all)]
pub async fn delete(conn: &mut PgConnection, id_hash: &[u8]) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM mcp_sessions WHERE id_hash = $1")
        .bind(id_hash)
        .execute(conn)
        .await?;
    Ok(())
}

/// How many open sessions a tenant has.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn open_count(conn: &mut PgConnection, tenant: Uuid) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM mcp_sessions WHERE tenant_id = $1 AND expires_at > now()",
    )
    .bind(tenant)
    .fetch_one(conn)
    .await?)
}
