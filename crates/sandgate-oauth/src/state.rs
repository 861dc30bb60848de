//! What the authorization server's handlers share.

use std::sync::Arc;

use sandgate_service::config::Config;
use sandgate_service::keys::KeyRing;
use sandgate_service::sandboxes::SandboxService;
use sandgate_store::PgPool;

use crate::OAuthState;

/// The state handed to the authorization server's routes: the parts of the gateway's state the
/// OAuth pages and endpoints use. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// The Postgres pool.
    pub db: PgPool,
    /// Signing and verifying keys for access tokens.
    pub keys: KeyRing,
    /// Tenant-scoped sandboxes (disconnecting an app closes its sandboxes).
    pub sandboxes: SandboxService,
    /// The authorization server's own state (cookie key, metadata-document fetcher).
    pub oauth: OAuthState,
}
