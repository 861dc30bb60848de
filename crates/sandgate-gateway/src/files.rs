//! Download links for files in a sandbox (DESIGN §1: `get_file` gives "an expiring download
//! link a human can open") and for transcripts ([`LinkKind`], served by [`crate::handoff`]).
//!
//! A link is opaque (its claims sealed: [`DownloadLinks`]) and opens on every replica with the
//! same `keys.secret`. Opening one:
//! - is refused when the link was not sealed by us (404), has expired (410), or the app
//!   connection or token that made it was revoked or disconnected (410, at once);
//! - is rate-limited per link and per tenant (429 with `Retry-After`);
//! - streams a file from the live sandbox chunk by chunk, never the whole file in memory;
//! - is not use of the sandbox: its idle clock is left alone;
//! - is audited (`download_events`: tenant, link, sandbox, path, outcome, bytes).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use bytes::Bytes;
use chrono::Utc;
use futures::Stream;
use sandgate_sandbox::FileChunks;
use sandgate_store::downloads::DownloadEvent;

use crate::AppState;
use crate::error::DownloadError;
pub use sandgate_service::links::{
    Claims, DownloadLinks, LINK_TTL, LinkKind, LinkLimit, LinkLimits, LinkOwner, OpenedLink,
};

/// `GET /files/{token}`: the file (or transcript), as a download.
pub async fn download(
    State(state): State<AppState>,
    Path(token): Path<String>,
) -> Result<Response, DownloadError> {
    let link = state.links.open(&token).ok_or(DownloadError::InvalidLink)?;
    let audit = Opening::new(&state, &link);
    match serve(&state, &link, &audit).await {
        Ok(response) => Ok(response),
        Err(err) => {
            audit.record(err.outcome(), Some(err.reason()), None);
            Err(err)
        }
    }
}

async fn serve(
    state: &AppState,
    link: &OpenedLink,
    audit: &Opening,
) -> Result<Response, DownloadError> {
    let claims = &link.claims;
    if claims.e <= Utc::now().timestamp() {
        return Err(DownloadError::Expired);
    }
    state
        .link_limits
        .check(link)
        .map_err(|(limit, retry_after)| DownloadError::RateLimited { limit, retry_after })?;
    refuse_revoked(state, claims).await?;
    if claims.k != LinkKind::File {
        let subject = match &claims.c {
            Some(c) => crate::transcripts::Subject::Conversation(c.clone()),
            None => crate::transcripts::Subject::Sandbox(claims.s.clone()),
        };
        let response = crate::handoff::download(state, claims.t, &subject, claims.k).await?;
        audit.record("ok", None, None);
        return Ok(response);
    }
    let (first, rest) = state
        .sandboxes
        .stream_file(claims.t, &claims.s, &claims.p)
        .await?;
    let mime = crate::mcp::tools::mime_type(&claims.p, &first[..first.len().min(512)]);
    let body = AuditedBody {
        first: Some(first),
        rest,
        sent: 0,
        audit: Some(audit.clone()),
    };
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&mime) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!(
        "attachment; filename=\"{}\"",
        download_name(&claims.p)
    )) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    untrusted(headers);
    Ok(response)
}

/// The file name offered to the browser: the path's last part, in safe characters.
fn download_name(path: &str) -> String {
    path.rsplit('/')
        .next()
        .filter(|n| !n.is_empty())
        .unwrap_or("file")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// Headers of every download: the content came from untrusted code, so a browser must never sniff
/// it into something runnable, and no shared cache may keep it.
pub(crate) fn untrusted(headers: &mut axum::http::HeaderMap) {
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-store"),
    );
}

