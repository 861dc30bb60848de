//! The token endpoint's grants (OAuth 2.1 §3.2: authorization code with PKCE, refresh token
//! rotation with reuse detection, client credentials), client authentication, and token
//! revocation (RFC 7009).

use std::time::Duration;

use chrono::Utc;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_auth::{Scope, pkce};
use sandgate_store::PgConnection;
use sandgate_store::changes::Change;
use sandgate_store::grants::{self, Grant, NewRefreshToken};
use uuid::Uuid;

use super::{Client, GrantError, Grants, join_scopes};

/// What a token request was granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// The access token (a JWT).
    pub access_token: String,
    /// Its lifetime, seconds.
    pub expires_in: u64,
    /// Its scopes.
    pub scopes: Vec<Scope>,
    /// The refresh token, when the grant gives one.
    pub refresh_token: Option<String>,
}

/// How a client authenticated at the token or revocation endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuth {
    /// HTTP Basic (`client_secret_basic`).
    Basic,
    /// `client_secret` in the form (`client_secret_post`).
    Post,
    /// No secret (public clients: `none`).
    None,
}

impl ClientAuth {
    fn method(self) -> &'static str {
        match self {
            ClientAuth::Basic => "client_secret_basic",
            ClientAuth::Post => "client_secret_post",
            ClientAuth::None => "none",
        }
    }
}

/// Checks the secret a client presented (`presented`, the way `how`) against the one it was
/// registered with. Basic and post stand in for each other.
pub fn authenticate(
    client: &Client,
    presented: Option<&str>,
    how: ClientAuth,
) -> Result<(), GrantError> {
    match (&client.secret_hash, presented) {
        (None, None) => Ok(()),
        (None, Some(_)) => Err(GrantError::PublicClientSecret),
        (Some(_), None) => Err(GrantError::SecretRequired),
        (Some(stored), Some(presented)) => {
            let ok = secret::is_kind(presented, SecretKind::ClientSecret)
                && secret::constant_time_eq_bytes(stored, &secret::hash(presented));
            let method = how.method();
            let secret_method = |m: &str| m == "client_secret_basic" || m == "client_secret_post";
            let method_ok = client.auth_method == method
                || (secret_method(&client.auth_method) && secret_method(method));
            if ok && method_ok {
                Ok(())
            } else {
                Err(GrantError::ClientAuthFailed)
            }
        }
    }
}

/// A code redemption (OAuth 2.1 §4.1.3).
#[derive(Debug, Clone, Copy)]
pub struct CodeRedemption<'a> {
    /// The code.
    pub code: &'a str,
    /// The redirect URI the request names.
    pub redirect_uri: Option<&'a str>,
    /// The PKCE verifier.
    pub code_verifier: Option<&'a str>,
    /// The resource the request names (RFC 8707).
    pub resource: Option<&'a str>,
}

fn check_resource(given: Option<&str>, bound: &str) -> Result<(), GrantError> {
    match given {
        Some(r) if r != bound => Err(GrantError::ResourceMismatch {
            given: r.to_owned(),
            bound: bound.to_owned(),
        }),
        _ => Ok(()),
    }
}

