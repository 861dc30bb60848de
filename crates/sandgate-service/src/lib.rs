//! The sandgate service layer: what the HTTP faces (MCP, OAuth, file links, admin CLI) call.
//! It knows no axum and no rmcp, so a new face reuses it as it is.
//!
//! - [`config`]: layered configuration, validated at start-up.
//! - [`sandboxes`]: tenant-scoped sandboxes ([`SandboxService`]): leasing, resolving, closing.
//! - [`lifecycle`]: the reaper, reconciliation of Docker with Postgres, the warm pool's rows.
//! - [`audit`]: the audit trail's writer (one event per tool call, kept through outages).
//! - [`keys`]: the signing-key ring (access tokens).
//! - [`admin`]: operator commands behind `sandgate admin`.
//! - [`transcripts`]: what ran in each sandbox, kept for the person who takes over.
//! - [`retention`]: what is kept after a sandbox ends and for how long; the purge job.

pub mod admin;
pub mod audit;
pub mod config;
pub mod keys;
pub mod retention;
pub mod sandboxes;
pub mod transcripts;

pub use sandboxes::lifecycle;

pub use config::Config;
pub use sandboxes::{Caller, Limits, Resolved, SandboxService, ServiceError, Target};
