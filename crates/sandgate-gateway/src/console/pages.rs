//! The console's pages: the tenant's conversations, and a conversation's live notebook.

use axum::extract::{OriginalUri, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use maud::{Markup, html};
use sandgate_service::grants::Session;
use sandgate_service::sandboxes::{SandboxRow, SandboxState, Target};
use sandgate_service::transcripts::{
    HtmlResults, Subject, Transcript, TranscriptError, human_bytes, render_parts,
};
use serde::Deserialize;

use super::{RECENT_SIGN_IN, missing_conversation, page, paths, signed_in, unavailable};
use crate::AppState;
use crate::oauth::html::hidden;

/// Most files of the sandbox the page lists.
const MAX_FILES_LISTED: usize = 200;
/// How deep under /home/user the page looks for files.
const MAX_FILES_DEPTH: usize = 4;
/// Longest conversation id looked up (the MCP face's bound).
pub const MAX_CONVERSATION_BYTES: usize = 256;

/// The list's query.
#[derive(Debug, Deserialize)]
pub struct ListQuery {
    #[serde(default)]
    q: Option<String>,
}

/// `GET /console[?q=…]`: the tenant's conversations, live and recent.
pub async fn list(
    State(state): State<AppState>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Query(query): Query<ListQuery>,
) -> Response {
    let here = uri.path_and_query().map_or(paths::LIST, |pq| pq.as_str());
    let session = match signed_in(&state, &headers, here).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let search = query
        .q
        .as_deref()
        .map(str::trim)
        .filter(|q| !q.is_empty() && q.len() <= MAX_CONVERSATION_BYTES);
    let Ok(lines) = state
        .sandboxes
        .conversations(session.tenant_id, search)
        .await
    else {
        return unavailable();
    };
    let body = html! {
        div.card {
            h1 { "Conversations" }
            p.muted { "Signed in as " (session.email) " (" (session.role) "). Open a conversation to see what the bot did and take over its sandbox." }
            form method="get" action=(paths::LIST) {
                div.actions {
                    input #q type="text" name="q" placeholder="conversation id" value=[search];
                    button.primary #search type="submit" { "Search" }
                }
            }
            table #conversations {
                tr { th { "Conversation" } th { "Sandbox" } th { "State" } th { "Last activity" } th { "Acted last" } }
                @for line in &lines {
                    tr.conversation data-conversation=(line.conversation_id) {
                        td { a href=(conversation_url(&line.conversation_id)) { (line.conversation_id) } }
                        td { code { (line.sandbox_id) } }
                        td { (format!("{:?}", line.state).to_lowercase()) }
                        td { (line.last_activity.map_or_else(|| "-".to_owned(), |t| t.format("%Y-%m-%d %H:%M UTC").to_string())) }
                        td { (line.person_last.as_deref().unwrap_or("the bot")) }
                    }
                }
            }
            @if lines.is_empty() { p.muted #no-conversations { "No conversations found." } }
            p.muted { a href=(crate::oauth::paths::APPS) { "Connected apps" } " · " a href=(crate::oauth::paths::TRANSCRIPTS) { "Transcripts" } " · " a #egress-requests href=(paths::EGRESS) { "Egress requests" } }
        }
    };
    page(
        StatusCode::OK,
        "Conversations · sandgate console",
        body,
        false,
    )
}

/// The URL of a conversation's page.
pub fn conversation_url(conversation: &str) -> String {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("id", conversation)
        .finish();
    format!("{}?{query}", paths::CONVERSATION)
}

/// The conversation page's query.
#[derive(Debug, Deserialize)]
pub struct ConversationQuery {
    #[serde(default)]
    id: String,
}

/// What the console knows of one of the tenant's conversations.
#[derive(Debug)]
pub struct Found {
    /// Its transcript (none: nothing recorded yet, or it was deleted).
    pub transcript: Option<Transcript>,
    /// Its live sandbox, if it has one.
    pub live: Option<SandboxRow>,
}

/// How much of a conversation [`find`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// Its transcript too (the page).
    Transcript,
    /// Only whether it is the tenant's, and its live sandbox (an action).
    Existence,
}

/// The tenant's conversation `id`, or the missing-conversation page (also for another
/// tenant's).
pub async fn find(
    state: &AppState,
    session: &Session,
    id: &str,
    read: Read,
) -> Result<Found, Response> {
    if id.is_empty() || id.len() > MAX_CONVERSATION_BYTES {
        return Err(missing_conversation());
    }
    let tenant = session.tenant_id;
    let live = state
        .sandboxes
        .live_sandbox_of(tenant, id)
        .await
        .map_err(|_| unavailable())?;
    let subject = Subject::Conversation(id.to_owned());
    let transcript = match read {
        Read::Existence if live.is_some() => None,
        // No live sandbox: it is the tenant's if it has a transcript (its outline reads no
        // entries).
        Read::Existence => match state.transcripts.outline(tenant, &subject).await {
            Ok(_) => None,
            Err(TranscriptError::NotFound { .. }) => return Err(missing_conversation()),
            Err(TranscriptError::Store(_) | TranscriptError::Busy) => return Err(unavailable()),
        },
        Read::Transcript => match state.transcripts.load(tenant, &subject).await {
            Ok(t) => Some(t),
            Err(TranscriptError::NotFound { .. }) if live.is_some() => None,
            Err(TranscriptError::NotFound { .. }) => return Err(missing_conversation()),
            Err(TranscriptError::Store(_) | TranscriptError::Busy) => return Err(unavailable()),
        },
    };
    Ok(Found { transcript, live })
}

/// `GET /console/conversation?id=…`: the conversation as a live notebook.
pub async fn conversation(
    State(state): State<AppState>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Query(query): Query<ConversationQuery>,
) -> Response {
    let here = uri.path_and_query().map_or(paths::LIST, |pq| pq.as_str());
    let session = match signed_in(&state, &headers, here).await {
        Ok(s) => s,
        Err(r) => return r,
    };
    let id = query.id.trim();
    let found = match find(&state, &session, id, Read::Transcript).await {
        Ok(f) => f,
        Err(r) => return r,
    };
    // Only a running sandbox's files are listed: reading a paused one's would resume it.
    let running = found
        .live
        .as_ref()
        .filter(|r| r.state == SandboxState::Leased);
    let files = match running {
        Some(row) => files_of(&state, &session, id, row).await,
        None => Vec::new(),
    };
    let running = running.is_some();
    let body = html! {
        div.card {
            h1 #title { "Conversation " (id) }
            @match &found.live {
                Some(row) if row.state == SandboxState::Leased => p.muted #sandbox { "Live sandbox " code { (row.id) } ". What you run here runs in this conversation's sandbox: the bot will find your variables and files, and be told a person acted." }
                Some(row) => p.muted #sandbox { "Sandbox " code { (row.id) } " is paused (its state is kept in a snapshot). Running code, or resuming it, brings it back with its variables and files." }
                None => p.muted #sandbox { "This conversation has no live sandbox; running code leases a new one for it." }
            }
            (takeover_options(&session, id, &found))
            p.muted { a href=(super::paths::LIST) { "All conversations" } }
        }
        div.card #notebook {
            h2 { "Notebook" }
            @match &found.transcript {
                Some(t) => {
                    @if let Some(note) = t.omitted.note() { p.note { (note) } }
                    (render_parts(t, HtmlResults::SandboxedFrame))
                    @if t.parts.iter().all(|p| p.records.is_empty()) { p.muted { "Nothing ran yet." } }
                }
                None => p.muted { "Nothing ran yet." }
            }
        }
        (act_card(&session, id))
        (files_card(&session, id, &files, running))
    };
    page(
        StatusCode::OK,
        &format!("{id} · sandgate console"),
        body,
        true,
    )
}

