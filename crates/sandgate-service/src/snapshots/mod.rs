//! Snapshots of tenants' sandboxes, sealed at rest (issue 26; pause, resume and fork build on
//! this, issue 27): the service holds the key-encryption key ([`keys`]), makes a fresh data key
//! for each snapshot, hands a node that key for the one checkpoint or restore (in the call,
//! never stored on the node), and records the snapshot's row with the key wrapped.
//!
//! Where the sealed bytes rest is the caller's: [`SnapshotCustody::take`] writes them to any
//! `AsyncWrite` and [`SnapshotCustody::restore`] reads them from any `AsyncRead` (issue 27's
//! snapshot store). They come to the service from the node (streamed back over the node RPC)
//! and go to it the same way: a node keeps neither plaintext nor ciphertext of a snapshot.

pub mod keys;
pub mod store;

use sandgate_node::{NodeHandle, SandboxHandle};
use sandgate_sandbox::{DataKey, SandboxError, SealedSnapshot, SnapshotAad};
use sandgate_store::snapshots::{self, NewSnapshot, SnapshotRow};
use sandgate_store::{PgPool, StoreError, sandboxes};
use tokio::io::{AsyncRead, AsyncWrite};
use uuid::Uuid;

pub use keys::{SnapshotKeys, UnwrapError};
pub use store::{SnapshotStore, SnapshotStoreError};

