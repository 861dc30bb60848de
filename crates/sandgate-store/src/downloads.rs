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
    /// What the link opened.
    pub kind: DownloadKind,
    /// The sandbox.
    pub sandbox_id: Option<String>,
    /// The conversation (a conversation's transcript).
    pub conversation_id: Option<String>,
    /// The file's path (files).
    pub path: Option<String>,
    /// How the opening ended.
    pub outcome: DownloadOutcome,
    /// Why it was refused or failed.
    pub reason: Option<DownloadReason>,
    /// Bytes sent.
    pub bytes: Option<i64>,
}

/// What a download link opens (stored as text in `download_events.kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum DownloadKind {
    /// A file in a live sandbox.
    File,
    /// A transcript as a Jupyter notebook.
    Notebook,
    /// A transcript as an HTML page.
    Html,
}

/// How an opening ended (stored as text in `download_events.outcome`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum DownloadOutcome {
    /// Served whole.
    Ok,
    /// The link may not be opened (now).
    Refused,
    /// Serving it went wrong on our side.
    Failed,
    /// The downloader went away before the end.
    Cancelled,
}

/// Why an opening was refused or failed (stored as text in `download_events.reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "snake_case")]
pub enum DownloadReason {
    /// Not a link we sealed.
    Invalid,
    /// Past its expiry.
    Expired,
    /// Its app connection or token was revoked.
    Revoked,
    /// The transcript it names is no longer kept.
    TranscriptGone,
    /// A per-link or per-tenant rate limit.
    RateLimited,
    /// The sandbox ended, was lost, or is not the tenant's.
    SandboxGone,
    /// Postgres or the sandbox's node was away.
    Unavailable,
    /// A tenant limit or quota.
    Limit,
    /// The file is no longer there (moved, removed, too large).
    FileGone,
    /// The file stream broke off in the sandbox.
    Sandbox,
    /// Anything else on our side.
    Internal,
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
    .bind(event.kind)
    .bind(&event.sandbox_id)
    .bind(&event.conversation_id)
    .bind(&event.path)
    .bind(event.outcome)
    .bind(event.reason)
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
