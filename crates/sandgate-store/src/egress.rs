//! A tenant's egress policy (allowed hosts and their budgets) and its secrets, sealed (issue 29).
//!
//! The store sees only sealed values: sealing and opening are the service's
//! (`sandgate_service::egress::SecretSealer`). Rules and bindings are checked by the service
//! before they are stored.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// One allowed host rule of a tenant's egress policy.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct EgressRule {
    /// A host name or a wildcard (`*.example.com`), lower-case, without a port.
    pub host: String,
    /// The one port the rule allows.
    pub port: i32,
    /// Most new connections per minute to this rule's hosts; `None`: no limit.
    pub connections_per_minute: Option<i32>,
    /// Most bytes (both ways) per day through this rule; `None`: no limit.
    pub bytes_per_day: Option<i64>,
}

/// A tenant's egress rules, by host then port (empty: no route out).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn rules(
    conn: &mut PgConnection,
    tenant_id: Uuid,
) -> Result<Vec<EgressRule>, StoreError> {
    Ok(sqlx::query_as::<_, EgressRule>(
        "SELECT host, port, connections_per_minute, bytes_per_day
         FROM tenant_egress_rules WHERE tenant_id = $1 ORDER BY host, port",
    )
    .bind(tenant_id)
    .fetch_all(conn)
    .await?)
}

/// Adds a rule, or replaces the budgets of the rule for the same host and port.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, host = %rule.host))]
pub async fn put_rule(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    rule: &EgressRule,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO tenant_egress_rules (tenant_id, host, port, connections_per_minute, bytes_per_day)
         VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT (tenant_id, host, port) DO UPDATE
         SET connections_per_minute = EXCLUDED.connections_per_minute,
             bytes_per_day = EXCLUDED.bytes_per_day",
    )
    .bind(tenant_id)
    .bind(&rule.host)
    .bind(rule.port)
    .bind(rule.connections_per_minute)
    .bind(rule.bytes_per_day)
    .execute(conn)
    .await?;
    Ok(())
}

/// Takes out the rule for `host` and `port`; whether there was one.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, host = %host))]
pub async fn remove_rule(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    host: &str,
    port: i32,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "DELETE FROM tenant_egress_rules WHERE tenant_id = $1 AND host = $2 AND port = $3",
    )
    .bind(tenant_id)
    .bind(host)
    .bind(port)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Takes out every rule of the tenant (no route out again); how many there were.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn clear_rules(conn: &mut PgConnection, tenant_id: Uuid) -> Result<u64, StoreError> {
    let done = sqlx::query("DELETE FROM tenant_egress_rules WHERE tenant_id = $1")
        .bind(tenant_id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

/// A secret as listed: its name, bindings and dates, never its value.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SecretInfo {
    /// The name (also the placeholder's environment variable).
    pub name: String,
    /// Grows by one at every rotation.
    pub version: i32,
    /// The hosts (names or wildcards) it may be sent to.
    pub hosts: Vec<String>,
    /// The request headers it may go into.
    pub headers: Vec<String>,
    /// When it was first set.
    pub created_at: DateTime<Utc>,
    /// When its value was last set.
    pub rotated_at: DateTime<Utc>,
}

/// A secret's sealed value and the version it was sealed for.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct SealedSecret {
    /// The version the value was sealed for (bound in the seal).
    pub version: i32,
    /// The sealed value.
    pub sealed: Vec<u8>,
}

/// The version the next value of secret `name` is sealed for: 1 for a new secret, one more than
/// the stored one otherwise. Lock the tenant first (`tenants::lock`) so two rotations do not
/// both take the same version.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, name = %name))]
pub async fn next_version(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    name: &str,
) -> Result<i32, StoreError> {
    let current: Option<i32> =
        sqlx::query_scalar("SELECT version FROM tenant_secrets WHERE tenant_id = $1 AND name = $2")
            .bind(tenant_id)
            .bind(name)
            .fetch_optional(conn)
            .await?;
    Ok(current.map_or(1, |v| v + 1))
}

/// Stores secret `name`'s value sealed for `version` (from [`next_version`]) with its bindings:
/// creates the secret, or rotates it (the bindings replaced, `created_at` kept).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, name = %name))]
pub async fn put_secret(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    name: &str,
    sealed: &SealedSecret,
    hosts: &[String],
    headers: &[String],
) -> Result<SecretInfo, StoreError> {
    Ok(sqlx::query_as::<_, SecretInfo>(
        "INSERT INTO tenant_secrets (tenant_id, name, version, sealed, hosts, headers)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (tenant_id, name) DO UPDATE
         SET version = EXCLUDED.version, sealed = EXCLUDED.sealed, hosts = EXCLUDED.hosts,
             headers = EXCLUDED.headers, rotated_at = now()
         RETURNING name, version, hosts, headers, created_at, rotated_at",
    )
    .bind(tenant_id)
    .bind(name)
    .bind(sealed.version)
    .bind(&sealed.sealed)
    .bind(hosts)
    .bind(headers)
    .fetch_one(conn)
    .await?)
}

/// A tenant's secrets by name, without their values.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn list_secrets(
    conn: &mut PgConnection,
    tenant_id: Uuid,
) -> Result<Vec<SecretInfo>, StoreError> {
    Ok(sqlx::query_as::<_, SecretInfo>(
        "SELECT name, version, hosts, headers, created_at, rotated_at
         FROM tenant_secrets WHERE tenant_id = $1 ORDER BY name",
    )
    .bind(tenant_id)
    .fetch_all(conn)
    .await?)
}

/// Secret `name`'s sealed value, for the egress component to open.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, name = %name))]
pub async fn sealed_secret(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    name: &str,
) -> Result<Option<SealedSecret>, StoreError> {
    Ok(sqlx::query_as::<_, SealedSecret>(
        "SELECT version, sealed FROM tenant_secrets WHERE tenant_id = $1 AND name = $2",
    )
    .bind(tenant_id)
    .bind(name)
    .fetch_optional(conn)
    .await?)
}

/// Deletes secret `name`; whether there was one.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, name = %name))]
pub async fn delete_secret(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    name: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query("DELETE FROM tenant_secrets WHERE tenant_id = $1 AND name = $2")
        .bind(tenant_id)
        .bind(name)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// A secret as the egress component needs it for a connection: its bindings and its sealed
/// value (opened only for a request it goes into).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct BoundSecret {
    /// The name (also the placeholder's environment variable).
    pub name: String,
    /// The version its value was sealed for.
    pub version: i32,
    /// The hosts (names or wildcards) it may be sent to.
    pub hosts: Vec<String>,
    /// The request headers it may go into.
    pub headers: Vec<String>,
    /// The sealed value.
    pub sealed: Vec<u8>,
}

/// A tenant's secrets with their bindings and sealed values, for the egress component.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn bound_secrets(
    conn: &mut PgConnection,
    tenant_id: Uuid,
) -> Result<Vec<BoundSecret>, StoreError> {
    Ok(sqlx::query_as::<_, BoundSecret>(
        "SELECT name, version, hosts, headers, sealed FROM tenant_secrets
         WHERE tenant_id = $1 ORDER BY name",
    )
    .bind(tenant_id)
    .fetch_all(conn)
    .await?)
}
