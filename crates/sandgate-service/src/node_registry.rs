//! A node's row in Postgres: registration at start (refused while another live node holds the
//! same engine) and the heartbeat that keeps it (docs/scale-out.md).

use std::time::Duration;

use sandgate_sandbox::{DockerBackend, DockerError};
use sandgate_store::nodes::{self, NewNode, NodeRow};
use sandgate_store::sandboxes;
use sandgate_store::{PgPool, StoreError};
use sqlx::PgConnection;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::config::NodeConfig;
use crate::sandboxes::SandboxService;

/// The slots of a node whose `node.slots` is 0: the host's memory divided by what one sandbox
/// may use at most (`sandbox_mb`: the profile's memory plus its tmpfs mounts, which the memory
/// cgroup counts, as [`sandgate_sandbox::SandboxProfile::container_memory_mb`]), at least one.
/// Leased sandboxes filling their limits then fit in the host's memory together (warm ones and
/// the processes beside them take what a real host keeps free).
pub fn derived_slots(host_memory_bytes: u64, sandbox_mb: u64) -> u32 {
    let per_sandbox = sandbox_mb.max(1).saturating_mul(1024 * 1024);
    u32::try_from(host_memory_bytes / per_sandbox)
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Why a node could not register.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// The engine could not say who it is.
    #[error("cannot ask the Docker engine for its id")]
    Engine(#[source] DockerError),
    /// Postgres failed.
    #[error("cannot record the node in Postgres")]
    Store(#[from] StoreError),
    /// Another node serves this engine: it holds the engine's lock.
    #[error(
        "another sandgate node already serves this Docker engine ({engine}): {url} on {name}, \
         last heartbeat {age}s ago; stop it first (a node that stopped frees its engine at once)"
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
    },
}

/// This process's registration as a node. Holds the engine's lock (a Postgres connection of its
/// own) while it lives; the heartbeat task takes it over.
#[derive(Debug)]
pub struct Registration {
    /// The node's row as registered.
    pub row: NodeRow,
    /// The connection that holds the engine's advisory lock.
    lock: PgConnection,
}

/// The id a node's sandboxes were recorded under before nodes had registry ids: `"local"`, or
/// the configured `docker.host`.
pub fn legacy_node_id(docker_host: &str) -> &str {
    if docker_host.is_empty() {
        "local"
    } else {
        docker_host
    }
}

/// Registers this process as the node of `docker`'s engine, reachable at `advertise_url` (empty:
/// it serves only its own process), with `node.slots` (0: [`derived_slots`] for a sandbox of
/// `sandbox_mb` at most), before anything touches the engine's containers. The engine's advisory lock, held
/// on a connection of its own for the node's life, makes a second live node on the same engine
/// impossible; a node that crashed frees it at once (Postgres ends its session). Rows recorded
/// under the node's old name (`legacy`) are renamed to its registry id.
pub async fn register(
    db: &PgPool,
    docker: &DockerBackend,
    config: &NodeConfig,
    sandbox_mb: u64,
    advertise_url: &str,
    legacy: &str,
) -> Result<Registration, RegistryError> {
    let engine = docker.engine().await.map_err(RegistryError::Engine)?;
    let slots = if config.slots > 0 {
        config.slots
    } else {
        derived_slots(engine.memory_bytes, sandbox_mb)
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
    let mut lock = db.acquire().await.map_err(StoreError::from)?.detach();
    if !nodes::try_lock(&mut lock, &engine.id).await? {
        let other = nodes::get(&mut lock, &engine.id).await?;
        let (url, name, age) = other.map_or_else(
            || (String::from("?"), String::from("?"), 0),
            |o| {
                let age = (chrono::Utc::now() - o.heartbeat_at).num_seconds().max(0);
                (o.advertise_url, o.name, age)
            },
        );
        return Err(RegistryError::EngineTaken {
            engine: engine.id,
            url,
            name,
            age,
        });
    }
    let row = nodes::register_locked(&mut lock, &node).await?;
    let renamed = sandboxes::rename_node(&mut lock, legacy, &row.id).await?;
    if renamed > 0 {
        tracing::info!(renamed, old = legacy, node = %row.id, "sandbox rows now carry the node's registry id");
    }
    Ok(Registration { row, lock })
}

/// Heartbeats every `node.heartbeat_seconds` with the node's live and ready counts, until `stop`,
/// on the connection that holds the engine's lock (should it break, a new one takes the lock
/// again first). Each beat reads back whether an operator drained the node.
pub fn spawn_heartbeat(
    registration: Registration,
    config: &NodeConfig,
    sandboxes: SandboxService,
    stop: CancellationToken,
    tasks: &TaskTracker,
) {
    let Registration { row, lock } = registration;
    let (id, process) = (row.id, row.process);
    sandboxes.nodes().set_draining(row.draining);
    let every = Duration::from_secs(config.heartbeat_seconds);
    tasks.spawn(async move {
        let mut lock = Some(lock);
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                () = stop.cancelled() => return,
            }
            let (live, ready) = sandboxes.node_counts().await;
            let beat = beat(&sandboxes.db, &mut lock, &id, process, live, ready).await;
            match beat {
                Ok(Some(draining)) => sandboxes.nodes().set_draining(draining),
                Ok(None) => tracing::error!(
                    node = %id,
                    "this node's row or engine lock belongs to another process now; restart this node"
                ),
                Err(err) => {
                    // The lock's connection may be gone: the next beat takes a new one.
                    lock = None;
                    tracing::warn!(error = %err, node = %id, "the node heartbeat failed");
                }
            }
        }
    });
}

/// One heartbeat on the lock's connection (re-locked on a new connection when there is none).
/// `None` when another process holds the engine now.
async fn beat(
    db: &PgPool,
    lock: &mut Option<PgConnection>,
    id: &str,
    process: Uuid,
    live: i32,
    ready: i32,
) -> Result<Option<bool>, StoreError> {
    if lock.is_none() {
        let mut conn = db.acquire().await?.detach();
        if !nodes::try_lock(&mut conn, id).await? {
            return Ok(None);
        }
        *lock = Some(conn);
    }
    let conn = lock.as_mut().expect("a lock connection");
    nodes::heartbeat(conn, id, process, live, ready).await
}

#[cfg(test)]
mod tests {
    use super::derived_slots;
    use sandgate_sandbox::SandboxProfile;

    const GIB: u64 = 1024 * 1024 * 1024;

    #[test]
    fn derived_slots_fit_every_sandbox_at_its_limit_in_the_hosts_memory() {
        // The default profile: 512 MiB of memory and 64 + 512 + 256 MiB of tmpfs.
        let profile = SandboxProfile::default();
        assert_eq!(profile.container_memory_mb(), 1344);
        let slots = derived_slots(24 * GIB, profile.container_memory_mb());
        assert_eq!(slots, 18, "24 GiB / 1344 MiB");
        assert!(u64::from(slots) * 1344 * 1024 * 1024 <= 24 * GIB);
        // A smaller profile gets more.
        assert_eq!(derived_slots(24 * GIB, 256), 96);
    }

    #[test]
    fn a_host_smaller_than_one_sandbox_still_has_one_slot() {
        assert_eq!(derived_slots(512 * 1024 * 1024, 1344), 1);
        assert_eq!(derived_slots(0, 0), 1);
    }
}