/// A link made under an app connection stops working once the connection is revoked, and one
/// made with a token once that token is revoked.
async fn refuse_revoked(state: &AppState, claims: &Claims) -> Result<(), DownloadError> {
    if claims.g.is_none() && claims.j.is_none() {
        return Ok(());
    }
    let live = async {
        let mut conn = state.db.acquire().await?;
        if let Some(grant) = claims.g {
            match sandgate_store::grants::get(&mut conn, grant).await? {
                Some(g) if g.revoked_at.is_none() && g.tenant_id == claims.t => {}
                _ => return Ok(false),
            }
        }
        match &claims.j {
            Some(jti) => sandgate_store::grants::token_is_active(&mut conn, None, jti).await,
            None => Ok(true),
        }
    }
    .await;
    match live {
        Ok(true) => Ok(()),
        Ok(false) => Err(DownloadError::Revoked),
        Err(_) => Err(DownloadError::Service(
            crate::sandboxes::ServiceError::DatabaseAway,
        )),
    }
}

/// The audit record of one opening, written once its outcome is known. Cheap to clone.
#[derive(Clone)]
struct Opening {
    db: sandgate_store::PgPool,
    event: DownloadEvent,
}

impl Opening {
    fn new(state: &AppState, link: &OpenedLink) -> Self {
        let c = &link.claims;
        let kind = match c.k {
            LinkKind::File => "file",
            LinkKind::Notebook => "notebook",
            LinkKind::Html => "html",
        };
        Self {
            db: state.db.clone(),
            event: DownloadEvent {
                at: Utc::now(),
                tenant_id: c.t,
                link_id: link.id.clone(),
                grant_id: c.g,
                token_id: c.j.clone(),
                kind: kind.to_owned(),
                sandbox_id: (!c.s.is_empty()).then(|| c.s.clone()),
                conversation_id: c.c.clone(),
                path: (!c.p.is_empty()).then(|| c.p.clone()),
                outcome: String::new(),
                reason: None,
                bytes: None,
            },
        }
    }

    /// Writes the event in the background (the response does not wait for it).
    fn record(&self, outcome: &str, reason: Option<&str>, bytes: Option<u64>) {
        let mut event = self.event.clone();
        event.outcome = outcome.to_owned();
        event.reason = reason.map(str::to_owned);
        event.bytes = bytes.map(|b| i64::try_from(b).unwrap_or(i64::MAX));
        let db = self.db.clone();
        tokio::spawn(async move {
            let written = async {
                let mut conn = db.acquire().await?;
                sandgate_store::downloads::record(&mut conn, &event).await
            }
            .await;
            if let Err(err) = written {
                tracing::warn!(error = %err, tenant_id = %event.tenant_id, "auditing a download failed");
            }
        });
    }
}

/// A file's body as the sandbox sends it, audited when it ends: `ok` with the bytes sent,
/// `failed` when the stream broke (the body then ends with an error, so the client sees a
/// broken transfer, never a short file passed off as whole), `cancelled` when the downloader
/// went away first.
struct AuditedBody {
    first: Option<Bytes>,
    rest: FileChunks,
    sent: u64,
    audit: Option<Opening>,
}

impl Stream for AuditedBody {
    type Item = Result<Bytes, sandgate_sandbox::ChannelError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Some(first) = self.first.take()
            && !first.is_empty()
        {
            self.sent += first.len() as u64;
            return Poll::Ready(Some(Ok(first)));
        }
        let next = self.rest.as_mut().poll_next(cx);
        match &next {
            Poll::Ready(Some(Ok(chunk))) => self.sent += chunk.len() as u64,
            Poll::Ready(Some(Err(err))) => {
                tracing::warn!(error = %err, "a download broke off");
                if let Some(audit) = self.audit.take() {
                    audit.record("failed", Some("sandbox"), Some(self.sent));
                }
            }
            Poll::Ready(None) => {
                if let Some(audit) = self.audit.take() {
                    audit.record("ok", None, Some(self.sent));
                }
            }
            Poll::Pending => {}
        }
        next
    }
}

impl Drop for AuditedBody {
    fn drop(&mut self) {
        if let Some(audit) = self.audit.take() {
            audit.record("cancelled", None, Some(self.sent));
        }
    }
}

/// How long a `Retry-After` for a link limit says, in whole seconds (at least 1).
pub fn retry_after_seconds(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}
