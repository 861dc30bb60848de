//! What the authorization server's handlers share.

use std::sync::Arc;

use sandgate_service::config::Config;
use sandgate_service::grants::Grants;
use sandgate_service::keys::KeyRing;

use crate::OAuthState;

/// The state handed to the authorization server's routes: the parts of the gateway's state the
/// OAuth pages and endpoints use. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    /// The validated configuration.
    pub config: Arc<Config>,
    /// Signing and verifying keys for access tokens (the JWKS).
    pub keys: KeyRing,
    /// The grant rules: codes, tokens, approvals, clients, sessions.
    pub grants: Grants,
    /// The authorization server's own state (cookie key, metadata-document fetcher).
    pub oauth: OAuthState,
}
