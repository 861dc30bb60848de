//! The OAuth 2.1 domain of sandgate (no HTTP, no Docker, no database).
//!
//! - [`scope`]: the scopes a grant can hold and which tools each one opens.
//! - [`token`]: signing keys and the JWT access tokens signed with them (issue and verify).
//! - [`pkce`]: PKCE S256 challenges and verifiers.
//! - [`secret`]: opaque secrets (codes, refresh tokens, sessions, CSRF) and their stored hashes.
//! - [`client`]: client registration metadata, metadata documents and redirect-URI rules.
//! - [`password`]: argon2 password hashes.

pub mod client;
pub mod password;
pub mod pkce;
pub mod scope;
pub mod secret;
pub mod token;

pub use scope::{Scope, UnknownScope};
pub use token::{AccessClaims, KeyPair, TokenError, TokenIssuer, TokenVerifier, VerifyingKey};
