//! Sandbox nodes: one row per Docker engine (docs/scale-out.md). A node registers at start and
//! heartbeats; a second node on the same engine is refused while the first one lives (it holds
//! the engine's advisory lock on a connection of its own).

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A node's row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct NodeRow {
    /// The engine's id (`docker info`).
    pub id: String,
    /// The engine host's name.
    pub name: String,
    /// What gateways dial.
    pub advertise_url: String,
    /// Most live sandboxes.
    pub slots: i32,
    /// The engine host's memory.
    pub memory_bytes: i64,
    /// Leased sandboxes at the last heartbeat.
    pub live_sandboxes: i32,
    /// Warm sandboxes waiting at the last heartbeat.
    pub ready_sandboxes: i32,
    /// Whether it takes no new leases.
    pub draining: bool,
    /// The registering process.
    pub process: Uuid,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
    /// When it registered.
    pub started_at: DateTime<Utc>,
}

/// What a node registers.
#[derive(Debug, Clone)]
pub struct NewNode<'a> {
    /// The engine's id.
    pub id: &'a str,
    /// The engine host's name.
    pub name: &'a str,
    /// What gateways dial.
    pub advertise_url: &'a str,
    /// Most live sandboxes.
    pub slots: i32,
    /// The host's memory.
    pub memory_bytes: i64,
    /// Whether it starts draining.
    pub draining: bool,
    /// The registering process.
    pub process: Uuid,
}

const COLUMNS: &str = "id, name, advertise_url, slots, memory_bytes, live_sandboxes, \
                       ready_sandboxes, draining, process, heartbeat_at, started_at";

/// Records a heartbeat with the node's numbers; returns whether the node is draining now
/// (an operator's `admin nodes drain` reaches the node this way), or `None` when the row
/// belongs to another process now (this one was taken for gone and replaced).
#[tracing::instrument(skip_all, fields(node = %id))]
pub async fn heartbeat(
    conn: &mut PgConnection,
    id: &str,
    process: Uuid,
    live: i32,
    ready: i32,
) -> Result<Option<bool>, StoreError> {
    Ok(sqlx::query_scalar(
        "UPDATE nodes SET heartbeat_at = now(), live_sandboxes = $3, ready_sandboxes = $4
         WHERE id = $1 AND process = $2
         RETURNING draining",
    )
    .bind(id)
    .bind(process)
    .bind(live)
    .bind(ready)
    .fetch_optional(conn)
    .await?)
}

/// Every registered node, by name.
#[tracing::instrument(skip_all)]
pub async fn list(conn: &mut PgConnection) -> Result<Vec<NodeRow>, StoreError> {
    Ok(sqlx::query_as::<_, NodeRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM nodes ORDER BY name, id"
    )))
    .fetch_all(conn)
    .await?)
}

/// Sets a node's draining flag; `None` when no node has that id.
#[tracing::instrument(skip_all, fields(node = %id))]
pub async fn set_draining(
    conn: &mut PgConnection,
    id: &str,
    draining: bool,
) -> Result<Option<NodeRow>, StoreError> {
    Ok(sqlx::query_as::<_, NodeRow>(sqlx::AssertSqlSafe(format!(
        "UPDATE nodes SET draining = $2 WHERE id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id)
    .bind(draining)
    .fetch_optional(conn)
    .await?)
}

/// A node's row.
#[tracing::instrument(skip_all, fields(node = %id))]
pub async fn get(conn: &mut PgConnection, id: &str) -> Result<Option<NodeRow>, StoreError> {
    Ok(sqlx::query_as::<_, NodeRow>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM nodes WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}

/// Takes the session-level advisory lock that says "a live process serves this engine" on
/// `conn` (a connection the node keeps for its whole life: Postgres releases the lock when the
/// connection ends, so a crashed node frees its engine at once). `false` when another live
/// process holds it.
#[tracing::instrument(skip_all, fields(node = %id))]
pub async fn try_lock(conn: &mut PgConnection, id: &str) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT pg_try_advisory_lock(hashtextextended('sandgate-node:' || $1, 0))",
    )
    .bind(id)
    .fetch_one(conn)
    .await?)
}

/// Registers a node whose engine lock ([`try_lock`]) this process holds: the row is created or
/// taken over whatever its heartbeat says (the lock proves its last holder is gone).
#[tracing::instrument(skip_all, fields(node = %node.id))]
pub async fn register_locked(
    conn: &mut PgConnection,
    node: &NewNode<'_>,
) -> Result<NodeRow, StoreError> {
    Ok(sqlx::query_as::<_, NodeRow>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO nodes (id, name, advertise_url, slots, memory_bytes, draining, process)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (id) DO UPDATE SET
             name = EXCLUDED.name, advertise_url = EXCLUDED.advertise_url,
             slots = EXCLUDED.slots, memory_bytes = EXCLUDED.memory_bytes,
             draining = nodes.draining OR EXCLUDED.draining, process = EXCLUDED.process,
             live_sandboxes = 0, ready_sandboxes = 0,
             heartbeat_at = now(), started_at = now()
         RETURNING {COLUMNS}"
    )))
    .bind(node.id)
    .bind(node.name)
    .bind(node.advertise_url)
    .bind(node.slots)
    .bind(node.memory_bytes)
    .bind(node.draining)
    .bind(node.process)
    .fetch_one(conn)
    .await?)
}

