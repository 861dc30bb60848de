//! The connected-apps page: each app the user connected (name, scopes, when, last used) with a
//! Disconnect button. Disconnecting revokes the grant (its tokens stop on their next request,
//! its refresh tokens are dead) and closes the sandboxes it leased.

use axum::extract::{Form, OriginalUri, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use sandgate_auth::Scope;
use sandgate_service::grants::GrantError;
use serde::Deserialize;
use uuid::Uuid;

use maud::html;

use super::html::{self, hidden, see_other};
use super::{paths, session};
use crate::AppState;

fn when(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M UTC").to_string()
}

fn unavailable(err: &GrantError) -> Response {
    super::log_failure(err);
    html::error_page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Temporarily unavailable",
        "sandgate could not load this page; please retry in a moment.",
    )
}

async fn page_handler(state: &AppState, headers: &HeaderMap, here: &str) -> Response {
    let session = match session::current(state, headers).await {
        Ok(Some(s)) => s,
        Ok(None) => return session::login_redirect(here),
        Err(err) => return unavailable(&err),
    };
    let connections = match state.grants.connections(session.user_id).await {
        Ok(c) => c,
        Err(err) => return unavailable(&err),
    };
    let body = html! {
        h1 { "Connected apps" }
        p.muted {
            "Signed in as " (session.email) ". Apps listed here can use sandgate for you. "
            "Disconnecting one stops its access at once and closes its sandboxes. "
            a href=(paths::TRANSCRIPTS) { "Find a conversation's transcript" } ", or "
            a #console href=(paths::CONSOLE) { "open the console" } " to take over a conversation's sandbox."
        }
        @for c in &connections {
            div.app data-grant=(c.id) {
                strong.app-name { (c.client_name) }
                p.muted { "Can " (describe_scopes(&c.scopes)) "." }
                p.muted {
                    "Connected " (when(c.created_at)) " · last used "
                    (c.last_used_at.map_or_else(|| "never".to_owned(), when))
                }
                form method="post" action=(paths::DISCONNECT) {
                    (hidden("csrf", &session.csrf_token))
                    (hidden("grant_id", &c.id.to_string()))
                    div.actions { button.disconnect type="submit" { "Disconnect" } }
                }
            }
        }
        @if connections.is_empty() {
            p.muted #no-apps { "No apps are connected." }
        }
        form method="post" action=(paths::LOGOUT) {
            (hidden("csrf", &session.csrf_token))
            div.actions { button type="submit" { "Sign out" } }
        }
    };
    html::page(StatusCode::OK, "Connected apps · sandgate", body)
}

/// A connection's scopes in words: "run code; read files".
fn describe_scopes(scopes: &str) -> String {
    Scope::parse_list(scopes)
        .unwrap_or_default()
        .iter()
        .map(|s| s.describe())
        .collect::<Vec<_>>()
        .join("; ")
}

/// `GET /apps`.
pub async fn page(
    State(state): State<AppState>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
) -> Response {
    page_handler(&state, &headers, uri.path()).await
}

/// The disconnect form.
#[derive(Debug, Deserialize)]
pub struct DisconnectForm {
    #[serde(default)]
    csrf: Option<String>,
    grant_id: Uuid,
}

/// `POST /apps/disconnect`: revokes the grant and closes its sandboxes, then back to the list.
pub async fn disconnect(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<DisconnectForm>,
) -> Response {
    let session = match session::current(&state, &headers).await {
        Ok(Some(s)) => s,
        Ok(None) => return session::login_redirect(paths::APPS),
        Err(err) => return unavailable(&err),
    };
    if !session::csrf_ok(&session, form.csrf.as_deref()) {
        return session::form_expired();
    }
    // Not this user's, or already gone (false): the page shows the truth either way.
    if let Err(err) = state
        .grants
        .disconnect(session.user_id, form.grant_id)
        .await
    {
        return unavailable(&err);
    }
    see_other(paths::APPS).into_response()
}
