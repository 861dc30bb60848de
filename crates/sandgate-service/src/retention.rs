//! What sandgate keeps after a sandbox ends, and for how long (docs/data.md): the settings, the
//! purge job that enforces them, and the operator's "remove everything of this tenant now".
//!
//! - Files live only in the sandbox's container and go with it at close (`files_seconds = 0`).
//! - Transcripts are kept `transcripts_seconds` after their sandbox ended (a tenant's own value
//!   wins), then deleted by [`start_purge`].
//! - The audit trail (`audit_events`, `download_events`, `package_installs`) is kept
//!   `audit_seconds`, then deleted by the same job.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::Utc;
use sandgate_node::NodeHandle;
use sandgate_sandbox::{ChannelError, DockerBackend, SandboxBackend, SandboxError};
use sandgate_store::audit::{self, AuditTable};
use sandgate_store::{PgPool, StoreError, nodes, sandboxes, transcripts};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::config::{Config, RetentionConfig};
use crate::node_registry::legacy_node_id;
use crate::sandboxes::{NodeSet, ServiceError};

/// Why a retention command (`sandgate admin tenant purge`, `… retention`) failed.
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    /// The database's schema is not one this binary can run against.
    #[error(transparent)]
    Schema(#[from] sandgate_store::schema::SchemaError),
    /// Postgres failed.
    #[error("database error (is Postgres running at database.url, and migrated?)")]
    Store(#[from] StoreError),
    /// The tenant does not exist.
    #[error("no tenant with id {0}; `sandgate admin tenant create <name>` makes one")]
    NoSuchTenant(Uuid),
    /// The node RPC's certificates (`node.tls_*`) could not be read.
    #[error(transparent)]
    NodeTls(#[from] sandgate_node::TlsError),
    /// The retention asked for does not fit the column.
    #[error("retention must be at most 2147483647 seconds")]
    TooLong,
    /// The snapshot store (`snapshots.store`) failed deleting the tenant's snapshots
    /// (their rows, with the keys, are deleted: what is left cannot be opened).
    #[error(transparent)]
    SnapshotStore(#[from] crate::snapshots::SnapshotStoreError),
}

/// Rows of an audit table one purge statement deletes at most.
const AUDIT_PURGE_BATCH: i64 = 10_000;

/// Starts the purge job: every `purge_interval_seconds` (and once at start), deletes the
/// transcripts whose retention is over and the audit events older than `audit_seconds`. Stops
/// when `stop` is cancelled.
pub fn start_purge(
    db: PgPool,
    config: &RetentionConfig,
    stop: CancellationToken,
    tracker: &TaskTracker,
) {
    let interval = Duration::from_secs(config.purge_interval_seconds);
    let default_seconds = config.transcripts_seconds as i64;
    let audit_seconds = config.audit_seconds as i64;
    tracker.spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = ticker.tick() => {}
            }
            match purge_once(&db, default_seconds).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(transcripts = n, "purged transcripts past their retention"),
                Err(err) => tracing::warn!(error = ?err, "purging expired transcripts failed; retrying at the next interval"),
            }
            match purge_audit(&db, audit_seconds).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(events = n, "purged audit events past their retention"),
                Err(err) => tracing::warn!(error = ?err, "purging old audit events failed; retrying at the next interval"),
            }
        }
    });
}

async fn purge_once(db: &PgPool, default_seconds: i64) -> Result<u64, StoreError> {
    let mut conn = db.acquire().await?;
    let purged = transcripts::purge_expired(&mut conn, default_seconds).await?;
    // MCP session states whose session ended (closed, expired, refused at the cap); ten minutes
    // old at least, so that a state saved just before its binding is never taken for one.
    sandgate_store::mcp_session_states::purge_unbound(&mut conn, 600).await?;
    // Requests for egress hosts a day after they ran out (their decisions stay in the audit
    // trail, under its own retention).
    sandgate_store::egress_approvals::purge_expired(&mut conn, 86_400).await?;
    Ok(purged)
}

