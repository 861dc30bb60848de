//! The snapshot store: where sealed snapshots rest between a pause and a resume (issue 27),
//! through the `object_store` crate (a local directory by default; any backend of that crate
//! fits behind it). Only the service reads and writes it: a node gets a snapshot's sealed bytes
//! streamed through the service for the one restore, never the store itself.
//!
//! Objects are named `tenants/<tenant id>/<snapshot id>.sgsnap`, so a tenant's purge deletes one
//! prefix. What is stored is the sealed stream only; its key is in the snapshot's row.

use std::path::Path;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::buffered::{BufReader, BufWriter};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use uuid::Uuid;

/// What went wrong in the snapshot store.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotStoreError {
    /// The store's directory could not be made or opened.
    #[error("opening the snapshot store at {path}: check snapshots.store_dir")]
    Open {
        /// The directory.
        path: String,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The snapshot's object is not in the store (deleted by retention, or a store that lost
    /// it).
    #[error("snapshot {snapshot_id} is not in the snapshot store")]
    Missing {
        /// The snapshot.
        snapshot_id: String,
    },
    /// The store failed an operation.
    #[error("the snapshot store failed {what}")]
    Store {
        /// What it was doing.
        what: &'static str,
        /// The cause.
        #[source]
        source: object_store::Error,
    },
}

/// The snapshot store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    store: Arc<dyn ObjectStore>,
}

impl SnapshotStore {
    /// A store in the local directory `dir` (made if missing).
    pub fn local(dir: &Path) -> Result<Self, SnapshotStoreError> {
        let open = |source: Box<dyn std::error::Error + Send + Sync>| SnapshotStoreError::Open {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| open(Box::new(e)))?;
        let fs = LocalFileSystem::new_with_prefix(dir).map_err(|e| open(Box::new(e)))?;
        Ok(Self::new(Arc::new(fs)))
    }

    /// A store over any `object_store` backend.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self { store }
    }

    fn path(tenant_id: Uuid, snapshot_id: &str) -> ObjectPath {
        ObjectPath::from(format!("tenants/{tenant_id}/{snapshot_id}.sgsnap"))
    }

    /// A writer for the tenant's snapshot's sealed stream. Nothing is visible in the store
    /// until [`tokio::io::AsyncWriteExt::shutdown`] completes; [`BufWriter::abort`] gives it up.
    pub fn writer(&self, tenant_id: Uuid, snapshot_id: &str) -> BufWriter {
        BufWriter::new(self.store.clone(), Self::path(tenant_id, snapshot_id))
    }

    /// A reader of the tenant's snapshot's sealed stream.
    pub async fn reader(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
    ) -> Result<BufReader, SnapshotStoreError> {
        let meta = self
            .store
            .head(&Self::path(tenant_id, snapshot_id))
            .await
            .map_err(|source| match source {
                object_store::Error::NotFound { .. } => SnapshotStoreError::Missing {
                    snapshot_id: snapshot_id.to_owned(),
                },
                source => SnapshotStoreError::Store {
                    what: "reading a snapshot",
                    source,
                },
            })?;
        Ok(BufReader::new(self.store.clone(), &meta))
    }

    /// Whether the tenant's snapshot is in the store.
    pub async fn contains(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
    ) -> Result<bool, SnapshotStoreError> {
        match self.store.head(&Self::path(tenant_id, snapshot_id)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(source) => Err(SnapshotStoreError::Store {
                what: "looking up a snapshot",
                source,
            }),
        }
    }

    /// Deletes the tenant's snapshot (one that is not there is no error).
    pub async fn delete(
        &self,
        tenant_id: Uuid,
        snapshot_id: &str,
    ) -> Result<(), SnapshotStoreError> {
        match self.store.delete(&Self::path(tenant_id, snapshot_id)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(SnapshotStoreError::Store {
                what: "deleting a snapshot",
                source,
            }),
        }
    }

    /// Deletes every snapshot of the tenant (its purge); returns how many.
    pub async fn delete_tenant(&self, tenant_id: Uuid) -> Result<usize, SnapshotStoreError> {
        let prefix = ObjectPath::from(format!("tenants/{tenant_id}"));
        let listed: Vec<_> =
            self.store
                .list(Some(&prefix))
                .try_collect()
                .await
                .map_err(|source| SnapshotStoreError::Store {
                    what: "listing a tenant's snapshots",
                    source,
                })?;
        for meta in &listed {
            match self.store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(source) => {
                    return Err(SnapshotStoreError::Store {
                        what: "deleting a tenant's snapshots",
                        source,
                    });
                }
            }
        }
        Ok(listed.len())
    }
}
