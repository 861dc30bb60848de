//! Pause and resume of sandboxes (issue 27): the transitions `leased → pausing → paused →
//! resuming → leased`, each one conditional statement (its own transaction unless the caller
//! wraps it in one), so that a crash between two leaves the row in a state a later pass can
//! settle, and two callers racing for one transition see exactly one of them win. A transition
//! is ended (finished or given up) only by the one that began it: each end names the
//! `transition_at` its `begin_*` returned, so a pause or resume that ran past the transition
//! deadline, was undone and begun again by another caller cannot end the new one with its own
//! (older) outcome.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;
use crate::sandboxes::{COLUMNS, SandboxRow};

/// How a pause kept a sandbox (`sandboxes.paused_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum PausedKind {
    /// A checkpoint: memory, files and installed packages.
    Memory,
    /// Where the runtime cannot checkpoint: the files of /home/user and the list of installed
    /// packages; a resume starts a fresh kernel.
    Files,
}

impl PausedKind {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            PausedKind::Memory => "memory",
            PausedKind::Files => "files",
        }
    }
}

/// Starts a pause: a leased sandbox becomes `pausing`. With `only_if_idle`, only while it is
/// still past its idle deadline (a call that touched it since the reaper read it wins) and not
/// past its lifetime (that one is closed, not paused). `None` when it is not such a sandbox.
#[tracing::instrument(skip_all, fields(sandbox_id = %id, only_if_idle))]
pub async fn begin_pause(
    conn: &mut PgConnection,
    id: &str,
    only_if_idle: bool,
) -> Result<Option<SandboxRow>, StoreError> {
    let idle = if only_if_idle {
        "AND COALESCE(last_used_at, leased_at) + make_interval(secs => idle_timeout_seconds) <= now()
         AND (expires_at IS NULL OR expires_at > now())"
    } else {
        ""
    };
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'pausing', transition_at = now()
         WHERE id = $1 AND state = 'leased' {idle}
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Ends the pause `began` (the row [`begin_pause`] returned): the `pausing` sandbox becomes
/// `paused`, resting in `snapshot_id`. `None` when it is not that pause's any more (undone, or
/// begun again by another).
#[tracing::instrument(skip_all, fields(sandbox_id = %began.id, snapshot = %snapshot_id))]
pub async fn finish_pause(
    conn: &mut PgConnection,
    began: &SandboxRow,
    snapshot_id: &str,
    kind: PausedKind,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'paused', snapshot_id = $2, paused_kind = $3,
                paused_at = now(), transition_at = NULL
         WHERE id = $1 AND state = 'pausing' AND transition_at IS NOT DISTINCT FROM $4
         RETURNING {COLUMNS}"
    )))
    .bind(&began.id)
    .bind(snapshot_id)
    .bind(kind.as_str())
    .bind(began.transition_at)
    .fetch_optional(conn)
    .await?)
}

/// Gives the pause `began` up: the `pausing` sandbox (its container still runs) is `leased`
/// again, its idle clock restarted so that the reaper does not retry at once. `None` when it
/// is not that pause's any more.
#[tracing::instrument(skip_all, fields(sandbox_id = %began.id))]
pub async fn abort_pause(
    conn: &mut PgConnection,
    began: &SandboxRow,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'leased', transition_at = NULL,
                last_used_at = GREATEST(last_used_at, now())
         WHERE id = $1 AND state = 'pausing' AND transition_at IS NOT DISTINCT FROM $2
         RETURNING {COLUMNS}"
    )))
    .bind(&began.id)
    .bind(began.transition_at)
    .fetch_optional(conn)
    .await?)
}

/// Starts a resume of a tenant's paused sandbox: it becomes `resuming`. Of two callers racing,
/// one gets the row and the other `None` (it waits for the first).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %id))]
pub async fn begin_resume(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'resuming', transition_at = now()
         WHERE id = $1 AND tenant_id = $2 AND state = 'paused'
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(tenant_id)
    .fetch_optional(conn)
    .await?)
}