/// Deletes the events of both audit tables older than `seconds`, a batch at a time; returns how
/// many it deleted.
pub async fn purge_audit(db: &PgPool, seconds: i64) -> Result<u64, StoreError> {
    let mut purged = 0;
    for table in [
        AuditTable::ToolCalls,
        AuditTable::Downloads,
        AuditTable::PackageInstalls,
    ] {
        loop {
            let mut conn = db.acquire().await?;
            let n = audit::purge_older_than(&mut conn, table, seconds, AUDIT_PURGE_BATCH).await?;
            purged += n;
            if n < AUDIT_PURGE_BATCH as u64 {
                break;
            }
        }
    }
    Ok(purged)
}

/// What `sandgate admin tenant purge` removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purged {
    /// Live sandboxes closed.
    pub sandboxes_closed: usize,
    /// Containers removed now (their files and variables with them), each through the node
    /// that owns it.
    pub containers_removed: usize,
    /// Containers that could not be removed now, by node.
    pub containers_left: Vec<LeftOnNode>,
    /// Transcripts deleted.
    pub transcripts: u64,
    /// Paused sandboxes closed, their snapshots deleted (rows, and the store's objects where
    /// a snapshot store is configured).
    pub snapshots_deleted: u64,
    /// Requests for hosts outside the egress policy (and their decisions) deleted.
    pub egress_requests: u64,
}

/// Containers of a purged tenant that their node could not remove now. Their rows are ended,
/// so the node's reconciliation removes them when it runs (at its start, and every
/// `lifecycle.reconcile_interval_seconds` while it runs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeftOnNode {
    /// The node's registry id.
    pub node: String,
    /// Its host's name, when it is registered.
    pub name: Option<String>,
    /// Seconds since its last heartbeat, when it is registered.
    pub silent_seconds: Option<i64>,
    /// Why the containers could not be removed.
    pub why: String,
    /// The containers.
    pub containers: Vec<String>,
}

/// What `sandgate admin tenant purge` prints: what went, and per node what is left and when it
/// goes.
pub fn render_purged(purged: &Purged) -> String {
    let mut out = format!(
        "closed {} live sandboxes, deleted {} transcripts and {} snapshots of paused sandboxes\n\
         removed {} containers (their files and variables)",
        purged.sandboxes_closed,
        purged.transcripts,
        purged.snapshots_deleted,
        purged.containers_removed
    );
    if purged.egress_requests > 0 {
        out.push_str(&format!(
            "\ndeleted {} requests for egress hosts (and their decisions)",
            purged.egress_requests
        ));
    }
    for left in &purged.containers_left {
        let node = match (&left.name, left.silent_seconds) {
            (Some(name), Some(silent)) => {
                format!("node {} ({name}, last heartbeat {silent} s ago)", left.node)
            }
            _ => format!(
                "node {} (not registered: the node that registers for its engine takes it over)",
                left.node
            ),
        };
        out.push_str(&format!(
            "\n{} containers on {node} could not be removed now ({}); their sandboxes are \
             closed, so that node removes them itself at its next reconciliation (when it starts \
             again, and every lifecycle.reconcile_interval_seconds while it runs): {}",
            left.containers.len(),
            left.why,
            left.containers.join(" ")
        ));
    }
    out
}

/// How long one container's removal may take before its node counts as not answering.
const REMOVE_WITHIN: Duration = Duration::from_secs(30);

/// How long the engine of `docker.host` may take to say who it is.
const ENGINE_WITHIN: Duration = Duration::from_secs(10);

