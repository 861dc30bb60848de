//! Expiring download links (`get_file`, `export_transcript`): minted by the service, opened by
//! the gateway's `/files/{token}` route.
//!
//! A link is opaque: its claims (tenant, sandbox, path, grant, expiry) are sealed with
//! XChaCha20-Poly1305 under a key derived from `keys.secret`, so the link text reveals nothing
//! and cannot be altered, and every replica (and the next start) with the same configuration
//! opens it. Sealing rather than a random id with the claims in Postgres: minting costs no write
//! (a `get_file` of a small file mints one whether or not anyone opens it), and what a link may
//! do is still checked against Postgres when it is opened (its grant live, its sandbox the
//! tenant's).

use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::Utc;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

mod limits;
mod open;

pub use limits::{LinkLimit, LinkLimits, retry_after_seconds};
pub use open::{Download, DownloadBroke, FileBody, LinkError, LinkService, TranscriptDownload};
/// Why an opening gave nothing (the audit trail's reasons; the gateway answers by them).
pub use sandgate_store::downloads::DownloadReason;

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
    /// The id of the access token that made it: revoking that token ends the link.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub j: Option<String>,
}

/// Who a link is minted for, and what its life is bound to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinkOwner {
    /// The tenant whose sandbox or transcript it opens.
    pub tenant: Uuid,
    /// The app connection (grant) of the token that asked: disconnecting it ends the link.
    pub grant: Option<Uuid>,
    /// The id of the token that asked: revoking it ends the link.
    pub token_id: Option<String>,
}

impl LinkOwner {
    /// A link asked for by a tenant's signed-in user (the transcripts page): bound to no token.
    pub fn session(tenant: Uuid) -> Self {
        Self {
            tenant,
            grant: None,
            token_id: None,
        }
    }
}

impl From<&crate::sandboxes::Caller> for LinkOwner {
    fn from(caller: &crate::sandboxes::Caller) -> Self {
        Self {
            tenant: caller.tenant,
            grant: caller.grant,
            token_id: Some(caller.token_id.clone()),
        }
    }
}

/// The longest link token [`DownloadLinks::open`] looks at; real ones are far shorter.
pub const MAX_TOKEN_CHARS: usize = 2048;

/// The version byte that starts every sealed link (and is bound as associated data).
const LINK_V2: u8 = 2;
const NONCE_BYTES: usize = 24;

/// A link that opened: what it names, and its id (for rate limits and the audit trail; derived
/// from its random nonce, so it names this link and nothing else).
#[derive(Debug, Clone, PartialEq)]
pub struct OpenedLink {
    /// What the link names.
    pub claims: Claims,
    /// The link's id: 16 hex digits, unique per minted link.
    pub id: String,
}

/// Mints and checks download links. Cheap to clone.
#[derive(Clone)]
pub struct DownloadLinks {
    cipher: Arc<XChaCha20Poly1305>,
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
    /// Links under `public_url`, sealed with a key derived from `secret` (the deployment's
    /// `keys.secret`, the same on every replica) for this purpose only.
    pub fn new(secret: &[u8], public_url: &str) -> Self {
        let key = crate::keys::derive_key(secret, "download links v2");
        Self {
            cipher: Arc::new(XChaCha20Poly1305::new(&key.into())),
            base: format!("{}/files/", public_url.trim_end_matches('/')),
        }
    }

    /// A link to `path` in `sandbox_id` of the owner's tenant, working for [`LINK_TTL`] (and
    /// while the owner's grant and token are not revoked); and its expiry.
    pub fn mint(
        &self,
        owner: impl Into<LinkOwner>,
        sandbox_id: &str,
        path: &str,
    ) -> (String, chrono::DateTime<Utc>) {
        let owner = owner.into();
        self.sign(Claims {
            t: owner.tenant,
            s: sandbox_id.to_owned(),
            p: path.to_owned(),
            e: 0,
            k: LinkKind::File,
            g: owner.grant,
            c: None,
            j: owner.token_id,
        })
    }

    /// A link to a transcript (`kind` Notebook or Html) of a sandbox or a conversation, with
    /// the same rules as a file's; and its expiry.
    pub fn mint_transcript(
        &self,
        owner: impl Into<LinkOwner>,
        subject: &crate::transcripts::Subject,
        kind: LinkKind,
    ) -> (String, chrono::DateTime<Utc>) {
        use crate::transcripts::Subject;
        let owner = owner.into();
        let (s, c) = match subject {
            Subject::Sandbox(id) => (id.clone(), None),
            Subject::Conversation(id) => (String::new(), Some(id.clone())),
        };
        self.sign(Claims {
            t: owner.tenant,
            s,
            p: String::new(),
            e: 0,
            k: kind,
            g: owner.grant,
            c,
            j: owner.token_id,
        })
    }

