//! Memory snapshots of sandboxes (issue 26, docs/snapshots.md): what a checkpoint gives
//! ([`SnapshotImage`], wrapped by the manager in a [`Snapshot`]), why an engine cannot take one
//! ([`SnapshotUnavailable`]) and what goes wrong taking or restoring one ([`SnapshotError`]).
//!
//! A snapshot's image is plaintext (the sandbox's memory and tmpfs contents): it lives only on a
//! tmpfs, and is deleted when its [`Snapshot`] is dropped. At rest it is sealed ([`seal`]):
//! encrypted under a data key the service holds, bound to its tenant, sandbox and snapshot id.

use std::path::PathBuf;

use crate::config::SandboxProfile;
use crate::error::{BackendError, BoxError};

pub mod files;
pub mod seal;

/// A checkpoint image as the backend left it: a directory on a tmpfs, owned by whoever holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotImage {
    /// The image's directory (on a tmpfs).
    pub dir: PathBuf,
    /// Its size in bytes (the files' lengths).
    pub size_bytes: u64,
    /// The name the engine knows the checkpoint by, which a restore must give it again.
    pub name: String,
    /// A fingerprint of the agent the checkpointed container ran (its embedded package).
    pub agent: String,
}

/// A sandbox's memory snapshot: where its image is and what it came from. A restore needs a
/// container of exactly this profile (the checkpointed tmpfs mounts and limits), so the profile
/// travels with it. Dropping it deletes the image.
#[derive(Debug)]
pub struct Snapshot {
    /// The snapshot's id (`snap_…`).
    pub id: String,
    /// The sandbox it was taken of.
    pub source_sandbox: String,
    /// The profile that sandbox ran (image, runtime, limits): every restore uses it.
    pub profile: SandboxProfile,
    /// The image on the tmpfs.
    pub image: SnapshotImage,
    /// When it was taken.
    pub taken: std::time::SystemTime,
}

impl Snapshot {
    /// The image's size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.image.size_bytes
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        // The plaintext lives no longer than its handle (a tmpfs: this takes microseconds).
        if let Err(err) = std::fs::remove_dir_all(&self.image.dir)
            && err.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %err, dir = %self.image.dir.display(), "deleting a snapshot image failed");
        }
    }
}

/// How an engine takes and restores snapshots (docs/snapshots.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotRoute {
    /// runsc driven directly through `scripts/sandgate-runsc`: images written and read in place
    /// on the plaintext tmpfs, uncompressed.
    Runsc,
    /// Docker's experimental checkpoint API (containerd copies each image twice).
    DockerApi,
}

impl std::fmt::Display for SnapshotRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Runsc => "runsc",
            Self::DockerApi => "docker-api",
        })
    }
}

/// Why an engine cannot checkpoint or restore sandboxes of a runtime (for `/readyz` and the log).
#[derive(Debug, thiserror::Error)]
pub enum SnapshotUnavailable {
    /// The backend has no checkpoint support at all.
    #[error("this sandbox backend cannot checkpoint containers")]
    NotSupported,
    /// No tmpfs directory was configured for the plaintext images.
    #[error("no plaintext tmpfs directory is configured for snapshot images")]
    NoPlainDir,
    /// The configured directory is not on a tmpfs (plaintext must never reach a disk).
    #[error("the snapshot directory {} is on {fs_type}, not on a tmpfs", path.display())]
    PlainDirNotTmpfs {
        /// The directory.
        path: PathBuf,
        /// The file system it is on.
        fs_type: String,
    },
    /// The engine is reached over TCP: the restore request and the data root need its host.
    #[error("the Docker engine at {host} is not on a local Unix socket")]
    NotLocal {
        /// The configured address.
        host: String,
    },
    /// `docker info` failed.
    #[error("the Docker engine does not answer `info`")]
    Info(#[source] BoxError),
    /// The engine is not in experimental mode (its checkpoint API needs it).
    #[error(
        "the Docker engine is not in experimental mode (\"experimental\": true in daemon.json)"
    )]
    NotExperimental,
    /// The engine does not know the runtime.
    #[error("the Docker engine has no runtime {runtime:?} (scripts/stack.sh registers runsc2024)")]
    RuntimeMissing {
        /// The profile's runtime.
        runtime: String,
    },
    /// The runtime cannot checkpoint here (runc needs a CRIU this host lacks, docs/snapshots.md).
    #[error(
        "runtime {runtime:?} cannot checkpoint sandboxes on this host (runtimes that can: {can})"
    )]
    RuntimeCannotCheckpoint {
        /// The profile's runtime.
        runtime: String,
        /// The runtimes that can, comma-separated.
        can: String,
    },
    /// The engine's data root (from `docker info`) is not reachable from this process.
    #[error("the Docker engine's data root {} is not reachable here", path.display())]
    DataRootUnreachable {
        /// `DockerRootDir`.
        path: PathBuf,
    },
}

