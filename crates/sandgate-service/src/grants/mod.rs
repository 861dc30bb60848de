//! The OAuth grant rules (DESIGN §6), under the authorization server's endpoints and pages:
//! what a code, a refresh token, an approval, a client or a login session may do, each rule one
//! operation on [`Grants`] that runs its own Postgres transaction. The face (`sandgate-oauth`)
//! parses requests, renders pages and maps [`GrantError`] to OAuth error responses.
//!
//! - [`tokens`]: the token endpoint's grants (code exchange, refresh rotation with reuse
//!   detection, client credentials), client authentication, revocation (RFC 7009).
//! - [`consent`]: approvals ("connect once"), authorization codes, connected apps, disconnect.
//! - [`clients`]: stored clients, dynamic registration (RFC 7591), client-ID metadata documents.
//! - [`sessions`]: login sessions, failed sign-ins and the account lockout.
//! - [`purge`]: the scheduled purge of expired codes, sessions, tokens and unused clients.

use std::sync::Arc;

use sandgate_store::PgPool;

use crate::config::Config;
use crate::keys::KeyRing;
use crate::sandboxes::SandboxService;

pub mod clients;
pub mod consent;
mod error;
pub mod purge;
pub mod sessions;
pub mod tokens;

pub use clients::Registered;
pub use consent::NewCode;
pub use error::GrantError;
pub use sessions::SignIn;
pub use tokens::{ClientAuth, Issued};

/// A registered OAuth client (admin-created, self-registered, or from a metadata document).
pub use sandgate_store::clients::Client;
/// An app connection as the connected-apps page lists it.
pub use sandgate_store::grants::Connection;
/// A signed-in browser session.
pub use sandgate_store::users::Session;
/// A tenant's user (with the password hash to check a sign-in against).
pub use sandgate_store::users::User;

/// The grant rules. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Grants {
    db: PgPool,
    keys: KeyRing,
    sandboxes: SandboxService,
    config: Arc<Config>,
}

impl Grants {
    /// The rules over `db`, signing with `keys`, closing the sandboxes of a disconnected app in
    /// `sandboxes`, under `config`'s `[oauth]` settings.
    pub fn new(db: PgPool, keys: KeyRing, sandboxes: SandboxService, config: Arc<Config>) -> Self {
        Self {
            db,
            keys,
            sandboxes,
            config,
        }
    }
}

/// Scopes as a space-separated string.
pub fn join_scopes(scopes: &[sandgate_auth::Scope]) -> String {
    scopes
        .iter()
        .map(|s| s.as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Seconds as a chrono duration, saturating (configuration is validated; this never wraps).
fn seconds(n: u64) -> chrono::Duration {
    chrono::Duration::seconds(i64::try_from(n).unwrap_or(i64::MAX / 4_000))
}
