//! Sandboxes: which container backs which sandbox, who owns it, and until when.
//!
//! Every function that reads or changes a leased sandbox takes the caller's tenant and filters
//! by it, so another tenant's sandbox is indistinguishable from one that does not exist.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// Where a sandbox is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::Type)]
#[sqlx(type_name = "text", rename_all = "lowercase")]
pub enum SandboxState {
    /// Started and ready, waiting in the pool; owned by nobody.
    Warm,
    /// Handed to a tenant.
    Leased,
    /// Being checkpointed for a pause; its container still runs (a crash returns it to
    /// `leased`).
    Pausing,
    /// Checkpointed into a snapshot (`snapshot_id`); its container is gone. The next call
    /// resumes it.
    Paused,
    /// Being restored from its snapshot onto a node (a crash returns it to `paused`).
    Resuming,
    /// Ended (closed by the user, expired, or disconnected); its container is gone.
    Closed,
    /// Its container disappeared behind our back.
    Lost,
}

/// A sandbox row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct SandboxRow {
    /// `sbx_…`.
    pub id: String,
    /// Profile it was made from.
    pub profile: String,
    /// Docker container id.
    pub container_id: String,
    /// The registry id of the node it lives on (its engine's id; see `nodes`).
    pub node: String,
    /// State.
    pub state: SandboxState,
    /// Owner (none while warm).
    pub tenant_id: Option<Uuid>,
    /// The conversation it is bound to, if any.
    pub conversation_id: Option<String>,
    /// When the container was created.
    pub created_at: DateTime<Utc>,
    /// When it was leased.
    pub leased_at: Option<DateTime<Utc>>,
    /// Last call on it.
    pub last_used_at: Option<DateTime<Utc>>,
    /// Idle timeout in seconds.
    pub idle_timeout_seconds: Option<i32>,
    /// Hard end of life.
    pub expires_at: Option<DateTime<Utc>>,
    /// When it ended.
    pub closed_at: Option<DateTime<Utc>>,
    /// Why it ended (`closed`, `idle`, `lifetime`, `lost`, `disconnected`…).
    pub close_reason: Option<String>,
    /// The OAuth grant (connection) whose token leased it, if any: disconnecting the app closes it.
    pub grant_id: Option<Uuid>,
    /// The snapshot a paused (or resuming) sandbox rests in.
    pub snapshot_id: Option<String>,
    /// When it was last paused.
    pub paused_at: Option<DateTime<Utc>>,
    /// When it last went into `pausing` or `resuming`.
    pub transition_at: Option<DateTime<Utc>>,
    /// How its last pause kept it: `memory` or `files`.
    pub paused_kind: Option<String>,
}

impl SandboxRow {
    /// When the idle timeout will end it, given its last use.
    pub fn idle_deadline(&self) -> Option<DateTime<Utc>> {
        let last = self.last_used_at.or(self.leased_at)?;
        Some(last + chrono::Duration::seconds(i64::from(self.idle_timeout_seconds?)))
    }
}

pub(crate) const COLUMNS: &str = "id, profile, container_id, node, state, tenant_id, conversation_id, \
     created_at, leased_at, last_used_at, idle_timeout_seconds, expires_at, closed_at, close_reason, grant_id, \
     snapshot_id, paused_at, transition_at, paused_kind";

/// A sandbox being leased to a tenant.
#[derive(Debug, Clone)]
pub struct NewLease<'a> {
    /// The owner.
    pub tenant_id: Uuid,
    /// The conversation to bind, if any.
    pub conversation_id: Option<&'a str>,
    /// Idle timeout, seconds.
    pub idle_timeout_seconds: i32,
    /// Hard end of life.
    pub expires_at: DateTime<Utc>,
    /// The grant whose token asked for it, if any.
    pub grant_id: Option<Uuid>,
}

/// Retires a warm pool member the pool no longer needs (demand fell): its row is deleted, only
/// while it is still `warm` (a warm row belongs to no tenant and has no history to keep). `None`
/// when someone leased (or ended) it meanwhile, or it is not recorded yet: then its container is
/// not the caller's to remove.
#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn retire_warm(
    conn: &mut PgConnection,
    id: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "DELETE FROM sandboxes WHERE id = $1 AND state = 'warm' RETURNING {COLUMNS}"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Records a container this process created as a warm pool member. Recording one that is
