//! The sandbox manager: hardened containers from a warm pool, a stateful Python kernel in each,
//! spoken to over the container's attach stream (DESIGN §3–4).
//!
//! - [`config`]: sandbox profiles (image, runtime, limits), pool sizing, agent timing.
//! - [`demand`]: the pure controller a pool's size and start concurrency follow.
//! - [`backend`]: the [`SandboxBackend`] trait between the pool and a container engine, and what
//!   crosses it (launch specs, attach streams, a container's fate).
//! - [`docker`]: the Docker implementation (bollard): the hardening baseline, the embedded agent.
//! - [`lean`]: the lean engine ([`LeanBackend`]): sandboxes forked from a warmed zygote into lean
//!   containers.
//! - [`engines`]: [`Engines`], a node's Docker and lean engines behind one backend.
//! - [`protocol`]: the agent protocol's wire format (`agent/PROTOCOL.md`).
//! - [`channel`]: [`AgentChannel`], one attach stream per sandbox with concurrent calls on it:
//!   exec, command, background jobs, file transfer, listing, ping; timeouts, interrupts,
//!   restarts, output budgets.
//! - [`manager`]: [`SandboxManager`] (warm pools, lease, adopt, close) and [`Sandbox`].
//! - [`faults`]: faults a test injects at the steps of a checkpoint or restore.
//! - [`snapshot`]: memory snapshots of sandboxes (checkpoint and restore), their errors, and
//!   sealing them for rest ([`snapshot::seal`]).
//! - [`telemetry`]: counters of what sandboxes sent beyond their budgets, for `/metrics`.

pub mod backend;
pub mod channel;
pub mod config;
pub mod demand;
pub mod docker;
pub mod engines;
mod error;
pub mod faults;
pub mod lean;
pub mod manager;
pub mod protocol;
pub mod snapshot;
pub mod telemetry;

#[cfg(test)]
mod testing;

pub use backend::{ContainerFate, ManagedContainer, SandboxBackend};
pub use channel::{
    AgentChannel, AgentError, CellError, ChannelError, CommandOptions, CommandOutcome, DirEntry,
    Display, EgressBudget, EgressEnd, EgressEnv, EgressEnvInfo, EgressFrame, EgressHandler,
    EgressIo, EgressRefusal, EgressSink, EgressTally, EgressUpstream, EntryKind, ExecOptions,
    ExecOutcome, FileChunks, FileInfo, IndexAnswer, IndexBody, IndexHandler, IndexStream, Job,
    Listing, OutputEvent, PingInfo, PreloadInfo, RestoredInfo, Space, relay_connection,
};
pub use config::{
    ChannelConfig, ManagerConfig, OciRuntime, PoolConfig, ProfileError, PullPolicy, SandboxProfile,
    TemplateConfig,
};
pub use docker::{DockerBackend, DockerError, EngineInfo, ImageReady};
pub use engines::Engines;
pub use faults::{SnapshotFaults, SnapshotStep};
pub use lean::{LeanBackend, LeanConfig};
pub use manager::{
    PoolStats, Sandbox, SandboxError, SandboxManager, StartPermit, TemplateError, TemplateInfo,
    TemplateStatus,
};
pub use snapshot::files::{FilesOpener, FilesSealer};
pub use snapshot::seal::{
    DataKey, SealError, SealedContent, SealedHeader, SealedSnapshot, SnapshotAad,
};
pub use snapshot::{Snapshot, SnapshotError, SnapshotImage, SnapshotRoute, SnapshotUnavailable};
