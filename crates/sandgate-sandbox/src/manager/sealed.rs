//! Sealed checkpoints and restores (issue 26): the manager's operations for a node that holds a
//! snapshot's data key for one operation only. The plaintext image exists on the tmpfs only
//! while the operation runs: a checkpoint's is deleted once sealed (or once sealing failed), an
//! opened one's once the restore is done (or failed).

use tokio::io::{AsyncRead, AsyncWrite};

use super::{Sandbox, SandboxError, SandboxManager};
use crate::snapshot::SnapshotUnavailable;
use crate::snapshot::seal::{DataKey, SealedSnapshot, SnapshotAad};
use crate::snapshot::{Snapshot, SnapshotError};

impl SandboxManager {
    /// Checkpoints `sandbox` as snapshot `aad.snapshot_id` and seals it into `out` under `key`,
    /// bound to `aad` (whose sandbox id must be this sandbox's). The plaintext image is deleted
    /// before this returns, whatever happened. With `leave_running` the sandbox serves on;
    /// without, it stops (see [`SandboxManager::checkpoint`]).
    #[tracing::instrument(skip_all, fields(sandbox_id = %sandbox.id(), snapshot = %aad.snapshot_id))]
    pub async fn checkpoint_sealed(
        &self,
        sandbox: &Sandbox,
        leave_running: bool,
        key: &DataKey,
        aad: &SnapshotAad,
        out: impl AsyncWrite + Unpin,
    ) -> Result<SealedSnapshot, SandboxError> {
        let snapshot = self
            .checkpoint_as(sandbox, &aad.snapshot_id, leave_running)
            .await?;
        let sealed = snapshot.seal(key, aad, out).await;
        // The plaintext goes now, sealed or not.
        drop(snapshot);
        sealed.map_err(|source| SandboxError::Seal {
            snapshot_id: aad.snapshot_id.clone(),
            source: Box::new(source),
        })
    }

    /// Opens the sealed snapshot read from `sealed` with `key` and `aad` onto the engine's
    /// plaintext tmpfs and restores it into a new sandbox (see [`SandboxManager::restore`]). A
    /// stream that does not open (altered, cut short, another tenant's) restores nothing; the
    /// opened image is deleted before this returns. With `keep_id` the new sandbox takes the
    /// id of the sandbox the snapshot was taken of (`aad.sandbox_id`, which the opening checks
    /// against the sealed header): a resume; without it, a fresh id (a fork, a clone).
    #[tracing::instrument(skip_all, fields(snapshot = %aad.snapshot_id, keep_id))]
    pub async fn restore_sealed(
        &self,
        sealed: impl AsyncRead + Unpin,
        key: &DataKey,
        aad: &SnapshotAad,
        keep_id: bool,
    ) -> Result<Sandbox, SandboxError> {
        // The place first, then the opening: the restores waiting for a place hold no plaintext
        // image on the tmpfs and spend no CPU opening one. Opened before waiting, twenty resumes
        // at once put twenty images (~110 MB each) on a tmpfs a few times that size, and their
        // openings shared the cores with the restores that had a place.
        let _place = self.restore_place().await?;
        let snapshot = self.open_sealed(sealed, key, aad).await?;
        let id = keep_id.then_some(aad.sandbox_id.as_str());
        let restored = self.restore_placed(&snapshot, id).await;
        drop(snapshot);
        restored
    }

    /// Opens a sealed snapshot onto the engine's plaintext tmpfs.
    async fn open_sealed(
        &self,
        sealed: impl AsyncRead + Unpin,
        key: &DataKey,
        aad: &SnapshotAad,
    ) -> Result<Snapshot, SandboxError> {
        let unavailable = |reason| SandboxError::Restore {
            snapshot_id: aad.snapshot_id.clone(),
            source: Box::new(SnapshotError::Unavailable(reason)),
        };
        let dir = self
            .inner
            .launcher
            .backend
            .snapshot_images_dir()
            .ok_or_else(|| unavailable(SnapshotUnavailable::NoPlainDir))?;
        std::fs::create_dir_all(&dir).map_err(|source| SandboxError::Restore {
            snapshot_id: aad.snapshot_id.clone(),
            source: Box::new(SnapshotError::Files {
                what: "creating",
                path: dir.clone(),
                source,
            }),
        })?;
        SealedSnapshot::open(sealed, key, aad, &dir)
            .await
            .map_err(|source| SandboxError::Seal {
                snapshot_id: aad.snapshot_id.clone(),
                source: Box::new(source),
            })
    }
}
