//! A tenant's conversations as the console lists them: one line per conversation its sandboxes
//! were bound to, from the newest sandbox of each.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;
use crate::sandboxes::SandboxState;

/// One conversation, as of its newest sandbox.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ConversationLine {
    /// The conversation id.
    pub conversation_id: String,
    /// Its newest sandbox.
    pub sandbox_id: String,
    /// That sandbox's state.
    pub state: SandboxState,
    /// The last call on it (or its lease, before any call).
    pub last_activity: Option<DateTime<Utc>>,
    /// The person who acted last, when a person acted after the bot's last cell or command.
    pub person_last: Option<String>,
}

/// The tenant's conversations, most recently active first, at most `limit`; with `search`,
/// only those whose id contains it (case-insensitive).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn list(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    search: Option<&str>,
    limit: i64,
) -> Result<Vec<ConversationLine>, StoreError> {
    Ok(sqlx::query_as::<_, ConversationLine>(
        "SELECT * FROM (
             SELECT DISTINCT ON (conversation_id) conversation_id, id AS sandbox_id, state,
                    coalesce(last_used_at, leased_at) AS last_activity,
                    CASE WHEN people_acted_at IS NOT NULL
                          AND (people_told_at IS NULL OR people_told_at < people_acted_at)
                         THEN people_acted_by END AS person_last
             FROM sandboxes
             WHERE tenant_id = $1 AND conversation_id IS NOT NULL
               AND ($2::text IS NULL OR strpos(lower(conversation_id), lower($2)) > 0)
             ORDER BY conversation_id, leased_at DESC NULLS LAST
         ) c
         ORDER BY last_activity DESC NULLS LAST
         LIMIT $3",
    )
    .bind(tenant_id)
    .bind(search)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}
