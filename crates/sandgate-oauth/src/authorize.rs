//! The authorization endpoint (OAuth 2.1 §4.1) and the consent page.
//!
//! Until the client and its redirect URI are known to be genuine, errors are shown as a page and
//! never redirected (OAuth 2.1 §4.1.2.1: no open redirector). After that, errors go back to the
//! client with `state` and `iss` (RFC 9207). A user who already approved the client for at least
//! the requested scopes is not asked again ("connect once").

use axum::extract::{Form, OriginalUri, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use sandgate_auth::{Scope, client as client_rules, pkce};
use sandgate_service::grants::consent::may_connect;
use sandgate_service::grants::{Client, GrantError, NewCode, Session, join_scopes};
use serde::Deserialize;

use super::clients::{ClientLookupError, lookup};
use super::ratelimit::ClientAddress;
use maud::html;

use super::html::{self, hidden, page, see_other};
use super::{paths, session};
use crate::AppState;

/// The parameters of an authorization request (query of GET, fields of the consent POST).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct AuthorizeParams {
    response_type: Option<String>,
    client_id: Option<String>,
    redirect_uri: Option<String>,
    code_challenge: Option<String>,
    code_challenge_method: Option<String>,
    state: Option<String>,
    scope: Option<String>,
    resource: Option<String>,
}

/// A request that passed every check.
#[derive(Debug)]
struct Valid {
    client: Client,
    redirect_uri: String,
    challenge: String,
    scopes: Vec<Scope>,
    resource: String,
    state: Option<String>,
}

/// How a request failed: a page (client or redirect URI untrusted) or an error sent back to the
/// client's redirect URI.
enum Failure {
    Page(Response),
    Redirect(Response),
}

impl Failure {
    fn into_response(self) -> Response {
        match self {
            Failure::Page(r) | Failure::Redirect(r) => r,
        }
    }
}

/// Builds the redirect back to the client with `params` added to the redirect URI's query.
fn redirect_to_client(
    state: &AppState,
    redirect_uri: &str,
    client_state: Option<&str>,
    params: &[(&str, &str)],
) -> Response {
    let Ok(mut url) = url::Url::parse(redirect_uri) else {
        return html::error_page(
            StatusCode::BAD_REQUEST,
            "Invalid redirect URI",
            "The app's redirect URI is not a valid URL.",
        );
    };
    {
        let mut query = url.query_pairs_mut();
        for (k, v) in params {
            query.append_pair(k, v);
        }
        if let Some(s) = client_state {
            query.append_pair("state", s);
        }
        query.append_pair("iss", &state.config.public_url());
    }
    see_other(url.as_str())
}

fn error_to_client(
    state: &AppState,
    valid_uri: &str,
    client_state: Option<&str>,
    error: &str,
    description: &str,
) -> Failure {
    Failure::Redirect(redirect_to_client(
        state,
        valid_uri,
        client_state,
        &[("error", error), ("error_description", description)],
    ))
}

fn unavailable(err: &GrantError) -> Failure {
    super::log_failure(err);
    Failure::Page(html::error_page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Temporarily unavailable",
        "sandgate could not process this request; please retry in a moment.",
    ))
}

