//! The seam between the pool and a container engine.
//!
//! [`SandboxBackend`] is what the manager needs from an engine: launch a hardened container running
//! the agent with its stdio attached, re-attach to one, explain its death, remove it, list ours.
//! Docker implements it now ([`crate::DockerBackend`]); a Kubernetes backend can later. Unit tests of
//! the pool use an in-memory fake.

use std::fmt;
use std::io;
use std::pin::Pin;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use tokio::io::AsyncWrite;

use crate::config::SandboxProfile;
pub use crate::error::{BackendError, BoxError};
use crate::snapshot::{SnapshotError, SnapshotImage, SnapshotUnavailable};

/// Label keys every sandbox container carries (DESIGN §3: for reconciliation).
pub mod labels {
    /// `"true"` on every container sandgate manages.
    pub const MANAGED: &str = "sandgate.managed";
    /// The gateway instance (deployment) that owns the container.
    pub const INSTANCE: &str = "sandgate.instance";
    /// The profile the container was made from.
    pub const PROFILE: &str = "sandgate.profile";
    /// The sandbox id the container serves.
    pub const SANDBOX_ID: &str = "sandgate.sandbox_id";
}

/// What to launch: a container of `profile` serving `sandbox_id`, owned by `instance`.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Image and limits.
    pub profile: SandboxProfile,
    /// The owning gateway instance, recorded in the `sandgate.instance` label.
    pub instance: String,
    /// The sandbox id, recorded in the `sandgate.sandbox_id` label.
    pub sandbox_id: String,
}

/// A piece of the container's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamChunk {
    /// From the agent's stdout: protocol frames.
    Stdout(Bytes),
    /// From the agent's stderr: diagnostics and crash tracebacks, logged, never parsed.
    Stderr(Bytes),
}

/// The container's attached stdio: what the agent writes, and its stdin.
pub struct AgentStreams {
    /// The container's stdout and stderr, demultiplexed. Attach delivers output from the moment of
    /// attaching on, never earlier output.
    pub output: BoxStream<'static, io::Result<StreamChunk>>,
    /// The container's stdin.
    pub input: Pin<Box<dyn AsyncWrite + Send>>,
}

impl fmt::Debug for AgentStreams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AgentStreams")
    }
}

/// A launched container, attached, its agent starting.
#[derive(Debug)]
pub struct Launched {
    /// The engine's container id.
    pub container_id: String,
    /// Its stdio, attached before the container started so the ready frame is not missed.
    pub streams: AgentStreams,
}

/// What became of a container: the answer to "why did the connection to the sandbox end?".
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ContainerFate {
    /// It is still running.
    Running,
    /// The kernel killed a process of it because it hit its memory limit.
    OomKilled {
        /// The limit, when the engine reports one.
        memory_limit_bytes: Option<u64>,
    },
    /// Its main process exited.
    Exited {
        /// The exit code (128 + N for a signal N).
        code: i64,
    },
    /// It does not exist (any more).
    Missing,
}

impl fmt::Display for ContainerFate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Running => f.write_str("its container is still running"),
            Self::OomKilled {
                memory_limit_bytes: Some(limit),
            } => write!(
                f,
                "it ran out of memory: the memory limit of {} MiB was hit and the kernel killed it",
                limit / (1024 * 1024)
            ),
            Self::OomKilled { .. } => f.write_str(
                "it ran out of memory: the memory limit was hit and the kernel killed it",
            ),
            Self::Exited { code: 137 } => {
                f.write_str("its main process was killed (SIGKILL, exit code 137)")
            }
            Self::Exited { code } => write!(f, "its main process exited with code {code}"),
            Self::Missing => f.write_str("its container no longer exists"),
        }
    }
}

