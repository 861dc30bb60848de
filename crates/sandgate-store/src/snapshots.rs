//! Sealed snapshots (`snapshots`): one row per snapshot with its wrapped data key and sizes.
//! Every read and delete filters by the owner tenant: another tenant's snapshot reads like a
//! missing one.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A snapshot to record.
#[derive(Debug, Clone)]
pub struct NewSnapshot<'a> {
    /// Its id (`snap_…`).
    pub id: &'a str,
    /// The tenant that owns the sandbox.
    pub tenant_id: Uuid,
    /// The sandbox it is of (a row of `sandboxes` owned by the tenant).
    pub sandbox_id: &'a str,
    /// The node that took it.
    pub node: &'a str,
    /// Its data key, wrapped under the service's key-encryption key.
    pub wrapped_key: &'a [u8],
    /// The plaintext image's size.
    pub image_bytes: u64,
    /// The sealed stream's size.
    pub sealed_bytes: u64,
}

/// A recorded snapshot.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SnapshotRow {
    /// Its id.
    pub id: String,
    /// Its owner.
    pub tenant_id: Uuid,
    /// The sandbox it is of.
    pub sandbox_id: String,
    /// The node that took it.
    pub node: String,
    /// Its wrapped data key.
    pub wrapped_key: Vec<u8>,
    /// The plaintext image's size.
    pub image_bytes: i64,
    /// The sealed stream's size.
    pub sealed_bytes: i64,
    /// When it was recorded.
    pub created_at: DateTime<Utc>,
}

const COLUMNS: &str =
    "id, tenant_id, sandbox_id, node, wrapped_key, image_bytes, sealed_bytes, created_at";

fn size(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// Records a snapshot of one of the tenant's sandboxes. `StoreError::NotFound("sandbox")` when
/// the sandbox is not the tenant's (or does not exist); `Conflict` when the id is taken.
#[tracing::instrument(skip_all, fields(snapshot = %new.id, sandbox_id = %new.sandbox_id, tenant_id = %new.tenant_id))]
pub async fn insert(
    conn: &mut PgConnection,
    new: &NewSnapshot<'_>,
) -> Result<SnapshotRow, StoreError> {
    let row = sqlx::query_as::<_, SnapshotRow>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO snapshots (id, tenant_id, sandbox_id, node, wrapped_key, image_bytes, sealed_bytes)
         SELECT $1, tenant_id, id, $4, $5, $6, $7 FROM sandboxes WHERE id = $3 AND tenant_id = $2
         RETURNING {COLUMNS}"
    )))
    .bind(new.id)
    .bind(new.tenant_id)
    .bind(new.sandbox_id)
    .bind(new.node)
    .bind(new.wrapped_key)
    .bind(size(new.image_bytes))
    .bind(size(new.sealed_bytes))
    .fetch_optional(conn)
    .await
    .map_err(|err| match &err {
        sqlx::Error::Database(db) if db.is_unique_violation() => {
            StoreError::Conflict("a snapshot with this id exists")
        }
        _ => err.into(),
    })?;
    row.ok_or(StoreError::NotFound("sandbox"))
}

/// The tenant's snapshot `id`; `None` when it does not exist or is another tenant's.
#[tracing::instrument(skip_all, fields(snapshot = %id, tenant_id = %tenant_id))]
pub async fn get(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
) -> Result<Option<SnapshotRow>, StoreError> {
    Ok(
        sqlx::query_as::<_, SnapshotRow>(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM snapshots WHERE id = $1 AND tenant_id = $2"
        )))
        .bind(id)
        .bind(tenant_id)
        .fetch_optional(conn)
        .await?,
    )
}

/// The tenant's snapshots of `sandbox_id`, oldest first.
#[tracing::instrument(skip_all, fields(sandbox_id = %sandbox_id, tenant_id = %tenant_id))]
pub async fn of_sandbox(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    sandbox_id: &str,
) -> Result<Vec<SnapshotRow>, StoreError> {
    Ok(
        sqlx::query_as::<_, SnapshotRow>(sqlx::AssertSqlSafe(format!(
            "SELECT {COLUMNS} FROM snapshots WHERE tenant_id = $1 AND sandbox_id = $2
          ORDER BY created_at, id"
        )))
        .bind(tenant_id)
        .bind(sandbox_id)
        .fetch_all(conn)
        .await?,
    )
}

/// The sealed bytes the tenant's snapshots hold (for its storage quota).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn sealed_bytes_of_tenant(
    conn: &mut PgConnection,
    tenant_id: Uuid,
) -> Result<u64, StoreError> {
    let total: Option<i64> =
        sqlx::query_scalar("SELECT sum(sealed_bytes)::bigint FROM snapshots WHERE tenant_id = $1")
            .bind(tenant_id)
            .fetch_one(conn)
            .await?;
    Ok(total.unwrap_or(0).max(0) as u64)
}

/// Whether the tenant's snapshot `id` is held: it is the snapshot of one of the tenant's
/// sandboxes that is paused or resuming. A snapshot nothing holds is what a pause or a fork
/// whose process died left behind (a fork's copy is never held: it serves its one restore).
#[tracing::instrument(skip_all, fields(snapshot = %id, tenant_id = %tenant_id))]
pub async fn is_held(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
) -> Result<bool, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (
             SELECT 1 FROM snapshots n
             JOIN sandboxes s ON s.id = n.sandbox_id AND s.tenant_id = n.tenant_id
             WHERE n.id = $1 AND n.tenant_id = $2 AND s.snapshot_id = n.id
               AND s.state IN ('paused', 'resuming'))",
    )
    .bind(id)
    .bind(tenant_id)
    .fetch_one(conn)
    .await?)
}

/// Deletes the tenant's snapshot `id`; false when there was none (or it is another tenant's).
#[tracing::instrument(skip_all, fields(snapshot = %id, tenant_id = %tenant_id))]
pub async fn delete(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    id: &str,
) -> Result<bool, StoreError> {
    Ok(
        sqlx::query("DELETE FROM snapshots WHERE id = $1 AND tenant_id = $2")
            .bind(id)
            .bind(tenant_id)
            .execute(conn)
            .await?
            .rows_affected()
            == 1,
    )
}

/// Deletes every snapshot row of a tenant (its purge: their sealed bytes can no longer be
/// opened, wherever they rest); returns how many.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn delete_of_tenant(conn: &mut PgConnection, tenant_id: Uuid) -> Result<u64, StoreError> {
    Ok(sqlx::query("DELETE FROM snapshots WHERE tenant_id = $1")
        .bind(tenant_id)
        .execute(conn)
        .await?
        .rows_affected())
}