async fn validate(
    state: &AppState,
    address: ClientAddress,
    p: &AuthorizeParams,
) -> Result<Valid, Failure> {
    let Some(client_id) = p.client_id.as_deref().filter(|c| !c.is_empty()) else {
        return Err(Failure::Page(html::error_page(
            StatusCode::BAD_REQUEST,
            "Invalid request",
            "The app did not say who it is (client_id is missing).",
        )));
    };
    let client = match lookup(state, client_id, address).await {
        Ok(client) => client,
        Err(ClientLookupError::Grant(err)) => return Err(unavailable(&err)),
        Err(ClientLookupError::Limited(limited)) => {
            let mut response =
                html::error_page(limited.status(), "Too many requests", &limited.message());
            limited.stamp(&mut response);
            return Err(Failure::Page(response));
        }
        Err(err) => {
            tracing::info!(error = %err, "authorization request from an unknown client");
            return Err(Failure::Page(html::error_page(
                StatusCode::BAD_REQUEST,
                "Unknown app",
                &format!("This app is not registered with sandgate ({err})."),
            )));
        }
    };
    let redirect_uri = match p.redirect_uri.as_deref() {
        Some(uri) if client_rules::redirect_uri_matches(&client.redirect_uris, uri) => {
            uri.to_owned()
        }
        None if client.redirect_uris.len() == 1 => client.redirect_uris[0].clone(),
        _ => {
            return Err(Failure::Page(html::error_page(
                StatusCode::BAD_REQUEST,
                "Invalid redirect URI",
                "The redirect URI does not exactly match one registered for this app, so sandgate will not send you there.",
            )));
        }
    };
    let cs = p.state.as_deref();
    if p.response_type.as_deref() != Some("code") {
        return Err(error_to_client(
            state,
            &redirect_uri,
            cs,
            "unsupported_response_type",
            "response_type must be code",
        ));
    }
    let challenge = pkce::check_challenge(
        p.code_challenge.as_deref(),
        p.code_challenge_method.as_deref(),
    )
    .map_err(|e| error_to_client(state, &redirect_uri, cs, "invalid_request", &e.to_string()))?;
    let allowed = match &client.scopes {
        Some(s) => Scope::parse_list(s).unwrap_or_default(),
        None => Scope::ALL.to_vec(),
    };
    let scopes = match p.scope.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        None => allowed.clone(),
        Some(s) => Scope::parse_list(s).map_err(|e| {
            error_to_client(state, &redirect_uri, cs, "invalid_scope", &e.to_string())
        })?,
    };
    if let Some(extra) = scopes.iter().find(|s| !allowed.contains(s)) {
        return Err(error_to_client(
            state,
            &redirect_uri,
            cs,
            "invalid_scope",
            &format!("this app may not ask for the {extra} scope"),
        ));
    }
    let mcp_url = state.config.mcp_url();
    let resource = match p.resource.as_deref() {
        None => mcp_url,
        Some(r) if r == mcp_url => mcp_url,
        Some(r) => {
            return Err(error_to_client(
                state,
                &redirect_uri,
                cs,
                "invalid_target",
                &format!("unknown resource {r:?}; this server protects {mcp_url}"),
            ));
        }
    };
    Ok(Valid {
        client,
        redirect_uri,
        challenge,
        scopes,
        resource,
        state: p.state.clone(),
    })
}

/// Issues a code under `grant_id` and redirects the browser to the client with it.
async fn issue_code(state: &AppState, valid: &Valid, grant_id: uuid::Uuid) -> Response {
    let code = NewCode {
        grant_id,
        client_id: &valid.client.id,
        redirect_uri: &valid.redirect_uri,
        code_challenge: &valid.challenge,
        resource: &valid.resource,
        scopes: &valid.scopes,
    };
    match state.grants.issue_code(code).await {
        Ok(code) => redirect_to_client(
            state,
            &valid.redirect_uri,
            valid.state.as_deref(),
            &[("code", &code)],
        ),
        Err(err) => unavailable(&err).into_response(),
    }
}

/// The refusal of a client registered for another tenant than the user's (the rule:
/// [`may_connect`]).
fn foreign_client(state: &AppState, valid: &Valid, session: &Session) -> Option<Response> {
    if may_connect(&valid.client, session) {
        return None;
    }
    tracing::warn!(client_id = %valid.client.id, user_id = %session.user_id, "refused a client registered for another tenant");
    Some(
        error_to_client(
            state,
            &valid.redirect_uri,
            valid.state.as_deref(),
            "access_denied",
            "this app is registered for another sandgate account",
        )
        .into_response(),
    )
}

/// `GET /oauth/authorize`.
pub async fn authorize(
    State(state): State<AppState>,
    address: ClientAddress,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Query(params): Query<AuthorizeParams>,
) -> Response {
    let valid = match validate(&state, address, &params).await {
        Ok(valid) => valid,
        Err(failure) => return failure.into_response(),
    };
    let session = match session::current(&state, &headers).await {
        Ok(Some(session)) => session,
        Ok(None) => {
            let here = uri
                .path_and_query()
                .map_or(paths::AUTHORIZE, |pq| pq.as_str());
            return session::login_redirect(here);
        }
        Err(err) => return unavailable(&err).into_response(),
    };
    if let Some(refused) = foreign_client(&state, &valid, &session) {
        return refused;
    }
    // Connect once: an approval covering these scopes skips the screen.
    let prior = state
        .grants
        .prior_approval(&session, &valid.client.id, &valid.scopes)
        .await;
    match prior {
        Ok(Some(grant_id)) => {
            tracing::info!(client_id = %valid.client.id, grant_id = %grant_id, "already approved; skipping consent");
            return issue_code(&state, &valid, grant_id).await;
        }
        Ok(None) => {}
        Err(err) => return unavailable(&err).into_response(),
    }
    consent_page(&state, &valid, &session).await
}

