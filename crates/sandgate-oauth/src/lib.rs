//! The OAuth 2.1 authorization server (DESIGN §6, MCP authorization spec): metadata and JWKS,
//! client registration and metadata documents, login, the consent page, the token and
//! revocation endpoints, and the connected-apps page where a user disconnects an app. The grant
//! rules themselves are the service's (`sandgate_service::grants`): this crate parses requests,
//! renders pages, sets cookies and maps the rules' refusals to OAuth error responses.
//!
//! - [`metadata`]: RFC 8414 authorization-server metadata and the JWKS.
//! - [`clients`]: dynamic registration (RFC 7591) and client-ID metadata documents.
//! - [`session`]: the login page and the signed session cookie.
//! - [`authorize`]: the authorization endpoint and the consent page.
//! - [`token`]: the token endpoint (code, refresh, client credentials) and revocation (RFC 7009).
//! - [`apps`]: the connected-apps page and disconnect.
//! - [`html`]: the pages' shared layout and the headers that keep them out of frames.
//! - [`ratelimit`]: limits on the unauthenticated endpoints, the client address.
//! - [`redirect`]: where a browser may be sent after login.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use sandgate_service::grants::GrantError;

pub use crate::state::AppState;
// The configuration lives in the service crate; `crate::config` keeps the modules' paths.
use crate::config::Config;
use sandgate_service::config;

pub mod apps;
pub mod authorize;
pub mod clients;
pub mod html;
pub mod metadata;
pub mod ratelimit;
pub mod redirect;
pub mod session;
mod state;
pub mod token;

/// Largest form or JSON body the OAuth endpoints accept.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Paths of the authorization server's endpoints.
pub mod paths {
    /// RFC 8414 metadata.
    pub const METADATA: &str = "/.well-known/oauth-authorization-server";
    /// Authorization endpoint (GET: the request; POST: the consent form).
    pub const AUTHORIZE: &str = "/oauth/authorize";
    /// Token endpoint.
    pub const TOKEN: &str = "/oauth/token";
    /// Dynamic client registration.
    pub const REGISTER: &str = "/oauth/register";
    /// Token revocation.
    pub const REVOKE: &str = "/oauth/revoke";
    /// The signing keys.
    pub const JWKS: &str = "/oauth/jwks";
    /// Login page.
    pub const LOGIN: &str = "/login";
    /// Logout.
    pub const LOGOUT: &str = "/logout";
    /// Connected apps.
    pub const APPS: &str = "/apps";
    /// Disconnect an app.
    pub const DISCONNECT: &str = "/apps/disconnect";
    /// A signed-in user's transcripts page (served by the gateway's handoff module).
    pub const TRANSCRIPTS: &str = "/transcripts";
    /// The console, where a tenant's users take over a conversation's sandbox (served by the
    /// gateway's console module).
    pub const CONSOLE: &str = "/console";
}

/// What the authorization server keeps beside the shared state.
#[derive(Clone)]
pub struct OAuthState {
    /// HMAC key of the session cookie.
    cookie_key: Arc<[u8; 32]>,
    /// Client for fetching client-ID metadata documents (SSRF-guarded resolver, no redirects).
    metadata_http: reqwest::Client,
    /// Rate limits, the hashing queue, the metadata negative cache.
    pub limits: ratelimit::Limiters,
}

impl OAuthState {
    /// The secret behind the session cookie, from which other signing keys are derived.
    pub fn cookie_key(&self) -> &[u8; 32] {
        &self.cookie_key
    }
}

impl std::fmt::Debug for OAuthState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OAuthState").finish_non_exhaustive()
    }
}

/// The authorization server could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The HTTP client for metadata documents could not be built.
    #[error("cannot build the HTTP client for client metadata documents")]
    Http(#[source] reqwest::Error),
}

impl OAuthState {
    /// Builds the state from the configuration.
    pub fn new(config: &Config) -> Result<Self, SetupError> {
        // Shared by every replica configured alike (validation refuses a deployment off
        // loopback without one); random only for a loopback development run.
        let cookie_key: [u8; 32] = config.cookie_key().unwrap_or_else(|| {
            tracing::warn!(
                "oauth.cookie_secret and keys.secret are empty: using a random login-cookie \
                 key, so login sessions end when this process stops and are not shared \
                 between replicas"
            );
            rand_key()
        });
        if !session::CookiePolicy::of(config).secure {
            tracing::warn!(
                public_url = %config.public_url(),
                "the public URL is plain http on a non-loopback host: login cookies are sent \
                 without Secure and without the __Host- prefix; use https outside development"
            );
        }
        let meta = &config.oauth.client_metadata;
        let metadata_http = clients::metadata_client(
            meta.allow_private_addresses,
            Duration::from_millis(meta.fetch_timeout_ms),
        )
        .map_err(SetupError::Http)?;
        Ok(Self {
            cookie_key: Arc::new(cookie_key),
            metadata_http,
            limits: ratelimit::Limiters::new(&config.oauth.limits),
        })
    }
}

fn rand_key() -> [u8; 32] {
    // A generated secret carries 256 bits of the OS's randomness.
    use sandgate_auth::secret::{SecretKind, generate, hash};
    hash(&generate(SecretKind::Session))
        .try_into()
        .expect("SHA-256 is 32 bytes")
}

/// The authorization server's routes.
pub fn routes() -> Router<AppState> {
    let routes = Router::new()
        .route(paths::METADATA, get(metadata::authorization_server))
        .route(paths::JWKS, get(metadata::jwks))
        .route(paths::REGISTER, post(clients::register))
        .route(
            paths::AUTHORIZE,
            get(authorize::authorize).post(authorize::consent),
        )
        .route(paths::TOKEN, post(token::token))
        .route(paths::REVOKE, post(token::revoke))
        .route(paths::LOGIN, get(session::login_page).post(session::login))
        .route(paths::LOGOUT, post(session::logout))
        .route(paths::APPS, get(apps::page))
        .route(paths::DISCONNECT, post(apps::disconnect))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES));
    html::with_security_headers(routes)
}

/// A failure of the service inside an OAuth handler: logged with its cause, shown as a plain
/// 500/503.
pub(crate) fn log_failure(err: &GrantError) {
    tracing::error!(error = ?err, "OAuth storage failed");
}
