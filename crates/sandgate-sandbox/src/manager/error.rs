//! What can go wrong managing sandboxes: [`SandboxError`].

use std::time::Duration;

use crate::backend::{BackendError, ContainerFate};
use crate::channel::ChannelError;
use crate::config::ProfileError;
use crate::snapshot::seal::SealError;
use crate::snapshot::{SnapshotError, SnapshotUnavailable};

/// What went wrong managing sandboxes.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    /// The sandbox's container stopped or vanished; the fate says why (e.g. its memory limit).
    #[error("sandbox {sandbox_id} stopped working: {fate}")]
    Died {
        /// The sandbox.
        sandbox_id: String,
        /// What happened to its container.
        fate: ContainerFate,
    },
    /// The attach stream to a container that still runs ended while the call was in flight
    /// (the engine restarted with live-restore, the connection dropped): the call's outcome is
    /// unknown, the kernel and files are intact, and the next call re-attaches
    /// ([`SandboxManager::adopt`]).
    #[error(
        "the connection to sandbox {sandbox_id} was lost while this call ran ({reason}); the \
         sandbox, its variables and files are intact and it is reconnected on the next call: \
         retry the call (it may or may not have run to the end)"
    )]
    ConnectionLost {
        /// The sandbox.
        sandbox_id: String,
        /// What the channel saw.
        reason: String,
    },
    /// Talking to the agent failed.
    #[error(transparent)]
    Channel(#[from] ChannelError),
    /// The engine could not launch a container.
    #[error("starting a sandbox failed")]
    Launch(#[source] BackendError),
    /// The container started but its agent never became ready.
    #[error("sandbox {sandbox_id} did not start ({fate})")]
    AgentStart {
        /// The sandbox.
        sandbox_id: String,
        /// What became of its container.
        fate: ContainerFate,
        /// What the channel saw.
        #[source]
        source: ChannelError,
    },
    /// No place among the starts the node runs at once came free within
    /// [`crate::ManagerConfig::start_wait`]: the node is busy starting others.
    #[error(
        "no sandbox could be started within {} s: the sandbox node is busy starting others",
        waited.as_secs()
    )]
    StartQueue {
        /// How long the start waited.
        waited: Duration,
    },
    /// The sandbox node holds as many bytes for calls as its budget allows (`node.reads_*`):
    /// the call is refused before the node reads anything; retrying shortly may work.
    #[error(
        "the sandbox node is at its bound of {what}; retry in {} s",
        retry_after.as_secs().max(1)
    )]
    NodeBusy {
        /// What is at its bound.
        what: String,
        /// When a retry may fit.
        retry_after: Duration,
    },
    /// No pool serves the named profile.
    #[error("no sandbox profile is named {0:?}")]
    UnknownProfile(String),
    /// A profile failed validation.
    #[error("sandbox profile {name:?} is invalid: {}: {reason}", .reason.field())]
    InvalidProfile {
        /// The profile.
        name: String,
        /// What is wrong, and in which field.
        reason: ProfileError,
    },
    /// `adopt` was given a container that this gateway instance does not own.
    #[error("container {container_id} is not a sandbox of this gateway")]
    NotOurs {
        /// The container.
        container_id: String,
    },
    /// Snapshots of the profile's sandboxes cannot be taken here; the reason says what is missing.
    #[error("sandboxes of profile {profile:?} cannot be snapshotted here")]
    SnapshotsUnavailable {
        /// The profile.
        profile: String,
        /// What is missing.
        #[source]
        reason: SnapshotUnavailable,
    },
    /// Checkpointing a sandbox failed.
    #[error("checkpointing sandbox {sandbox_id} failed")]
    Checkpoint {
        /// The sandbox.
        sandbox_id: String,
        /// What failed.
        #[source]
        source: Box<SnapshotError>,
    },
    /// Restoring a snapshot into a new container failed (no container is left).
    #[error("restoring snapshot {snapshot_id} failed")]
    Restore {
        /// The snapshot.
        snapshot_id: String,
        /// What failed.
        #[source]
        source: Box<SnapshotError>,
    },
    /// A restored sandbox's agent did not answer `restored` (it was removed).
    #[error("sandbox {sandbox_id} restored from snapshot {snapshot_id} did not answer ({fate})")]
    RestoredAgent {
        /// The restored sandbox.
        sandbox_id: String,
        /// The snapshot.
        snapshot_id: String,
        /// What became of its container.
        fate: Box<ContainerFate>,
        /// What the channel saw.
        #[source]
        source: Box<ChannelError>,
    },
    /// Sealing a snapshot for rest, or opening a sealed one, failed (no plaintext is left).
    #[error("sealing or opening snapshot {snapshot_id} failed")]
    Seal {
        /// The snapshot.
        snapshot_id: String,
        /// What failed (a refused stream says why).
        #[source]
        source: Box<SealError>,
    },
    /// A checkpoint stopped the sandbox: it serves no more calls (its snapshot has its state).
    #[error("sandbox {sandbox_id} was checkpointed and stopped; restore its snapshot to go on")]
    Checkpointed {
        /// The sandbox.
        sandbox_id: String,
    },
    /// An engine call (inspect, attach, remove, list) failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// A sandbox node in another process failed the call for a reason it logged rather than
    /// sent (its engine's words, paths and addresses stay on the node): its log has the whole
    /// cause chain under `incident`.
    #[error(
        "the sandbox node at {node} failed {} (incident {incident}: the node's log has the details)",
        if *starting { "to start a sandbox" } else { "the call" }
    )]
    NodeFailed {
        /// The node's address.
        node: String,
        /// The id the node logged the failure under.
        incident: String,
        /// Whether it was starting a sandbox (else a call on one).
        starting: bool,
    },
    /// The node serves no longer the node RPC version this gateway speaks: the gateway is older
    /// than the node's oldest supported caller.
    #[error(
        "the sandbox node at {node} serves node RPC versions {oldest} to {newest}, this gateway \
         speaks {caller}: upgrade the gateway (docs/scale-out.md, \"Upgrades\")"
    )]
    VersionSkew {
        /// The node's address.
        node: String,
        /// The version this gateway sent.
        caller: u32,
        /// The oldest the node serves.
        oldest: u32,
        /// The newest the node speaks.
        newest: u32,
    },
    /// The node does not know a call this gateway made: it runs an older sandgate.
    #[error(
        "the sandbox node at {node} does not know this call ({detail}): it runs an older \
         sandgate than this gateway; upgrade nodes before gateways (docs/scale-out.md, \"Upgrades\")"
    )]
    OlderNode {
        /// The node's address.
        node: String,
        /// What the RPC layer said.
        detail: String,
    },
}
