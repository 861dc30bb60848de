//! Tenants: the customers of sandgate, each with its own limits.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A tenant row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Tenant {
    /// Stable id, handed out by `sandgate admin tenant create`.
    pub id: Uuid,
    /// Human name, unique.
    pub name: String,
    /// When the tenant was created.
    pub created_at: DateTime<Utc>,
}

/// Creates a tenant with default limits.
#[tracing::instrument(skip_all)]
pub async fn create(conn: &mut PgConnection, name: &str) -> Result<Tenant, StoreError> {
    let tenant = sqlx::query_as::<_, Tenant>(
        "INSERT INTO tenants (id, name) VALUES ($1, $2) RETURNING id, name, created_at",
    )
    .bind(Uuid::now_v7())
    .bind(name)
    .fetch_one(conn)
    .await?;
    Ok(tenant)
}

/// Finds a tenant by id.
#[tracing::instrument(skip_all)]
pub async fn get(conn: &mut PgConnection, id: Uuid) -> Result<Option<Tenant>, StoreError> {
    Ok(
        sqlx::query_as::<_, Tenant>("SELECT id, name, created_at FROM tenants WHERE id = $1")
            .bind(id)
            .fetch_optional(conn)
            .await?,
    )
}

/// Locks a tenant's row until the transaction ends, serialising changes that must respect the
/// tenant's limits (e.g. leasing under a concurrent-sandbox limit).
#[tracing::instrument(skip_all)]
pub async fn lock(conn: &mut PgConnection, id: Uuid) -> Result<(), StoreError> {
    sqlx::query("SELECT 1 FROM tenants WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// A tenant's own limits. `None` means "the gateway's configured default".
#[derive(Debug, Clone, Default, PartialEq, sqlx::FromRow)]
pub struct TenantLimits {
    /// Most live sandboxes at once.
    pub max_sandboxes: Option<i32>,
    /// Longest idle timeout, seconds.
    pub max_idle_seconds: Option<i32>,
    /// Longest lifetime of a sandbox, seconds.
    pub max_lifetime_seconds: Option<i32>,
    /// Memory per sandbox, MiB.
    pub memory_mb: Option<i32>,
    /// CPU quota per sandbox, cores.
    pub cpus: Option<f32>,
    /// Most tool calls per minute.
    pub max_calls_per_minute: Option<i32>,
    /// Most open MCP sessions (2025-11-25 era) at once.
    pub max_sessions: Option<i32>,
    /// Most tool calls running at once.
    pub max_calls_in_flight: Option<i32>,
}

const LIMIT_COLUMNS: &str =
    "max_sandboxes, max_idle_seconds, max_lifetime_seconds, memory_mb, cpus,
     max_calls_per_minute, max_sessions, max_calls_in_flight";

/// A tenant's limits; `None` when the tenant does not exist.
#[tracing::instrument(skip_all)]
pub async fn limits(conn: &mut PgConnection, id: Uuid) -> Result<Option<TenantLimits>, StoreError> {
    Ok(
        sqlx::query_as::<_, TenantLimits>(sqlx::AssertSqlSafe(format!(
            "SELECT {LIMIT_COLUMNS} FROM tenants WHERE id = $1"
        )))
        .bind(id)
        .fetch_optional(conn)
        .await?,
    )
}

/// Replaces a tenant's limits (a `None` goes back to the default); returns the new ones, or
/// `None` when the tenant does not exist.
#[tracing::instrument(skip_all)]
pub async fn set_limits(
    conn: &mut PgConnection,
    id: Uuid,
    limits: &TenantLimits,
) -> Result<Option<TenantLimits>, StoreError> {
    Ok(
        sqlx::query_as::<_, TenantLimits>(sqlx::AssertSqlSafe(format!(
        "UPDATE tenants SET max_sandboxes = $2, max_idle_seconds = $3, max_lifetime_seconds = $4,
                memory_mb = $5, cpus = $6, max_calls_per_minute = $7, max_sessions = $8,
                max_calls_in_flight = $9
         WHERE id = $1 RETURNING {LIMIT_COLUMNS}"
    )))
        .bind(id)
        .bind(limits.max_sandboxes)
        .bind(limits.max_idle_seconds)
        .bind(limits.max_lifetime_seconds)
        .bind(limits.memory_mb)
        .bind(limits.cpus)
        .bind(limits.max_calls_per_minute)
        .bind(limits.max_sessions)
        .bind(limits.max_calls_in_flight)
        .fetch_optional(conn)
        .await?,
    )
}