async fn consent_page(state: &AppState, valid: &Valid, session: &Session) -> Response {
    let tenant_name = match state.grants.tenant_name(session.tenant_id).await {
        Ok(name) => name,
        Err(err) => return unavailable(&err).into_response(),
    };
    let redirect_host = url::Url::parse(&valid.redirect_uri)
        .ok()
        .map(|u| match u.host_str() {
            Some(h) => match u.port() {
                Some(p) => format!("{h}:{p}"),
                None => h.to_owned(),
            },
            None => format!("{}:", u.scheme()),
        })
        .unwrap_or_default();
    let name = valid.client.name.as_str();
    let cimd_host = url::Url::parse(&valid.client.id)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned))
        .unwrap_or_default();
    let identity = html! {
        @match valid.client.kind.as_str() {
            "cimd" => p.muted { "App identity verified by its web address: " strong { (cimd_host) } },
            "confidential" => p.muted { "This app was registered by your administrator." },
            _ => p.muted { "This app registered itself; sandgate has not verified its name. Only continue if you started this connection." },
        }
    };
    let scope_string = join_scopes(&valid.scopes);
    let body = html! {
        h1 #title { span #client-name { (name) } " wants to use your sandgate account" }
        (identity)
        p { "Account: " strong #tenant { (tenant_name) } " " span.muted { "(signed in as " (session.email) ")" } }
        p { "If you allow it, " strong { (name) } " will be able to:" }
        ul.scopes #scopes {
            @for s in &valid.scopes {
                li { (sentence_case(s.describe())) " " code { (s.as_str()) } }
            }
        }
        p.muted {
            "You will then be sent to " strong #redirect-host { (redirect_host) } ". "
            "You can disconnect this app at any time under " a href=(paths::APPS) { "Connected apps" } "."
        }
        form method="post" action=(paths::AUTHORIZE) {
            (hidden("csrf", &session.csrf_token))
            (hidden("response_type", "code"))
            (hidden("client_id", &valid.client.id))
            (hidden("redirect_uri", &valid.redirect_uri))
            (hidden("code_challenge", &valid.challenge))
            (hidden("code_challenge_method", "S256"))
            (hidden("scope", &scope_string))
            (hidden("resource", &valid.resource))
            @if let Some(state) = &valid.state { (hidden("state", state)) }
            div.actions {
                button #deny type="submit" name="decision" value="deny" { "Deny" }
                button.primary #approve type="submit" name="decision" value="approve" { "Allow" }
            }
        }
    };
    page(StatusCode::OK, &format!("Allow {name}? · sandgate"), body)
}

/// "run code" → "Run code".
fn sentence_case(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// The consent form: the authorization request again, the CSRF token and the decision.
#[derive(Debug, Deserialize)]
pub struct ConsentForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    decision: Option<String>,
    #[serde(default)]
    response_type: Option<String>,
    #[serde(default)]
    client_id: Option<String>,
    #[serde(default)]
    redirect_uri: Option<String>,
    #[serde(default)]
    code_challenge: Option<String>,
    #[serde(default)]
    code_challenge_method: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    resource: Option<String>,
}

/// `POST /oauth/authorize`: the user's decision on the consent page. Answers 303.
pub async fn consent(
    State(state): State<AppState>,
    address: ClientAddress,
    headers: HeaderMap,
    Form(form): Form<ConsentForm>,
) -> Response {
    let session = match session::current(&state, &headers).await {
        Ok(Some(session)) => session,
        Ok(None) => {
            return html::error_page(
                StatusCode::UNAUTHORIZED,
                "Signed out",
                "Your session ended before you decided. Go back to the app and connect again.",
            );
        }
        Err(err) => return unavailable(&err).into_response(),
    };
    // The token proves the form came from our consent page in this session (no CSRF).
    if !super::session::csrf_ok(&session, form.csrf.as_deref()) {
        tracing::warn!(user_id = %session.user_id, "consent POST without a valid CSRF token");
        return html::error_page(
            StatusCode::FORBIDDEN,
            "Form expired",
            "This form expired or did not come from sandgate. Go back to the app and connect again.",
        );
    }
    let params = AuthorizeParams {
        response_type: form.response_type,
        client_id: form.client_id,
        redirect_uri: form.redirect_uri,
        code_challenge: form.code_challenge,
        code_challenge_method: form.code_challenge_method,
        state: form.state,
        scope: form.scope,
        resource: form.resource,
    };
    let valid = match validate(&state, address, &params).await {
        Ok(valid) => valid,
        Err(failure) => return failure.into_response(),
    };
    if let Some(refused) = foreign_client(&state, &valid, &session) {
        return refused;
    }
    if form.decision.as_deref() != Some("approve") {
        tracing::info!(client_id = %valid.client.id, "the user denied access");
        return error_to_client(
            &state,
            &valid.redirect_uri,
            valid.state.as_deref(),
            "access_denied",
            "the user denied access",
        )
        .into_response();
    }
    let approved = state
        .grants
        .approve(&session, &valid.client.id, &valid.scopes)
        .await;
    let grant_id = match approved {
        Ok(grant_id) => grant_id,
        Err(err) => return unavailable(&err).into_response(),
    };
    tracing::info!(client_id = %valid.client.id, grant_id = %grant_id, user_id = %session.user_id, "the user approved an app");
    issue_code(&state, &valid, grant_id).await
}
