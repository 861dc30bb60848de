//! The audit trail: one event per tool call (who, which sandbox, outcome, duration).
//! Never the code, its output, file contents or tokens.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// One audited tool call.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct AuditEvent {
    /// When the call ended.
    pub at: DateTime<Utc>,
    /// The caller's tenant.
    pub tenant_id: Uuid,
    /// The access token's `jti`.
    pub token_id: Option<String>,
    /// The token's subject.
    pub subject: Option<String>,
    /// The conversation, if one was named or bound.
    pub conversation_id: Option<String>,
    /// The sandbox the call reached, if any.
    pub sandbox_id: Option<String>,
    /// Tool name.
    pub tool: String,
    /// `ok`, `user_error` (the user's code failed), `refused` (bad input, limits) or `failed`.
    pub outcome: String,
    /// A short machine-readable error kind, when not ok.
    pub error_kind: Option<String>,
    /// How long the call took.
    pub duration_ms: i32,
}

/// Appends an event (its `at` is set by the database).
pub async fn record(conn: &mut PgConnection, event: &AuditEvent) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO audit_events (tenant_id, token_id, subject, conversation_id, sandbox_id, tool,
                                   outcome, error_kind, duration_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(event.tenant_id)
    .bind(&event.token_id)
    .bind(&event.subject)
    .bind(&event.conversation_id)
    .bind(&event.sandbox_id)
    .bind(&event.tool)
    .bind(&event.outcome)
    .bind(&event.error_kind)
    .bind(event.duration_ms)
    .execute(conn)
    .await?;
    Ok(())
}

/// A tenant's most recent events, newest first.
pub async fn recent(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    limit: i64,
) -> Result<Vec<AuditEvent>, StoreError> {
    Ok(sqlx::query_as::<_, AuditEvent>(
        "SELECT at, tenant_id, token_id, subject, conversation_id, sandbox_id, tool, outcome,
                error_kind, duration_ms
         FROM audit_events WHERE tenant_id = $1 ORDER BY at DESC, id DESC LIMIT $2",
    )
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// How many calls a tenant made in the last minute, not counting those refused for making too
/// many (a client that keeps knocking must not lock itself out for ever).
pub async fn calls_last_minute(
    conn: &mut PgConnection,
    tenant_id: Uuid,
) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM audit_events
         WHERE tenant_id = $1 AND at > now() - interval '1 minute'
           AND error_kind IS DISTINCT FROM 'rate_limited'",
    )
    .bind(tenant_id)
    .fetch_one(conn)
    .await?)
}
