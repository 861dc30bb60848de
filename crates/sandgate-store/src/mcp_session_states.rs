//! What any replica needs to take over a 2025-11-25 MCP session (`mcp_session_states`): the
//! client's `initialize` parameters, keyed by the keyed hash of the session id like
//! [`crate::mcp_sessions`]. A state is readable only while its session's binding is open.

use sqlx::PgConnection;

use crate::StoreError;

/// Records the `initialize` parameters (JSON) of the session `id_hash` (replacing any).
#[tracing::instrument(skip_all)]
pub async fn save(
    conn: &mut PgConnection,
    id_hash: &[u8],
    initialize_params: &sqlx::types::JsonValue,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO mcp_session_states (id_hash, initialize_params) VALUES ($1, $2)
         ON CONFLICT (id_hash) DO UPDATE SET initialize_params = EXCLUDED.initialize_params",
    )
    .bind(id_hash)
    .bind(initialize_params)
    .execute(conn)
    .await?;
    Ok(())
}

/// The `initialize` parameters of an open session (its binding unexpired); `None` otherwise.
#[tracing::instrument(skip_all)]
pub async fn load(
    conn: &mut PgConnection,
    id_hash: &[u8],
) -> Result<Option<sqlx::types::JsonValue>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT s.initialize_params FROM mcp_session_states s
           JOIN mcp_sessions b ON b.id_hash = s.id_hash
          WHERE s.id_hash = $1 AND b.expires_at > now()",
    )
    .bind(id_hash)
    .fetch_optional(conn)
    .await?)
}

/// Forgets a session's state (it was closed).
#[tracing::instrument(skip_all)]
pub async fn delete(conn: &mut PgConnection, id_hash: &[u8]) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM mcp_session_states WHERE id_hash = $1")
        .bind(id_hash)
        .execute(conn)
        .await?;
    Ok(())
}

/// Deletes states older than `min_age_seconds` whose session has no open binding (closed,
/// expired, or refused at its tenant's cap); returns how many.
#[tracing::instrument(skip_all)]
pub async fn purge_unbound(
    conn: &mut PgConnection,
    min_age_seconds: i64,
) -> Result<u64, StoreError> {
    Ok(sqlx::query(
        "DELETE FROM mcp_session_states s
          WHERE s.created_at < now() - make_interval(secs => $1)
            AND NOT EXISTS (SELECT 1 FROM mcp_sessions b
                             WHERE b.id_hash = s.id_hash AND b.expires_at > now())",
    )
    .bind(min_age_seconds as f64)
    .execute(conn)
    .await?
    .rows_affected())
}