    fn sign(&self, mut claims: Claims) -> (String, chrono::DateTime<Utc>) {
        let expires = Utc::now() + chrono::Duration::from_std(LINK_TTL).expect("a small duration");
        claims.e = expires.timestamp();
        (format!("{}{}", self.base, self.seal(&claims)), expires)
    }

    /// The token (the part after `/files/`) for `claims`.
    fn seal(&self, claims: &Claims) -> String {
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let plain = serde_json::to_vec(claims).expect("claims serialize");
        let sealed = self
            .cipher
            .encrypt(
                &nonce,
                Payload {
                    msg: &plain,
                    aad: &[LINK_V2],
                },
            )
            .expect("sealing a small message cannot fail");
        let mut raw = Vec::with_capacity(1 + NONCE_BYTES + sealed.len());
        raw.push(LINK_V2);
        raw.extend_from_slice(&nonce);
        raw.extend_from_slice(&sealed);
        URL_SAFE_NO_PAD.encode(raw)
    }

    /// What a link this key sealed names, or `None` for anything else (forged, altered,
    /// truncated, another deployment's, not a link at all). Expiry is the caller's to check.
    pub fn open(&self, token: &str) -> Option<OpenedLink> {
        if token.len() > MAX_TOKEN_CHARS {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(token).ok()?;
        let (&version, rest) = raw.split_first()?;
        if version != LINK_V2 || rest.len() < NONCE_BYTES {
            return None;
        }
        let (nonce, sealed) = rest.split_at(NONCE_BYTES);
        let nonce_bytes = <[u8; NONCE_BYTES]>::try_from(nonce).ok()?;
        let plain = self
            .cipher
            .decrypt(
                &XNonce::from(nonce_bytes),
                Payload {
                    msg: sealed,
                    aad: &[LINK_V2],
                },
            )
            .ok()?;
        let claims = serde_json::from_slice(&plain).ok()?;
        Some(OpenedLink {
            claims,
            id: hex_prefix(&nonce_bytes),
        })
    }
}

fn hex_prefix(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = "http://127.0.0.1:8080/files/";

    fn token(url: &str) -> &str {
        url.strip_prefix(BASE).expect("under /files/")
    }

    #[test]
    fn links_round_trip_and_name_nothing_readable() {
        let links = DownloadLinks::new(
            b"a secret of at least thirty-two chars",
            "http://127.0.0.1:8080",
        );
        let tenant = Uuid::new_v4();
        let (url, _) = links.mint(
            LinkOwner::session(tenant),
            "sbx_1234567890",
            "/home/user/report.csv",
        );
        let opened = links.open(token(&url)).expect("a fresh link opens");
        assert_eq!(
            (
                opened.claims.s.as_str(),
                opened.claims.p.as_str(),
                opened.claims.t
            ),
            ("sbx_1234567890", "/home/user/report.csv", tenant)
        );
        // Nothing of the claims shows, however the text is decoded.
        let raw = URL_SAFE_NO_PAD.decode(token(&url)).unwrap();
        let lossy = String::from_utf8_lossy(&raw);
        for secret in [
            tenant.to_string(),
            tenant.simple().to_string(),
            "sbx_1234567890".into(),
            "report.csv".into(),
            "/home/user".into(),
        ] {
            assert!(!url.contains(&secret), "{secret} readable in {url}");
            assert!(
                !lossy.contains(&secret),
                "{secret} readable in the decoded link"
            );
        }
        let (again, _) = links.mint(
            LinkOwner::session(tenant),
            "sbx_1234567890",
            "/home/user/report.csv",
        );
        assert_ne!(url, again, "each link is sealed with its own nonce");
        assert_ne!(
            links.open(token(&again)).unwrap().id,
            opened.id,
            "and has its own id"
        );
    }

    #[test]
    fn tampered_truncated_and_foreign_links_are_refused() {
        let links = DownloadLinks::new(
            b"a secret of at least thirty-two chars",
            "http://127.0.0.1:8080",
        );
        let (url, _) = links.mint(LinkOwner::session(Uuid::nil()), "sbx_1", "/home/user/a.csv");
        let good = token(&url);
        let mut raw = URL_SAFE_NO_PAD.decode(good).unwrap();
        for i in 0..raw.len() {
            raw[i] ^= 0x01;
            assert!(
                links.open(&URL_SAFE_NO_PAD.encode(&raw)).is_none(),
                "a flipped bit at byte {i} is refused"
            );
            raw[i] ^= 0x01;
        }
        for len in 0..good.len() {
            assert!(
                links.open(&good[..len]).is_none(),
                "truncated to {len} is refused"
            );
        }
        assert!(
            links.open(&format!("{good}A")).is_none(),
            "extended is refused"
        );
        let other = DownloadLinks::new(
            b"another secret, thirty-two chars+",
            "http://127.0.0.1:8080",
        );
        assert!(
            other.open(good).is_none(),
            "another deployment's key is refused"
        );
        assert!(links.open(&"A".repeat(MAX_TOKEN_CHARS + 1)).is_none());
    }
}
