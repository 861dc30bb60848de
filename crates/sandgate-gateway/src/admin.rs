//! Operator commands (`sandgate admin …`): tenants, tokens for integrations and tests, keys.

use std::time::Duration;

use sandgate_auth::Scope;
use sandgate_store::{PgPool, StoreError, tenants};
use secrecy::ExposeSecret;
use uuid::Uuid;

use crate::Config;
use crate::keys::{self, KeyError, KeyRing};

/// What went wrong in an admin command.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// Postgres failed.
    #[error("database error (is Postgres running at database.url, and migrated?)")]
    Store(#[from] StoreError),
    /// Key handling failed.
    #[error(transparent)]
    Keys(#[from] KeyError),
    /// The tenant does not exist.
    #[error("no tenant with id {0}; `sandgate admin tenant create <name>` makes one")]
    NoSuchTenant(Uuid),
    /// A tenant with that name exists.
    #[error("a tenant named {0:?} exists already")]
    TenantExists(String),
    /// Token signing failed.
    #[error("issuing the token failed")]
    Token(#[from] sandgate_auth::TokenError),
}

async fn pool(config: &Config) -> Result<PgPool, AdminError> {
    let db =
        sandgate_store::connect_lazy(config.database.url.expose_secret(), &config.pool_settings())?;
    sandgate_store::migrate(&db).await?;
    Ok(db)
}

/// Creates a tenant and returns it.
pub async fn create_tenant(config: &Config, name: &str) -> Result<tenants::Tenant, AdminError> {
    let db = pool(config).await?;
    let mut conn = db.acquire().await.map_err(StoreError::from)?;
    match tenants::create(&mut conn, name).await {
        Err(StoreError::Query(sqlx_err))
            if sqlx_err
                .as_database_error()
                .is_some_and(|e| e.is_unique_violation()) =>
        {
            Err(AdminError::TenantExists(name.to_owned()))
        }
        other => Ok(other?),
    }
}

/// Issues an access token for `tenant` with `scopes`, valid for `ttl`, whose audience is this
/// gateway's MCP URL. For server-to-server integrations and tests.
pub async fn issue_token(
    config: &Config,
    tenant: Uuid,
    scopes: &[Scope],
    ttl: Duration,
) -> Result<String, AdminError> {
    let db = pool(config).await?;
    let mut conn = db.acquire().await.map_err(StoreError::from)?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    drop(conn);
    let ring = KeyRing::load(db, config.public_url(), config.mcp_url()).await?;
    let (token, _) = ring.issuer().issue(
        &format!("admin:{tenant}"),
        tenant,
        scopes,
        &config.mcp_url(),
        ttl,
        None,
        None,
    )?;
    Ok(token)
}

/// Rotates the signing key; returns the new key's id.
pub async fn rotate_keys(config: &Config) -> Result<String, AdminError> {
    let db = pool(config).await?;
    Ok(keys::rotate(&db).await?)
}
