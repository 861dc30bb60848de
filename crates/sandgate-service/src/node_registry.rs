//! A node's row in Postgres: registration at start (refused while another node's heartbeat on
//! the same engine is live) and the heartbeat that keeps it (docs/scale-out.md).

use std::time::Duration;

use sandgate_sandbox::{DockerBackend, DockerError};
use sandgate_store::nodes::{self, NewNode, NodeRow};
use sandgate_store::{PgPool, StoreError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::config::NodeConfig;
use crate::sandboxes::SandboxService;

/// Why a node could not register.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The engine could not say who it is.
    #[error("cannot ask the Docker engine for its id")]
    Engine(#[source] DockerError),
    /// Postgres failed.
    #[error("cannot record the node in Postgres")]
    Store(#[from] StoreError),
    /// Migrating failed.
    #[error(transparent)]
    Start(Box<crate::startup::StartError>),
    /// Another node serves this engine and its heartbeat is live.
    #[error(
        "another sandgate node already serves this Docker engine ({engine}): {url} on {name}, \
         last heartbeat {age}s ago; stop it first, or wait node.lost_after_seconds \
         ({lost_after}s) after it stopped"
    )]
    EngineTaken {
        /// The engine's id.
        engine: String,
        /// The other node's URL.
        url: String,
        /// Its host's name.
        name: String,
        /// Seconds since its last heartbeat.
        age: i64,
        /// The configured `node.lost_after_seconds`.
        lost_after: u64,
    },
}

/// This process's registration as a node.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The node's row as registered.
    pub row: NodeRow,
}

/// Registers this process as the node of the configured engine, reachable at `advertise_url`,
/// before anything touches the engine's containers (so a second node on the same engine stops
/// here). Migrates first: the table must exist.
pub async fn register_configured(
    config: &crate::config::Config,
    advertise_url: &str,
) -> Result<Registration, RegistryError> {
    crate::startup::migrate(config)
        .await
        .map_err(|e| RegistryError::Start(Box::new(e)))?;
    let db = sandgate_store::connect_lazy(
        secrecy::ExposeSecret::expose_secret(&config.database.url),
        &config.pool_settings(),
    )?;
    let docker = DockerBackend::connect(&config.docker.host).map_err(RegistryError::Engine)?;
    let registered = register(
        &db,
        &docker,
        &config.node,
        advertise_url,
        config.sandbox.container_memory_mb(),
    )
    .await;
    db.close().await;
    registered
}

/// Registers this process as the node of `docker`'s engine, reachable at `advertise_url`, with
/// `node.slots` (0: one per `sandbox_mb` of the host's memory).
pub async fn register(
    db: &PgPool,
    docker: &DockerBackend,
    config: &NodeConfig,
    advertise_url: &str,
    sandbox_mb: u64,
) -> Result<Registration, RegistryError> {
    let engine = docker.engine().await.map_err(RegistryError::Engine)?;
    let slots = if config.slots > 0 {
        config.slots
    } else {
        let per = sandbox_mb.max(1) * 1024 * 1024;
        u32::try_from(engine.memory_bytes / per)
            .unwrap_or(u32::MAX)
            .max(1)
    };
    let node = NewNode {
        id: &engine.id,
        name: &engine.name,
        advertise_url,
        slots: i32::try_from(slots).unwrap_or(i32::MAX),
        memory_bytes: i64::try_from(engine.memory_bytes).unwrap_or(i64::MAX),
        draining: config.drain,
        process: Uuid::new_v4(),
    };
    let lost_after = i64::try_from(config.lost_after_seconds).unwrap_or(i64::MAX);
    let mut conn = db.acquire().await.map_err(StoreError::from)?;
    match nodes::register(&mut conn, &node, lost_after).await? {
        Some(row) => Ok(Registration { row }),
        None => {
            let other = nodes::get(&mut conn, &engine.id).await?;
            let (url, name, age) = other.map_or_else(
                || (String::from("?"), String::from("?"), 0),
                |o| {
                    let age = (chrono::Utc::now() - o.heartbeat_at).num_seconds().max(0);
                    (o.advertise_url, o.name, age)
                },
            );
            Err(RegistryError::EngineTaken {
                engine: engine.id,
                url,
                name,
                age,
                lost_after: config.lost_after_seconds,
            })
        }
    }
}

/// Heartbeats every `node.heartbeat_seconds` with the node's live and ready counts, until `stop`.
pub fn spawn_heartbeat(
    registration: &Registration,
    config: &NodeConfig,
    sandboxes: SandboxService,
    stop: CancellationToken,
    tasks: &TaskTracker,
) {
    let (id, process) = (registration.row.id.clone(), registration.row.process);
    let every = Duration::from_secs(config.heartbeat_seconds);
    tasks.spawn(async move {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                () = stop.cancelled() => return,
            }
            let (live, ready) = sandboxes.node_counts().await;
            let beat = async {
                let mut conn = sandboxes.db.acquire().await.map_err(StoreError::from)?;
                nodes::heartbeat(&mut conn, &id, process, live, ready).await
            }
            .await;
            match beat {
                Ok(true) => {}
                Ok(false) => tracing::error!(
                    node = %id,
                    "this node's row belongs to another process now (it was taken for lost); restart this node"
                ),
                Err(err) => tracing::warn!(error = %err, node = %id, "the node heartbeat failed"),
            }
        }
    });
}
