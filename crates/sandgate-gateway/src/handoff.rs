//! The HTTP faces of transcripts, for the person who takes over a conversation:
//!
//! - [`download`]: an exported transcript behind a download link (`export_transcript`, or the
//!   page below). The HTML page is served sandboxed (`Content-Security-Policy: sandbox`, no
//!   script): it is an opaque origin that can run nothing and reach no cookie of ours.
//! - [`page`]: `/transcripts`, where a tenant's logged-in users find a conversation's transcript
//!   by its conversation id, next to their connected apps, without the bot making a link first.

use axum::extract::{OriginalUri, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::html;
use serde::Deserialize;

use sandgate_service::links::{LinkKind, LinkOwner, TranscriptDownload};
use sandgate_service::transcripts::{CONTENT_SECURITY_POLICY, Format, Subject, TranscriptError};

use crate::AppState;
use crate::headers::untrusted;
use crate::oauth::{html as pages, session};

/// The path of the transcripts page.
pub const PAGE: &str = crate::oauth::paths::TRANSCRIPTS;

/// Serves a tenant's transcript behind a link, in the link's format.
pub fn download(transcript: TranscriptDownload) -> Response {
    let TranscriptDownload { format, name, body } = transcript;
    let mut response = body.into_response();
    let headers = response.headers_mut();
    let (content_type, disposition) = match format {
        Format::Html => ("text/html; charset=utf-8", "inline".to_owned()),
        Format::Notebook => (
            "application/x-ipynb+json",
            format!("attachment; filename=\"transcript-{name}.ipynb\""),
        ),
    };
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    if let Ok(v) = HeaderValue::from_str(&disposition) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    // Untrusted content: a sandboxed, script-less document in an opaque origin.
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    untrusted(headers);
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    response
}

/// The page's query.
#[derive(Debug, Deserialize)]
pub struct PageQuery {
    #[serde(default)]
    conversation_id: Option<String>,
}

/// `GET /transcripts[?conversation_id=…]`: a form, and for a conversation of the user's tenant,
/// its sandboxes and links to its transcript (15 minutes, like every download link).
pub async fn page(
    State(state): State<AppState>,
    OriginalUri(uri): OriginalUri,
    headers: HeaderMap,
    Query(query): Query<PageQuery>,
) -> Response {
    let here = uri
        .path_and_query()
        .map_or(PAGE.to_owned(), |pq| pq.as_str().to_owned());
    let session = match session::current(&state.oauth_app(), &headers).await {
        Ok(Some(s)) => s,
        Ok(None) => return session::login_redirect(&here),
        Err(_) => return unavailable(),
    };
    let conversation = query
        .conversation_id
        .map(|c| c.trim().to_owned())
        .filter(|c| !c.is_empty());
    let found = match &conversation {
        None => None,
        Some(c) => {
            let subject = Subject::Conversation(c.clone());
            match state.transcripts.outline(session.tenant_id, &subject).await {
                Ok(t) => {
                    let link = |format| {
                        state
                            .links
                            .mint_transcript(
                                LinkOwner::session(session.tenant_id),
                                &subject,
                                LinkKind::from(format),
                            )
                            .0
                    };
                    Some(Ok((t, link(Format::Html), link(Format::Notebook))))
                }
                Err(TranscriptError::NotFound { .. }) => Some(Err(())),
                Err(TranscriptError::Store(_) | TranscriptError::Busy) => return unavailable(),
            }
        }
    };
    let body = html! {
        h1 { "Conversation transcripts" }
        p.muted { "Signed in as " (session.email) ". Find what ran in a conversation's sandboxes by its conversation id, to take it over." }
        form method="get" action=(PAGE) {
            label for="conversation_id" { "Conversation id" }
            input #conversation_id type="text" name="conversation_id" value=[conversation.as_deref()]
                style="width:100%;padding:12px;font-size:1rem;border:1px solid #c7ccd6;border-radius:8px";
            div.actions { button.primary type="submit" { "Find" } }
        }
        @match &found {
            None => {}
            Some(Err(())) => {
                p.error #not-found { "No transcript for this conversation: nothing ran in it, the id is not one of your tenant's, or it was deleted after its retention period." }
            }
            Some(Ok((t, html_link, notebook_link))) => {
                div #found {
                    p { strong { (t.title()) } }
                    @for part in &t.parts {
                        p.muted.sandbox { "Sandbox " code { (part.sandbox_id) } " · " (part.calls) " calls" }
                    }
                    @if let Some(note) = t.omitted.note() {
                        p.muted.omitted { (note) }
                    }
                    p { a #open-html href=(html_link) rel="noreferrer" target="_blank" { "Open the transcript" } " · "
                        a #download-ipynb href=(notebook_link) rel="noreferrer" { "Download as a Jupyter notebook" } }
                    p.muted { "Links work for 15 minutes." }
                }
            }
        }
        p.muted { a href=(crate::oauth::paths::APPS) { "Connected apps" } }
    };
    pages::page(StatusCode::OK, "Transcripts · sandgate", body)
}

fn unavailable() -> Response {
    pages::error_page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Temporarily unavailable",
        "sandgate could not load this page; please retry in a moment.",
    )
}
