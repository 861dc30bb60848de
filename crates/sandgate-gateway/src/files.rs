//! Expiring download links for files in a sandbox (DESIGN §1: `get_file` gives "an expiring
//! download link a human can open"). A link carries the tenant, sandbox, path and expiry, signed
//! with HMAC-SHA256; opening it reads the file from the live sandbox at that moment. A link stops
//! working when it expires or when its sandbox ends.
//!
//! A link can also name a transcript (a sandbox's or a conversation's, as a notebook or an HTML
//! page: [`LinkKind`]); it is served by [`crate::transcripts`] and outlives the sandbox. A link
//! minted for a token of an app connection (grant) stops working once that connection is
//! revoked.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::Utc;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use uuid::Uuid;

use crate::AppState;
use crate::error::DownloadError;
use crate::sandboxes::{Caller, ServiceError, Target};

type HmacSha256 = Hmac<Sha256>;

/// How long a download link works.
pub const LINK_TTL: Duration = Duration::from_secs(15 * 60);

/// What a link opens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LinkKind {
    /// A file in a live sandbox.
    #[default]
    File,
    /// A transcript as a Jupyter notebook.
    Notebook,
    /// A transcript as an HTML page.
    Html,
}

impl LinkKind {
    fn is_file(&self) -> bool {
        *self == LinkKind::File
    }
}

/// What a link names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Claims {
    /// Tenant.
    t: Uuid,
    /// Sandbox id (empty for a conversation's transcript).
    s: String,
    /// Absolute path in the sandbox (files only).
    p: String,
    /// Expiry, unix seconds.
    e: i64,
    /// What it opens.
    #[serde(default, skip_serializing_if = "LinkKind::is_file")]
    k: LinkKind,
    /// The app connection (grant) whose token made it: revoking it ends the link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    g: Option<Uuid>,
    /// The conversation, for a conversation's transcript.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    c: Option<String>,
}

/// Mints and checks download links. Cheap to clone.
#[derive(Clone)]
pub struct DownloadLinks {
    key: Arc<[u8; 32]>,
    base: String,
}

impl std::fmt::Debug for DownloadLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DownloadLinks")
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl DownloadLinks {
    /// Links under `public_url`, signed with a key derived from `secret` (the OAuth cookie key:
    /// shared by replicas when `oauth.cookie_secret` is set) for this purpose only.
    pub fn new(secret: &[u8; 32], public_url: &str) -> Self {
        let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
        mac.update(b"sandgate download links v1");
        Self {
            key: Arc::new(mac.finalize().into_bytes().into()),
            base: format!("{}/files/", public_url.trim_end_matches('/')),
        }
    }

    /// A link to `path` in `sandbox_id` of `tenant`, working for [`LINK_TTL`] (and while
    /// `grant`, when given, is not revoked); and its expiry.
    pub fn mint(
        &self,
        tenant: Uuid,
        grant: Option<Uuid>,
        sandbox_id: &str,
        path: &str,
    ) -> (String, chrono::DateTime<Utc>) {
        self.sign(Claims {
            t: tenant,
            s: sandbox_id.to_owned(),
            p: path.to_owned(),
            e: 0,
            k: LinkKind::File,
            g: grant,
            c: None,
        })
    }

    /// A link to a transcript (`kind` Notebook or Html) of a sandbox or a conversation, with
    /// the same rules as a file's; and its expiry.
    pub fn mint_transcript(
        &self,
        tenant: Uuid,
        grant: Option<Uuid>,
        subject: &crate::transcripts::Subject,
        kind: LinkKind,
    ) -> (String, chrono::DateTime<Utc>) {
        use crate::transcripts::Subject;
        let (s, c) = match subject {
            Subject::Sandbox(id) => (id.clone(), None),
            Subject::Conversation(id) => (String::new(), Some(id.clone())),
        };
        self.sign(Claims {
            t: tenant,
            s,
            p: String::new(),
            e: 0,
            k: kind,
            g: grant,
            c,
        })
    }

    fn sign(&self, mut claims: Claims) -> (String, chrono::DateTime<Utc>) {
        let expires = Utc::now() + chrono::Duration::from_std(LINK_TTL).expect("a small duration");
        claims.e = expires.timestamp();
        let body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&claims).expect("claims serialize"));
        (format!("{}{body}.{}", self.base, self.tag(&body)), expires)
    }

    fn tag(&self, body: &str) -> String {
        let mut mac = HmacSha256::new_from_slice(self.key.as_slice()).expect("any key length");
        mac.update(body.as_bytes());
        URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    }

    fn open(&self, token: &str) -> Option<Claims> {
        let (body, tag) = token.rsplit_once('.')?;
        let mut mac = HmacSha256::new_from_slice(self.key.as_slice()).expect("any key length");
        mac.update(body.as_bytes());
        mac.verify_slice(&URL_SAFE_NO_PAD.decode(tag).ok()?).ok()?;
        serde_json::from_slice(&URL_SAFE_NO_PAD.decode(body).ok()?).ok()
    }
}

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
        return Ok(crate::handoff::download(&state, claims.t, &subject, claims.k).await);
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

pub(crate) fn refuse(status: StatusCode, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        format!("{message}\n"),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_round_trip_and_tampering_is_refused() {
        let links = DownloadLinks::new(&[7; 32], "http://127.0.0.1:8080");
        let (url, _) = links.mint(Uuid::nil(), None, "sbx_1", "/home/user/a.csv");
        let token = url
            .strip_prefix("http://127.0.0.1:8080/files/")
            .expect("under /files/");
        let claims = links.open(token).expect("a fresh link opens");
        assert_eq!(
            (claims.s.as_str(), claims.p.as_str()),
            ("sbx_1", "/home/user/a.csv")
        );
        let (body, tag) = token.rsplit_once('.').unwrap();
        let forged = Claims {
            p: "/home/user/other".into(),
            ..claims
        };
        let forged_body = URL_SAFE_NO_PAD.encode(serde_json::to_vec(&forged).unwrap());
        assert!(
            links.open(&format!("{forged_body}.{tag}")).is_none(),
            "a changed path is refused"
        );
        let other = DownloadLinks::new(&[8; 32], "http://127.0.0.1:8080");
        assert!(
            other.open(&format!("{body}.{tag}")).is_none(),
            "another key's link is refused"
        );
    }
}
