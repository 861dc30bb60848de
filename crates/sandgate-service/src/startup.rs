//! Starting the service layer: the Postgres pool and its migrations (or the schema check), the
//! signing keys, the Docker
//! engine and the sandbox manager, and the background work (reaper, reconciliation, audit writer,
//! retention purge). The HTTP faces are started on top of what [`Services::start`] returns.

use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::{
    DockerBackend, DockerError, Engines, LeanBackend, LeanConfig, ManagerConfig, PoolConfig,
    SandboxBackend, SandboxError, SandboxManager,
};
use sandgate_store::{PgPool, StoreError};
use secrecy::ExposeSecret;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::audit::AuditLog;
use crate::config::Config;
use crate::keys::{KeyError, KeyRing, KeySettings};
use crate::sandboxes::{NodeSet, OwnNode, SandboxService};
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
    /// The schema is not one this binary can run against (or Postgres could not be asked).
    #[error("cannot run against the database at database.url")]
    Schema(#[source] sandgate_store::schema::SchemaError),
    /// The signing keys could not be loaded.
    #[error("cannot load the token signing keys")]
    Keys(#[source] KeyError),
    /// The Docker client could not be set up.
    #[error("cannot set up the Docker client")]
    Docker(#[source] DockerError),
    /// The sandbox image could not be made ready as `sandbox.pull` says.
    #[error("the sandbox image is not ready on this node's engine")]
    SandboxImage(#[source] DockerError),
    /// The profile names the lean engine and this node cannot run it.
    #[error("the profile's runtime is \"lean\" and this node cannot run the lean engine: {0}")]
    Lean(String),
    /// The sandbox manager could not start.
    #[error("cannot start the sandbox manager")]
    Sandboxes(#[source] SandboxError),
    /// `egress.test_hosts` is refused.
    #[error("egress.test_hosts: {0}")]
    Egress(String),
    /// The package index could not be set up (its configuration).
    #[error("cannot set up packages on demand")]
    Packages(#[source] crate::packages::PackagesConfigError),
    /// The snapshot store could not be opened.
    #[error("cannot open the snapshot store (snapshots.store)")]
    SnapshotStore(#[source] crate::snapshots::SnapshotStoreError),
    /// The node could not register (e.g. another node serves the same engine).
    #[error("cannot register the sandbox node")]
    Registry(#[source] crate::node_registry::RegistryError),
    /// The certificates for reaching other nodes could not be read.
    #[error("cannot read the node certificates")]
    NodeTls(#[source] sandgate_node::TlsError),
}

/// What a process runs besides the service layer.
#[derive(Debug, Clone)]
pub enum Role {
    /// A node of its own (`sandgate serve`, `sandgate node`): its engine's containers, warm pool
    /// and attach channels, registered in `nodes` and reachable at `advertise_url` (empty: by
    /// this process only).
    Node {
        /// The URL other gateways dial.
        advertise_url: String,
    },
    /// No node (`sandgate serve --gateway-only`): no Docker, no pool; every sandbox is on a
    /// registered node, reached over the node RPC.
    GatewayOnly,
}

/// The running service layer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Services {
    /// The Postgres pool.
    pub db: PgPool,
    /// The Docker engine of this process's own node (none: gateway-only).
    pub docker: Option<DockerBackend>,
    /// This process's own node's registry id (none: gateway-only).
    pub node_id: Option<String>,
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
    /// Snapshots sealed at rest: key custody and the snapshots' rows.
    pub snapshots: crate::snapshots::SnapshotCustody,
    /// Cancelled to end the background work.
    pub background_stop: CancellationToken,
    /// The background work, to wait for at shutdown.
    pub background: TaskTracker,
}

impl Services {
    /// Connects to Postgres, migrates (`database.auto_migrate`, else checks the schema), loads
    /// keys; with a node of its own ([`Role::Node`]) connects to Docker, registers the node
    /// (before touching its containers), starts the sandbox manager (which begins filling the
    /// warm pool) and the heartbeat; then the background work.
    pub async fn start(config: &Config, role: Role) -> Result<Self, StartError> {
        let db = open_pool(config)?;
        if config.database.auto_migrate {
            sandgate_store::migrate(&db)
                .await
                .map_err(StartError::Migrate)?;
        } else {
            sandgate_store::schema::check(&db)
                .await
                .map_err(StartError::Schema)?;
        }
        let keys = KeyRing::load(
            db.clone(),
            KeySettings::of(config),
            config.public_url(),
            config.mcp_url(),
        )
        .await
        .map_err(StartError::Keys)?;
        let packages = crate::packages::PackageIndex::new(&config.packages, Some(db.clone()))
            .map_err(StartError::Packages)?;
        let advertise_url = match role {
            Role::Node { advertise_url } => Some(advertise_url),
            Role::GatewayOnly => None,
        };
        let snapshots = crate::snapshots::SnapshotCustody::new(
            db.clone(),
            crate::snapshots::SnapshotKeys::of(config),
        );
        // Pausing needs the key custody, so only a process that holds the keys pauses and
        // resumes: `serve` and gateway-only replicas, the idle sandboxes of any node.
        let pausing = pausing(config, &snapshots).await?;
        let core = Core::start(
            config,
            db.clone(),
            advertise_url,
            Some(packages.clone()),
            Idle {
                pausing,
                left_to_gateways: None,
            },
        )
        .await?;
        let (background_stop, background) = (core.background_stop, core.background);
        // The egress component runs where the calls run: here, never on a node host.
        let check = config
            .egress
            .target_check(config.only_loopback())
            .map_err(StartError::Egress)?;
        let upstream_tls = config
            .egress
            .upstream_tls(config.only_loopback())
            .map_err(StartError::Egress)?;
        let egress = crate::egress::EgressService::new(
            db.clone(),
            check,
            std::time::Duration::from_secs(config.egress.connect_timeout_seconds),
            config.egress.sealer(config.only_loopback()),
            upstream_tls,
        )
        .with_approvals_page(format!(
            "{}{}",
            config.public_url(),
            crate::egress::APPROVALS_PATH
        ));
        let sandboxes = core.sandboxes.with_egress(egress);
        // The calls run here (a node runs none), and other replicas' consoles may interrupt them.
        sandboxes.listen_for_interrupts(background_stop.clone(), &background);
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
            docker: core.docker,
            node_id: core.node_id,
            keys,
            sandboxes,
            audit,
            transcripts,
            packages,
            snapshots,
            background_stop,
            background,
        })
    }
}

/// The service layer of `sandgate node`: a node and nothing of a gateway. It holds no signing
/// key, no secret (`keys.secret`, `oauth.cookie_secret` are never read: a sealed snapshot's data
/// key travels in the RPC that needs it), writes no audit trail or transcript, purges nothing,
/// and never migrates: it checks that the schema is one it can run against, so it works with a
/// database role that may read and write only the node's tables (`deploy/postgres/roles.sql`).
#[derive(Debug, Clone)]
pub struct NodeServices {
    /// The Postgres pool.
    pub db: PgPool,
    /// The node's Docker engine.
    pub docker: DockerBackend,
    /// The node's registry id.
    pub node_id: String,
    /// The node's sandboxes (its own manager; reaper and reconciliation of its rows).
    pub sandboxes: SandboxService,
    /// Cancelled to end the background work.
    pub background_stop: CancellationToken,
    /// The background work, to wait for at shutdown.
    pub background: TaskTracker,
}

impl NodeServices {
    /// Connects to Postgres and checks the schema, connects to Docker, registers the node
    /// (advertising `advertise_url`), starts the sandbox manager, the heartbeat, the reaper and
    /// reconciliation.
    pub async fn start(config: &Config, advertise_url: String) -> Result<Self, StartError> {
        let db = open_pool(config)?;
        sandgate_store::schema::check(&db)
            .await
            .map_err(StartError::Schema)?;
        // No key custody here, so no pausing: a node's idle sandboxes are closed at their idle
        // deadline, or, where the deployment's gateways pause them, left to those (closed here
        // only when none paused one within the transition deadline past it).
        let left_to_gateways = config
            .snapshots
            .paused_by_gateways
            .then(|| Duration::from_secs(config.snapshots.transition_deadline_seconds));
        let idle = Idle {
            pausing: None,
            left_to_gateways,
        };
        let core = Core::start(config, db.clone(), Some(advertise_url), None, idle).await?;
        let (Some(docker), Some(node_id)) = (core.docker, core.node_id) else {
            unreachable!("Core::start with an advertise URL starts a node")
        };
        Ok(Self {
            db,
            docker,
            node_id,
            sandboxes: core.sandboxes,
            background_stop: core.background_stop,
            background: core.background,
        })
    }
}

/// What becomes of idle sandboxes in a process: paused by it (it holds the key custody), or
/// on a node, left to the gateways' pausing for a while.
struct Idle {
    pausing: Option<crate::sandboxes::Pausing>,
    left_to_gateways: Option<Duration>,
}

/// What gateways and nodes share: the sandbox service over the registered nodes, with this
/// process's own node when it has one, and the background work that keeps rows and containers
/// in step.
struct Core {
    docker: Option<DockerBackend>,
    node_id: Option<String>,
    sandboxes: SandboxService,
    background_stop: CancellationToken,
    background: TaskTracker,
}

impl Core {
    /// With `advertise_url` (a node of its own): Docker, the registration (before touching its
    /// containers), the sandbox manager and the heartbeat. Then the lifecycle (reaper,
    /// reconciliation) and the cache's invalidation listener.
    async fn start(
        config: &Config,
        db: PgPool,
        advertise_url: Option<String>,
        packages: Option<crate::packages::PackageIndex>,
        idle: Idle,
    ) -> Result<Self, StartError> {
        let tls = config.node.tls().map_err(StartError::NodeTls)?;
        let (docker, own, registration) = match advertise_url {
            Some(advertise_url) => {
                let mut docker =
                    DockerBackend::connect(&config.docker.host).map_err(StartError::Docker)?;
                if let Some(plain) = config.snapshots.plain_dir() {
                    docker = docker.with_snapshots(plain);
                }
                // Before the registration: a node that cannot get its image takes no lease.
                docker
                    .prepare_image(&config.sandbox.image, config.sandbox.pull)
                    .await
                    .map_err(StartError::SandboxImage)?;
                let registration = crate::node_registry::register(
                    &db,
                    &docker,
                    &config.node,
                    config.sandbox.container_memory_mb(),
                    &advertise_url,
                    crate::node_registry::legacy_node_id(&config.docker.host),
                )
                .await
                .map_err(StartError::Registry)?;
                let own = OwnNode {
                    id: registration.row.id.clone(),
                    manager: sandbox_manager(config, docker.clone())?,
                };
                (Some(docker), Some(own), Some(registration))
            }
            None => (None, None, None),
        };
        let node_id = own.as_ref().map(|o| o.id.clone());
        let nodes = NodeSet::new(own, tls, config.node.liveness());
        let mut sandboxes = SandboxService::new(
            db.clone(),
            nodes,
            config.sandbox.clone(),
            config.limits.clone(),
        );
        if let Some(packages) = packages {
            sandboxes = sandboxes.with_packages(packages);
        }
        if let Some(pausing) = idle.pausing {
            sandboxes = sandboxes.with_pausing(pausing);
        }
        if let Some(grace) = idle.left_to_gateways {
            sandboxes = sandboxes.with_idle_left_to_gateways(grace);
        }
        let background_stop = CancellationToken::new();
        let background = TaskTracker::new();
        if let Some(registration) = registration {
            crate::node_registry::spawn_heartbeat(
                registration,
                &config.node,
                sandboxes.clone(),
                background_stop.clone(),
                &background,
            );
        }
        sandboxes
            .start_lifecycle(
                &config.lifecycle,
                Duration::from_secs(config.node.heartbeat_seconds),
                background_stop.clone(),
                &background,
            )
            .await;
        sandboxes
            .cache()
            .listen(db, background_stop.clone(), &background);
        Ok(Self {
            docker,
            node_id,
            sandboxes,
            background_stop,
            background,
        })
    }
}

/// The lazily connecting pool on `database.url`.
fn open_pool(config: &Config) -> Result<PgPool, StartError> {
    sandgate_store::connect_lazy(config.database.url.expose_secret(), &config.pool_settings())
        .map_err(StartError::Database)
}

/// Pause and resume, where `snapshots.store` names a snapshot store. An S3 store is reached
/// once: a missing bucket or refused credentials fail the start, naming the setting; an
/// endpoint that does not answer yet is only warned about (pauses fail until it does).
async fn pausing(
    config: &Config,
    custody: &crate::snapshots::SnapshotCustody,
) -> Result<Option<crate::sandboxes::Pausing>, StartError> {
    use crate::snapshots::{SnapshotStore, SnapshotStoreError};
    let Some(store) = SnapshotStore::open(&config.snapshots).map_err(StartError::SnapshotStore)?
    else {
        tracing::info!(
            "no snapshot store (snapshots.store_dir empty): idle sandboxes are closed, not paused"
        );
        return Ok(None);
    };
    if config.snapshots.store == crate::config::StoreKind::S3 {
        match store.check().await {
            Ok(()) => {}
            Err(
                err @ (SnapshotStoreError::BucketMissing { .. }
                | SnapshotStoreError::CredentialsRefused { .. }),
            ) => return Err(StartError::SnapshotStore(err)),
            Err(err) => tracing::warn!(
                error = %err,
                "the S3 snapshot store does not answer yet (snapshots.s3.endpoint): pauses and \
                 resumes fail until it does"
            ),
        }
    }
    Ok(Some(crate::sandboxes::Pausing {
        custody: custody.clone(),
        store,
        on_idle: config.snapshots.pause_on_idle,
        transition_deadline: Duration::from_secs(config.snapshots.transition_deadline_seconds),
        max_paused: config.snapshots.max_paused,
        tenant_max_bytes: config.snapshots.tenant_max_bytes,
        retention: Duration::from_secs(config.retention.paused_seconds),
        transcripts: crate::transcripts::bound_of(&config.retention),
    }))
}

/// Runs the migrations embedded in the binary (`sandgate migrate`).
pub async fn migrate(config: &Config) -> Result<(), StartError> {
    let db = open_pool(config)?;
    sandgate_store::migrate(&db)
        .await
        .map_err(StartError::Migrate)
}

/// The node's engines: Docker, and the lean engine when the profile's runtime is `lean` (whose
/// zygote starts importing at once, so the first sandbox does not wait for it). The log says
/// which engine serves the profile.
fn engines(config: &Config, docker: DockerBackend) -> Result<Engines, StartError> {
    let profile = &config.sandbox;
    let engines = if profile.runtime.is_lean() {
        let lean = lean_engine(config, &docker)?;
        Engines::new(docker, Ok(lean))
    } else {
        Engines::new(docker, Err("no profile names it".into()))
    };
    tracing::info!(profile = %profile.name, engine = %engines.engine(profile), "sandbox engine");
    Ok(engines)
}

/// The lean engine under `[lean]`, its zygote for the profile's image warming in the background.
fn lean_engine(config: &Config, docker: &DockerBackend) -> Result<LeanBackend, StartError> {
    let mut settings =
        LeanConfig::beside_executable_in(config.lean.dir.clone()).map_err(StartError::Lean)?;
    if !config.lean.library.is_empty() {
        settings.library = std::path::PathBuf::from(&config.lean.library);
    }
    let lean = LeanBackend::new(docker.client().clone(), settings)
        .map_err(|e| StartError::Lean(e.to_string()))?;
    let warm = lean.clone();
    let image = config.sandbox.image.clone();
    tokio::spawn(async move {
        if let Err(err) = warm.warm(&image).await {
            tracing::warn!(error = %err, "the lean engine's zygote did not start; the first sandbox retries");
        }
    });
    Ok(lean)
}

/// The sandbox manager of this process's own node, for the configured profile.
fn sandbox_manager(config: &Config, docker: DockerBackend) -> Result<SandboxManager, StartError> {
    let mut manager_config = ManagerConfig::new(config.instance.clone());
    manager_config.demand_window = Duration::from_secs(config.pool.demand_window_seconds);
    manager_config.start_wait = Duration::from_secs(config.pool.start_wait_seconds);
    manager_config.templates = config.snapshots.templates();
    manager_config.pool = PoolConfig {
        min_ready: config.pool.min_ready,
        max_ready: config.pool.max_ready,
        max_concurrent_starts: config.pool.max_concurrent_starts,
    };
    SandboxManager::start(
        Arc::new(engines(config, docker)?),
        vec![config.sandbox.clone()],
        manager_config,
    )
    .map_err(StartError::Sandboxes)
}