/// recorded already does nothing.
#[tracing::instrument(skip_all, fields(sandbox_id = %id, node = %node))]
pub async fn insert_warm(
    conn: &mut PgConnection,
    id: &str,
    profile: &str,
    container_id: &str,
    node: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO sandboxes (id, profile, container_id, node, state) VALUES ($1, $2, $3, $4, 'warm')
         ON CONFLICT DO NOTHING",
    )
    .bind(id)
    .bind(profile)
    .bind(container_id)
    .bind(node)
    .execute(conn)
    .await?;
    Ok(())
}

/// Flips one warm row of `profile` to leased, on a node of `nodes` (the placement's choice, best
/// first): a row of the first node that has one, the oldest of that node's. Rows of nodes not
/// listed are never taken. `FOR UPDATE SKIP LOCKED` makes concurrent leases (from any number of
/// gateways) take different rows. `None` when no listed node has one.
#[tracing::instrument(skip_all)]
pub async fn lease_warm(
    conn: &mut PgConnection,
    profile: &str,
    nodes: &[String],
    lease: &NewLease<'_>,
) -> Result<Option<SandboxRow>, StoreError> {
    if nodes.is_empty() {
        return Ok(None);
    }
    let row = sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'leased', tenant_id = $3, conversation_id = $4,
                leased_at = now(), last_used_at = now(), idle_timeout_seconds = $5, expires_at = $6, grant_id = $7
         WHERE id = (SELECT id FROM sandboxes
                     WHERE state = 'warm' AND profile = $1 AND node = ANY($2)
                     ORDER BY array_position($2, node), created_at
                     FOR UPDATE SKIP LOCKED LIMIT 1)
         RETURNING {COLUMNS}"
    )))
    .bind(profile)
    .bind(nodes)
    .bind(lease.tenant_id)
    .bind(lease.conversation_id)
    .bind(lease.idle_timeout_seconds)
    .bind(lease.expires_at)
    .bind(lease.grant_id)
    .fetch_optional(conn)
    .await
    .map_err(conflict_on_unique("conversation already has a sandbox"))?;
    Ok(row)
}

/// Gives the rows recorded under a node's old name (`"local"` or the `docker.host` URL, before
/// nodes had registry ids) the node's registry id, so its reconciliation and reaper find them.
#[tracing::instrument(skip_all, fields(node = %node))]
pub async fn rename_node(
    conn: &mut PgConnection,
    old: &str,
    node: &str,
) -> Result<u64, StoreError> {
    Ok(
        sqlx::query("UPDATE sandboxes SET node = $2 WHERE node = $1")
            .bind(old)
            .bind(node)
            .execute(conn)
            .await?
            .rows_affected(),
    )
}

/// The lost-node sweep, one statement: every warm or leased sandbox on a node whose heartbeat is
/// older than `lost_after_seconds` becomes `lost`, its reason naming the node and when it
/// stopped answering. Idempotent (ended rows are left alone); returns the rows it ended.
#[tracing::instrument(skip_all)]
pub async fn sweep_silent_nodes(
    conn: &mut PgConnection,
    lost_after_seconds: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let columns = columns_of("s");
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes s SET state = 'lost', closed_at = now(),
                close_reason = format('it was on node %s (%s), which stopped answering at %s',
                    n.name, n.id,
                    to_char(n.heartbeat_at AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS \"UTC\"'))
         FROM nodes n
         WHERE s.node = n.id AND s.state IN ('warm', 'leased')
           AND n.heartbeat_at < now() - make_interval(secs => $1)
         RETURNING {columns}"
    )))
    .bind(lost_after_seconds as f64)
    .fetch_all(conn)
    .await?)
}

/// Records a freshly created container as leased straight away (cold start).
#[tracing::instrument(skip_all, fields(sandbox_id = %id, node = %node))]
pub async fn insert_leased(
    conn: &mut PgConnection,
    id: &str,
    profile: &str,
    container_id: &str,
    node: &str,
    lease: &NewLease<'_>,
) -> Result<SandboxRow, StoreError> {
    sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO sandboxes (id, profile, container_id, node, state, tenant_id, conversation_id,
                                leased_at, last_used_at, idle_timeout_seconds, expires_at, grant_id)
         VALUES ($1, $2, $3, $4, 'leased', $5, $6, now(), now(), $7, $8, $9)
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(profile)
    .bind(container_id)
    .bind(node)
    .bind(lease.tenant_id)
    .bind(lease.conversation_id)
    .bind(lease.idle_timeout_seconds)
    .bind(lease.expires_at)
    .bind(lease.grant_id)
    .fetch_one(conn)
    .await
    .map_err(conflict_on_unique("conversation already has a sandbox"))
}

