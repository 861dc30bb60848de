//! The hosts a conversation's sandbox asked for outside the tenant's egress policy (issue 29,
//! its optional part), decided by a person: off unless the tenant's policy turns approvals on
//! (`sandgate admin tenant egress <id> --approvals on`).
//!
//! - `GET /console/egress[?id=…]`: the tenant's requests, pending first; with `id` (the link
//!   the sandbox's refusal carries), that request on top. Every user of the tenant may read;
//!   another tenant's request, and one that does not exist, get the same missing page.
//! - `POST /console/egress/decide`: approves or denies a pending request. Only the `approver`
//!   role, within [`super::RECENT_SIGN_IN`] of proving the password, from our own pages (the
//!   origin checks and the session's CSRF token), as every console action. The bot cannot get
//!   here: its access token opens the MCP endpoint only, never a browser session.
//! - `POST /console/egress/confirm`: confirms the password again, back to the page.
//!
//! An approval lets that sandbox alone reach that name and port for
//! [`APPROVAL_HOLDS_FOR`]; the name is still checked as a rule's is (never an address, never a
//! private, loopback, link-local or metadata one) and every connection is audited. A decision
//! is audited under `user:<email>` (`console_egress_approve` / `console_egress_deny`).

use axum::extract::{Form, OriginalUri, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use maud::{Markup, html};
use sandgate_service::egress::approvals::{self, Approval, ApprovalState, Decided};
use sandgate_service::egress::{APPROVAL_HOLDS_FOR, APPROVALS_PATH};
use sandgate_service::grants::Session;
use serde::Deserialize;

use super::pages::conversation_url;
use super::{RECENT_SIGN_IN, error_page, page, paths, same_origin, signed_in, unavailable};
use crate::AppState;
use crate::oauth::html::{hidden, see_other};
use crate::oauth::session;

/// Most requests the page lists.
const LISTED: i64 = 200;

/// The page's query.
#[derive(Debug, Deserialize)]
pub struct PageQuery {
    #[serde(default)]
    id: Option<String>,
}

/// The decide form.
#[derive(Debug, Deserialize)]
pub struct DecideForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    id: String,
    #[serde(default)]
    decision: String,
}

/// The confirm form.
#[derive(Debug, Deserialize)]
pub struct ConfirmForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    id: String,
    #[serde(default)]
    password: String,
}

/// The URL of request `id`'s place on the page (or the page, for no id).
pub fn request_url(id: Option<&str>) -> String {
    match id.and_then(|id| uuid::Uuid::parse_str(id).ok()) {
        Some(id) => format!("{APPROVALS_PATH}?id={id}"),
        None => APPROVALS_PATH.to_owned(),
    }
}

/// The page for a request that is not one of the tenant's (or does not exist): the same
/// answer either way.
fn missing_request() -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        "No such request",
        "No egress request with this id: it is not one of your tenant's, or its sandbox's \
         records were deleted.",
    )
}

/// Why the user may not decide now (the role, then a recent sign-in); `None` when they may.
fn refusal_to_decide(session: &Session) -> Option<Response> {
    if session.role != crate::admin::UserRole::Approver {
        return Some(error_page(
            StatusCode::FORBIDDEN,
            "Not an approver",
            "Your account may read egress requests but not decide them; an operator can give it \
             the approver role (sandgate admin user role --role approver).",
        ));
    }
    if chrono::Utc::now() - session.authenticated_at > RECENT_SIGN_IN {
        return Some(error_page(
            StatusCode::FORBIDDEN,
            "Confirm your password",
            "Deciding a request needs a recent sign-in: confirm your password on the egress \
             requests page, then try again.",
        ));
    }
    None
}

/// Where a request stands now, as shown (`expired` for one past its time).
fn shown_state(request: &Approval) -> &'static str {
    if request.current(chrono::Utc::now()) {
        request.state.as_str()
    } else {
        "expired"
    }
}

fn when(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M UTC").to_string()
}

/// One request's row, with the decide forms when the user may decide it.
fn row(session: &Session, request: &Approval, may_decide: bool) -> Markup {
    let open = request.state == ApprovalState::Pending && request.current(chrono::Utc::now());
    let id = request.id.to_string();
    html! {
        tr.request data-id=(id) data-state=(shown_state(request)) {
            td { code.target { (request.host) ":" (request.port) } }
            td {
                @if let Some(conversation) = &request.conversation_id {
                    a href=(conversation_url(conversation)) { (conversation) }
                } @else { "-" }
            }
            td { code { (request.sandbox_id) } }
            td { (when(request.requested_at)) }
            td.state { (shown_state(request)) }
            td {
                @if let Some(by) = &request.decided_by {
                    (by) " · until " (when(request.expires_at))
                } @else if open {
                    "open until " (when(request.expires_at))
                } @else { "-" }
            }
            td {
                @if open && may_decide {
                    form.decide method="post" action=(paths::EGRESS_DECIDE) style="display:inline" {
                        (hidden("csrf", &session.csrf_token))
                        (hidden("id", &id))
                        (hidden("decision", "approve"))
                        button.primary.approve type="submit" { "Approve" }
                    }
                    " "
                    form.decide method="post" action=(paths::EGRESS_DECIDE) style="display:inline" {
                        (hidden("csrf", &session.csrf_token))
                        (hidden("id", &id))
                        (hidden("decision", "deny"))
                        button.deny type="submit" { "Deny" }
                    }
                }
            }
        }
    }
}