/// Removes everything of a tenant's content now: closes its live sandboxes and removes their
/// containers (files and variables go with them) through the node that owns each, deletes its
/// transcripts and forgets its conversation ids. Containers of its sandboxes that the lost-node
/// sweep ended on a silent node are removed too when their node (or this host's engine) can be
/// reached. The tenant, its users, connections and audit trail (which never holds content)
/// stay.
pub async fn purge_tenant(config: &Config, tenant: Uuid) -> Result<Purged, RetentionError> {
    let db = config.migrated_pool().await?;
    // Before anything changes: a configuration that cannot reach the nodes fails here.
    let remover = Remover::new(config).await?;
    let mut tx = sandgate_store::begin(&db).await?;
    if sandgate_store::tenants::get(&mut tx, tenant)
        .await?
        .is_none()
    {
        return Err(RetentionError::NoSuchTenant(tenant));
    }
    let lost_after = i64::try_from(config.node.lost_after_seconds).unwrap_or(i64::MAX);
    let mut ended = sandboxes::end_all_of_tenant(&mut tx, tenant, "purged").await?;
    let paused =
        sandgate_store::pauses::end_all_paused_of_tenant(&mut tx, tenant, "purged").await?;
    let snapshots_deleted = sandgate_store::snapshots::delete_of_tenant(&mut tx, tenant).await?;
    let stranded = sandboxes::lost_on_silent_nodes(&mut tx, tenant, lost_after).await?;
    let deleted = transcripts::purge_tenant(&mut tx, tenant).await?;
    let egress_requests =
        sandgate_store::egress_approvals::delete_of_tenant(&mut tx, tenant).await?;
    sandgate_store::commit(tx).await?;
    let paused_closed = paused.len();
    // A pausing one's container still ran; a paused one's is gone already.
    ended.extend(paused.into_iter().filter(|r| r.snapshot_id.is_none()));
    if let Some(store) = crate::snapshots::SnapshotStore::open(&config.snapshots)? {
        store.delete_tenant(tenant).await?;
    }
    let mut by_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for row in ended.iter().chain(&stranded) {
        by_node
            .entry(row.node.as_str())
            .or_default()
            .push(row.container_id.as_str());
    }
    let mut conn = sandgate_store::acquire(&db).await?;
    let registry: HashMap<String, nodes::NodeRow> = nodes::list(&mut conn)
        .await?
        .into_iter()
        .map(|n| (n.id.clone(), n))
        .collect();
    drop(conn);
    let mut removed = 0;
    let mut left = Vec::new();
    for (node, containers) in by_node {
        let (done, not_done) = remover.remove_on(&db, node, &containers).await;
        removed += done;
        if let Some((why, containers)) = not_done {
            let row = registry.get(node);
            left.push(LeftOnNode {
                node: node.to_owned(),
                name: row.map(|n| n.name.clone()),
                silent_seconds: row.map(|n| (Utc::now() - n.heartbeat_at).num_seconds().max(0)),
                why,
                containers,
            });
        }
    }
    Ok(Purged {
        sandboxes_closed: ended.len() + paused_closed,
        snapshots_deleted,
        egress_requests,
        containers_removed: removed,
        containers_left: left,
        transcripts: deleted,
    })
}

/// Where a node's containers are removed.
enum Via<'a> {
    /// This host's engine, directly.
    Engine(&'a DockerBackend),
    /// The node, over the node RPC.
    Node(NodeHandle),
}

/// Removes containers through the node that owns them: this host's engine directly when the
/// node is the one of `docker.host` (the admin command may run where no node process does),
/// any other node over the node RPC, with the `[node]` certificates as a gateway-only replica
/// reaches it.
struct Remover {
    /// This host's engine and the node ids its rows carry (its registry id; the id rows had
    /// before nodes had registry ids).
    own: Option<(DockerBackend, [String; 2])>,
    nodes: NodeSet,
}

impl Remover {
    async fn new(config: &Config) -> Result<Self, RetentionError> {
        let own = match DockerBackend::connect(&config.docker.host) {
            Ok(docker) => match tokio::time::timeout(ENGINE_WITHIN, docker.engine()).await {
                Ok(Ok(engine)) if !engine.id.is_empty() => {
                    let legacy = legacy_node_id(&config.docker.host).to_owned();
                    Some((docker, [engine.id, legacy]))
                }
                Ok(Ok(_)) => None,
                Ok(Err(err)) => {
                    tracing::info!(error = %err, "no Docker engine here: every container is removed through its node");
                    None
                }
                Err(_) => {
                    tracing::info!(
                        "the Docker engine of docker.host did not answer: every container is removed through its node"
                    );
                    None
                }
            },
            Err(_) => None,
        };
        let tls = config.node.tls()?;
        Ok(Self {
            own,
            nodes: NodeSet::new(None, tls, config.node.liveness()),
        })
    }

