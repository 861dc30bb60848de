//! Expiring download links (`get_file`, `export_transcript`): minted by the service, opened by
//! the gateway's `/files/{token}` route. HMAC-signed with a key derived from the cookie secret,
//! so every replica with the same configuration accepts them.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::Utc;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use uuid::Uuid;

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

/// The link kind that serves a transcript in `format`.
impl From<crate::transcripts::Format> for LinkKind {
    fn from(format: crate::transcripts::Format) -> Self {
        use crate::transcripts::Format;
        match format {
            Format::Notebook => LinkKind::Notebook,
            Format::Html => LinkKind::Html,
        }
    }
}

/// What a link names (short field names keep links short).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claims {
    /// Tenant.
    pub t: Uuid,
    /// Sandbox id (empty for a conversation's transcript).
    pub s: String,
    /// Absolute path in the sandbox (files only).
    pub p: String,
    /// Expiry, unix seconds.
    pub e: i64,
    /// What it opens.
    #[serde(default, skip_serializing_if = "LinkKind::is_file")]
    pub k: LinkKind,
    /// The app connection (grant) whose token made it: revoking it ends the link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub g: Option<Uuid>,
    /// The conversation, for a conversation's transcript.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub c: Option<String>,
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

    /// The claims of a link this key signed, or `None` for anything else (forged, altered,
    /// another deployment's). Expiry is the caller's to check.
    pub fn open(&self, token: &str) -> Option<Claims> {
        let (body, tag) = token.rsplit_once('.')?;
        let mut mac = HmacSha256::new_from_slice(self.key.as_slice()).expect("any key length");
        mac.update(body.as_bytes());
        mac.verify_slice(&URL_SAFE_NO_PAD.decode(tag).ok()?).ok()?;
        serde_json::from_slice(&URL_SAFE_NO_PAD.decode(body).ok()?).ok()
    }
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
