//! Egress a tenant chooses (issue 29): the policy (which hosts and ports a tenant's sandboxes may
//! reach, with optional budgets) and the secrets the egress component may put into requests to
//! them, sealed under a key of their own.
//!
//! So far: the rules and secrets are checked, sealed and stored (`sandgate admin tenant
//! egress`, `sandgate admin tenant secret`), [`target`] decides where a connection may go, and
//! [`EgressService`] (the egress component, in the gateway's process) decides, dials, budgets and
//! audits the CONNECTs the agent's loopback proxy relays over the sandbox's channel: a plain
//! tunnel, or for a host a secret is bound to, an interception that puts the secret's value
//! where the sandbox's placeholder is ([`intercept`]). A tenant may have a host outside its
//! policy approved for one sandbox by a person ([`APPROVALS_PATH`],
//! `sandgate_store::egress_approvals`).

pub mod admin;
pub mod approvals;
mod intercept;
pub mod metrics;
mod relay;
mod rules;
mod secrets;
pub mod target;

pub use intercept::upstream_config;
pub use relay::{APPROVAL_HOLDS_FOR, CallNotes, EgressService};

/// The console's page of a tenant's requests for hosts outside its egress policy (approved or
/// denied there by a user with the `approver` role); a request's link adds `?id=<uuid>`.
pub const APPROVALS_PATH: &str = "/console/egress";
pub use rules::{HostPattern, RuleError, parse_rule};
pub use secrets::{
    DEVELOPMENT_SECRETS_KEY, MAX_VALUE_BYTES, SecretBinding, SecretError, SecretSealer,
    check_header_name, check_secret_name, check_secret_value,
};
