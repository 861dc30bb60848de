//! The operator's delete commands (`sandgate admin tenant|user|client delete`), with the
//! erasure each implies (docs/data.md, "Deleting a tenant, a user or a client"). Each is
//! recorded in `admin_events` (ids and counts only).

use std::collections::BTreeMap;

use sandgate_store::{StoreError, erasure};
use serde_json::json;
use uuid::Uuid;

use crate::config::Config;
use crate::retention::{self, Purged, RetentionError};

/// Why a delete command failed.
#[derive(Debug, thiserror::Error)]
pub enum ErasureError {
    /// The database's schema is not one this binary can run against.
    #[error(transparent)]
    Schema(#[from] sandgate_store::schema::SchemaError),
    /// Postgres failed.
    #[error("database error (is Postgres running at database.url, and migrated?)")]
    Store(#[from] StoreError),
    /// Closing the tenant's sandboxes and deleting its content failed; its tokens are revoked
    /// already, and running the command again finishes it.
    #[error("{0} (its tokens are revoked; run the command again to finish the deletion)")]
    Purge(#[source] RetentionError),
    /// No tenant has that id, and nothing is stored under it.
    #[error("no tenant with id {0} (`sandgate admin sandboxes` and `admin audit` name tenants)")]
    NoSuchTenant(Uuid),
    /// No user has that id.
    #[error("no user with id {0}")]
    NoSuchUser(Uuid),
    /// No OAuth client has that id.
    #[error("no OAuth client with id {0:?}")]
    NoSuchClient(String),
}

/// What `sandgate admin tenant delete` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeletedTenant {
    /// Access tokens (admin-issued) and grants revoked before anything else.
    pub revoked: (u64, u64),
    /// What the purge removed (sandboxes, containers, snapshots, transcripts), when the tenant
    /// still existed.
    pub purged: Option<Purged>,
    /// Rows deleted per table.
    pub rows: BTreeMap<String, u64>,
}

/// Deletes a tenant and everything stored under it: first its tokens are refused (every
/// admin-issued token revoked, every grant revoked: gateways are notified at the commit), then
/// its content goes as with `tenant purge` (live and paused sandboxes closed, their containers
/// removed through their nodes, snapshots deleted from the store, transcripts deleted), then
/// every row under its id in every table with a `tenant_id` (users, clients, grants, tokens,
/// sessions, quotas, package policy and installs, egress rules and secrets, sandboxes, its
/// audit trail) and the tenant itself. A tenant already deleted whose id still has rows (an
/// audit event a call in flight recorded after the deletion) has them deleted too.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn delete_tenant(config: &Config, tenant: Uuid) -> Result<DeletedTenant, ErasureError> {
    let db = config.migrated_pool().await?;
    let mut tx = sandgate_store::begin(&db).await?;
    let exists = sandgate_store::tenants::get(&mut tx, tenant)
        .await?
        .is_some();
    let revoked = if exists {
        erasure::revoke_tenant_tokens(&mut tx, tenant).await?
    } else {
        (0, 0)
    };
    sandgate_store::commit(tx).await?;
    let purged = if exists {
        Some(
            retention::purge_tenant(config, tenant)
                .await
                .map_err(ErasureError::Purge)?,
        )
    } else {
        None
    };
    let mut tx = sandgate_store::begin(&db).await?;
    let rows: BTreeMap<String, u64> = erasure::delete_tenant(&mut tx, tenant)
        .await?
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    if rows.is_empty() && !exists {
        return Err(ErasureError::NoSuchTenant(tenant));
    }
    let detail = json!({
        "rows": rows,
        "tokens_revoked": revoked.0,
        "grants_revoked": revoked.1,
        "sandboxes_closed": purged.as_ref().map(|p| p.sandboxes_closed),
        "containers_removed": purged.as_ref().map(|p| p.containers_removed),
        "containers_left": purged.as_ref().map(|p| p.containers_left.iter().map(|l| l.containers.len()).sum::<usize>()),
    });
    erasure::record(&mut tx, "tenant delete", &tenant.to_string(), &detail).await?;
    sandgate_store::commit(tx).await?;
    tracing::info!(tenant_id = %tenant, "tenant deleted");
    Ok(DeletedTenant {
        revoked,
        purged,
        rows,
    })
}

/// What `sandgate admin tenant delete` prints.
pub fn render_deleted_tenant(tenant: Uuid, deleted: &DeletedTenant) -> String {
    let mut out = format!(
        "deleted tenant {tenant}\nrevoked {} admin-issued tokens and {} app connections",
        deleted.revoked.0, deleted.revoked.1
    );
    if let Some(purged) = &deleted.purged {
        out.push('\n');
        out.push_str(&retention::render_purged(purged));
    }
    let rows: Vec<String> = deleted
        .rows
        .iter()
        .map(|(table, n)| format!("{table} {n}"))
        .collect();
    out.push_str(&format!("\nrows deleted: {}", rows.join(", ")));
    out
}

/// Deletes a user: its login sessions end at once, the app connections it approved are deleted
/// (their tokens are refused from the next request on), then the user. The tenant's
/// sandboxes and audit trail stay (they are the tenant's). Returns what went.
#[tracing::instrument(skip_all, fields(user_id = %user))]
pub async fn delete_user(
    config: &Config,
    user: Uuid,
) -> Result<erasure::DeletedUser, ErasureError> {
    let db = config.migrated_pool().await?;
    let mut tx = sandgate_store::begin(&db).await?;
    let deleted = erasure::delete_user(&mut tx, user)
        .await?
        .ok_or(ErasureError::NoSuchUser(user))?;
    let detail = json!({
        "tenant": deleted.tenant_id,
        "sessions": deleted.sessions,
        "grants": deleted.grants,
    });
    erasure::record(&mut tx, "user delete", &user.to_string(), &detail).await?;
    sandgate_store::commit(tx).await?;
    tracing::info!(user_id = %user, tenant_id = %deleted.tenant_id, "user deleted");
    Ok(deleted)
}

/// Deletes an OAuth client: its app connections (grants) are deleted, so every token issued to
/// it is refused from the next request on and its refresh tokens and codes go, then the
/// client. Returns how many grants went.
#[tracing::instrument(skip_all)]
pub async fn delete_client(config: &Config, client: &str) -> Result<u64, ErasureError> {
    let client = client.trim();
    let db = config.migrated_pool().await?;
    let mut tx = sandgate_store::begin(&db).await?;
    let grants = erasure::delete_client(&mut tx, client)
        .await?
        .ok_or_else(|| ErasureError::NoSuchClient(client.to_owned()))?;
    erasure::record(
        &mut tx,
        "client delete",
        client,
        &json!({ "grants": grants }),
    )
    .await?;
    sandgate_store::commit(tx).await?;
    tracing::info!(client_id = client, grants, "client deleted");
    Ok(grants)
}
