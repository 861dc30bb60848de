//! Sandbox nodes: one row per Docker engine (docs/scale-out.md). A node registers at start and
//! heartbeats; a second node on the same engine is refused while the first one's heartbeat is
//! live.

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

/// Registers a node: a new engine gets a row; an engine whose row's heartbeat is older than
/// `lost_after_seconds` is taken over. `None` when another process's heartbeat on the same
/// engine is live (the caller refuses to start and says which).
#[tracing::instrument(skip_all, fields(node = %node.id))]
pub async fn register(
    conn: &mut PgConnection,
    node: &NewNode<'_>,
    lost_after_seconds: i64,
) -> Result<Option<NodeRow>, StoreError> {
    let row = sqlx::query_as::<_, NodeRow>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO nodes (id, name, advertise_url, slots, memory_bytes, draining, process)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (id) DO UPDATE SET
             name = EXCLUDED.name, advertise_url = EXCLUDED.advertise_url,
             slots = EXCLUDED.slots, memory_bytes = EXCLUDED.memory_bytes,
             draining = nodes.draining OR EXCLUDED.draining, process = EXCLUDED.process,
             live_sandboxes = 0, ready_sandboxes = 0,
             heartbeat_at = now(), started_at = now()
         WHERE nodes.heartbeat_at < now() - make_interval(secs => $8)
         RETURNING {COLUMNS}"
    )))
    .bind(node.id)
    .bind(node.name)
    .bind(node.advertise_url)
    .bind(node.slots)
    .bind(node.memory_bytes)
    .bind(node.draining)
    .bind(node.process)
    .bind(lost_after_seconds as f64)
    .fetch_optional(conn)
    .await?;
    Ok(row)
}

/// Records a heartbeat with the node's numbers; `false` when the row belongs to another process
/// now (this one was taken for lost and replaced).
#[tracing::instrument(skip_all, fields(node = %id))]
pub async fn heartbeat(
    conn: &mut PgConnection,
    id: &str,
    process: Uuid,
    live: i32,
    ready: i32,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "UPDATE nodes SET heartbeat_at = now(), live_sandboxes = $3, ready_sandboxes = $4
         WHERE id = $1 AND process = $2",
    )
    .bind(id)
    .bind(process)
    .bind(live)
    .bind(ready)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
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
