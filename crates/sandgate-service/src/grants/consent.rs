//! Approvals and what hangs off them: "connect once" (an approval covering the scopes asked for
//! skips the consent page), authorization codes, the connected-apps list, and disconnecting an
//! app (its tokens stop at once, its refresh tokens are dead, its sandboxes close).

use chrono::Utc;
use sandgate_auth::Scope;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_store::changes::Change;
use sandgate_store::grants::{self, NewAuthCode};
use sandgate_store::tenants;
use uuid::Uuid;

use super::{Client, Connection, GrantError, Grants, Session, join_scopes};

/// An authorization code to issue for a request that passed every check.
#[derive(Debug, Clone, Copy)]
pub struct NewCode<'a> {
    /// The approval (grant) it redeems under.
    pub grant_id: Uuid,
    /// The client.
    pub client_id: &'a str,
    /// The redirect URI the request named (the redemption must name it again).
    pub redirect_uri: &'a str,
    /// The PKCE challenge (S256).
    pub code_challenge: &'a str,
    /// The resource (the MCP endpoint).
    pub resource: &'a str,
    /// The scopes asked for.
    pub scopes: &'a [Scope],
}

/// A confidential client registered for one tenant (`sandgate admin client create`) acts only
/// for that tenant: a user of another tenant may not connect it. Self-registered (DCR) and
/// metadata-document clients belong to no tenant and may be connected by anyone.
pub fn may_connect(client: &Client, session: &Session) -> bool {
    client
        .tenant_id
        .is_none_or(|owner| owner == session.tenant_id)
}

impl Grants {
    /// The user's live approval of `client_id` when it covers every one of `scopes`: then the
    /// consent page is skipped.
    #[tracing::instrument(skip_all, fields(user_id = %session.user_id, client_id = client_id))]
    pub async fn prior_approval(
        &self,
        session: &Session,
        client_id: &str,
        scopes: &[Scope],
    ) -> Result<Option<Uuid>, GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        let existing = grants::live_for(
            &mut conn,
            session.tenant_id,
            Some(session.user_id),
            client_id,
        )
        .await?;
        Ok(existing.and_then(|grant| {
            let granted = Scope::parse_list(&grant.scopes).unwrap_or_default();
            scopes
                .iter()
                .all(|s| granted.contains(s))
                .then_some(grant.id)
        }))
    }

    /// Records the user's approval of `client_id` for `scopes`, added to what the connection
    /// already holds (approving more never silently drops earlier scopes); its id.
    #[tracing::instrument(skip_all, fields(user_id = %session.user_id, client_id = client_id))]
    pub async fn approve(
        &self,
        session: &Session,
        client_id: &str,
        scopes: &[Scope],
    ) -> Result<Uuid, GrantError> {
        let mut tx = sandgate_store::begin(&self.db).await?;
        let existing =
            grants::live_for(&mut tx, session.tenant_id, Some(session.user_id), client_id).await?;
        let mut all = existing
            .map(|g| Scope::parse_list(&g.scopes).unwrap_or_default())
            .unwrap_or_default();
        all.extend(scopes.iter().copied());
        all.sort();
        all.dedup();
        let grant = grants::approve(
            &mut tx,
            session.tenant_id,
            Some(session.user_id),
            client_id,
            &join_scopes(&all),
        )
        .await?;
        sandgate_store::commit(tx).await?;
        Ok(grant.id)
    }

    /// Issues an authorization code (valid `oauth.code_ttl_seconds`, single use); the code.
    #[tracing::instrument(skip_all, fields(grant_id = %code.grant_id, client_id = code.client_id))]
    pub async fn issue_code(&self, code: NewCode<'_>) -> Result<String, GrantError> {
        let secret_code = secret::generate(SecretKind::AuthorizationCode);
        let ttl = i64::try_from(self.config.oauth.code_ttl_seconds).unwrap_or(60);
        let mut conn = sandgate_store::acquire(&self.db).await?;
        grants::insert_code(
            &mut conn,
            &NewAuthCode {
                code_hash: &secret::hash(&secret_code),
                grant_id: code.grant_id,
                client_id: code.client_id,
                redirect_uri: code.redirect_uri,
                code_challenge: code.code_challenge,
                resource: code.resource,
                scopes: &join_scopes(code.scopes),
                expires_at: Utc::now() + chrono::Duration::seconds(ttl),
            },
        )
        .await?;
        Ok(secret_code)
    }

    /// The name of `tenant` (its id when it has no row).
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
    pub async fn tenant_name(&self, tenant: Uuid) -> Result<String, GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(tenants::get(&mut conn, tenant)
            .await?
            .map_or_else(|| tenant.to_string(), |t| t.name))
    }

    /// The apps `user_id` connected, for the connected-apps page.
    #[tracing::instrument(skip_all, fields(user_id = %user_id))]
    pub async fn connections(&self, user_id: Uuid) -> Result<Vec<Connection>, GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(grants::connections_of_user(&mut conn, user_id).await?)
    }

    /// Disconnects the app connection `grant_id` of `user_id`: the grant is revoked (its tokens
    /// stop on their next request everywhere), then its sandboxes close. False when it is not
    /// this user's, or already gone.
    #[tracing::instrument(skip_all, fields(user_id = %user_id, grant_id = %grant_id))]
    pub async fn disconnect(&self, user_id: Uuid, grant_id: Uuid) -> Result<bool, GrantError> {
        let mut tx = sandgate_store::begin(&self.db).await?;
        let done =
            grants::revoke(&mut tx, grant_id, Some(user_id), "disconnected by the user").await?;
        sandgate_store::commit(tx).await?;
        if !done {
            return Ok(false);
        }
        tracing::info!(grant_id = %grant_id, user_id = %user_id, "app disconnected");
        self.sandboxes.cache().forget(&Change::Grant(grant_id));
        match self.sandboxes.close_grant(grant_id).await {
            Ok(n) => tracing::info!(grant_id = %grant_id, closed = n, "closed the app's sandboxes"),
            Err(err) => {
                tracing::error!(error = ?err, grant_id = %grant_id, "closing the app's sandboxes failed")
            }
        }
        Ok(true)
    }
}
