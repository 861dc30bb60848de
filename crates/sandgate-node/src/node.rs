//! The node-level operations a gateway needs, wherever the node runs.

use sandgate_sandbox::{
    DataKey, PoolStats, SandboxError, SandboxManager, SandboxProfile, SealedSnapshot, SnapshotAad,
    StartPermit,
};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::{RemoteNode, SandboxHandle};

/// A node: the process that owns one engine's containers, warm pools and attach channels.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub enum NodeHandle {
    /// This process's own node: the sandbox manager, called directly.
    Local(SandboxManager),
    /// A node in another process, over the node RPC.
    Remote(RemoteNode),
}

/// A place among the starts a node runs at once (see [`NodeHandle::start_permit`]); freed on
/// drop.
#[derive(Debug)]
pub enum StartTicket {
    /// A permit of this process's manager.
    Local(StartPermit),
    /// A remote node bounds its starts itself.
    Remote,
}

impl NodeHandle {
    /// The sandbox manager when the node runs in this process (its pool, reconciliation and
    /// shutdown are this process's work).
    pub fn local(&self) -> Option<&SandboxManager> {
        match self {
            Self::Local(manager) => Some(manager),
            Self::Remote(_) => None,
        }
    }

    /// Waits for a place among the starts the node runs at once for `profile` (a cold start).
    pub async fn start_permit(&self, profile: &str) -> Result<StartTicket, SandboxError> {
        match self {
            Self::Local(manager) => Ok(StartTicket::Local(manager.start_permit(profile).await?)),
            Self::Remote(_) => Ok(StartTicket::Remote),
        }
    }

    /// Starts a sandbox from `profile` now, holding `ticket` while it starts.
    pub async fn launch(
        &self,
        profile: &SandboxProfile,
        ticket: StartTicket,
    ) -> Result<SandboxHandle, SandboxError> {
        match (self, ticket) {
            (Self::Local(manager), StartTicket::Local(permit)) => manager
                .launch_permitted(profile, permit)
                .await
                .map(SandboxHandle::Local),
            (Self::Local(manager), StartTicket::Remote) => {
                let permit = manager.start_permit(&profile.name).await?;
                manager
                    .launch_permitted(profile, permit)
                    .await
                    .map(SandboxHandle::Local)
            }
            (Self::Remote(node), _) => node.launch(profile).await.map(SandboxHandle::Remote),
        }
    }

    /// Starts a sandbox from `profile` under the id `sandbox_id` (a files-only resume keeps its
    /// sandbox's id; never from the warm pool or a template). A node that does not know the
    /// request (one of before) starts it under a fresh id: the caller checks the handle's id.
    pub async fn launch_as(
        &self,
        profile: &SandboxProfile,
        ticket: StartTicket,
        sandbox_id: &str,
    ) -> Result<SandboxHandle, SandboxError> {
        match (self, ticket) {
            (Self::Local(manager), StartTicket::Local(permit)) => manager
                .launch_permitted_as(profile, permit, Some(sandbox_id))
                .await
                .map(SandboxHandle::Local),
            (Self::Local(manager), StartTicket::Remote) => {
                let permit = manager.start_permit(&profile.name).await?;
                manager
                    .launch_permitted_as(profile, permit, Some(sandbox_id))
                    .await
                    .map(SandboxHandle::Local)
            }
            (Self::Remote(node), _) => node
                .launch_as(profile, Some(sandbox_id))
                .await
                .map(SandboxHandle::Remote),
        }
    }

    /// Takes the warm sandbox `sandbox_id` out of the node's pool, else attaches to its
    /// container `container_id`. In-process, a handle out of the pool whose connection died is
    /// returned as it is (the caller asks its fate).
    pub async fn claim(
        &self,
        sandbox_id: &str,
        container_id: &str,
    ) -> Result<SandboxHandle, SandboxError> {
        match self {
            Self::Local(manager) => match manager.take_ready_id(sandbox_id) {
                Some(sandbox) => Ok(SandboxHandle::Local(sandbox)),
                None => manager.adopt(container_id).await.map(SandboxHandle::Local),
            },
            Self::Remote(node) => node
                .claim(sandbox_id, container_id)
                .await
                .map(SandboxHandle::Remote),
        }
    }

