//! Expiring download links for files in a sandbox (DESIGN §1: `get_file` gives "an expiring
//! download link a human can open"). A link carries the tenant, sandbox, path and expiry, signed
//! with HMAC-SHA256; opening it reads the file from the live sandbox at that moment. A link stops
//! working when it expires or when its sandbox ends.
//!
//! A link can also name a transcript (a sandbox's or a conversation's, as a notebook or an HTML
//! page: [`LinkKind`]); it is served by [`crate::transcripts`] and outlives the sandbox. A link
//! minted for a token of an app connection (grant) stops working once that connection is
//! revoked.

use axum::extract::{Path, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use chrono::Utc;

use crate::AppState;
use crate::error::DownloadError;
use crate::sandboxes::{Caller, ServiceError, Target};
pub use sandgate_service::links::{Claims, DownloadLinks, LINK_TTL, LinkKind};

/// `GET /files/{token}`: the file, as a download.
pub async fn download(
    State(state): State<AppState>,
    Path(token): Path<String>,
) -> Result<Response, DownloadError> {
    let claims = state.links.open(&token).ok_or(DownloadError::InvalidLink)?;
    if claims.e <= Utc::now().timestamp() {
        return Err(DownloadError::Expired);
    }
    refuse_revoked(&state, &claims).await?;
    if claims.k != LinkKind::File {
        let subject = match claims.c {
            Some(c) => crate::transcripts::Subject::Conversation(c),
            None => crate::transcripts::Subject::Sandbox(claims.s),
        };
        return crate::handoff::download(&state, claims.t, &subject, claims.k).await;
    }
    let service = &state.sandboxes;
    let caller = Caller {
        tenant: claims.t,
        subject: "download-link".into(),
        token_id: "download-link".into(),
        grant: None,
        limits: service.limits(claims.t).await?,
    };
    let target = Target {
        sandbox_id: Some(&claims.s),
        ..Target::default()
    };
    let (_, data, info) = service.read_file(&caller, target, &claims.p).await?;
    let mime = crate::mcp::tools::mime_type(&info.path, &data[..data.len().min(512)]);
    let name: String = info
        .path
        .rsplit('/')
        .next()
        .unwrap_or("file")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut response = data.into_response();
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

/// A link made under an app connection stops working once the connection is revoked.
async fn refuse_revoked(state: &AppState, claims: &Claims) -> Result<(), DownloadError> {
    let Some(grant) = claims.g else {
        return Ok(());
    };
    let live = async {
        let mut conn = state.db.acquire().await?;
        sandgate_store::grants::get(&mut conn, grant).await
    }
    .await;
    match live {
        Ok(Some(g)) if g.revoked_at.is_none() && g.tenant_id == claims.t => Ok(()),
        Ok(_) => Err(DownloadError::Revoked),
        Err(_) => Err(DownloadError::Service(ServiceError::DatabaseAway)),
    }
}
