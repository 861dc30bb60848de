//! The snapshot store: where sealed snapshots rest between a pause and a resume (issue 27),
//! through the `object_store` crate: a local directory by default (`snapshots.store = "fs"`), an
//! S3-compatible bucket for production (`"s3"`); any backend of that crate fits behind it. Only
//! the service reads and writes it: a node gets a snapshot's sealed bytes streamed through the
//! service for the one restore, never the store itself (nor its credentials).
//!
//! Objects are named `tenants/<tenant id>/<snapshot id>.sgsnap` (under `snapshots.s3.prefix`),
//! so a tenant's purge deletes one prefix. What is stored is the sealed stream only; its key is
//! in the snapshot's row. Writes go through [`BufWriter`], a multipart upload once a snapshot
//! outgrows one part; reads through [`BufReader`], ranged reads as the restore consumes them.

use std::path::Path;
use std::sync::Arc;

use futures::TryStreamExt;
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use object_store::buffered::{BufReader, BufWriter};
use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use secrecy::ExposeSecret;
use uuid::Uuid;

use crate::config::{S3StoreConfig, SnapshotsConfig, StoreSettings};

/// What went wrong in the snapshot store.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotStoreError {
    /// The store could not be made or opened.
    #[error("opening the snapshot store at {path}: check {setting}")]
    Open {
        /// The directory or bucket.
        path: String,
        /// The settings that name it.
        setting: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The S3 bucket does not exist (or the endpoint serves no such bucket).
    #[error(
        "the snapshot store's bucket {bucket:?} does not exist at its endpoint: check \
         snapshots.s3.bucket and snapshots.s3.endpoint (the service never creates the bucket)"
    )]
    BucketMissing {
        /// The bucket.
        bucket: String,
        /// The cause.
        #[source]
        source: object_store::Error,
    },
    /// The S3 store refused the credentials (unknown, wrong, or not allowed on the bucket).
    #[error(
        "the snapshot store refused the credentials {what}: check snapshots.s3.access_key_id \
         and snapshots.s3.secret_access_key (and that they may read, write, list and delete in \
         snapshots.s3.bucket)"
    )]
    CredentialsRefused {
        /// What it was doing.
        what: &'static str,
        /// The cause.
        #[source]
        source: object_store::Error,
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

/// What an S3 endpoint refused, as far as its answer tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum S3Refusal {
    /// `NoSuchBucket`.
    NoSuchBucket,
    /// Some other 404 (a HEAD's answer has no body to tell an object from the bucket).
    NotFound,
    /// 401/403: unknown key, bad signature, or no permission.
    Credentials,
}

impl S3Refusal {
    /// Reads `err`: the typed variants where `object_store` maps the status, else the S3 error
    /// code in the answer it carries (its listing and multipart errors are `Generic`, with the
    /// HTTP error in a type it does not export, so the cause chain's text is what there is; the
    /// codes are S3's documented ones).
    fn of(err: &object_store::Error) -> Option<Self> {
        match err {
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. } => return Some(Self::Credentials),
            _ => {}
        }
        let mut chain = String::new();
        let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
        while let Some(e) = cause {
            chain.push_str(&e.to_string());
            chain.push('\n');
            cause = e.source();
        }
        const CREDENTIALS: [&str; 6] = [
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AccessDenied",
            "InvalidSecurity",
            "403 Forbidden",
            "401 Unauthorized",
        ];
        if chain.contains("NoSuchBucket") {
            Some(Self::NoSuchBucket)
        } else if CREDENTIALS.iter().any(|code| chain.contains(code)) {
            Some(Self::Credentials)
        } else if matches!(err, object_store::Error::NotFound { .. })
            || chain.contains("404 Not Found")
        {
            Some(Self::NotFound)
        } else {
            None
        }
    }
}

/// The snapshot store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SnapshotStore {
    store: Arc<dyn ObjectStore>,
    /// The S3 bucket, for the errors that name it; `None` for other backends.
    bucket: Option<String>,
}

impl SnapshotStore {
    /// The store `snapshots` configures, `None` when pauses are off (no store).
    pub fn open(snapshots: &SnapshotsConfig) -> Result<Option<Self>, SnapshotStoreError> {
        match snapshots.store() {
            None => Ok(None),
            Some(StoreSettings::Fs(dir)) => Self::local(dir).map(Some),
            Some(StoreSettings::S3(s3)) => Self::s3(s3).map(Some),
        }
    }

