//! The OAuth 2.1 domain of sandgate.
//!
//! - [`scope`]: the scopes a grant can hold and which tools each one opens.

pub mod scope;

pub use scope::{Scope, UnknownScope};