/// What went wrong taking or restoring a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The engine or runtime cannot take snapshots.
    #[error("snapshots are not available")]
    Unavailable(#[from] SnapshotUnavailable),
    /// Inspecting the container to checkpoint failed, or it is not running.
    #[error("container {container_id} cannot be checkpointed: {reason}")]
    NotCheckpointable {
        /// The container.
        container_id: String,
        /// Why.
        reason: String,
    },
    /// The engine's checkpoint call failed.
    #[error("checkpointing container {container_id} failed")]
    Checkpoint {
        /// The container.
        container_id: String,
        /// The engine's error.
        #[source]
        source: BoxError,
    },
    /// A checkpoint that stops the container returned, but the container did not stop.
    #[error("container {container_id} did not stop after its checkpoint")]
    StopAfterCheckpoint {
        /// The container.
        container_id: String,
    },
    /// Preparing, moving, linking or removing the image's files failed.
    #[error("{what} {} failed", path.display())]
    Files {
        /// What was done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The file system's error.
        #[source]
        source: std::io::Error,
    },
    /// The checkpoint left no image where the engine writes it.
    #[error("the checkpoint of container {container_id} left no image in {}", path.display())]
    NoImage {
        /// The container.
        container_id: String,
        /// Where it was expected.
        path: PathBuf,
    },
    /// Creating or attaching to the container to restore into failed.
    #[error("preparing the container to restore into failed")]
    Prepare(#[source] BackendError),
    /// The engine's socket could not be spoken to for the restore's start.
    #[error("sending the restore request to the engine at {socket} failed")]
    RestoreRequest {
        /// The socket.
        socket: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// runsc's own checkpoint (through `sandgate-runsc`) failed.
    #[error("runsc could not checkpoint container {container_id}: {message}")]
    Runsc {
        /// The container.
        container_id: String,
        /// What runsc said, or why it could not be run.
        message: String,
    },
    /// The engine refused or failed to start the container from the checkpoint.
    #[error("the engine could not restore container {container_id} (HTTP {status}): {message}")]
    Restore {
        /// The container.
        container_id: String,
        /// The HTTP status of `start?checkpoint=`.
        status: u16,
        /// The engine's message.
        message: String,
    },
    /// A test armed a fault at this step ([`crate::faults::SnapshotFaults`]).
    #[error("a fault was injected at {step}")]
    Injected {
        /// Where.
        step: SnapshotStep,
    },
}

/// A step of a checkpoint or a restore at which a fault can be injected, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotStep {
    /// Checkpoint: the container's checkpoint directory is linked into the tmpfs.
    CheckpointLinked,
    /// Checkpoint: the engine's checkpoint call has returned (a stopping checkpoint has stopped
    /// the container, or is stopping it).
    CheckpointTaken,
    /// Checkpoint: the image is out of the engine's reach, under the manager's images; the last
    /// step before the snapshot is handed over.
    CheckpointMoved,
    /// Restore: the new container is created and attached, not started.
    RestoreCreated,
    /// Restore: the image is in the new container's checkpoint directory.
    RestorePlaced,
    /// Restore: the engine has started the container from the image (the agent runs).
    RestoreStarted,
    /// Restore: the restored agent is about to be told its identity (the manager's step).
    RestoreAgent,
}

impl SnapshotStep {
    /// The checkpoint's steps, in order.
    pub const CHECKPOINT: [SnapshotStep; 3] = [
        SnapshotStep::CheckpointLinked,
        SnapshotStep::CheckpointTaken,
        SnapshotStep::CheckpointMoved,
    ];
    /// The restore's steps, in order.
    pub const RESTORE: [SnapshotStep; 4] = [
        SnapshotStep::RestoreCreated,
        SnapshotStep::RestorePlaced,
        SnapshotStep::RestoreStarted,
        SnapshotStep::RestoreAgent,
    ];
}

impl std::fmt::Display for SnapshotStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SnapshotStep::CheckpointLinked => "checkpoint: directory linked",
            SnapshotStep::CheckpointTaken => "checkpoint: engine call returned",
            SnapshotStep::CheckpointMoved => "checkpoint: image moved",
            SnapshotStep::RestoreCreated => "restore: container created",
            SnapshotStep::RestorePlaced => "restore: image placed",
            SnapshotStep::RestoreStarted => "restore: container started",
            SnapshotStep::RestoreAgent => "restore: agent to be told",
        })
    }
}

/// The file system type of the mount `path` is on (from /proc/self/mountinfo): where plaintext
/// images may go (a tmpfs only), for the engine's checkpoints and for unsealing.
pub(crate) fn fs_type(path: &std::path::Path) -> Option<String> {
    let path = std::fs::canonicalize(path).ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mounts
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let point = *fields.get(4)?;
            let dash = fields.iter().position(|f| *f == "-")?;
            Some((PathBuf::from(point), (*fields.get(dash + 1)?).to_owned()))
        })
        .filter(|(point, _)| path.starts_with(point))
        .max_by_key(|(point, _)| point.as_os_str().len())
        .map(|(_, kind)| kind)
}
