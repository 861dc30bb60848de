//! Packages on demand: the host side of `pip install` in a sandbox that has no network.
//!
//! The sandbox's pip asks the agent's loopback index (the image's pip.conf); the agent relays each
//! request over its channel to a [`CallIndex`] made for the call that runs pip. It fetches the
//! project's page from the configured upstream index (PEP 691 JSON, or PEP 503 HTML), offers
//! **binary wheels only**, applies the tenant's policy, and serves each wheel from a shared
//! content-addressed cache on this host (downloaded once, its sha256 checked against the index's),
//! recording every wheel it hands out in the install audit. pip in the sandbox resolves with the
//! sandbox's own interpreter and platform tags.

mod budget;
mod cache;
mod config;
mod index;
mod policy;
pub mod requirements;
mod upstream;

pub use crate::config::PackagesConfig;
pub use config::PackagesConfigError;
pub use index::CallIndex;
pub use policy::{Policy, Rule};

use std::path::PathBuf;
use std::sync::Arc;

use sandgate_store::PgPool;
use url::Url;
use uuid::Uuid;

/// The package index service: one per process, cheap to clone.
#[derive(Debug, Clone)]
pub struct PackageIndex {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The upstream simple index, or why installs are off.
    upstream: Result<Url, String>,
    client: reqwest::Client,
    cache: cache::WheelCache,
    budget: budget::DownloadBudget,
    max_wheel_bytes: u64,
    db: Option<PgPool>,
}

impl PackageIndex {
    /// The index for `config`: resolves the upstream (the configured URL, else the host pip's),
    /// builds the HTTP client (system trust store plus the configured extra CA bundle) and
    /// prepares the cache directory. `db` receives the install audit.
    pub fn new(config: &PackagesConfig, db: Option<PgPool>) -> Result<Self, PackagesConfigError> {
        let upstream = if config.enabled {
            config::upstream_index(config)
        } else {
            Err(disabled_text())
        };
        let client = upstream::client(config)?;
        let cache_dir = config.cache_dir();
        let cache =
            cache::WheelCache::open(&cache_dir, config.cache_max_mb.saturating_mul(1 << 20))
                .map_err(|source| PackagesConfigError::Cache {
                    dir: cache_dir.clone(),
                    source,
                })?;
        match &upstream {
            Ok(url) => {
                tracing::info!(index = %url, cache = %cache_dir.display(), "packages on demand")
            }
            Err(why) => tracing::info!(%why, "packages on demand are off"),
        }
        Ok(Self {
            inner: Arc::new(Inner {
                upstream,
                client,
                cache,
                budget: budget::DownloadBudget::new(
                    config.tenant_download_mb_per_hour.saturating_mul(1 << 20),
                ),
                max_wheel_bytes: config.max_wheel_mb.saturating_mul(1 << 20),
                db,
            }),
        })
    }

    /// The upstream index installs come from, when installs are on.
    pub fn upstream(&self) -> Option<&Url> {
        self.inner.upstream.as_ref().ok()
    }

    /// Where wheels are cached on this host.
    pub fn cache_dir(&self) -> PathBuf {
        self.inner.cache.dir().to_path_buf()
    }

    /// Records a wheel handed to a sandbox in the install audit, once per (sandbox, sha256) however
    /// often pip fetches it (a failure is logged: the install itself goes on).
    pub(crate) async fn audit_install(
        &self,
        tenant_id: Uuid,
        sandbox_id: &str,
        project: &str,
        version: &str,
        filename: &str,
        sha256: &str,
    ) {
        let Some(db) = &self.inner.db else {
            return;
        };
        let install = sandgate_store::packages::PackageInstall {
            at: chrono::Utc::now(),
            tenant_id,
            sandbox_id: sandbox_id.to_owned(),
            project: project.to_owned(),
            version: version.to_owned(),
            filename: filename.to_owned(),
            sha256: sha256.to_owned(),
        };
        let written = match db.acquire().await {
            Ok(mut conn) => sandgate_store::packages::record_install(&mut conn, &install)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(err) = written {
            tracing::error!(%err, project, version, "package install not audited");
        }
    }

    /// A tenant's package policy (the empty default without a database).
    pub(crate) async fn tenant_policy(&self, tenant_id: Uuid) -> Result<Policy, String> {
        let Some(db) = &self.inner.db else {
            return Ok(Policy::default());
        };
        let mut conn = db.acquire().await.map_err(|e| e.to_string())?;
        let stored = sandgate_store::packages::policy(&mut conn, tenant_id)
            .await
            .map_err(|e| e.to_string())?;
        Policy::from_stored(&stored)
    }

    /// A tenant's most recent installs, newest first.
    pub async fn recent_installs(
        &self,
        tenant_id: Uuid,
        limit: i64,
    ) -> Result<Vec<sandgate_store::packages::PackageInstall>, String> {
        let Some(db) = &self.inner.db else {
            return Ok(Vec::new());
        };
        let mut conn = db.acquire().await.map_err(|e| e.to_string())?;
        sandgate_store::packages::recent_installs(&mut conn, tenant_id, limit)
            .await
            .map_err(|e| e.to_string())
    }

    /// The handler for one call of `tenant` in `sandbox_id`: what pip in that call may install.
    pub fn for_call(&self, tenant: Uuid, sandbox_id: &str) -> CallIndex {
        CallIndex::new(self.clone(), tenant, sandbox_id.to_owned())
    }
}

/// What pip in a sandbox hears when installs are off.
fn disabled_text() -> String {
    "package installs are turned off on this sandgate server: an operator enables them with \
     `packages.enabled = true` in the configuration (SANDGATE_PACKAGES__ENABLED=true) and, if the \
     gateway's own pip has no index configured, `packages.index_url`"
        .into()
}

impl crate::SandboxService {
    /// This service with packages on demand served by `index`.
    #[must_use]
    pub fn with_packages(mut self, index: PackageIndex) -> Self {
        self.packages = Some(index);
        self
    }

    /// Runs `call` (a cell or a command in `resolved`) with the sandbox's package index served
    /// beside it, so that `pip install` in it reaches the tenant's packages; the call's output.
    pub async fn with_package_index<T>(
        &self,
        resolved: &crate::Resolved,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        let (Some(index), Some(tenant)) = (&self.packages, resolved.row.tenant_id) else {
            return call.await;
        };
        let handler = index.for_call(tenant, &resolved.row.id);
        resolved.sandbox.with_index(&handler, call).await
    }
}
