//! The OAuth 2.1 domain of sandgate.
//!
//! - [`scope`]: the scopes a grant can hold and which tools each one opens.
//! - [`token`]: signing keys and the JWT access tokens signed with them (issue and verify).

pub mod scope;
pub mod token;

pub use scope::{Scope, UnknownScope};
pub use token::{AccessClaims, KeyPair, TokenError, TokenIssuer, TokenVerifier, VerifyingKey};