/// How a takeover user may take over besides working in the live sandbox: resume a paused
/// sandbox, or "take over in a copy" (fork it into a conversation of its own and work there,
/// leaving the bot's sandbox untouched). Nothing for a reader, or without a sandbox.
pub fn takeover_options(session: &Session, id: &str, found: &Found) -> Markup {
    let takeover = session.role.may_act();
    let Some(row) = found.live.as_ref().filter(|_| takeover) else {
        return html! {};
    };
    let paused = row.state != SandboxState::Leased;
    html! {
        div.actions #takeover {
            @if paused {
                form #resume-form method="post" action=(paths::RESUME) {
                    (hidden("csrf", &session.csrf_token))
                    (hidden("conversation", id))
                    button.primary #resume type="submit" { "Resume the sandbox" }
                }
            }
            form #fork-form method="post" action=(paths::FORK) {
                (hidden("csrf", &session.csrf_token))
                (hidden("conversation", id))
                button #fork type="submit" { "Take over in a copy" }
            }
            span.muted { "A copy has the same variables and files, in a conversation of its own; the bot's sandbox is left alone." }
        }
    }
}

/// The run, interrupt and confirm forms (or why there are none).
fn act_card(session: &Session, id: &str) -> Markup {
    let takeover = session.role.may_act();
    let recent = chrono::Utc::now() - session.authenticated_at <= RECENT_SIGN_IN;
    html! {
        div.card #act {
            h2 { "Run in the sandbox" }
            @if !takeover {
                p.muted #read-only { "Your account may read this conversation but not run code in it (it needs the takeover role)." }
            } @else {
                @if !recent {
                    form #confirm-form method="post" action=(paths::CONFIRM) {
                        p.muted { "Running code needs a recent sign-in: confirm your password." }
                        (hidden("csrf", &session.csrf_token))
                        (hidden("conversation", id))
                        input #confirm-password type="password" name="password" autocomplete="current-password" required;
                        div.actions { button.primary #confirm type="submit" { "Confirm" } }
                    }
                }
                form #run-form method="post" action=(paths::RUN) {
                    (hidden("csrf", &session.csrf_token))
                    (hidden("conversation", id))
                    textarea #code name="code" rows="6" spellcheck="false" placeholder="Python, or a shell command" {}
                    div.actions {
                        select #kind name="kind" style="width:auto" {
                            option value="cell" selected { "Python cell" }
                            option value="command" { "Shell command" }
                        }
                        button.primary #run type="submit" { "Run" }
                        span.muted #run-state {}
                    }
                }
                form #interrupt-form method="post" action=(paths::INTERRUPT) {
                    (hidden("csrf", &session.csrf_token))
                    (hidden("conversation", id))
                    div.actions { button #interrupt type="submit" { "Interrupt running calls (the bot's too)" } }
                }
                div #live-output hidden {}
                p #reload hidden { a href=(conversation_url(id)) { "Show it in the notebook" } }
            }
        }
    }
}

