//! Marks of calls in flight that outlive a second (`sandbox_call_marks`): every replica's reaper
//! leaves a sandbox with a live mark alone, whichever replica runs the call. A mark expires by
//! itself when its replica stops renewing it (it died).

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// Records or renews the mark `mark_id` of a call on `sandbox_id`, live until `until`. Does
/// nothing when the sandbox has no row.
#[tracing::instrument(skip_all, fields(sandbox_id = %sandbox_id))]
pub async fn renew(
    conn: &mut PgConnection,
    mark_id: Uuid,
    sandbox_id: &str,
    until: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO sandbox_call_marks (mark_id, sandbox_id, until)
         SELECT $1, id, $3 FROM sandboxes WHERE id = $2
         ON CONFLICT (mark_id) DO UPDATE SET until = EXCLUDED.until",
    )
    .bind(mark_id)
    .bind(sandbox_id)
    .bind(until)
    .execute(conn)
    .await?;
    Ok(())
}

/// Removes a call's mark (the call ended).
#[tracing::instrument(skip_all)]
pub async fn remove(conn: &mut PgConnection, mark_id: Uuid) -> Result<(), StoreError> {
    sqlx::query("DELETE FROM sandbox_call_marks WHERE mark_id = $1")
        .bind(mark_id)
        .execute(conn)
        .await?;
    Ok(())
}

/// Which of `sandbox_ids` have a call mark live at `now` (a call runs on them somewhere).
#[tracing::instrument(skip_all)]
pub async fn marked(
    conn: &mut PgConnection,
    sandbox_ids: &[String],
    now: DateTime<Utc>,
) -> Result<HashSet<String>, StoreError> {
    if sandbox_ids.is_empty() {
        return Ok(HashSet::new());
    }
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT sandbox_id FROM sandbox_call_marks
          WHERE sandbox_id = ANY($1) AND until > $2",
    )
    .bind(sandbox_ids)
    .bind(now)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Deletes marks that expired before `before` (left by replicas that died); returns how many.
#[tracing::instrument(skip_all)]
pub async fn purge_expired(
    conn: &mut PgConnection,
    before: DateTime<Utc>,
) -> Result<u64, StoreError> {
    Ok(
        sqlx::query("DELETE FROM sandbox_call_marks WHERE until <= $1")
            .bind(before)
            .execute(conn)
            .await?
            .rows_affected(),
    )
}