/// What went wrong taking, restoring or deleting a snapshot.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotServiceError {
    /// The tenant has no such sandbox (or it is another tenant's: the same answer).
    #[error("sandbox {sandbox_id} not found")]
    SandboxNotFound {
        /// The sandbox asked for.
        sandbox_id: String,
    },
    /// The tenant has no such snapshot (or it is another tenant's: the same answer).
    #[error("snapshot {snapshot_id} not found")]
    NotFound {
        /// The snapshot asked for.
        snapshot_id: String,
    },
    /// The snapshot's data key does not unwrap.
    #[error(transparent)]
    Unwrap(#[from] UnwrapError),
    /// The node failed the checkpoint, the sealing, the opening or the restore.
    #[error("the snapshot operation failed on the node")]
    Sandbox(#[source] Box<SandboxError>),
    /// Postgres failed. After a checkpoint that the row could not record, the sealed bytes
    /// written are of no use (no row holds their key): delete them.
    #[error("recording or reading the snapshot failed")]
    Store(#[from] StoreError),
}

impl From<SandboxError> for SnapshotServiceError {
    fn from(err: SandboxError) -> Self {
        Self::Sandbox(Box::new(err))
    }
}

impl From<sqlx::Error> for SnapshotServiceError {
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

/// A snapshot just taken: its row and what was sealed.
#[derive(Debug, Clone)]
pub struct TakenSnapshot {
    /// The recorded row (its wrapped key, sizes).
    pub row: SnapshotRow,
    /// The sealed stream's header and sizes.
    pub sealed: SealedSnapshot,
}

/// A snapshot sealed and written, not yet recorded: the caller records it
/// ([`PendingSnapshot::record`]) in the transaction that also changes its sandbox's state.
#[derive(Debug)]
pub struct PendingSnapshot {
    /// `snap_…`.
    pub id: String,
    /// The owner.
    pub tenant_id: Uuid,
    /// The sandbox it was taken of.
    pub sandbox_id: String,
    /// The node that took it.
    pub node: String,
    wrapped: Vec<u8>,
    /// The sealed stream's header and sizes.
    pub sealed: SealedSnapshot,
}

impl PendingSnapshot {
    /// Records the snapshot's row (its wrapped key, sizes) on `conn`.
    pub async fn record(&self, conn: &mut sqlx::PgConnection) -> Result<SnapshotRow, StoreError> {
        snapshots::insert(
            conn,
            &NewSnapshot {
                id: &self.id,
                tenant_id: self.tenant_id,
                sandbox_id: &self.sandbox_id,
                node: &self.node,
                wrapped_key: &self.wrapped,
                image_bytes: self.sealed.header.image_bytes,
                sealed_bytes: self.sealed.sealed_bytes,
            },
        )
        .await
    }
}

/// The data key of a files-only snapshot the service seals itself, with its binding.
#[derive(Debug)]
pub struct FilesKey {
    /// The data key (for this one sealing).
    pub key: DataKey,
    /// The binding the stream is sealed under.
    pub aad: SnapshotAad,
    wrapped: Vec<u8>,
    tenant_id: Uuid,
    node: String,
}

impl FilesKey {
    /// The snapshot sealed under this key, to record.
    pub fn pending(self, sealed: SealedSnapshot) -> PendingSnapshot {
        PendingSnapshot {
            id: self.aad.snapshot_id.clone(),
            tenant_id: self.tenant_id,
            sandbox_id: self.aad.sandbox_id.clone(),
            node: self.node,
            wrapped: self.wrapped,
            sealed,
        }
    }
}

/// The service's snapshot operations: key custody and the rows. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SnapshotCustody {
    db: PgPool,
    keys: SnapshotKeys,
}

fn binding(tenant_id: Uuid, sandbox_id: &str, snapshot_id: &str) -> SnapshotAad {
    SnapshotAad {
        tenant_id: tenant_id.to_string(),
        sandbox_id: sandbox_id.to_owned(),
        snapshot_id: snapshot_id.to_owned(),
    }
}

impl SnapshotCustody {
    /// Snapshot custody on `db` with `keys`.
    pub fn new(db: PgPool, keys: SnapshotKeys) -> Self {
        Self { db, keys }
    }

    /// Checkpoints the tenant's sandbox `sandbox` on `node` (registered as `node_name`) under
    /// a fresh snapshot id and data key, writing the sealed stream to `out`, and records the
    /// snapshot. Another tenant's sandbox is [`SnapshotServiceError::SandboxNotFound`], before
    /// anything is checkpointed.
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %sandbox.id(), snapshot))]
    pub async fn take(
        &self,
        tenant_id: Uuid,
        node_name: &str,
        node: &NodeHandle,
        sandbox: &SandboxHandle,
        leave_running: bool,
        out: impl AsyncWrite + Unpin + Send,
    ) -> Result<TakenSnapshot, SnapshotServiceError> {
        let snapshot_id = Self::new_id();
        let pending = self
            .take_as(
                &snapshot_id,
                tenant_id,
                node_name,
                node,
                sandbox,
                leave_running,
                out,
            )
            .await?;
        let mut conn = sandgate_store::acquire(&self.db).await?;
        let row = pending.record(&mut conn).await?;
        Ok(TakenSnapshot {
            row,
            sealed: pending.sealed,
        })
    }

    /// A fresh snapshot id (`snap_…`), for a caller that must know where the sealed bytes go
    /// before they are written.
    pub fn new_id() -> String {
        format!("snap_{}", Uuid::now_v7().simple())
    }

    /// [`Self::take`] under `snapshot_id`, leaving the row to the caller to record
    /// ([`PendingSnapshot::record`]).
    #[allow(clippy::too_many_arguments)] // the one operation's parts; a struct would only rename them
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, sandbox_id = %sandbox.id(), snapshot = %snapshot_id))]
    pub async fn take_as(
        &self,
        snapshot_id: &str,
        tenant_id: Uuid,
        node_name: &str,
        node: &NodeHandle,
        sandbox: &SandboxHandle,
        leave_running: bool,
        out: impl AsyncWrite + Unpin + Send,
    ) -> Result<PendingSnapshot, SnapshotServiceError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        if sandboxes::get(&mut conn, tenant_id, sandbox.id())
            .await?
            .is_none()
        {
            return Err(SnapshotServiceError::SandboxNotFound {
                sandbox_id: sandbox.id().to_owned(),
            });
        }
        drop(conn);
        let aad = binding(tenant_id, sandbox.id(), snapshot_id);
        let (key, wrapped) = self.keys.issue(&aad);
        let sealed = node
            .checkpoint_sealed(sandbox, leave_running, &key, &aad, out)
            .await;
        drop(key);
        Ok(PendingSnapshot {
            id: snapshot_id.to_owned(),
            tenant_id,
            sandbox_id: sandbox.id().to_owned(),
            node: node_name.to_owned(),
            wrapped,
            sealed: sealed?,
        })
    }

    /// Restores the tenant's snapshot `snapshot_id`, whose sealed stream is read from `sealed`,
    /// into a new sandbox on `node`. Another tenant's snapshot is
    /// [`SnapshotServiceError::NotFound`]; a stream that does not open under this snapshot's
    /// key and binding restores nothing.
    pub async fn restore(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
        node: &NodeHandle,
        sealed: impl AsyncRead + Unpin + Send,
    ) -> Result<SandboxHandle, SnapshotServiceError> {
        self.restore_into(tenant_id, snapshot_id, node, sealed, false)
            .await
    }

    /// [`Self::restore`], the new sandbox keeping the id of the sandbox the snapshot was taken
    /// of when `keep_id` (a resume: its old container is gone), else with a fresh id.
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant_id, snapshot = %snapshot_id, keep_id))]
    pub async fn restore_into(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
        node: &NodeHandle,
        sealed: impl AsyncRead + Unpin + Send,
        keep_id: bool,
    ) -> Result<SandboxHandle, SnapshotServiceError> {
        let row = self.get(tenant_id, snapshot_id).await?;
        let aad = binding(row.tenant_id, &row.sandbox_id, &row.id);
        let key = self.keys.unwrap(&aad, &row.wrapped_key)?;
        let restored = node.restore_sealed(sealed, &key, &aad, keep_id).await;
        drop(key);
        Ok(restored?)
    }

    /// A fresh data key for a snapshot the service seals itself (a files-only pause, whose
    /// archive the sandbox's agent makes), bound like a checkpoint's to the tenant, sandbox and
    /// snapshot id; [`FilesKey::pending`] makes its row once sealed.
    pub fn issue_files(
        &self,
        snapshot_id: &str,
        tenant_id: Uuid,
        sandbox_id: &str,
        node: &str,
    ) -> FilesKey {
        let aad = binding(tenant_id, sandbox_id, snapshot_id);
        let (key, wrapped) = self.keys.issue(&aad);
        FilesKey {
            key,
            aad,
            wrapped,
            tenant_id,
            node: node.to_owned(),
        }
    }

    /// The data key and binding of the tenant's snapshot `snapshot_id`, unwrapped to open it
    /// here (a files-only resume). Another tenant's snapshot is
    /// [`SnapshotServiceError::NotFound`].
    pub async fn open_key(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
    ) -> Result<(DataKey, SnapshotAad), SnapshotServiceError> {
        let row = self.get(tenant_id, snapshot_id).await?;
        let aad = binding(row.tenant_id, &row.sandbox_id, &row.id);
        let key = self.keys.unwrap(&aad, &row.wrapped_key)?;
        Ok((key, aad))
    }

    /// The tenant's snapshot `snapshot_id`.
    pub async fn get(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
    ) -> Result<SnapshotRow, SnapshotServiceError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        snapshots::get(&mut conn, tenant_id, snapshot_id)
            .await?
            .ok_or_else(|| SnapshotServiceError::NotFound {
                snapshot_id: snapshot_id.to_owned(),
            })
    }

    /// Deletes the tenant's snapshot's row (its wrapped key with it: the sealed bytes, wherever
    /// they rest, can no longer be opened). False when the tenant had no such snapshot.
    pub async fn forget(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
    ) -> Result<bool, SnapshotServiceError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(snapshots::delete(&mut conn, tenant_id, snapshot_id).await?)
    }
}
