//! "Take over in a copy", resuming a paused sandbox, and the console's own file download.
//!
//! - `POST /console/fork`: forks the conversation's sandbox (the service's
//!   [`fork_into`](sandgate_service::sandboxes::SandboxService::fork_into), as the
//!   `fork_sandbox` tool's `fork`) into a copy bound to a conversation of its own
//!   (`<conversation>~copy-<hex>`), so the person works in the copy with its own page and
//!   transcript while the bot goes on in the original.
//! - `POST /console/resume`: resumes the conversation's paused sandbox (the same resume a tool
//!   call naming it makes).
//! - `GET /console/file?conversation=…&path=…`: a file of the conversation's live sandbox, as an
//!   attachment with `nosniff`; the conversation must be the signed-in user's tenant's (else the
//!   missing-conversation page), unlike a `/files/` link, which opens for whoever holds it.
//!
//! Each is admitted as the other actions are ([`super::act::acting`]; the download as a read),
//! under the tenant's quotas, audited under `user:<email>`.

use std::time::Instant;

use axum::body::Body;
use axum::extract::{Form, OriginalUri, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use sandgate_service::audit::Outcome;
use sandgate_service::sandboxes::{SandboxState, Target};
use serde::Deserialize;

use super::act::{acting, audit, bad_request, person, refused};
use super::pages::{MAX_CONVERSATION_BYTES, Read, conversation_url, find};
use super::{paths, signed_in};
use crate::AppState;
use crate::headers::untrusted;
use crate::oauth::html::see_other;

/// The fork and resume forms.
#[derive(Debug, Deserialize)]
pub struct SandboxForm {
    #[serde(default)]
    csrf: Option<String>,
    #[serde(default)]
    conversation: String,
}

/// The conversation a copy of `conversation`'s sandbox is bound to: a fresh one, named after it.
pub fn copy_conversation(conversation: &str) -> Option<String> {
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let copy = format!("{conversation}~copy-{suffix}");
    (copy.len() <= MAX_CONVERSATION_BYTES).then_some(copy)
}

/// `POST /console/fork`: forks the conversation's sandbox into a copy with a conversation of
/// its own, and opens the copy's page.
pub async fn fork(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<SandboxForm>,
) -> Response {
    let conversation = form.conversation.trim().to_owned();
    let (session, found) = match acting(&state, &headers, form.csrf.as_deref(), &conversation).await
    {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    let Some(row) = found.live else {
        return bad_request("This conversation has no live or paused sandbox to copy.");
    };
    let Some(copy) = copy_conversation(&conversation) else {
        return bad_request("This conversation's id is too long to name a copy after it.");
    };
    let caller = match person(&state, &session).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let permit = match state.sandboxes.admit(&caller).await {
        Ok(p) => p,
        Err(err) => return refused(&err),
    };
    let started = Instant::now();
    let forked = state
        .sandboxes
        .fork_into(&caller, &row.id, Some(&copy))
        .await;
    drop(permit);
    match forked {
        Ok(forked) => {
            let sandbox = Some(forked.fork.row.id.clone());
            audit(
                &state,
                &caller,
                &copy,
                "console_fork_sandbox",
                sandbox,
                Outcome::Ok,
                started.elapsed(),
            );
            see_other(&conversation_url(&copy))
        }
        Err(err) => {
            let took = started.elapsed();
            let sandbox = Some(row.id);
            let tool = "console_fork_sandbox";
            audit(
                &state,
                &caller,
                &conversation,
                tool,
                sandbox,
                Outcome::Failed,
                took,
            );
            refused(&err)
        }
    }
}

/// `POST /console/resume`: resumes the conversation's paused sandbox (a live one is left as it
/// is), back to its page.
pub async fn resume(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<SandboxForm>,
) -> Response {
    let conversation = form.conversation.trim().to_owned();
    let (session, found) = match acting(&state, &headers, form.csrf.as_deref(), &conversation).await
    {
        Ok(ok) => ok,
        Err(r) => return r,
    };
    let Some(row) = found.live else {
        return see_other(&conversation_url(&conversation));
    };
    let caller = match person(&state, &session).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let permit = match state.sandboxes.admit(&caller).await {
        Ok(p) => p,
        Err(err) => return refused(&err),
    };
    let started = Instant::now();
    let target = Target {
        sandbox_id: Some(&row.id),
        conversation: Some(&conversation),
        keep_alive: None,
    };
    let resolved = state.sandboxes.resolve_target(&caller, target).await;
    drop(permit);
    let tool = "console_resume_sandbox";
    let sandbox = Some(row.id.clone());
    match resolved {
        Ok(_) => {
            let took = started.elapsed();
            audit(
                &state,
                &caller,
                &conversation,
                tool,
                sandbox,
                Outcome::Ok,
                took,
            );
            see_other(&conversation_url(&conversation))
        }
        Err(err) => {
            let took = started.elapsed();
            audit(
                &state,
                &caller,
                &conversation,
                tool,
                sandbox,
                Outcome::Failed,
                took,
            );
            refused(&err)
        }
    }
}

/// The download's query.
#[derive(Debug, Deserialize)]
pub struct FileQuery {
    #[serde(default)]
    conversation: String,
    #[serde(default)]
    path: String,
}

/// The URL of the console's download of `path` in `conversation`'s sandbox.
pub fn file_url(conversation: &str, path: &str) -> String {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("conversation", conversation)
        .append_pair("path", path)
        .finish();
    format!("{}?{query}", paths::FILE)
}

/// `GET /console/file?conversation=…&path=…`: the file, as an attachment.
pub async fn file(
    State(state): State<AppState>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Query(query): Query<FileQuery>,
) -> Response {
    let here = uri.path_and_query().map_or(paths::LIST, |pq| pq.as_str());
    let session = match signed_in(&state, &headers, here).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let conversation = query.conversation.trim();
    let found = match find(&state, &session, conversation, Read::Existence).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    let Some(row) = found.live.filter(|r| r.state == SandboxState::Leased) else {
        return bad_request(
            "This conversation's sandbox is not running (paused or ended): resume it from its \
             page first.",
        );
    };
    let caller = match person(&state, &session).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let started = Instant::now();
    let target = Target {
        sandbox_id: Some(&row.id),
        conversation: Some(conversation),
        keep_alive: None,
    };
    let read = state
        .sandboxes
        .read_file(&caller, target, query.path.trim())
        .await;
    let tool = "console_get_file";
    let sandbox = Some(row.id.clone());
    let (data, info) = match read {
        Ok((_, data, info)) => (data, info),
        Err(err) => {
            let took = started.elapsed();
            audit(
                &state,
                &caller,
                conversation,
                tool,
                sandbox,
                Outcome::UserError,
                took,
            );
            return refused(&err);
        }
    };
    audit(
        &state,
        &caller,
        conversation,
        tool,
        sandbox,
        Outcome::Ok,
        started.elapsed(),
    );
    attachment(&info.path, data)
}

/// `data` as a download named after `path`'s last part, with the untrusted-content headers.
fn attachment(path: &str, data: Vec<u8>) -> Response {
    let mime = crate::mcp::tools::mime_type(path, &data[..data.len().min(512)]);
    let name = crate::files::download_name(path);
    let mut response = Response::new(Body::from(data));
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&mime) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    untrusted(headers);
    *response.status_mut() = StatusCode::OK;
    response
}
