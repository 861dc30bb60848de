//! Deleting a tenant, a user or an OAuth client, with everything stored under it, and the
//! operator's record that it happened (`admin_events`).

use serde_json::Value;
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// Makes every token of `tenant` unusable now, before its rows go: its admin-issued tokens
/// join the revoked access tokens (each gateway is notified and refuses them from its next
/// request) and its grants are revoked (the tokens under them are refused likewise). Returns
/// how many tokens and grants it revoked.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn revoke_tenant_tokens(
    conn: &mut PgConnection,
    tenant: Uuid,
) -> Result<(u64, u64), StoreError> {
    // The revocation records carry no tenant id: they outlive the tenant until the tokens
    // would have expired anyway, and the hygiene purge deletes them then.
    let tokens = sqlx::query(
        "INSERT INTO revoked_access_tokens (jti, expires_at)
         SELECT jti, expires_at FROM admin_tokens
          WHERE tenant_id = $1 AND expires_at > now()
         ON CONFLICT (jti) DO NOTHING",
    )
    .bind(tenant)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    let grants = sqlx::query(
        "UPDATE grants SET revoked_at = now(), revoke_reason = 'tenant deleted'
         WHERE tenant_id = $1 AND revoked_at IS NULL",
    )
    .bind(tenant)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    Ok((tokens, grants))
}

/// The base tables of the current schema with a `tenant_id` column, except `tenants` itself,
/// read from the catalog: a table added later is covered without a change here.
pub async fn tables_with_tenant_id(conn: &mut PgConnection) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT c.table_name::text FROM information_schema.columns c
           JOIN information_schema.tables t
             ON t.table_schema = c.table_schema AND t.table_name = c.table_name
          WHERE c.table_schema = current_schema() AND c.column_name = 'tenant_id'
            AND t.table_type = 'BASE TABLE' AND c.table_name <> 'tenants'
          ORDER BY c.table_name",
    )
    .fetch_all(conn)
    .await?)
}

/// Deletes the tenant's row and every row under its id in every table that has a `tenant_id`
/// (rows that hang off those, such as transcript entries, login sessions, codes and refresh
/// tokens, go by their foreign keys' cascade). Returns the rows deleted per table (`tenants`
/// last). With no such tenant it still deletes what is left under its id (all counts 0: none
/// was). Run it in a transaction.
#[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
pub async fn delete_tenant(
    conn: &mut PgConnection,
    tenant: Uuid,
) -> Result<Vec<(String, u64)>, StoreError> {
    // Locked first: a lease or a token of the tenant that commits meanwhile waits for this.
    sqlx::query("SELECT id FROM tenants WHERE id = $1 FOR UPDATE")
        .bind(tenant)
        .fetch_optional(&mut *conn)
        .await?;
    let mut deleted = Vec::new();
    for table in tables_with_tenant_id(conn).await? {
        // Safe: the name is the catalog's, quoted.
        let sql = format!("DELETE FROM {} WHERE tenant_id = $1", quote_ident(&table));
        let n = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(tenant)
            .execute(&mut *conn)
            .await?
            .rows_affected();
        deleted.push((table, n));
    }
    let n = sqlx::query("DELETE FROM tenants WHERE id = $1")
        .bind(tenant)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    deleted.push(("tenants".to_owned(), n));
    Ok(deleted)
}

/// A user deleted: its id, its tenant and how many login sessions and grants went with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeletedUser {
    /// The user's tenant.
    pub tenant_id: Uuid,
    /// Login sessions ended.
    pub sessions: u64,
    /// App connections (grants) the user had approved, deleted (their tokens are refused).
    pub grants: u64,
}

/// Deletes a user: its login sessions end at once (each request looks its session up), the
/// grants it approved go (every gateway is notified and refuses their tokens), then the user.
/// `None` when there is no such user. Run it in a transaction.
#[tracing::instrument(skip_all, fields(user_id = %user))]
pub async fn delete_user(
    conn: &mut PgConnection,
    user: Uuid,
) -> Result<Option<DeletedUser>, StoreError> {
    let Some(tenant_id): Option<Uuid> =
        sqlx::query_scalar("SELECT tenant_id FROM users WHERE id = $1 FOR UPDATE")
            .bind(user)
            .fetch_optional(&mut *conn)
            .await?
    else {
        return Ok(None);
    };
    let sessions = sqlx::query("DELETE FROM user_sessions WHERE user_id = $1")
        .bind(user)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    let grants = sqlx::query("DELETE FROM grants WHERE user_id = $1")
        .bind(user)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    sqlx::query("DELETE FROM users WHERE id = $1")
        .bind(user)
        .execute(&mut *conn)
        .await?;
    Ok(Some(DeletedUser {
        tenant_id,
        sessions,
        grants,
    }))
}

/// Deletes an OAuth client: its grants go (every gateway is notified and refuses their tokens;
/// codes and refresh tokens cascade), then the client. Returns the grants deleted, or `None`
/// when there is no such client. Run it in a transaction.
#[tracing::instrument(skip_all)]
pub async fn delete_client(
    conn: &mut PgConnection,
    client: &str,
) -> Result<Option<u64>, StoreError> {
    let found: Option<String> =
        sqlx::query_scalar("SELECT id FROM oauth_clients WHERE id = $1 FOR UPDATE")
            .bind(client)
            .fetch_optional(&mut *conn)
            .await?;
    if found.is_none() {
        return Ok(None);
    }
    let grants = sqlx::query("DELETE FROM grants WHERE client_id = $1")
        .bind(client)
        .execute(&mut *conn)
        .await?
        .rows_affected();
    sqlx::query("DELETE FROM oauth_clients WHERE id = $1")
        .bind(client)
        .execute(&mut *conn)
        .await?;
    Ok(Some(grants))
}

/// Records an operator command in `admin_events`: what was done, to which id, and counts.
pub async fn record(
    conn: &mut PgConnection,
    command: &str,
    target: &str,
    detail: &Value,
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO admin_events (command, target, detail) VALUES ($1, $2, $3)")
        .bind(command)
        .bind(target)
        .bind(detail)
        .execute(conn)
        .await?;
    Ok(())
}

/// An identifier quoted for SQL (names come from the catalog, but quote them all the same).
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}
