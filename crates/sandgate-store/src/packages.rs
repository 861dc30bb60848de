//! The install audit of packages on demand: one row per wheel handed to a sandbox.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// One wheel the package index handed to a sandbox's pip.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct PackageInstall {
    /// When (set by the database on insert).
    pub at: DateTime<Utc>,
    /// The sandbox's tenant.
    pub tenant_id: Uuid,
    /// The sandbox.
    pub sandbox_id: String,
    /// The project's normalized name.
    pub project: String,
    /// The wheel's version.
    pub version: String,
    /// The wheel's file name.
    pub filename: String,
    /// Its sha256 (hex), as checked.
    pub sha256: String,
}

/// Appends an install (its `at` is set by the database); one row per (sandbox, sha256): a wheel
/// handed to the same sandbox again is not recorded again.
#[tracing::instrument(skip_all, fields(tenant_id = %install.tenant_id, project = %install.project))]
pub async fn record_install(
    conn: &mut PgConnection,
    install: &PackageInstall,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO package_installs (tenant_id, sandbox_id, project, version, filename, sha256)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (sandbox_id, sha256) DO NOTHING",
    )
    .bind(install.tenant_id)
    .bind(&install.sandbox_id)
    .bind(&install.project)
    .bind(&install.version)
    .bind(&install.filename)
    .bind(&install.sha256)
    .execute(conn)
    .await?;
    Ok(())
}

/// A tenant's most recent installs, newest first.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn recent_installs(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    limit: i64,
) -> Result<Vec<PackageInstall>, StoreError> {
    Ok(sqlx::query_as::<_, PackageInstall>(
        "SELECT at, tenant_id, sandbox_id, project, version, filename, sha256
         FROM package_installs WHERE tenant_id = $1 ORDER BY at DESC, id DESC LIMIT $2",
    )
    .bind(tenant_id)
    .bind(limit)
    .fetch_all(conn)
    .await?)
}

/// A tenant's package policy as stored (rules are requirement strings, checked when set).
#[derive(Debug, Clone, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct PackagePolicy {
    /// Only these projects (and versions) may be installed; empty: any not denied.
    pub allow: Vec<String>,
    /// These projects (or versions) may not be installed.
    pub deny: Vec<String>,
    /// The largest wheel, MiB; `None`: the configured default.
    pub max_wheel_mb: Option<i32>,
}

/// A tenant's package policy (the default, empty, when none was set).
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn policy(conn: &mut PgConnection, tenant_id: Uuid) -> Result<PackagePolicy, StoreError> {
    Ok(sqlx::query_as::<_, PackagePolicy>(
        "SELECT allow, deny, max_wheel_mb FROM tenant_package_policy WHERE tenant_id = $1",
    )
    .bind(tenant_id)
    .fetch_optional(conn)
    .await?
    .unwrap_or_default())
}

/// Replaces a tenant's package policy.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant_id))]
pub async fn set_policy(
    conn: &mut PgConnection,
    tenant_id: Uuid,
    policy: &PackagePolicy,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO tenant_package_policy (tenant_id, allow, deny, max_wheel_mb)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (tenant_id) DO UPDATE
         SET allow = EXCLUDED.allow, deny = EXCLUDED.deny, max_wheel_mb = EXCLUDED.max_wheel_mb,
             updated_at = now()",
    )
    .bind(tenant_id)
    .bind(&policy.allow)
    .bind(&policy.deny)
    .bind(policy.max_wheel_mb)
    .execute(conn)
    .await?;
    Ok(())
}
