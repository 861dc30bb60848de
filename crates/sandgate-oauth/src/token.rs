//! The token endpoint (OAuth 2.1 §3.2: authorization code with PKCE, refresh token rotation,
//! client credentials) and token revocation (RFC 7009).

use std::time::Duration;

use axum::Json;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use chrono::Utc;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_auth::{Scope, pkce};
use sandgate_store::StoreError;
use sandgate_store::changes::Change;
use sandgate_store::clients::Client;
use sandgate_store::grants::{self, Grant, NewRefreshToken};
use serde::Deserialize;
use uuid::Uuid;

use super::clients::{ClientLookupError, join_scopes, lookup};
use super::ratelimit::ClientAddress;
use crate::AppState;

/// A refused token or revocation request (RFC 6749 §5.2), or a failure on our side.
#[derive(Debug, thiserror::Error)]
pub enum TokenEndpointError {
    /// Malformed request.
    #[error("{0}")]
    InvalidRequest(String),
    /// Client authentication failed.
    #[error("{0}")]
    InvalidClient(String),
    /// The code or refresh token is invalid, expired, used, revoked or not this client's.
    #[error("{0}")]
    InvalidGrant(String),
    /// The client may not use this grant type.
    #[error("{0}")]
    UnauthorizedClient(String),
    /// Unknown grant type.
    #[error("{0}")]
    UnsupportedGrantType(String),
    /// Scopes beyond what may be granted.
    #[error("{0}")]
    InvalidScope(String),
    /// A resource other than this server's MCP endpoint (RFC 8707).
    #[error("{0}")]
    InvalidTarget(String),
    /// Postgres failed.
    #[error("database error")]
    Store(#[from] StoreError),
    /// Signing failed.
    #[error("signing failed")]
    Sign(#[from] sandgate_auth::TokenError),
}

impl IntoResponse for TokenEndpointError {
    fn into_response(self) -> Response {
        let (status, code) = match &self {
            TokenEndpointError::InvalidRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            TokenEndpointError::InvalidClient(_) => (StatusCode::UNAUTHORIZED, "invalid_client"),
            TokenEndpointError::InvalidGrant(_) => (StatusCode::BAD_REQUEST, "invalid_grant"),
            TokenEndpointError::UnauthorizedClient(_) => {
                (StatusCode::BAD_REQUEST, "unauthorized_client")
            }
            TokenEndpointError::UnsupportedGrantType(_) => {
                (StatusCode::BAD_REQUEST, "unsupported_grant_type")
            }
            TokenEndpointError::InvalidScope(_) => (StatusCode::BAD_REQUEST, "invalid_scope"),
            TokenEndpointError::InvalidTarget(_) => (StatusCode::BAD_REQUEST, "invalid_target"),
            TokenEndpointError::Store(err) => {
                super::log_store(err);
                (StatusCode::SERVICE_UNAVAILABLE, "temporarily_unavailable")
            }
            TokenEndpointError::Sign(err) => {
                tracing::error!(error = ?err, "signing an access token failed");
                (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
            }
        };
        let description = match &self {
            TokenEndpointError::Store(_) | TokenEndpointError::Sign(_) => {
                "sandgate could not process the request; retry later".to_owned()
            }
            other => other.to_string(),
        };
        let mut response = (
            status,
            Json(serde_json::json!({ "error": code, "error_description": description })),
        )
            .into_response();
        no_store(&mut response);
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"sandgate\""),
            );
        }
        response
    }
}

fn no_store(response: &mut Response) {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
        .headers_mut()
        .insert(header::PRAGMA, HeaderValue::from_static("no-cache"));
}

/// The token request's form fields.
#[derive(Debug, Default, Deserialize)]
pub struct TokenForm {
    grant_type: Option<String>,
    code: Option<String>,
    redirect_uri: Option<String>,
    code_verifier: Option<String>,
    client_id: Option<String>,
    client_secret: Option<String>,
    refresh_token: Option<String>,
    scope: Option<String>,
    resource: Option<String>,
    token: Option<String>,
}

