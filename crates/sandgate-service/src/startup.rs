//! Starting the service layer: the Postgres pool and its migrations, the signing keys, the Docker
//! engine and the sandbox manager, and the background work (reaper, reconciliation, audit writer,
//! retention purge). The HTTP faces are started on top of what [`Services::start`] returns.

use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    DockerBackend, DockerError, ManagerConfig, PoolConfig, SandboxError, SandboxManager,
};
use sandgate_store::{PgPool, StoreError};
use secrecy::ExposeSecret;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::audit::AuditLog;
use crate::config::Config;
use crate::keys::{KeyError, KeyRing, KeySettings};
use crate::sandboxes::SandboxService;
use crate::transcripts::Transcripts;

/// Why the service layer could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The database URL could not be used.
    #[error("cannot set up the database pool")]
    Database(#[source] StoreError),
    /// Migrations failed (Postgres unreachable, or a migration error).
    #[error("cannot migrate the database; is Postgres running at the configured database.url?")]
    Migrate(#[source] StoreError),
    /// The signing keys could not be loaded.
    #[error("cannot load the token signing keys")]
    Keys(#[source] KeyError),
    /// The Docker client could not be set up.
    #[error("cannot set up the Docker client")]
    Docker(#[source] DockerError),
    /// The sandbox manager could not start.
    #[error("cannot start the sandbox manager")]
    Sandboxes(#[source] SandboxError),
    /// The package index could not be set up (its configuration).
    #[error("cannot set up packages on demand")]
    Packages(#[source] crate::packages::PackagesConfigError),
}

/// The running service layer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Services {
    /// The Postgres pool.
    pub db: PgPool,
    /// The Docker engine.
    pub docker: DockerBackend,
    /// Signing and verifying keys for access tokens.
    pub keys: KeyRing,
    /// Tenant-scoped sandboxes.
    pub sandboxes: SandboxService,
    /// The audit trail's writer.
    pub audit: AuditLog,
    /// Transcripts of what ran in sandboxes.
    pub transcripts: Transcripts,
    /// Packages on demand: the host side of `pip install` in a sandbox.
    pub packages: crate::packages::PackageIndex,
    /// Cancelled to end the background work.
    pub background_stop: CancellationToken,
    /// The background work, to wait for at shutdown.
    pub background: TaskTracker,
}

impl Services {
    /// Connects to Postgres and Docker, migrates, loads keys, starts the sandbox manager (which
    /// begins filling the warm pool) and the background work.
    pub async fn start(config: &Config) -> Result<Self, StartError> {
        let db = sandgate_store::connect_lazy(
            config.database.url.expose_secret(),
            &config.pool_settings(),
        )
        .map_err(StartError::Database)?;
        sandgate_store::migrate(&db)
            .await
            .map_err(StartError::Migrate)?;
        let keys = KeyRing::load(
            db.clone(),
            KeySettings::of(config),
            config.public_url(),
            config.mcp_url(),
        )
        .await
        .map_err(StartError::Keys)?;
        let docker = DockerBackend::connect(&config.docker.host).map_err(StartError::Docker)?;
        let packages = crate::packages::PackageIndex::new(&config.packages, Some(db.clone()))
            .map_err(StartError::Packages)?;
        let sandboxes =
            sandbox_service(config, db.clone(), docker.clone())?.with_packages(packages.clone());
        let background_stop = CancellationToken::new();
        let background = TaskTracker::new();
        sandboxes
            .start_lifecycle(&config.lifecycle, background_stop.clone(), &background)
            .await;
        sandboxes
            .cache()
            .listen(db.clone(), background_stop.clone(), &background);
        let audit = AuditLog::start(db.clone(), background_stop.clone(), &background);
        crate::retention::start_purge(
            db.clone(),
            &config.retention,
            background_stop.clone(),
            &background,
        );
        let transcripts = Transcripts::start(
            db.clone(),
            &config.retention,
            background_stop.clone(),
            &background,
        );
        Ok(Self {
            db,
            docker,
            keys,
            sandboxes,
            audit,
            transcripts,
            packages,
            background_stop,
            background,
        })
    }
}

/// Runs the migrations embedded in the binary.
pub async fn migrate(config: &Config) -> Result<(), StartError> {
    let db =
        sandgate_store::connect_lazy(config.database.url.expose_secret(), &config.pool_settings())
            .map_err(StartError::Database)?;
    sandgate_store::migrate(&db)
        .await
        .map_err(StartError::Migrate)
}

/// The sandbox manager for the configured profile, under the tenant-scoped service.
fn sandbox_service(
    config: &Config,
    db: PgPool,
    docker: DockerBackend,
) -> Result<SandboxService, StartError> {
    let mut manager_config = ManagerConfig::new(config.instance.clone());
    manager_config.demand_window = Duration::from_secs(config.pool.demand_window_seconds);
    manager_config.pool = PoolConfig {
        min_ready: config.pool.min_ready,
        max_ready: config.pool.max_ready,
        max_concurrent_starts: config.pool.max_concurrent_starts,
    };
    let manager = SandboxManager::start(
        Arc::new(docker),
        vec![config.sandbox.clone()],
        manager_config,
    )
    .map_err(StartError::Sandboxes)?;
    let node = if config.docker.host.is_empty() {
        "local".to_owned()
    } else {
        config.docker.host.clone()
    };
    Ok(SandboxService::new(
        db,
        manager,
        config.sandbox.clone(),
        node,
        config.limits.clone(),
    ))
}