/// Ends the resume `began` (the row [`begin_resume`] returned): the `resuming` sandbox is
/// `leased` again in `container_id` on `node`, its snapshot forgotten, its idle clock started
/// now (time paused never counts as idle; its own idle timeout is kept). `None` when it is not
/// that resume's any more (undone, or begun again by another).
#[tracing::instrument(skip_all, fields(sandbox_id = %began.id, node = %node))]
pub async fn finish_resume(
    conn: &mut PgConnection,
    began: &SandboxRow,
    container_id: &str,
    node: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'leased', container_id = $2, node = $3,
                snapshot_id = NULL, transition_at = NULL, last_used_at = now()
         WHERE id = $1 AND state = 'resuming' AND transition_at IS NOT DISTINCT FROM $4
         RETURNING {COLUMNS}"
    )))
    .bind(&began.id)
    .bind(container_id)
    .bind(node)
    .bind(began.transition_at)
    .fetch_optional(conn)
    .await?)
}

/// Gives the resume `began` up: the `resuming` sandbox is `paused` again (its snapshot is
/// untouched). `None` when it is not that resume's any more.
#[tracing::instrument(skip_all, fields(sandbox_id = %began.id))]
pub async fn abort_resume(
    conn: &mut PgConnection,
    began: &SandboxRow,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'paused', transition_at = NULL
         WHERE id = $1 AND state = 'resuming' AND transition_at IS NOT DISTINCT FROM $2
         RETURNING {COLUMNS}"
    )))
    .bind(&began.id)
    .bind(began.transition_at)
    .fetch_optional(conn)
    .await?)
}

/// The resume `began` cannot be: its snapshot is gone. The `resuming` sandbox is `lost` with
/// `why` (its snapshot forgotten). `None` when it is not that resume's any more.
#[tracing::instrument(skip_all, fields(sandbox_id = %began.id))]
pub async fn lose_resuming(
    conn: &mut PgConnection,
    began: &SandboxRow,
    why: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'lost', closed_at = now(), close_reason = $2,
                snapshot_id = NULL, transition_at = NULL
         WHERE id = $1 AND state = 'resuming' AND transition_at IS NOT DISTINCT FROM $3
         RETURNING {COLUMNS}"
    )))
    .bind(&began.id)
    .bind(why)
    .bind(began.transition_at)
    .fetch_optional(conn)
    .await?)
}

/// Undoes transitions a crash cut short: `pausing` rows on `node` (its process just started, so
/// no pause of it runs; `None`: any node's) or older than `deadline_seconds` go back to
/// `leased` (their container was left running), `resuming` ones older than the deadline back to
/// `paused`. Returns the rows it settled.
#[tracing::instrument(skip_all)]
pub async fn undo_cut_transitions(
    conn: &mut PgConnection,
    node: Option<&str>,
    deadline_seconds: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET
                state = CASE state WHEN 'pausing' THEN 'leased' ELSE 'paused' END,
                last_used_at = CASE state WHEN 'pausing' THEN now() ELSE last_used_at END,
                transition_at = NULL
         WHERE (state = 'pausing' AND (node = $1 OR transition_at < now() - make_interval(secs => $2)))
            OR (state = 'resuming' AND transition_at < now() - make_interval(secs => $2))
         RETURNING {COLUMNS}"
    )))
    .bind(node)
    .bind(deadline_seconds as f64)
    .fetch_all(conn)
    .await?)
}

/// Paused sandboxes past their lifetime at `now`, or paused longer than their tenant's own
/// retention (`tenants.paused_retention_seconds`), else `retention_seconds`: to be closed and
/// their snapshots deleted.
#[tracing::instrument(skip_all)]
pub async fn paused_overdue(
    conn: &mut PgConnection,
    now: DateTime<Utc>,
    retention_seconds: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE state = 'paused' AND (
             expires_at <= $1
             OR paused_at + make_interval(secs => COALESCE(
                    (SELECT n.paused_retention_seconds::double precision FROM tenants n
                      WHERE n.id = sandboxes.tenant_id),
                    $2)) <= $1)"
    )))
    .bind(now)
    .bind(retention_seconds as f64)
    .fetch_all(conn)
    .await?)
}

/// Ends a paused sandbox (`closed` with `reason`): `None` when it was not paused any more (a
/// resume began meanwhile).
#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn end_paused(
    conn: &mut PgConnection,
    id: &str,
    reason: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'closed', closed_at = now(), close_reason = $2
         WHERE id = $1 AND state = 'paused'
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(reason)
    .fetch_optional(conn)
    .await?)
}