/// Authenticates the client of a token or revocation request: HTTP Basic, `client_secret` in the
/// body, or (public clients) just `client_id`.
async fn authenticate(
    state: &AppState,
    address: ClientAddress,
    headers: &HeaderMap,
    form: &TokenForm,
) -> Result<Client, TokenEndpointError> {
    let basic = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Basic ")
                .or_else(|| v.strip_prefix("basic "))
        })
        .map(|b64| {
            let decoded = STANDARD
                .decode(b64.trim())
                .ok()
                .and_then(|d| String::from_utf8(d).ok())
                .ok_or_else(|| {
                    TokenEndpointError::InvalidClient("malformed Basic credentials".into())
                })?;
            let (id, secret) = decoded.split_once(':').ok_or_else(|| {
                TokenEndpointError::InvalidClient("malformed Basic credentials".into())
            })?;
            // RFC 6749 §2.3.1: both parts are form-urlencoded.
            let unescape = |s: &str| {
                url::form_urlencoded::parse(format!("x={s}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
                    .unwrap_or_default()
            };
            Ok::<_, TokenEndpointError>((unescape(id), unescape(secret)))
        })
        .transpose()?;
    let (client_id, presented_secret, method) = match (&basic, &form.client_secret) {
        (Some(_), Some(_)) => {
            return Err(TokenEndpointError::InvalidRequest(
                "use one client authentication method, not two".into(),
            ));
        }
        (Some((id, secret)), None) => (id.clone(), Some(secret.clone()), "client_secret_basic"),
        (None, Some(secret)) => (
            form.client_id.clone().unwrap_or_default(),
            Some(secret.clone()),
            "client_secret_post",
        ),
        (None, None) => (form.client_id.clone().unwrap_or_default(), None, "none"),
    };
    if client_id.is_empty() {
        return Err(TokenEndpointError::InvalidClient(
            "client authentication is required (client_id)".into(),
        ));
    }
    if basic.is_some() && form.client_id.as_deref().is_some_and(|f| f != client_id) {
        return Err(TokenEndpointError::InvalidClient(
            "client_id does not match the credentials".into(),
        ));
    }
    let client = lookup(state, &client_id, address)
        .await
        .map_err(|e| match e {
            ClientLookupError::Store(err) => TokenEndpointError::Store(err),
            ClientLookupError::Limited(limited) => {
                TokenEndpointError::InvalidClient(limited.message())
            }
            _ => TokenEndpointError::InvalidClient("unknown client".into()),
        })?;
    match (&client.secret_hash, presented_secret) {
        (None, None) => Ok(client),
        (None, Some(_)) => Err(TokenEndpointError::InvalidClient(
            "this client is public: it has no secret to present".into(),
        )),
        (Some(_), None) => Err(TokenEndpointError::InvalidClient(
            "this client must authenticate with its client secret".into(),
        )),
        (Some(stored), Some(presented)) => {
            let ok = secret::is_kind(&presented, SecretKind::ClientSecret)
                && secret::constant_time_eq_bytes(stored, &secret::hash(&presented));
            if !ok {
                return Err(TokenEndpointError::InvalidClient(
                    "client authentication failed".into(),
                ));
            }
            if client.auth_method != method
                && !(client.auth_method == "client_secret_basic" && method == "client_secret_post")
                && !(client.auth_method == "client_secret_post" && method == "client_secret_basic")
            {
                return Err(TokenEndpointError::InvalidClient(
                    "client authentication failed".into(),
                ));
            }
            Ok(client)
        }
    }
}

/// `POST /oauth/token`.
pub async fn token(
    State(state): State<AppState>,
    address: ClientAddress,
    headers: HeaderMap,
    Form(form): Form<TokenForm>,
) -> Response {
    let result = async {
        let client = authenticate(&state, address, &headers, &form).await?;
        match form.grant_type.as_deref() {
            Some("authorization_code") => authorization_code(&state, &client, &form).await,
            Some("refresh_token") => refresh(&state, &client, &form).await,
            Some("client_credentials") => client_credentials(&state, &client, &form).await,
            Some(other) => Err(TokenEndpointError::UnsupportedGrantType(format!(
                "grant_type {other:?} is not supported"
            ))),
            None => Err(TokenEndpointError::InvalidRequest(
                "grant_type is required".into(),
            )),
        }
    }
    .await;
    match result {
        Ok(body) => {
            let mut response = Json(body).into_response();
            no_store(&mut response);
            response
        }
        Err(err) => {
            tracing::info!(error = %err, "token request refused");
            err.into_response()
        }
    }
}

fn check_resource(given: Option<&str>, bound: &str) -> Result<(), TokenEndpointError> {
    match given {
        Some(r) if r != bound => Err(TokenEndpointError::InvalidTarget(format!(
            "resource {r:?} is not the one this grant was issued for ({bound})"
        ))),
        _ => Ok(()),
    }
}

async fn authorization_code(
    state: &AppState,
    client: &Client,
    form: &TokenForm,
) -> Result<serde_json::Value, TokenEndpointError> {
    let code = required(form.code.as_deref(), "code")?;
    let mut tx = sandgate_store::begin(&state.db).await?;
    let row = grants::lock_code(&mut tx, &secret::hash(code))
        .await?
        .ok_or_else(|| {
            TokenEndpointError::InvalidGrant("the authorization code is invalid".into())
        })?;
    if row.used_at.is_some() {
        // OAuth 2.1 §4.1.3: a code used twice means it leaked; what it issued is revoked.
        grants::revoke(&mut tx, row.grant_id, None, "authorization code replayed").await?;
        sandgate_store::commit(tx).await?;
        state.sandboxes.cache().forget(&Change::Grant(row.grant_id));
        tracing::warn!(grant_id = %row.grant_id, client_id = %client.id, "authorization code replayed; grant revoked");
        return Err(TokenEndpointError::InvalidGrant(
            "the authorization code was already used; the tokens issued with it are revoked".into(),
        ));
    }
    let refusal = if row.expires_at <= Utc::now() {
        Some(TokenEndpointError::InvalidGrant(
            "the authorization code has expired".into(),
        ))
    } else if row.client_id != client.id {
        Some(TokenEndpointError::InvalidGrant(
            "the authorization code was issued to another client".into(),
        ))
    } else if form.redirect_uri.as_deref() != Some(row.redirect_uri.as_str()) {
        Some(TokenEndpointError::InvalidGrant(
            "redirect_uri does not match the authorization request".into(),
        ))
    } else if let Err(e) = pkce::verify(form.code_verifier.as_deref(), &row.code_challenge) {
        Some(TokenEndpointError::InvalidGrant(e.to_string()))
    } else {
        check_resource(form.resource.as_deref(), &row.resource).err()
    };
    if let Some(refusal) = refusal {
        // A failed redemption burns the code: it cannot be retried, by anyone.
        grants::delete_code(&mut tx, &secret::hash(code)).await?;
        sandgate_store::commit(tx).await?;
        return Err(refusal);
    }
    grants::mark_code_used(&mut tx, &secret::hash(code)).await?;
    let grant = live_grant(&mut tx, row.grant_id).await?;
    let scopes = Scope::parse_list(&row.scopes).unwrap_or_default();
    let refresh = client
        .grant_types
        .iter()
        .any(|g| g == "refresh_token")
        .then(Uuid::now_v7);
    let body = issue(
        state,
        &mut tx,
        client,
        &grant,
        &scopes,
        &row.resource,
        refresh,
    )
    .await?;
    sandgate_store::commit(tx).await?;
    Ok(body)
}

async fn live_grant(
    conn: &mut sandgate_store::PgConnection,
    id: Uuid,
) -> Result<Grant, TokenEndpointError> {
    grants::get(conn, id)
        .await?
        .filter(|g| g.revoked_at.is_none())
        .ok_or_else(|| TokenEndpointError::InvalidGrant("the app was disconnected".into()))
}

/// Mints an access token (and, with `family`, a refresh token in that rotation family).
async fn issue(
    state: &AppState,
    conn: &mut sandgate_store::PgConnection,
    client: &Client,
    grant: &Grant,
    scopes: &[Scope],
    resource: &str,
    family: Option<Uuid>,
) -> Result<serde_json::Value, TokenEndpointError> {
    let oauth = &state.config.oauth;
    let subject = grant
        .user_id
        .map_or_else(|| format!("client:{}", client.id), |u| u.to_string());
    let (access, _) = state.keys.issuer().issue(
        &subject,
        grant.tenant_id,
        scopes,
        resource,
        Duration::from_secs(oauth.access_token_ttl_seconds),
        Some(grant.id),
        Some(client.id.clone()),
    )?;
    let mut body = serde_json::json!({
        "access_token": access,
        "token_type": "Bearer",
        "expires_in": oauth.access_token_ttl_seconds,
        "scope": join_scopes(scopes),
    });
    if let Some(family_id) = family {
        let refresh = secret::generate(SecretKind::RefreshToken);
        let ttl = i64::try_from(oauth.refresh_token_ttl_seconds).unwrap_or(i64::MAX / 4);
        grants::insert_refresh(
            conn,
            &NewRefreshToken {
                token_hash: &secret::hash(&refresh),
                family_id,
                grant_id: grant.id,
                client_id: &client.id,
                scopes: &join_scopes(scopes),
                resource,
                expires_at: Utc::now() + chrono::Duration::seconds(ttl),
            },
        )
        .await?;
        body["refresh_token"] = refresh.into();
    }
    Ok(body)
}

async fn refresh(
    state: &AppState,
    client: &Client,
    form: &TokenForm,
) -> Result<serde_json::Value, TokenEndpointError> {
    let presented = required(form.refresh_token.as_deref(), "refresh_token")?;
    let hash = secret::hash(presented);
    let mut tx = sandgate_store::begin(&state.db).await?;
    let row = grants::take_refresh(&mut tx, &hash)
        .await?
        .ok_or_else(|| TokenEndpointError::InvalidGrant("the refresh token is invalid".into()))?;
    if row.client_id != client.id {
        return Err(TokenEndpointError::InvalidGrant(
            "the refresh token was issued to another client".into(),
        ));
    }
    if row.revoked_at.is_some() {
        return Err(TokenEndpointError::InvalidGrant(
            "the refresh token was revoked".into(),
        ));
    }
    if row.used_at.is_some() {
        // OAuth 2.1 §4.3.1 / BCP for refresh rotation: reuse means one copy was stolen; neither
        // party can be told apart, so the whole family ends.
        let revoked = grants::revoke_family(&mut tx, row.family_id).await?;
        sandgate_store::commit(tx).await?;
        tracing::warn!(family_id = %row.family_id, revoked, client_id = %client.id, "refresh token reused; family revoked");
        return Err(TokenEndpointError::InvalidGrant(
            "the refresh token was already used; every refresh token of this sign-in is revoked"
                .into(),
        ));
    }
    if row.expires_at <= Utc::now() {
        return Err(TokenEndpointError::InvalidGrant(
            "the refresh token has expired".into(),
        ));
    }
    check_resource(form.resource.as_deref(), &row.resource)?;
    let held = Scope::parse_list(&row.scopes).unwrap_or_default();
    let scopes = narrow_scopes(form.scope.as_deref(), &held, |extra| {
        format!("the refresh token does not hold the {extra} scope")
    })?;
    let grant = live_grant(&mut tx, row.grant_id).await?;
    let body = issue(
        state,
        &mut tx,
        client,
        &grant,
        &scopes,
        &row.resource,
        Some(row.family_id),
    )
    .await?;
    sandgate_store::commit(tx).await?;
    Ok(body)
}

async fn client_credentials(
    state: &AppState,
    client: &Client,
    form: &TokenForm,
) -> Result<serde_json::Value, TokenEndpointError> {
    let Some(tenant) = client.tenant_id.filter(|_| client.kind == "confidential") else {
        return Err(TokenEndpointError::UnauthorizedClient(
            "only clients created with `sandgate admin client create` may use client_credentials"
                .into(),
        ));
    };
    let resource = state.config.mcp_url();
    check_resource(form.resource.as_deref(), &resource)?;
    let mut tx = sandgate_store::begin(&state.db).await?;
    let grant = grants::live_for(&mut tx, tenant, None, &client.id)
        .await?
        .ok_or_else(|| {
            TokenEndpointError::InvalidGrant("this client's access was revoked".into())
        })?;
    let held = Scope::parse_list(&grant.scopes).unwrap_or_default();
    let scopes = narrow_scopes(form.scope.as_deref(), &held, |extra| {
        format!("this client may not have the {extra} scope")
    })?;
    // RFC 6749 §4.4.3: no refresh token for client credentials.
    let body = issue(state, &mut tx, client, &grant, &scopes, &resource, None).await?;
    sandgate_store::commit(tx).await?;
    Ok(body)
}

/// `POST /oauth/revoke` (RFC 7009). Answers 200 whether or not the token was known (§2.2), so
/// nothing can be learned by probing; only client authentication failures are errors.
pub async fn revoke(
    State(state): State<AppState>,
    address: ClientAddress,
    headers: HeaderMap,
    Form(form): Form<TokenForm>,
) -> Response {
    let result = async {
        let client = authenticate(&state, address, &headers, &form).await?;
        let token = required(form.token.as_deref(), "token")?;
        let mut conn = sandgate_store::acquire(&state.db).await?;
        // Only the client a token was issued to may revoke it; anything else is ignored.
        if secret::is_kind(token, SecretKind::RefreshToken) {
            let row = grants::refresh_by_hash(&mut conn, &secret::hash(token)).await?;
            if let Some(row) = row.filter(|r| r.client_id == client.id) {
                grants::revoke_family(&mut conn, row.family_id).await?;
                tracing::info!(family_id = %row.family_id, "refresh token revoked");
            }
        } else if let Ok(claims) = state.keys.verify(token).await
            && claims.client_id.as_deref() == Some(client.id.as_str())
        {
            let expires = chrono::DateTime::from_timestamp(claims.exp, 0).unwrap_or_else(Utc::now);
            grants::revoke_access_token(&mut conn, &claims.jti, expires).await?;
            state
                .sandboxes
                .cache()
                .forget(&Change::Token(claims.jti.clone()));
            tracing::info!(jti = %claims.jti, "access token revoked");
        }
        Ok::<_, TokenEndpointError>(())
    }
    .await;
    match result {
        Ok(()) => {
            let mut response = StatusCode::OK.into_response();
            no_store(&mut response);
            response
        }
        Err(err) => err.into_response(),
    }
}

/// The scopes a token request asks for (RFC 6749 §6, §4.4.2): all of `held` when it names none,
/// else exactly those named, each of which must be held; `refusal` words the error for an extra.
fn narrow_scopes(
    asked: Option<&str>,
    held: &[Scope],
    refusal: impl Fn(Scope) -> String,
) -> Result<Vec<Scope>, TokenEndpointError> {
    let Some(asked) = asked.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(held.to_vec());
    };
    let asked =
        Scope::parse_list(asked).map_err(|e| TokenEndpointError::InvalidScope(e.to_string()))?;
    if let Some(extra) = asked.iter().find(|s| !held.contains(s)) {
        return Err(TokenEndpointError::InvalidScope(refusal(*extra)));
    }
    Ok(asked)
}

/// A form field the request cannot do without (RFC 6749 §5.2 `invalid_request` when missing).
fn required<'a>(value: Option<&'a str>, name: &str) -> Result<&'a str, TokenEndpointError> {
    value
        .filter(|v| !v.is_empty())
        .ok_or_else(|| TokenEndpointError::InvalidRequest(format!("{name} is required")))
}