/// A tenant's sandbox by id, in any state. Another tenant's sandbox is `None`, like a missing one.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %id))]
pub async fn get(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE id = $1 AND tenant_id = $2"
    )))
    .bind(id)
    .bind(tenant_id)
    .fetch_optional(conn)
    .await?)
}

/// The sandbox bound to a tenant's conversation that is live or paused (leased, pausing,
/// paused or resuming), if any.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn by_conversation(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    conversation_id: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes
         WHERE tenant_id = $1 AND conversation_id = $2
           AND state IN ('leased', 'pausing', 'paused', 'resuming')"
    )))
    .bind(tenant_id)
    .bind(conversation_id)
    .fetch_optional(conn)
    .await?)
}

/// The most recent sandbox (any state) a tenant's conversation was bound to: lets a call on a
/// conversation whose sandbox ended explain why.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn last_for_conversation(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    conversation_id: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE tenant_id = $1 AND conversation_id = $2
         ORDER BY leased_at DESC NULLS LAST LIMIT 1"
    )))
    .bind(tenant_id)
    .bind(conversation_id)
    .fetch_optional(conn)
    .await?)
}

/// Marks a call on a leased sandbox: refreshes `last_used_at` (never moving it back: an
/// end-of-call touch may have set it up to a second ahead, see [`touch_live`]) and, if given,
/// sets a new idle timeout. Returns the updated row, or `None` if it is not a live sandbox of
/// this tenant.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %id))]
pub async fn touch(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
    idle_timeout_seconds: Option<i32>,
) -> Result<Option<SandboxRow>, StoreError> {
    touch_where(conn, tenant_id, id, idle_timeout_seconds, "TRUE").await
}

/// Lookup, ownership check and idle touch in one statement: refreshes `last_used_at` (and, if
/// given, the idle timeout) of a tenant's leased sandbox that is not past its idle deadline or
/// its lifetime, and returns the row. `None` when it is not such a sandbox (missing, another
/// tenant's, ended, or overdue): the caller reads the row to say which.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %id))]
pub async fn touch_in_time(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
    idle_timeout_seconds: Option<i32>,
) -> Result<Option<SandboxRow>, StoreError> {
    let in_time = "(expires_at IS NULL OR expires_at > now())
           AND (idle_timeout_seconds IS NULL OR coalesce(last_used_at, leased_at) IS NULL
                OR coalesce(last_used_at, leased_at)
                   + make_interval(secs => idle_timeout_seconds) > now())";
    touch_where(conn, tenant_id, id, idle_timeout_seconds, in_time).await
}

/// The touch of a tenant's leased sandbox where `condition` (a constant SQL expression of
/// ours, never input) holds too.
async fn touch_where(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
    idle_timeout_seconds: Option<i32>,
    condition: &str,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET last_used_at = GREATEST(last_used_at, now()),
                idle_timeout_seconds = COALESCE($3, idle_timeout_seconds)
         WHERE id = $1 AND tenant_id = $2 AND state = 'leased' AND {condition}
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(tenant_id)
    .bind(idle_timeout_seconds)
    .fetch_optional(conn)
    .await?)
}

/// Why a sandbox ended, as kept in `sandboxes.close_reason` (text: `closed`, `idle`,
/// `lifetime`, `disconnected`, or for a lost one what became of its container).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// Its tenant closed it.
    Closed,
    /// Its idle timeout passed.
    Idle,
    /// Its maximum lifetime passed.
    Lifetime,
    /// The app whose token leased it was disconnected.
    Disconnected,
    /// Its container vanished or died; what happened, in words.
    Lost(String),
}

impl CloseReason {
    /// The stored text.
    pub fn as_str(&self) -> &str {
        match self {
            CloseReason::Closed => "closed",
            CloseReason::Idle => "idle",
            CloseReason::Lifetime => "lifetime",
            CloseReason::Disconnected => "disconnected",
            CloseReason::Lost(why) => why,
        }
    }

    /// The state a sandbox ending for this reason is left in.
    pub fn state(&self) -> SandboxState {
        match self {
            CloseReason::Lost(_) => SandboxState::Lost,
            _ => SandboxState::Closed,
        }
    }

