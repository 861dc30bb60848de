//! The sandgate service layer: what the HTTP faces (MCP, OAuth, file links, admin CLI) call.
//! It knows no axum and no rmcp, so a new face reuses it as it is.
//!
//! - [`config`]: layered configuration, validated at start-up.
//! - [`sandboxes`]: tenant-scoped sandboxes ([`SandboxService`]): leasing, resolving, closing.
//! - [`lifecycle`]: the reaper, reconciliation of Docker with Postgres, the warm pool's rows.
//! - [`audit`]: the audit trail's writer (one event per tool call, kept through outages).
//! - [`cache`]: live tokens and tenant limits cached briefly, invalidated across replicas.
//! - [`egress`]: egress a tenant chooses: host rules and secrets sealed under a key of their
//!   own (stored and checked; no connection leaves a sandbox yet).
//! - [`grants`]: the OAuth grant rules: codes, refresh rotation, approvals, clients, sessions.
//! - [`health`]: readiness (Postgres, Docker, the sandbox image).
//! - [`keys`]: the signing-key ring (access tokens).
//! - [`links`]: expiring download links: minting, and opening one ([`links::LinkService`]).
//! - [`metrics`]: the service's numbers for the gateway's `/metrics` (pools, nodes, budgets).
//! - [`node_rpc`]: serving this process's sandbox node to gateways (`[node]`).
//! - [`node_registry`]: the node's row in Postgres: registration and heartbeat.
//! - [`packages`]: packages on demand (the host side of `pip install` in a sandbox).
//! - [`placement`]: which node a lease goes to, warm or cold: one rule.
//! - [`sessions`]: MCP sessions bound to the principal that opened them; the session cap.
//! - [`snapshots`]: snapshots of sandboxes sealed at rest: key custody (the key-encryption key,
//!   a data key per snapshot, wrapped in its row) and the snapshot operations on a node.
//! - [`startup`]: [`Services::start`]: the pool, keys, sandbox manager and background work.
//! - [`admin`]: operator commands behind `sandgate admin`.
//! - [`transcripts`]: what ran in each sandbox, kept for the person who takes over.
//! - [`resource_uri`]: the URIs of the MCP resources (files, transcripts, the data policy).
//! - [`retention`]: what is kept after a sandbox ends and for how long; the purge job.
//! - `write_behind`: the bounded queues that audit events and transcript entries are written
//!   from in batches, behind the answers.

pub mod admin;
pub mod audit;
pub mod cache;
pub mod config;
pub mod egress;
pub mod erasure;
pub mod grants;
pub mod health;
pub mod keys;
pub mod links;
pub mod metrics;
pub mod node_registry;
pub mod node_rpc;
pub mod packages;
pub mod placement;
pub mod resource_uri;
pub mod retention;
pub mod sandboxes;
pub mod sessions;
pub mod snapshots;
pub mod startup;
pub mod transcripts;
mod write_behind;

pub use sandboxes::lifecycle;

pub use config::Config;
pub use sandboxes::{
    BoundedRead, CallPermit, Caller, CommandLine, ErrorKind, FilesResume, Limits, OutputSink,
    Quota, RESUMED_FROM_FILES, Resolved, Resumed, RunLimits, SandboxService, ServiceError, Target,
};
/// The Postgres pool the faces hold for the service (the store's).
pub use sandgate_store::PgPool;

/// The sandbox's domain values a face reads and renders: outcomes of cells and commands, their
/// output events, files, listings and jobs (the sandbox crate's types, so that a face needs no
/// crate below the service).
pub mod domain {
    pub use sandgate_sandbox::{
        CommandOutcome, Display, EntryKind, ExecOutcome, FileInfo, Job, Listing, OutputEvent, Space,
    };
}
pub use startup::{NodeServices, Services};
