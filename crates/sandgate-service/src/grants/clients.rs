//! Clients: the stored ones, dynamic registration (RFC 7591), and clients from client-ID
//! metadata documents (fetched by the face, remembered here). Dynamic clients that never
//! completed a flow are kept under `oauth.limits.max_unused_dynamic_clients` by evicting the
//! oldest: a flood of registrations cannot lock out real ones, which complete their flow.

use chrono::Utc;
use sandgate_auth::client::{AuthMethod, ValidClient};
use sandgate_auth::secret::{self, SecretKind};
use sandgate_store::clients::{self as store, NewClient};
use sandgate_store::{PgConnection, hygiene};

use super::{Client, GrantError, Grants, join_scopes};

/// A client just registered, with its secret (shown once: only its hash is kept).
#[derive(Debug, Clone)]
pub struct Registered {
    /// The stored client.
    pub client: Client,
    /// Its secret, for a confidential client.
    pub client_secret: Option<String>,
}

fn new_client<'a>(
    id: &'a str,
    kind: &'a str,
    valid: &'a ValidClient,
    secret_hash: Option<&'a [u8]>,
) -> NewClient<'a> {
    NewClient {
        id,
        kind,
        name: &valid.name,
        redirect_uris: &valid.redirect_uris,
        auth_method: valid.auth_method.as_str(),
        secret_hash,
        grant_types: &valid.grant_types,
        scopes: None,
        tenant_id: None,
    }
}

impl Grants {
    /// The stored client `client_id` when it can be used as stored: any client but one from a
    /// metadata document, and that one while its document was fetched within
    /// `oauth.client_metadata.cache_seconds`. `None`: unknown, or its document must be fetched.
    #[tracing::instrument(skip_all, fields(client_id = client_id))]
    pub async fn stored_client(&self, client_id: &str) -> Result<Option<Client>, GrantError> {
        let cache_seconds = self.config.oauth.client_metadata.cache_seconds;
        let mut conn = sandgate_store::acquire(&self.db).await?;
        let existing = store::get(&mut conn, client_id).await?;
        Ok(existing.filter(|c| {
            c.kind != "cimd"
                || c.fetched_at.is_some_and(|t| {
                    (Utc::now() - t).num_seconds()
                        < i64::try_from(cache_seconds).unwrap_or(i64::MAX)
                })
        }))
    }

    /// Remembers the client described by the metadata document at `client_id` (freshly fetched
    /// and validated).
    #[tracing::instrument(skip_all, fields(client_id = client_id))]
    pub async fn save_document_client(
        &self,
        client_id: &str,
        valid: &ValidClient,
    ) -> Result<Client, GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        self.make_room(&mut conn).await?;
        Ok(store::upsert(&mut conn, &new_client(client_id, "cimd", valid, None)).await?)
    }

    /// Registers a client (RFC 7591 §3): a new id, and a secret unless it authenticates with
    /// none.
    #[tracing::instrument(skip_all, fields(client_id))]
    pub async fn register_client(&self, valid: &ValidClient) -> Result<Registered, GrantError> {
        let client_id = format!("sgcl_{}", uuid::Uuid::new_v4().simple());
        tracing::Span::current().record("client_id", client_id.as_str());
        let client_secret = (valid.auth_method != AuthMethod::None)
            .then(|| secret::generate(SecretKind::ClientSecret));
        let secret_hash = client_secret.as_deref().map(secret::hash);
        let mut row = new_client(&client_id, "dcr", valid, secret_hash.as_deref());
        let scopes = valid.scopes.as_ref().map(|s| join_scopes(s));
        row.scopes = scopes.as_deref();
        let mut conn = sandgate_store::acquire(&self.db).await?;
        self.make_room(&mut conn).await?;
        let client = store::upsert(&mut conn, &row).await?;
        tracing::info!(client_id = %client.id, name = %client.name, "registered a client");
        Ok(Registered {
            client,
            client_secret,
        })
    }

    /// Evicts the oldest dynamic clients that never completed a flow, down to the cap.
    async fn make_room(&self, conn: &mut PgConnection) -> Result<(), GrantError> {
        let cap = i64::from(self.config.oauth.limits.max_unused_dynamic_clients);
        let evicted = hygiene::evict_unused_clients(conn, cap).await?;
        if evicted > 0 {
            tracing::info!(
                evicted,
                "evicted dynamic clients that never completed a flow"
            );
        }
        Ok(())
    }
}