/// A node's row with the number of sandboxes leased on it now (from `sandboxes`, not the
/// heartbeat's count), for placing a lease.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct NodeLoad {
    /// The node's row.
    #[sqlx(flatten)]
    pub node: NodeRow,
    /// Sandboxes leased on it now.
    pub leased: i64,
}

/// Every node that may take a new lease: heartbeat within `heard_within_seconds` (callers pass
/// the away deadline: an away node takes no new lease), not draining; each with its leased
/// count.
#[tracing::instrument(skip_all)]
pub async fn placeable(
    conn: &mut PgConnection,
    heard_within_seconds: i64,
) -> Result<Vec<NodeLoad>, StoreError> {
    Ok(sqlx::query_as::<_, NodeLoad>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS},
                (SELECT count(*) FROM sandboxes s WHERE s.node = nodes.id AND s.state = 'leased')
                    AS leased
         FROM nodes
         WHERE NOT draining AND heartbeat_at > now() - make_interval(secs => $1)
         ORDER BY name, id"
    )))
    .bind(heard_within_seconds as f64)
    .fetch_all(conn)
    .await?)
}

/// How many nodes are live (a heartbeat within `within_seconds`) and how many of those take new
/// leases (not draining).
#[tracing::instrument(skip_all)]
pub async fn live_counts(
    conn: &mut PgConnection,
    within_seconds: i64,
) -> Result<LiveCounts, StoreError> {
    Ok(sqlx::query_as::<_, LiveCounts>(
        "SELECT count(*) AS live, count(*) FILTER (WHERE NOT draining) AS placeable
         FROM nodes
         WHERE heartbeat_at > now() - make_interval(secs => $1)",
    )
    .bind(within_seconds as f64)
    .fetch_one(conn)
    .await?)
}

/// The answer of [`live_counts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, sqlx::FromRow)]
pub struct LiveCounts {
    /// Nodes with a recent heartbeat.
    pub live: i64,
    /// Of those, the ones not draining.
    pub placeable: i64,
}

/// A node's numbers as the tables hold them, for metrics: what any process (a gateway-only
/// replica too) can export without asking the node.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct NodePool {
    /// The node's registry id.
    pub id: String,
    /// Its host's name.
    pub name: String,
    /// Most live sandboxes.
    pub slots: i32,
    /// Whether it takes no new leases.
    pub draining: bool,
    /// Seconds since its last heartbeat.
    pub heartbeat_age_seconds: f64,
    /// Warm sandboxes recorded on it (ready to lease).
    pub ready: i64,
    /// Leased sandboxes on it.
    pub leased: i64,
}

/// Every registered node with its warm and leased counts from `sandboxes`.
#[tracing::instrument(skip_all)]
pub async fn pools(conn: &mut PgConnection) -> Result<Vec<NodePool>, StoreError> {
    Ok(sqlx::query_as::<_, NodePool>(
        "SELECT n.id, n.name, n.slots, n.draining,
                EXTRACT(EPOCH FROM now() - n.heartbeat_at)::float8 AS heartbeat_age_seconds,
                count(s.id) FILTER (WHERE s.state = 'warm') AS ready,
                count(s.id) FILTER (WHERE s.state = 'leased') AS leased
         FROM nodes n
         LEFT JOIN sandboxes s ON s.node = n.id AND s.state IN ('warm', 'leased')
         GROUP BY n.id
         ORDER BY n.name, n.id",
    )
    .fetch_all(conn)
    .await?)
}
