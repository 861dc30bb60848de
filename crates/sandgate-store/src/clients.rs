//! OAuth clients: dynamically registered, client-ID metadata documents (cached), and
//! operator-created confidential clients.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use uuid::Uuid;

use crate::StoreError;

/// A client row.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Client {
    /// `client_id` (for metadata documents: the document's URL).
    pub id: String,
    /// `dcr`, `cimd` or `confidential`.
    pub kind: String,
    /// Name shown on the consent screen and the connected-apps page.
    pub name: String,
    /// Registered redirect URIs.
    pub redirect_uris: Vec<String>,
    /// `none`, `client_secret_basic` or `client_secret_post`.
    pub auth_method: String,
    /// SHA-256 of the client secret, for confidential clients.
    pub secret_hash: Option<Vec<u8>>,
    /// Allowed grant types.
    pub grant_types: Vec<String>,
    /// Space-separated scopes the client may ask for (None: any).
    pub scopes: Option<String>,
    /// The tenant a confidential client acts for (client credentials).
    pub tenant_id: Option<Uuid>,
    /// When registered.
    pub created_at: DateTime<Utc>,
    /// Metadata documents: when last fetched.
    pub fetched_at: Option<DateTime<Utc>>,
}

const COLUMNS: &str = "id, kind, name, redirect_uris, auth_method, secret_hash, grant_types, scopes, \
                       tenant_id, created_at, fetched_at";

/// A client to store.
#[derive(Debug, Clone)]
pub struct NewClient<'a> {
    /// `client_id`.
    pub id: &'a str,
    /// `dcr`, `cimd` or `confidential`.
    pub kind: &'a str,
    /// Name.
    pub name: &'a str,
    /// Redirect URIs.
    pub redirect_uris: &'a [String],
    /// Token endpoint authentication.
    pub auth_method: &'a str,
    /// Secret hash.
    pub secret_hash: Option<&'a [u8]>,
    /// Grant types.
    pub grant_types: &'a [String],
    /// Allowed scopes.
    pub scopes: Option<&'a str>,
    /// Tenant (confidential clients).
    pub tenant_id: Option<Uuid>,
}

/// Stores a client; a metadata document's row is replaced (refetched) when it exists.
#[tracing::instrument(skip_all)]
pub async fn upsert(conn: &mut PgConnection, c: &NewClient<'_>) -> Result<Client, StoreError> {
    let row = sqlx::query_as::<_, Client>(sqlx::AssertSqlSafe(format!(
        "INSERT INTO oauth_clients (id, kind, name, redirect_uris, auth_method, secret_hash, grant_types,
                                    scopes, tenant_id, fetched_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, CASE WHEN $2 = 'cimd' THEN now() END)
         ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name, redirect_uris = EXCLUDED.redirect_uris,
             auth_method = EXCLUDED.auth_method, grant_types = EXCLUDED.grant_types,
             scopes = EXCLUDED.scopes, fetched_at = EXCLUDED.fetched_at
         WHERE oauth_clients.kind = 'cimd'
         RETURNING {COLUMNS}"
    )))
    .bind(c.id)
    .bind(c.kind)
    .bind(c.name)
    .bind(c.redirect_uris)
    .bind(c.auth_method)
    .bind(c.secret_hash)
    .bind(c.grant_types)
    .bind(c.scopes)
    .bind(c.tenant_id)
    .fetch_optional(conn)
    .await?;
    row.ok_or(StoreError::Conflict("a client with that id exists already"))
}

/// A client by id.
#[tracing::instrument(skip_all)]
pub async fn get(conn: &mut PgConnection, id: &str) -> Result<Option<Client>, StoreError> {
    Ok(sqlx::query_as::<_, Client>(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM oauth_clients WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(conn)
    .await?)
}