    /// Attaches to a running container of the node (after a restart, or one another process
    /// started).
    pub async fn adopt(&self, container_id: &str) -> Result<SandboxHandle, SandboxError> {
        match self {
            Self::Local(manager) => manager.adopt(container_id).await.map(SandboxHandle::Local),
            Self::Remote(node) => node.adopt(container_id).await.map(SandboxHandle::Remote),
        }
    }

    /// Removes a sandbox's container (its files and kernel go with it).
    pub async fn close(&self, sandbox: SandboxHandle) -> Result<(), SandboxError> {
        match (self, sandbox) {
            (Self::Local(manager), SandboxHandle::Local(sandbox)) => manager.close(sandbox).await,
            (_, SandboxHandle::Remote(sandbox)) => {
                sandbox.node().remove(sandbox.container_id()).await
            }
            (Self::Remote(node), SandboxHandle::Local(sandbox)) => {
                node.remove(sandbox.container_id()).await
            }
        }
    }

    /// Removes a container by id.
    pub async fn remove_container(&self, container_id: &str) -> Result<(), SandboxError> {
        match self {
            Self::Local(manager) => manager.remove_container(container_id).await,
            Self::Remote(node) => node.remove(container_id).await,
        }
    }

    /// Checkpoints `sandbox` as snapshot `aad.snapshot_id` and seals it under `key` (bound to
    /// `aad`) into `out`: the node holds the key for this call only, and its plaintext image
    /// is gone when this returns (see [`SandboxManager::checkpoint_sealed`]).
    pub async fn checkpoint_sealed(
        &self,
        sandbox: &SandboxHandle,
        leave_running: bool,
        key: &DataKey,
        aad: &SnapshotAad,
        out: impl AsyncWrite + Unpin + Send,
    ) -> Result<SealedSnapshot, SandboxError> {
        match (self, sandbox) {
            (Self::Local(manager), SandboxHandle::Local(sandbox)) => {
                manager
                    .checkpoint_sealed(sandbox, leave_running, key, aad, out)
                    .await
            }
            (_, SandboxHandle::Remote(remote)) => {
                remote
                    .node()
                    .checkpoint_sealed(remote.call(), leave_running, key, aad, out)
                    .await
            }
            (Self::Remote(node), SandboxHandle::Local(sandbox)) => {
                let call = crate::proto::SandboxCall {
                    sandbox_id: sandbox.id().to_owned(),
                    container_id: sandbox.container_id().to_owned(),
                };
                node.checkpoint_sealed(call, leave_running, key, aad, out)
                    .await
            }
        }
    }

    /// Restores the sealed snapshot read from `sealed` (opened with `key` and `aad`) into a new
    /// sandbox of the node; a stream that does not open restores nothing (see
    /// [`SandboxManager::restore_sealed`]). With `keep_id` the new sandbox keeps the id the
    /// snapshot was taken of (a resume), else it gets a fresh one.
    pub async fn restore_sealed(
        &self,
        sealed: impl AsyncRead + Unpin + Send,
        key: &DataKey,
        aad: &SnapshotAad,
        keep_id: bool,
    ) -> Result<SandboxHandle, SandboxError> {
        match self {
            Self::Local(manager) => manager
                .restore_sealed(sealed, key, aad, keep_id)
                .await
                .map(SandboxHandle::Local),
            Self::Remote(node) => node
                .restore_sealed(sealed, key, aad, keep_id)
                .await
                .map(SandboxHandle::Remote),
        }
    }

    /// Tells the node's pool for `profile` that a lease happened (its size follows demand).
    pub fn record_lease(&self, profile: &str) {
        match self {
            Self::Local(manager) => manager.record_lease(profile),
            // The node counts the leases it serves itself (launch and claim).
            Self::Remote(_) => {}
        }
    }

    /// Asks the node's pool for `profile` to refill.
    pub fn refill(&self, profile: &str) -> Result<(), SandboxError> {
        match self {
            Self::Local(manager) => manager.refill(profile),
            // A claim refills the node's pool there.
            Self::Remote(_) => Ok(()),
        }
    }

    /// The numbers of the node's pool for `profile`.
    pub async fn pool_stats(&self, profile: &str) -> Option<PoolStats> {
        match self {
            Self::Local(manager) => manager.pool_stats(profile),
            Self::Remote(node) => node.pool_stats(profile).await,
        }
    }
}
