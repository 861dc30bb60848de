//! Download links for files in a sandbox (DESIGN §1: `get_file` gives "an expiring download
//! link a human can open") and for transcripts ([`LinkKind`], rendered by [`crate::handoff`]).
//!
//! A link is opaque (its claims sealed: [`DownloadLinks`]) and opens on every replica with the
//! same `keys.secret`. Opening one is the service's [`LinkService::open`] (revocation, rate
//! limits, the audit trail, the file streamed from the live sandbox); this module turns what it
//! gives into HTTP: 404 for a link not sealed by us, 410 for one expired or revoked, 429 with
//! `Retry-After` for one opened too often, the file as an attachment otherwise.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::Response;
use sandgate_service::links::Download;

use crate::AppState;
use crate::error::DownloadError;
use crate::headers::untrusted;
pub use sandgate_service::links::{
    Claims, DownloadLinks, LINK_TTL, LinkKind, LinkLimit, LinkLimits, LinkOwner, LinkService,
    OpenedLink, retry_after_seconds,
};

/// `GET /files/{token}`: the file (or transcript), as a download.
pub async fn download(
    State(state): State<AppState>,
    Path(token): Path<String>,
) -> Result<Response, DownloadError> {
    let body = match state.link_service.open(&token).await? {
        Download::Transcript(transcript) => return Ok(crate::handoff::download(transcript)),
        Download::File(body) => body,
    };
    let mime = crate::mcp::tools::mime_type(body.path(), body.head());
    let name = download_name(body.path());
    let mut response = Response::new(Body::from_stream(body));
    let headers = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&mime) {
        headers.insert(header::CONTENT_TYPE, v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    untrusted(headers);
    Ok(response)
}

/// The file name offered to the browser: the path's last part, in safe characters.
pub(crate) fn download_name(path: &str) -> String {
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