    /// Removes `containers` of node `node`: how many it removed, and those it could not with
    /// why. A node that does not answer is not asked again for the rest.
    async fn remove_on(
        &self,
        db: &PgPool,
        node: &str,
        containers: &[&str],
    ) -> (usize, Option<(String, Vec<String>)>) {
        let all_left =
            |why: String| Some((why, containers.iter().map(|c| (*c).to_owned()).collect()));
        // A lean sandbox is its node's alone (its records, cgroup and keeper): never removed
        // through the Docker engine, which would answer that it has no such container.
        let lean = containers
            .iter()
            .any(|c| sandgate_sandbox::lean::is_lean(c));
        let via = match &self.own {
            Some((docker, ids)) if !lean && ids.iter().any(|id| id == node) => Via::Engine(docker),
            _ => match self.nodes.get(db, node).await {
                Ok(handle) => Via::Node(handle),
                Err(ServiceError::NodeAway { why, .. }) => return (0, all_left(why)),
                Err(err) => return (0, all_left(err.to_string())),
            },
        };
        let mut removed = 0;
        let mut left = Vec::new();
        let mut why = None;
        for (i, container) in containers.iter().enumerate() {
            let attempt = async {
                match &via {
                    Via::Engine(docker) => {
                        docker.remove(container).await.map_err(SandboxError::from)
                    }
                    Via::Node(handle) => handle.remove_container(container).await,
                }
            };
            match tokio::time::timeout(REMOVE_WITHIN, attempt).await {
                Ok(Ok(())) => removed += 1,
                Ok(Err(SandboxError::Channel(ChannelError::AttachLost { reason }))) => {
                    left.extend(containers[i..].iter().map(|c| (*c).to_owned()));
                    why = Some(reason);
                    break;
                }
                Ok(Err(err)) => {
                    tracing::warn!(error = ?err, node, container, "removing a purged tenant's container failed");
                    left.push((*container).to_owned());
                    why = Some(err.to_string());
                }
                Err(_) => {
                    left.extend(containers[i..].iter().map(|c| (*c).to_owned()));
                    why = Some(format!(
                        "it did not answer within {} s",
                        REMOVE_WITHIN.as_secs()
                    ));
                    break;
                }
            }
        }
        (removed, why.map(|why| (why, left)))
    }
}

/// Sets a tenant's own transcript retention (`None`: back to the configured default); returns
/// the retention now in force, seconds.
pub async fn set_tenant_retention(
    config: &Config,
    tenant: Uuid,
    seconds: Option<u32>,
) -> Result<u64, RetentionError> {
    let db = config.migrated_pool().await?;
    let mut conn = sandgate_store::acquire(&db).await?;
    let value = seconds
        .map(|s| i32::try_from(s).map_err(|_| RetentionError::TooLong))
        .transpose()?;
    if !transcripts::set_retention(&mut conn, tenant, value).await? {
        return Err(RetentionError::NoSuchTenant(tenant));
    }
    Ok(value.map_or(config.retention.transcripts_seconds, |v| v as u64))
}

/// Sets a tenant's own retention of paused sandboxes (`None`: back to the configured
/// `retention.paused_seconds`); returns the retention now in force, seconds. The reaper's next
/// pass closes the tenant's paused sandboxes older than it and deletes their snapshots.
pub async fn set_tenant_paused_retention(
    config: &Config,
    tenant: Uuid,
    seconds: Option<u32>,
) -> Result<u64, RetentionError> {
    let db = config.migrated_pool().await?;
    let mut conn = sandgate_store::acquire(&db).await?;
    let value = seconds
        .map(|s| i32::try_from(s).map_err(|_| RetentionError::TooLong))
        .transpose()?;
    if !sandgate_store::pauses::set_paused_retention(&mut conn, tenant, value).await? {
        return Err(RetentionError::NoSuchTenant(tenant));
    }
    Ok(value.map_or(config.retention.paused_seconds, |v| v as u64))
}

/// The transcript retention in force for a tenant, seconds.
pub async fn tenant_retention(
    db: &PgPool,
    default_seconds: u64,
    tenant: Uuid,
) -> Result<u64, StoreError> {
    let mut conn = db.acquire().await?;
    Ok(transcripts::retention_of(&mut conn, tenant)
        .await?
        .flatten()
        .map_or(default_seconds, |v| v as u64))
}