/// How many sandboxes a tenant has paused (or pausing, or resuming).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn count_paused(conn: &mut PgConnection, tenant_id: Uuid) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM sandboxes WHERE tenant_id = $1
           AND state IN ('pausing', 'paused', 'resuming')",
    )
    .bind(tenant_id)
    .fetch_one(conn)
    .await?)
}

/// A tenant's sandboxes that are live or paused (leased, pausing, paused, resuming), those of
/// one conversation when it is named, newest first, with the sealed size of a paused one's
/// snapshot.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn held_of_tenant(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    conversation_id: Option<&str>,
) -> Result<Vec<(SandboxRow, Option<i64>)>, StoreError> {
    let columns = crate::sandboxes::columns_of("s");
    let rows: Vec<HeldRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {columns}, p.sealed_bytes AS snapshot_bytes
         FROM sandboxes s LEFT JOIN snapshots p ON p.id = s.snapshot_id AND p.tenant_id = s.tenant_id
         WHERE s.tenant_id = $1 AND s.state IN ('leased', 'pausing', 'paused', 'resuming')
           AND ($2::text IS NULL OR s.conversation_id = $2)
         ORDER BY s.leased_at DESC NULLS LAST
         LIMIT 1000"
    )))
    .bind(tenant_id)
    .bind(conversation_id)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.row, r.snapshot_bytes))
        .collect())
}

/// Every live or paused sandbox, of one tenant when named, newest first, with a paused one's
/// sealed snapshot size (for `sandgate admin sandboxes`).
#[tracing::instrument(skip_all)]
pub async fn list_held(
    conn: &mut PgConnection,
    tenant_id: Option<Uuid>,
) -> Result<Vec<(SandboxRow, Option<i64>)>, StoreError> {
    let columns = crate::sandboxes::columns_of("s");
    let rows: Vec<HeldRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {columns}, p.sealed_bytes AS snapshot_bytes
         FROM sandboxes s LEFT JOIN snapshots p ON p.id = s.snapshot_id AND p.tenant_id = s.tenant_id
         WHERE s.state IN ('leased', 'pausing', 'paused', 'resuming')
           AND ($1::uuid IS NULL OR s.tenant_id = $1)
         ORDER BY s.leased_at DESC NULLS LAST"
    )))
    .bind(tenant_id)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| (r.row, r.snapshot_bytes))
        .collect())
}

#[derive(sqlx::FromRow)]
struct HeldRow {
    #[sqlx(flatten)]
    row: SandboxRow,
    snapshot_bytes: Option<i64>,
}

/// Ends (`closed` with `reason`) every sandbox of a tenant that is pausing, paused or resuming
/// (its purge); returns the rows it ended. A pausing one's container still runs: the caller
/// removes it.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn end_all_paused_of_tenant(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    reason: &str,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'closed', closed_at = now(), close_reason = $2,
                transition_at = NULL
         WHERE tenant_id = $1 AND state IN ('pausing', 'paused', 'resuming')
         RETURNING {COLUMNS}"
    )))
    .bind(tenant_id)
    .bind(reason)
    .fetch_all(conn)
    .await?)
}

/// A tenant's own retention of paused sandboxes, seconds: `None` when there is no such tenant,
/// `Some(None)` when it has none of its own (the configured default holds).
#[tracing::instrument(skip_all, fields(%tenant))]
pub async fn paused_retention_of(
    conn: &mut PgConnection,
    tenant: uuid::Uuid,
) -> Result<Option<Option<i32>>, StoreError> {
    Ok(sqlx::query_scalar::<_, Option<i32>>(
        "SELECT paused_retention_seconds FROM tenants WHERE id = $1",
    )
    .bind(tenant)
    .fetch_optional(conn)
    .await?)
}

/// Sets (or with `None` clears) a tenant's own retention of paused sandboxes. False when there
/// is no such tenant.
#[tracing::instrument(skip_all, fields(%tenant))]
pub async fn set_paused_retention(
    conn: &mut PgConnection,
    tenant: uuid::Uuid,
    seconds: Option<i32>,
) -> Result<bool, StoreError> {
    let done = sqlx::query("UPDATE tenants SET paused_retention_seconds = $2 WHERE id = $1")
        .bind(tenant)
        .bind(seconds)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() == 1)
}