/// A container found by [`SandboxBackend::inspect`] or [`SandboxBackend::list`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManagedContainer {
    /// The engine's container id.
    pub container_id: String,
    /// From the `sandgate.sandbox_id` label (empty when absent).
    pub sandbox_id: String,
    /// From the `sandgate.profile` label (empty when absent).
    pub profile: String,
    /// From the `sandgate.instance` label (empty when absent).
    pub instance: String,
    /// Whether `sandgate.managed=true` is set.
    pub managed: bool,
    /// Running, or how it ended.
    pub fate: ContainerFate,
    /// When the engine created it (Unix seconds), when known: reconciliation leaves young
    /// containers alone, since another gateway process may be about to record them.
    pub created_unix: Option<i64>,
    /// The engine's id of the image it was created from, when known: a node restarted after a
    /// new `sandbox.image` retires warm containers of the previous one.
    pub image_id: Option<String>,
}

/// A container engine that can run sandboxes. Object-safe: the manager holds an
/// `Arc<dyn SandboxBackend>`.
#[async_trait]
pub trait SandboxBackend: Send + Sync + fmt::Debug + 'static {
    /// Creates a hardened container for `spec` running the agent, attaches to its stdio and starts
    /// it. Returns without waiting for the agent's ready frame. A container that was created but
    /// could not be started or attached is removed before the error is returned.
    async fn launch(&self, spec: &LaunchSpec) -> Result<Launched, BackendError>;

    /// Attaches to a running container's stdio (only output from now on is delivered).
    async fn attach(&self, container_id: &str) -> Result<AgentStreams, BackendError>;

    /// Looks a container up; `None` when it does not exist.
    async fn inspect(&self, container_id: &str) -> Result<Option<ManagedContainer>, BackendError>;

    /// Removes a container, running or not. Removing one that is already gone succeeds.
    async fn remove(&self, container_id: &str) -> Result<(), BackendError>;

    /// Every container carrying `sandgate.managed=true` and `sandgate.instance=instance`,
    /// running or not.
    async fn list(&self, instance: &str) -> Result<Vec<ManagedContainer>, BackendError>;

    /// The engine's id of `image` (its content digest), for a template's fingerprint: a template
    /// taken from an image that has since been rebuilt under the same name is rebuilt too.
    /// `None` when the engine cannot say (the default).
    async fn image_id(&self, image: &str) -> Option<String> {
        let _ = image;
        None
    }

    /// Which engine serves sandboxes of `profile` on this node, and why: `/readyz` and the
    /// start-up log say it. The default: Docker, under the profile's runtime.
    fn engine(&self, profile: &SandboxProfile) -> String {
        format!("docker ({})", profile.runtime)
    }

    /// Whether containers of `runtime` can be checkpointed and restored here, and if not why.
    /// The default: never.
    async fn snapshot_support(&self, runtime: &str) -> Result<(), SnapshotUnavailable> {
        let _ = runtime;
        Err(SnapshotUnavailable::NotSupported)
    }

    /// The tmpfs directory where snapshot images are kept, into which sealed snapshots are
    /// opened. The default: none (no snapshots).
    fn snapshot_images_dir(&self) -> Option<std::path::PathBuf> {
        None
    }

    /// Checkpoints a running container into an image called `name` on a tmpfs, leaving the
    /// container running or stopping it (then it shows exited with code 0, its attach stream
    /// ended). The default: [`SnapshotUnavailable::NotSupported`].
    async fn checkpoint(
        &self,
        container_id: &str,
        name: &str,
        leave_running: bool,
    ) -> Result<SnapshotImage, SnapshotError> {
        let _ = (container_id, name, leave_running);
        Err(SnapshotUnavailable::NotSupported.into())
    }

    /// Creates a container for `spec` (the image's own profile), attaches to it and starts it from
    /// `image`: its agent resumes where the checkpoint left it and sends no ready frame. No copy of
    /// the image is left behind; `image` itself stays. A container that could not be restored is
    /// removed. The default: [`SnapshotUnavailable::NotSupported`].
    async fn restore(
        &self,
        spec: &LaunchSpec,
        image: &SnapshotImage,
    ) -> Result<Launched, SnapshotError> {
        let _ = (spec, image);
        Err(SnapshotUnavailable::NotSupported.into())
    }

    /// Fails when a test armed a fault at `step` of a snapshot operation the manager runs
    /// ([`crate::faults`]). The default: never.
    fn snapshot_fault(&self, step: crate::snapshot::SnapshotStep) -> Result<(), SnapshotError> {
        let _ = step;
        Ok(())
    }
}
