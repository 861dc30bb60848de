//! The token endpoint (OAuth 2.1 §3.2: authorization code with PKCE, refresh token rotation,
//! client credentials) and token revocation (RFC 7009).

use axum::Json;
use axum::extract::{Form, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use sandgate_service::grants::tokens::{self, CodeRedemption};
use sandgate_service::grants::{Client, ClientAuth, GrantError, Issued, join_scopes};
use serde::Deserialize;

use super::clients::{ClientLookupError, lookup};
use super::ratelimit::ClientAddress;
use crate::AppState;

/// A refused token or revocation request (RFC 6749 §5.2), or a failure on our side.
#[derive(Debug, thiserror::Error)]
pub enum TokenEndpointError {
    /// Malformed request.
    #[error("{0}")]
    InvalidRequest(String),
    /// Client authentication failed before a grant rule was reached.
    #[error("{0}")]
    InvalidClient(String),
    /// Unknown grant type.
    #[error("{0}")]
    UnsupportedGrantType(String),
    /// A grant rule refused the request, or the service failed.
    #[error(transparent)]
    Grant(#[from] GrantError),
}

impl TokenEndpointError {
    /// The status and RFC 6749 §5.2 error code: the one exhaustive mapping.
    fn code(&self) -> (StatusCode, &'static str) {
        const BAD: StatusCode = StatusCode::BAD_REQUEST;
        const CLIENT: (StatusCode, &str) = (StatusCode::UNAUTHORIZED, "invalid_client");
        match self {
            TokenEndpointError::InvalidRequest(_) => (BAD, "invalid_request"),
            TokenEndpointError::InvalidClient(_) => CLIENT,
            TokenEndpointError::UnsupportedGrantType(_) => (BAD, "unsupported_grant_type"),
            TokenEndpointError::Grant(err) => match err {
                GrantError::CodeInvalid
                | GrantError::CodeReplayed
                | GrantError::CodeExpired
                | GrantError::CodeOtherClient
                | GrantError::RedirectUriMismatch
                | GrantError::Pkce(_)
                | GrantError::Disconnected
                | GrantError::RefreshInvalid
                | GrantError::RefreshOtherClient
                | GrantError::RefreshRevoked
                | GrantError::RefreshReused
                | GrantError::RefreshExpired
                | GrantError::ClientRevoked => (BAD, "invalid_grant"),
                GrantError::ResourceMismatch { .. } => (BAD, "invalid_target"),
                GrantError::ScopeUnknown(_)
                | GrantError::ScopeNotHeld(_)
                | GrantError::ScopeNotAllowed(_) => (BAD, "invalid_scope"),
                GrantError::NotAdminClient => (BAD, "unauthorized_client"),
                GrantError::PublicClientSecret
                | GrantError::SecretRequired
                | GrantError::ClientAuthFailed => CLIENT,
                GrantError::Store(_) => {
                    super::log_failure(err);
                    (StatusCode::SERVICE_UNAVAILABLE, "temporarily_unavailable")
                }
                GrantError::Sign(_) => {
                    tracing::error!(error = ?err, "signing an access token failed");
                    (StatusCode::INTERNAL_SERVER_ERROR, "server_error")
                }
            },
        }
    }
}

impl IntoResponse for TokenEndpointError {
    fn into_response(self) -> Response {
        let (status, code) = self.code();
        let description = if status.is_server_error() {
            "sandgate could not process the request; retry later".to_owned()
        } else {
            self.to_string()
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
        (Some((id, secret)), None) => (id.clone(), Some(secret.clone()), ClientAuth::Basic),
        (None, Some(secret)) => (
            form.client_id.clone().unwrap_or_default(),
            Some(secret.clone()),
            ClientAuth::Post,
        ),
        (None, None) => (
            form.client_id.clone().unwrap_or_default(),
            None,
            ClientAuth::None,
        ),
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
            ClientLookupError::Grant(err) => TokenEndpointError::Grant(err),
            ClientLookupError::Limited(limited) => {
                TokenEndpointError::InvalidClient(limited.message())
            }
            _ => TokenEndpointError::InvalidClient("unknown client".into()),
        })?;
    tokens::authenticate(&client, presented_secret.as_deref(), method)?;
    Ok(client)
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
        let grants = &state.grants;
        let (scope, resource) = (form.scope.as_deref(), form.resource.as_deref());
        let issued = match form.grant_type.as_deref() {
            Some("authorization_code") => {
                let redemption = CodeRedemption {
                    code: required(form.code.as_deref(), "code")?,
                    redirect_uri: form.redirect_uri.as_deref(),
                    code_verifier: form.code_verifier.as_deref(),
                    resource,
                };
                grants.exchange_code(&client, redemption).await?
            }
            Some("refresh_token") => {
                let presented = required(form.refresh_token.as_deref(), "refresh_token")?;
                grants.refresh(&client, presented, scope, resource).await?
            }
            Some("client_credentials") => {
                grants.client_credentials(&client, scope, resource).await?
            }
            Some(other) => {
                return Err(TokenEndpointError::UnsupportedGrantType(format!(
                    "grant_type {other:?} is not supported"
                )));
            }
            None => {
                return Err(TokenEndpointError::InvalidRequest(
                    "grant_type is required".into(),
                ));
            }
        };
        Ok(issued)
    }
    .await;
    match result {
        Ok(issued) => {
            let mut response = Json(token_body(issued)).into_response();
            no_store(&mut response);
            response
        }
        Err(err) => {
            tracing::info!(error = %err, "token request refused");
            err.into_response()
        }
    }
}

/// The token response (RFC 6749 §5.1).
fn token_body(issued: Issued) -> serde_json::Value {
    let mut body = serde_json::json!({
        "access_token": issued.access_token,
        "token_type": "Bearer",
        "expires_in": issued.expires_in,
        "scope": join_scopes(&issued.scopes),
    });
    if let Some(refresh) = issued.refresh_token {
        body["refresh_token"] = refresh.into();
    }
    body
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
        // Only the client a token was issued to may revoke it; anything else is ignored.
        state.grants.revoke_token(&client, token).await?;
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

/// A form field the request cannot do without (RFC 6749 §5.2 `invalid_request` when missing).
fn required<'a>(value: Option<&'a str>, name: &str) -> Result<&'a str, TokenEndpointError> {
    value
        .filter(|v| !v.is_empty())
        .ok_or_else(|| TokenEndpointError::InvalidRequest(format!("{name} is required")))
}
