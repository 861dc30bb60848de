//! Egress a tenant chooses (issue 29): the policy (which hosts and ports a tenant's sandboxes may
//! reach, with optional budgets) and the secrets the egress component may put into requests to
//! them, sealed under a key of their own.
//!
//! So far: the rules and secrets are checked, sealed and stored (`sandgate admin tenant
//! egress`, `sandgate admin tenant secret`), and [`target`] decides where a connection may go
//! (a library nothing calls yet). No connection leaves a sandbox (no proxy in the agent, no
//! relay, no egress component), so every sandbox still has no route out.

pub mod admin;
mod rules;
mod secrets;
pub mod target;

pub use rules::{HostPattern, RuleError, parse_rule};
pub use secrets::{
    DEVELOPMENT_SECRETS_KEY, MAX_VALUE_BYTES, SecretBinding, SecretError, SecretSealer,
    check_header_name, check_secret_name, check_secret_value,
};