impl Grants {
    /// Redeems an authorization code for `client`. A code used twice revokes what it issued;
    /// any other failed redemption burns the code.
    #[tracing::instrument(skip_all, fields(client_id = %client.id, grant_id))]
    pub async fn exchange_code(
        &self,
        client: &Client,
        req: CodeRedemption<'_>,
    ) -> Result<Issued, GrantError> {
        let hash = secret::hash(req.code);
        let mut tx = sandgate_store::begin(&self.db).await?;
        let row = grants::lock_code(&mut tx, &hash)
            .await?
            .ok_or(GrantError::CodeInvalid)?;
        tracing::Span::current().record("grant_id", tracing::field::display(row.grant_id));
        if row.used_at.is_some() {
            // OAuth 2.1 §4.1.3: a code used twice means it leaked; what it issued is revoked.
            grants::revoke(&mut tx, row.grant_id, None, "authorization code replayed").await?;
            sandgate_store::commit(tx).await?;
            self.sandboxes.cache().forget(&Change::Grant(row.grant_id));
            tracing::warn!(grant_id = %row.grant_id, client_id = %client.id, "authorization code replayed; grant revoked");
            return Err(GrantError::CodeReplayed);
        }
        let refusal = if row.expires_at <= Utc::now() {
            Some(GrantError::CodeExpired)
        } else if row.client_id != client.id {
            Some(GrantError::CodeOtherClient)
        } else if req.redirect_uri != Some(row.redirect_uri.as_str()) {
            Some(GrantError::RedirectUriMismatch)
        } else if let Err(e) = pkce::verify(req.code_verifier, &row.code_challenge) {
            Some(GrantError::Pkce(e))
        } else {
            check_resource(req.resource, &row.resource).err()
        };
        if let Some(refusal) = refusal {
            // A failed redemption burns the code: it cannot be retried, by anyone.
            grants::delete_code(&mut tx, &hash).await?;
            sandgate_store::commit(tx).await?;
            return Err(refusal);
        }
        grants::mark_code_used(&mut tx, &hash).await?;
        let grant = live_grant(&mut tx, row.grant_id).await?;
        let scopes = Scope::parse_list(&row.scopes).unwrap_or_default();
        let refresh = client
            .grant_types
            .iter()
            .any(|g| g == "refresh_token")
            .then(Uuid::now_v7);
        let issued = self
            .issue(&mut tx, client, &grant, &scopes, &row.resource, refresh)
            .await?;
        sandgate_store::commit(tx).await?;
        Ok(issued)
    }

    /// Rotates a refresh token for `client`: a new access token and a new refresh token in the
    /// same family. A token used twice ends its whole family (OAuth 2.1 §4.3.1).
    #[tracing::instrument(skip_all, fields(client_id = %client.id, family_id))]
    pub async fn refresh(
        &self,
        client: &Client,
        presented: &str,
        scope: Option<&str>,
        resource: Option<&str>,
    ) -> Result<Issued, GrantError> {
        let mut tx = sandgate_store::begin(&self.db).await?;
        let row = grants::take_refresh(&mut tx, &secret::hash(presented))
            .await?
            .ok_or(GrantError::RefreshInvalid)?;
        tracing::Span::current().record("family_id", tracing::field::display(row.family_id));
        if row.client_id != client.id {
            return Err(GrantError::RefreshOtherClient);
        }
        if row.revoked_at.is_some() {
            return Err(GrantError::RefreshRevoked);
        }
        if row.used_at.is_some() {
            // Reuse means one copy was stolen; neither party can be told apart, so the whole
            // family ends.
            let revoked = grants::revoke_family(&mut tx, row.family_id).await?;
            sandgate_store::commit(tx).await?;
            tracing::warn!(family_id = %row.family_id, revoked, client_id = %client.id, "refresh token reused; family revoked");
            return Err(GrantError::RefreshReused);
        }
        if row.expires_at <= Utc::now() {
            return Err(GrantError::RefreshExpired);
        }
        check_resource(resource, &row.resource)?;
        let held = Scope::parse_list(&row.scopes).unwrap_or_default();
        let scopes = narrow_scopes(scope, &held, GrantError::ScopeNotHeld)?;
        let grant = live_grant(&mut tx, row.grant_id).await?;
        let issued = self
            .issue(
                &mut tx,
                client,
                &grant,
                &scopes,
                &row.resource,
                Some(row.family_id),
            )
            .await?;
        sandgate_store::commit(tx).await?;
        Ok(issued)
    }

    /// Client credentials (RFC 6749 §4.4) for an admin-created confidential client: an access
    /// token under its own grant, no refresh token.
    #[tracing::instrument(skip_all, fields(client_id = %client.id))]
    pub async fn client_credentials(
        &self,
        client: &Client,
        scope: Option<&str>,
        resource: Option<&str>,
    ) -> Result<Issued, GrantError> {
        let Some(tenant) = client.tenant_id.filter(|_| client.kind == "confidential") else {
            return Err(GrantError::NotAdminClient);
        };
        let bound = self.config.mcp_url();
        check_resource(resource, &bound)?;
        let mut tx = sandgate_store::begin(&self.db).await?;
        let grant = grants::live_for(&mut tx, tenant, None, &client.id)
            .await?
            .ok_or(GrantError::ClientRevoked)?;
        let held = Scope::parse_list(&grant.scopes).unwrap_or_default();
        let scopes = narrow_scopes(scope, &held, GrantError::ScopeNotAllowed)?;
        // RFC 6749 §4.4.3: no refresh token for client credentials.
        let issued = self
            .issue(&mut tx, client, &grant, &scopes, &bound, None)
            .await?;
        sandgate_store::commit(tx).await?;
        Ok(issued)
    }

