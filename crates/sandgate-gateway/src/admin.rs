//! Operator commands (`sandgate admin …`): tenants, users, confidential clients, tokens for
//! integrations and tests, keys.

use std::time::Duration;

use sandgate_auth::Scope;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_store::{PgPool, StoreError, clients, grants, tenants, users};
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
    /// The password was refused or could not be hashed.
    #[error(transparent)]
    Password(#[from] sandgate_auth::password::PasswordError),
    /// A user with that email exists.
    #[error("a user with email {0:?} exists already")]
    UserExists(String),
    /// The email is not plausible.
    #[error("{0:?} is not an email address")]
    BadEmail(String),
    /// A redirect URI was refused.
    #[error(transparent)]
    Client(#[from] sandgate_auth::client::ClientError),
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

/// Creates a user of `tenant` who can log in to approve apps; returns the user's id.
pub async fn create_user(
    config: &Config,
    tenant: Uuid,
    email: &str,
    password: &str,
) -> Result<Uuid, AdminError> {
    let email = email.trim();
    if !email.contains('@') || email.len() > 254 || email.chars().any(char::is_whitespace) {
        return Err(AdminError::BadEmail(email.to_owned()));
    }
    let hash = sandgate_auth::password::hash_password(password)?;
    let db = pool(config).await?;
    let mut conn = db.acquire().await.map_err(StoreError::from)?;
    if tenants::get(&mut conn, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    match users::create(&mut conn, tenant, email, &hash).await {
        Ok(user) => Ok(user.id),
        Err(StoreError::Conflict(_)) => Err(AdminError::UserExists(email.to_owned())),
        Err(err) => Err(err.into()),
    }
}

/// A confidential client made by `sandgate admin client create`.
#[derive(Debug)]
pub struct CreatedClient {
    /// `client_id`.
    pub client_id: String,
    /// The secret, shown once.
    pub client_secret: String,
}

/// Creates a confidential client acting for `tenant`: it may use client credentials with
/// `scopes` (its connection is recorded as a grant, so it shows up and can be revoked), and the
/// authorization code flow with `redirect_uris`.
pub async fn create_client(
    config: &Config,
    tenant: Uuid,
    name: &str,
    redirect_uris: &[String],
    scopes: &[Scope],
) -> Result<CreatedClient, AdminError> {
    for uri in redirect_uris {
        sandgate_auth::client::check_redirect_uri(uri)?;
    }
    let db = pool(config).await?;
    let mut tx = db.begin().await.map_err(StoreError::from)?;
    if tenants::get(&mut tx, tenant).await?.is_none() {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    let client_id = format!("sgcl_{}", Uuid::new_v4().simple());
    let client_secret = secret::generate(SecretKind::ClientSecret);
    let scope_string = scopes
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    let grant_types: Vec<String> = ["authorization_code", "refresh_token", "client_credentials"]
        .map(str::to_owned)
        .to_vec();
    clients::upsert(
        &mut tx,
        &clients::NewClient {
            id: &client_id,
            kind: "confidential",
            name,
            redirect_uris,
            auth_method: "client_secret_basic",
            secret_hash: Some(&secret::hash(&client_secret)),
            grant_types: &grant_types,
            scopes: Some(&scope_string),
            tenant_id: Some(tenant),
        },
    )
    .await?;
    grants::approve(&mut tx, tenant, None, &client_id, &scope_string).await?;
    tx.commit().await.map_err(StoreError::from)?;
    Ok(CreatedClient {
        client_id,
        client_secret,
    })
}