/// A file of the sandbox with its download link.
struct FileLine {
    path: String,
    size: u64,
    link: String,
}

/// The sandbox's files under /home/user, each with the console's download link (bound to the
/// signed-in user's tenant; attachment, `nosniff`).
async fn files_of(
    state: &AppState,
    session: &Session,
    id: &str,
    row: &SandboxRow,
) -> Vec<FileLine> {
    let Ok(caller) = state
        .sandboxes
        .person_caller(session.tenant_id, session.user_id, &session.email)
        .await
    else {
        return Vec::new();
    };
    let target = Target {
        sandbox_id: Some(&row.id),
        conversation: Some(id),
        keep_alive: None,
    };
    let Ok(resolved) = state.sandboxes.resolve_target(&caller, target).await else {
        return Vec::new();
    };
    let files = state
        .sandboxes
        .walk_files(&resolved, MAX_FILES_LISTED, MAX_FILES_DEPTH)
        .await;
    files
        .into_iter()
        .map(|(path, size)| {
            let link = super::takeover::file_url(id, &path);
            FileLine { path, size, link }
        })
        .collect()
}

fn files_card(session: &Session, id: &str, files: &[FileLine], live: bool) -> Markup {
    let takeover = session.role.may_act();
    let upload = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("conversation", id)
        .finish();
    html! {
        div.card #files {
            h2 { "Files in /home/user" }
            @if !live { p.muted { "No live sandbox." } }
            table {
                @for f in files {
                    tr.file data-path=(f.path) {
                        td { a.download href=(f.link) rel="noreferrer" { (f.path) } }
                        td { (human_bytes(f.size)) }
                    }
                }
            }
            @if takeover {
                form #upload-form method="post" action={ (paths::UPLOAD) "?" (upload) } {
                    (hidden("csrf", &session.csrf_token))
                    div.actions {
                        input #upload-file type="file" name="file";
                        button #upload type="submit" { "Upload to /home/user" }
                    }
                }
            }
        }
    }
}