    /// Revokes `token` (a refresh token, or an access token) when it was issued to `client`;
    /// anything else is ignored (RFC 7009 §2.2: nothing can be learned by probing).
    #[tracing::instrument(skip_all, fields(client_id = %client.id))]
    pub async fn revoke_token(&self, client: &Client, token: &str) -> Result<(), GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        if secret::is_kind(token, SecretKind::RefreshToken) {
            let row = grants::refresh_by_hash(&mut conn, &secret::hash(token)).await?;
            if let Some(row) = row.filter(|r| r.client_id == client.id) {
                grants::revoke_family(&mut conn, row.family_id).await?;
                tracing::info!(family_id = %row.family_id, "refresh token revoked");
            }
        } else if let Ok(claims) = self.keys.verify(token).await
            && claims.client_id.as_deref() == Some(client.id.as_str())
        {
            let expires = chrono::DateTime::from_timestamp(claims.exp, 0).unwrap_or_else(Utc::now);
            grants::revoke_access_token(&mut conn, &claims.jti, expires).await?;
            self.sandboxes
                .cache()
                .forget(&Change::Token(claims.jti.clone()));
            tracing::info!(jti = %claims.jti, "access token revoked");
        }
        Ok(())
    }

    /// Mints an access token (and, with `family`, a refresh token in that rotation family).
    async fn issue(
        &self,
        conn: &mut PgConnection,
        client: &Client,
        grant: &Grant,
        scopes: &[Scope],
        resource: &str,
        family: Option<Uuid>,
    ) -> Result<Issued, GrantError> {
        let oauth = &self.config.oauth;
        let subject = grant
            .user_id
            .map_or_else(|| format!("client:{}", client.id), |u| u.to_string());
        let (access_token, _) = self.keys.issuer().issue(
            &subject,
            grant.tenant_id,
            scopes,
            resource,
            Duration::from_secs(oauth.access_token_ttl_seconds),
            Some(grant.id),
            Some(client.id.clone()),
        )?;
        let mut issued = Issued {
            access_token,
            expires_in: oauth.access_token_ttl_seconds,
            scopes: scopes.to_vec(),
            refresh_token: None,
        };
        if let Some(family_id) = family {
            let refresh = secret::generate(SecretKind::RefreshToken);
            grants::insert_refresh(
                conn,
                &NewRefreshToken {
                    token_hash: &secret::hash(&refresh),
                    family_id,
                    grant_id: grant.id,
                    client_id: &client.id,
                    scopes: &join_scopes(scopes),
                    resource,
                    expires_at: Utc::now() + super::seconds(oauth.refresh_token_ttl_seconds),
                },
            )
            .await?;
            issued.refresh_token = Some(refresh);
        }
        Ok(issued)
    }
}

async fn live_grant(conn: &mut PgConnection, id: Uuid) -> Result<Grant, GrantError> {
    grants::get(conn, id)
        .await?
        .filter(|g| g.revoked_at.is_none())
        .ok_or(GrantError::Disconnected)
}

/// The scopes a token request asks for (RFC 6749 §6, §4.4.2): all of `held` when it names none,
/// else exactly those named, each of which must be held; `refusal` names the error for an extra.
fn narrow_scopes(
    asked: Option<&str>,
    held: &[Scope],
    refusal: impl Fn(Scope) -> GrantError,
) -> Result<Vec<Scope>, GrantError> {
    let Some(asked) = asked.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(held.to_vec());
    };
    let asked = Scope::parse_list(asked).map_err(GrantError::ScopeUnknown)?;
    if let Some(extra) = asked.iter().find(|s| !held.contains(s)) {
        return Err(refusal(*extra));
    }
    Ok(asked)
}