    /// A store in an S3-compatible bucket (checked at load: [`S3StoreConfig::check`]). Nothing
    /// is sent yet; [`SnapshotStore::check`] is the first request.
    pub fn s3(config: &S3StoreConfig) -> Result<Self, SnapshotStoreError> {
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(config.access_key_id.expose_secret())
            .with_secret_access_key(config.secret_access_key.expose_secret())
            .with_allow_http(config.allow_http);
        if !config.endpoint.is_empty() {
            builder = builder.with_endpoint(&config.endpoint);
        }
        let s3 = builder.build().map_err(|e| SnapshotStoreError::Open {
            path: format!("s3 bucket {:?}", config.bucket),
            setting: "[snapshots.s3]",
            source: Box::new(e),
        })?;
        let store: Arc<dyn ObjectStore> = if config.prefix.is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(PrefixStore::new(s3, config.prefix.as_str()))
        };
        Ok(Self {
            store,
            bucket: Some(config.bucket.clone()),
        })
    }

    /// Reaches the store once (a listing under the snapshots' prefix), so that a missing
    /// bucket or refused credentials are said at start-up, naming the setting, rather than at
    /// the first pause.
    pub async fn check(&self) -> Result<(), SnapshotStoreError> {
        self.store
            .list_with_delimiter(Some(&ObjectPath::from("tenants")))
            .await
            .map(drop)
            .map_err(|source| self.failed("reaching the snapshot store", source, true))
    }

    /// The error for `source`, met `what`-ing; `not_found_is_bucket`: whether a "not found"
    /// can only mean the bucket (a write or a listing: no object was named).
    fn failed(
        &self,
        what: &'static str,
        source: object_store::Error,
        not_found_is_bucket: bool,
    ) -> SnapshotStoreError {
        let Some(bucket) = &self.bucket else {
            return SnapshotStoreError::Store { what, source };
        };
        match S3Refusal::of(&source) {
            Some(S3Refusal::NoSuchBucket) => SnapshotStoreError::BucketMissing {
                bucket: bucket.clone(),
                source,
            },
            Some(S3Refusal::NotFound) if not_found_is_bucket => SnapshotStoreError::BucketMissing {
                bucket: bucket.clone(),
                source,
            },
            Some(S3Refusal::Credentials) => SnapshotStoreError::CredentialsRefused { what, source },
            Some(S3Refusal::NotFound) | None => SnapshotStoreError::Store { what, source },
        }
    }

    /// The error of a [`SnapshotStore::writer`] that failed (its `write` or `shutdown`): the
    /// store's own error when the writer carried one.
    pub fn write_failed(&self, err: std::io::Error) -> SnapshotStoreError {
        let source = match err
            .into_inner()
            .map(|inner| inner.downcast::<object_store::Error>())
        {
            Some(Ok(source)) => *source,
            Some(Err(other)) => object_store::Error::Generic {
                store: "snapshots",
                source: other,
            },
            None => object_store::Error::Generic {
                store: "snapshots",
                source: "the write failed".into(),
            },
        };
        self.failed("writing a snapshot", source, true)
    }

    /// A store in the local directory `dir` (made if missing).
    pub fn local(dir: &Path) -> Result<Self, SnapshotStoreError> {
        let open = |source: Box<dyn std::error::Error + Send + Sync>| SnapshotStoreError::Open {
            path: dir.display().to_string(),
            setting: "snapshots.store_dir",
            source,
        };
        std::fs::create_dir_all(dir).map_err(|e| open(Box::new(e)))?;
        let fs = LocalFileSystem::new_with_prefix(dir).map_err(|e| open(Box::new(e)))?;
        Ok(Self::new(Arc::new(fs)))
    }

    /// A store over any `object_store` backend.
    pub fn new(store: Arc<dyn ObjectStore>) -> Self {
        Self {
            store,
            bucket: None,
        }
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
                source => self.failed("reading a snapshot", source, false),
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
            Err(source) => Err(self.failed("looking up a snapshot", source, false)),
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
            Err(source) => Err(self.failed("deleting a snapshot", source, false)),
        }
    }

    /// The snapshots in the store written before `before`: (tenant, snapshot id) of each. Lists
    /// the whole store (the snapshot sweep does, once in a while).
    pub async fn written_before(
        &self,
        before: chrono::DateTime<chrono::Utc>,
    ) -> Result<Vec<(Uuid, String)>, SnapshotStoreError> {
        let listed: Vec<_> = self
            .store
            .list(Some(&ObjectPath::from("tenants")))
            .try_collect()
            .await
            .map_err(|source| self.failed("listing the snapshots", source, true))?;
        Ok(listed
            .into_iter()
            .filter(|meta| meta.last_modified < before)
            .filter_map(|meta| {
                // `tenants/<tenant id>/<snapshot id>.sgsnap`; anything else is not ours.
                let parts: Vec<String> = meta
                    .location
                    .parts()
                    .map(|p| p.as_ref().to_owned())
                    .collect();
                match parts.as_slice() {
                    [top, tenant, file] if top == "tenants" => Some((
                        tenant.parse().ok()?,
                        file.strip_suffix(".sgsnap")?.to_owned(),
                    )),
                    _ => None,
                }
            })
            .collect())
    }

    /// Deletes every snapshot of the tenant (its purge); returns how many.
    pub async fn delete_tenant(&self, tenant_id: Uuid) -> Result<usize, SnapshotStoreError> {
        let prefix = ObjectPath::from(format!("tenants/{tenant_id}"));
        let listed: Vec<_> = self
            .store
            .list(Some(&prefix))
            .try_collect()
            .await
            .map_err(|source| self.failed("listing a tenant's snapshots", source, true))?;
        for meta in &listed {
            match self.store.delete(&meta.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(source) => {
                    return Err(self.failed("deleting a tenant's snapshots", source, false));
                }
            }
        }
        Ok(listed.len())
    }
}