/// `GET /console/egress[?id=…]`: the tenant's egress requests.
pub async fn list(
    State(state): State<AppState>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Query(query): Query<PageQuery>,
) -> Response {
    let here = uri
        .path_and_query()
        .map_or(APPROVALS_PATH, |pq| pq.as_str());
    let session = match signed_in(&state, &headers, here).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let chosen = match query.id.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        None => None,
        Some(raw) => {
            let Ok(id) = uuid::Uuid::parse_str(raw) else {
                return missing_request();
            };
            match approvals::get(&state.db, session.tenant_id, id).await {
                Ok(Some(request)) => Some(request),
                Ok(None) => return missing_request(),
                Err(_) => return unavailable(),
            }
        }
    };
    let Ok(requests) = approvals::list(&state.db, session.tenant_id, LISTED).await else {
        return unavailable();
    };
    let approver = session.role == crate::admin::UserRole::Approver;
    let recent = chrono::Utc::now() - session.authenticated_at <= RECENT_SIGN_IN;
    let may_decide = approver && recent;
    let hours = APPROVAL_HOLDS_FOR.num_hours();
    let head = html! {
        tr { th { "Host" } th { "Conversation" } th { "Sandbox" } th { "Asked" } th { "State" } th { "Decided" } th {} }
    };
    let body = html! {
        div.card {
            h1 { "Egress requests" }
            p.muted { "Signed in as " (session.email) " (" (session.role) "). A sandbox of your tenant asked to reach these hosts, which are not in the tenant's egress policy. Approving one lets that sandbox alone connect to that host and port for " (hours) " hours; the name is still checked (never a private or internal address) and every connection is audited. Approve only hosts you expect this conversation to need: the request comes from the bot's code." }
            @if !approver {
                p.muted #read-only { "Your account may read these requests but not decide them (it needs the approver role)." }
            } @else if !recent {
                form #confirm-form method="post" action=(paths::EGRESS_CONFIRM) {
                    p.muted { "Deciding needs a recent sign-in: confirm your password." }
                    (hidden("csrf", &session.csrf_token))
                    (hidden("id", &chosen.as_ref().map(|r| r.id.to_string()).unwrap_or_default()))
                    input #confirm-password type="password" name="password" autocomplete="current-password" required;
                    div.actions { button.primary #confirm type="submit" { "Confirm" } }
                }
            }
        }
        @if let Some(request) = &chosen {
            div.card #request {
                h2 { "This request" }
                table { (head) (row(&session, request, may_decide)) }
            }
        }
        div.card {
            h2 { "All requests" }
            table #requests {
                (head)
                @for request in &requests { (row(&session, request, may_decide)) }
            }
            @if requests.is_empty() { p.muted #no-requests { "No sandbox of your tenant has asked for a host outside the policy." } }
            p.muted { a href=(paths::LIST) { "Conversations" } }
        }
    };
    page(
        StatusCode::OK,
        "Egress requests · sandgate console",
        body,
        false,
    )
}

/// `POST /console/egress/decide`: approves or denies a pending request, back to its place.
pub async fn decide(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<DecideForm>,
) -> Response {
    let back = request_url(Some(form.id.trim()));
    let session = match signed_in(&state, &headers, &back).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if !same_origin(&state, &headers) || !session::csrf_ok(&session, form.csrf.as_deref()) {
        return session::form_expired();
    }
    let Ok(id) = uuid::Uuid::parse_str(form.id.trim()) else {
        return missing_request();
    };
    let approve = match form.decision.as_str() {
        "approve" => true,
        "deny" => false,
        _ => {
            return error_page(
                StatusCode::BAD_REQUEST,
                "Cannot do that",
                "A decision is approve or deny.",
            );
        }
    };
    if let Some(refusal) = refusal_to_decide(&session) {
        return refusal;
    }
    let by = format!("user:{}", session.email);
    match approvals::decide(&state.db, session.tenant_id, id, approve, &by).await {
        Ok(Decided::Now(_)) => see_other(&back),
        Ok(Decided::Missing) => missing_request(),
        Ok(Decided::Already(request)) => error_page(
            StatusCode::CONFLICT,
            "Already decided",
            &format!(
                "This request is {}: it can no longer be decided. If the sandbox asks again, a \
                 new request appears on the page.",
                shown_state(&request)
            ),
        ),
        Err(err) => {
            tracing::error!(%err, "egress request: the decision could not be stored");
            unavailable()
        }
    }
}

/// `POST /console/egress/confirm`: checks the password again, back to the page.
pub async fn confirm(
    State(state): State<AppState>,
    extensions: axum::http::Extensions,
    headers: HeaderMap,
    Form(form): Form<ConfirmForm>,
) -> Response {
    let back = request_url(Some(form.id.trim()));
    let session = match signed_in(&state, &headers, &back).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    if !same_origin(&state, &headers) || !session::csrf_ok(&session, form.csrf.as_deref()) {
        return session::form_expired();
    }
    super::act::reconfirmed(
        &state,
        &extensions,
        &headers,
        &session,
        form.password,
        &back,
    )
    .await
}
