//! The audit trail of download links: one row per opening (tenant, link, sandbox, path,
//! outcome). Never the file's content.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// One opening of a download link.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct DownloadEvent {
    /// When.
    pub at: DateTime<Utc>,
    /// The link's tenant.
    pub tenant_id: Uuid,
    /// The link's id (not the link).
    pub link_id: String,
    /// The app connection that made the link, if any.
    pub grant_id: Option<Uuid>,
    /// The access token that made the link, if any.
    pub token_id: Option<String>,
    /// `file`, `notebook` or `html`.
    pub kind: String,
    /// The sandbox.
    pub sandbox_id: Option<String>,
    /// The conversation (a conversation's transcript).
    pub conversation_id: Option<String>,
    /// The file's path (files).
    pub path: Option<String>,
    /// `ok`, `refused`, `failed` or `cancelled` (the downloader went away).
    pub outcome: String,
    /// Why it was refused or failed.
    pub reason: Option<String>,
    /// Bytes sent.
    pub bytes: Option<i64>,
}

/// Records an opening.
#[tracing::instrument(skip_all, fields(tenant_id = %event.tenant_id))]
pub async fn record(conn: &mut PgConnection, event: &DownloadEvent) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO download_events (at, tenant_id, link_id, grant_id, token_id, kind, sandbox_id,
                                      conversation_id, path, outcome, reason, bytes)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
    )
    .bind(event.at)
    .bind(event.tenant_id)
    .bind(&event.link_id)
    .bind(event.grant_id)
    .bind(&event.token_id)
    .bind(&event.kind)
    .bind(&event.sandbox_id)
    .bind(&event.conversation_id)
    .bind(&event.path)
    .bind(&event.outcome)
    .bind(&event.reason)
    .bind(event.bytes)
    .execute(conn)
    .await?;
    Ok(())
}

/// A tenant's most recent openings, newest first.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn recent(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    limit: i64,
) -> Result<Vec<DownloadEvent>, StoreError> {
    Ok(sqlx::query_as::<_, DownloadEvent>(
        "SELECT at, tenant_id, link_id, grant_id, token_id, kind, sandbox_id, conversation_id,
                path, outcome, reason, bytes
         FROM download_events WHERE tenant_id = $1 ORDER BY at DESC, id DESC LIMIT $2",
    )
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}