    /// Reads a stored reason of a row in `state`.
    pub fn from_stored(state: SandboxState, text: &str) -> Self {
        match (state, text) {
            (SandboxState::Lost, why) => CloseReason::Lost(why.to_owned()),
            (_, "idle") => CloseReason::Idle,
            (_, "lifetime") => CloseReason::Lifetime,
            (_, "disconnected") => CloseReason::Disconnected,
            _ => CloseReason::Closed,
        }
    }
}

impl SandboxRow {
    /// Why the sandbox ended, when it has.
    pub fn close_reason(&self) -> Option<CloseReason> {
        self.close_reason
            .as_deref()
            .map(|text| CloseReason::from_stored(self.state, text))
    }
}

/// Ends a sandbox (`closed`, or `lost` for [`CloseReason::Lost`]) with its reason; returns the
/// row if it was live.
#[tracing::instrument(skip_all, fields(sandbox_id = %id))]
pub async fn end(
    conn: &mut PgConnection,
    id: &str,
    reason: &CloseReason,
) -> Result<Option<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = $2, closed_at = now(), close_reason = $3
         WHERE id = $1 AND state IN ('warm', 'leased')
         RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(reason.state())
    .bind(reason.as_str())
    .fetch_optional(conn)
    .await?)
}

/// How many live sandboxes a tenant has.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn count_live(conn: &mut PgConnection, tenant_id: Uuid) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM sandboxes WHERE tenant_id = $1 AND state = 'leased'",
    )
    .bind(tenant_id)
    .fetch_one(conn)
    .await?)
}

/// Live sandboxes leased under a grant (closed when the grant's app is disconnected).
#[tracing::instrument(skip_all, fields(grant_id = %grant_id))]
pub async fn live_of_grant(
    conn: &mut PgConnection,
    grant_id: Uuid,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE grant_id = $1 AND state = 'leased'"
    )))
    .bind(grant_id)
    .fetch_all(conn)
    .await?)
}

/// Ends every live sandbox of a tenant (`closed`, with `reason`) and forgets the conversation
/// ids of all its sandboxes (they may name a customer's ticket); returns the rows it ended, whose
/// containers the caller removes.
pub async fn end_all_of_tenant(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    reason: &str,
) -> Result<Vec<SandboxRow>, StoreError> {
    let ended = sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE sandboxes SET state = 'closed', closed_at = now(), close_reason = $2
         WHERE tenant_id = $1 AND state = 'leased'
         RETURNING {COLUMNS}"
    )))
    .bind(tenant_id)
    .bind(reason)
    .fetch_all(&mut *conn)
    .await?;
    sqlx::query("UPDATE sandboxes SET conversation_id = NULL WHERE tenant_id = $1")
        .bind(tenant_id)
        .execute(conn)
        .await?;
    Ok(ended)
}

/// [`COLUMNS`], each qualified with the table alias `alias` (for statements that join).
pub(crate) fn columns_of(alias: &str) -> String {
    COLUMNS
        .split(", ")
        .map(|c| format!("{alias}.{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A tenant's `lost` sandboxes on nodes silent past `lost_after_seconds`: the lost-node sweep
/// ended their rows, but their containers (with the tenant's files) stay on their engines until
/// their node answers again and its reconciliation removes them.
#[tracing::instrument(skip_all)]
pub async fn lost_on_silent_nodes(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    lost_after_seconds: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    let columns = columns_of("s");
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM sandboxes s JOIN nodes n ON n.id = s.node
         WHERE s.tenant_id = $1 AND s.state = 'lost'
           AND n.heartbeat_at < now() - make_interval(secs => $2)"
    )))
    .bind(tenant_id)
    .bind(lost_after_seconds as f64)
    .fetch_all(conn)
    .await?)
}

/// Live sandboxes (warm and leased) on `node`, for reconciliation with the Docker engine.
#[tracing::instrument(skip_all, fields(node = %node))]
pub async fn live_on_node(
    conn: &mut PgConnection,
    node: &str,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE node = $1 AND state IN ('warm', 'leased')"
    )))
    .bind(node)
    .fetch_all(conn)
    .await?)
}

/// How many leased sandboxes `node` runs (its heartbeat reports it), counted in the database.
#[tracing::instrument(skip_all, fields(node = %node))]
pub async fn count_leased_on_node(conn: &mut PgConnection, node: &str) -> Result<i64, StoreError> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM sandboxes WHERE node = $1 AND state = 'leased'")
            .bind(node)
            .fetch_one(conn)
            .await?,
    )
}

