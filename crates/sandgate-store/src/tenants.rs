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
pub async fn lock(conn: &mut PgConnection, id: Uuid) -> Result<(), StoreError> {
    sqlx::query("SELECT 1 FROM tenants WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}