/// Leased sandboxes past their idle deadline at `now` and not past their lifetime, on this
/// process's own node (`own_node`) or on a registered node that answers (heartbeat within
/// `away_after_seconds`): the ones a process holding the key custody pauses (a split
/// deployment's nodes leave them to it). A sandbox on an *away* node (silent, not yet lost) is
/// left out: its node cannot checkpoint it now, and a pause begun there would hold the row
/// `pausing` (its calls waiting on it instead of hearing that the node is away) until the RPC
/// gave up, then restart its idle clock. Each is then taken by the conditional
/// `pauses::begin_pause`, so racing processes pause each once.
#[tracing::instrument(skip_all)]
pub async fn idle_anywhere(
    conn: &mut PgConnection,
    now: DateTime<Utc>,
    own_node: Option<&str>,
    away_after_seconds: i64,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE state = 'leased'
           AND (expires_at IS NULL OR expires_at > $1)
           AND COALESCE(last_used_at, leased_at) + make_interval(secs => idle_timeout_seconds) <= $1
           AND (node = $2 OR EXISTS (
                 SELECT 1 FROM nodes n WHERE n.id = sandboxes.node
                    AND n.heartbeat_at > now() - make_interval(secs => $3)))"
    )))
    .bind(now)
    .bind(own_node)
    .bind(away_after_seconds as f64)
    .fetch_all(conn)
    .await?)
}

/// Leased sandboxes on `node` past their idle deadline or hard expiry at `now`.
#[tracing::instrument(skip_all, fields(node = %node))]
pub async fn overdue(
    conn: &mut PgConnection,
    node: &str,
    now: DateTime<Utc>,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE state = 'leased' AND node = $2 AND (
             expires_at <= $1
             OR COALESCE(last_used_at, leased_at) + make_interval(secs => idle_timeout_seconds) <= $1)"
    )))
    .bind(now)
    .bind(node)
    .fetch_all(conn)
    .await?)
}

/// Refreshes the idle clock of leased sandboxes, whoever owns them (a call on them just ended,
/// or is still running), to `at` unless it already reads later: the clock never moves back, so
/// a writer that sets it a moment ahead (coalescing the next calls' writes) can rely on it.
/// Does nothing to a sandbox that is not live.
#[tracing::instrument(skip_all)]
pub async fn touch_live(
    conn: &mut PgConnection,
    ids: &[String],
    at: DateTime<Utc>,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE sandboxes SET last_used_at = GREATEST(last_used_at, $2)
         WHERE id = ANY($1) AND state = 'leased'",
    )
    .bind(ids)
    .bind(at)
    .execute(conn)
    .await?;
    Ok(())
}

/// The rows of the given sandbox ids, in any state (for checking a process's warm pool against
/// the records).
#[tracing::instrument(skip_all)]
pub async fn by_ids(
    conn: &mut PgConnection,
    ids: &[String],
) -> Result<Vec<SandboxRow>, StoreError> {
    where_any(conn, "id", ids).await
}

/// The rows of the given container ids, in any state (for reconciliation).
#[tracing::instrument(skip_all)]
pub async fn by_containers(
    conn: &mut PgConnection,
    container_ids: &[String],
) -> Result<Vec<SandboxRow>, StoreError> {
    where_any(conn, "container_id", container_ids).await
}

/// The rows, in any state, whose `column` (one of ours, never input) is one of `values`.
async fn where_any(
    conn: &mut PgConnection,
    column: &'static str,
    values: &[String],
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE {column} = ANY($1)"
    )))
    .bind(values)
    .fetch_all(conn)
    .await?)
}

/// Live sandboxes, optionally of one tenant, newest first (for `sandgate admin sandboxes`).
#[tracing::instrument(skip_all)]
pub async fn list_live(
    conn: &mut PgConnection,
    tenant_id: Option<Uuid>,
) -> Result<Vec<SandboxRow>, StoreError> {
    Ok(sqlx::query_as::<_, SandboxRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM sandboxes WHERE state = 'leased' AND ($1::uuid IS NULL OR tenant_id = $1)
         ORDER BY leased_at DESC"
    )))
    .bind(tenant_id)
    .fetch_all(conn)
    .await?)
}

pub(crate) fn conflict_on_unique(what: &'static str) -> impl Fn(sqlx::Error) -> StoreError {
    move |err| match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict(what),
        _ => StoreError::from(err),
    }
}
