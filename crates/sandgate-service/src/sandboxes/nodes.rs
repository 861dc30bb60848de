//! The nodes a service reaches (docs/scale-out.md): this process's own node, when it runs one
//! (`sandgate serve`, `sandgate node`), called directly; every other registered node over the
//! node RPC, connected on first use to the URL of its row in `nodes` and kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sandgate_node::{NodeHandle, NodeTls, RemoteNode, SandboxHandle, SandboxManager};
use sandgate_store::nodes;
use sandgate_store::{PgConnection, PgPool, StoreError};

use super::ServiceError;
use crate::placement::{self, Choice, Placement};

/// This process's own node: its registry id and its sandbox manager.
#[derive(Debug, Clone)]
pub struct OwnNode {
    /// The node's registry id (its engine's id).
    pub id: String,
    /// The sandbox manager of its engine.
    pub manager: SandboxManager,
}

/// The nodes a service reaches. Cheap to clone.
#[derive(Debug, Clone)]
pub struct NodeSet {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    own: Option<OwnNode>,
    /// The client identity for remote nodes (`node.tls_*`); none: only `http://` nodes on
    /// loopback can be reached.
    tls: Option<NodeTls>,
    remote: Mutex<HashMap<String, RemoteNode>>,
    /// A node silent this long is away: it takes no leases, seconds.
    away_after_seconds: u64,
    /// A node silent this long is lost: the sweep ends its sandboxes, seconds.
    lost_after_seconds: u64,
    /// Whether this process's own node is draining (the heartbeat reads it back).
    draining: AtomicBool,
}

impl NodeSet {
    /// The nodes of a process that runs `own` (if any), reaching others with `tls`; a node is
    /// away once silent `liveness.0` seconds, lost once silent `liveness.1`
    /// (`node.away_after_seconds`, `node.lost_after_seconds`).
    pub fn new(own: Option<OwnNode>, tls: Option<NodeTls>, liveness: (u64, u64)) -> Self {
        let (away_after_seconds, lost_after_seconds) = liveness;
        Self {
            inner: Arc::new(Inner {
                own,
                tls,
                remote: Mutex::default(),
                away_after_seconds,
                lost_after_seconds,
                draining: AtomicBool::new(false),
            }),
        }
    }

    /// This process's own node's registry id.
    pub fn own_id(&self) -> Option<&str> {
        self.inner.own.as_ref().map(|o| o.id.as_str())
    }

    /// This process's own sandbox manager (its pool, reconciliation and shutdown are this
    /// process's work).
    pub fn local(&self) -> Option<&SandboxManager> {
        self.inner.own.as_ref().map(|o| &o.manager)
    }

    /// How long a node may be silent before it counts as away (no new lease), seconds.
    pub fn away_after_seconds(&self) -> i64 {
        i64::try_from(self.inner.away_after_seconds).unwrap_or(i64::MAX)
    }

    /// How long a node may be silent before it counts as lost, seconds.
    pub fn lost_after_seconds(&self) -> i64 {
        i64::try_from(self.inner.lost_after_seconds).unwrap_or(i64::MAX)
    }

    /// Whether this process's own node is draining.
    pub fn draining(&self) -> bool {
        self.inner.draining.load(Ordering::Relaxed)
    }

    /// Records whether this process's own node is draining (from its heartbeat); a draining
    /// node's pool starts no warm sandbox (the ones it has are retired by `trim_pool`).
    pub fn set_draining(&self, draining: bool) {
        self.inner.draining.store(draining, Ordering::Relaxed);
        if let Some(own) = &self.inner.own {
            own.manager.pause_refills(draining);
        }
    }

    /// The node with registry id `id`: this process's own directly (no Postgres read), another
    /// over the RPC (its URL read from the registry on first use).
    pub async fn get(&self, db: &PgPool, id: &str) -> Result<NodeHandle, ServiceError> {
        if let Some(own) = self.inner.own.as_ref().filter(|o| o.id == id) {
            return Ok(NodeHandle::Local(own.manager.clone()));
        }
        if let Some(remote) = self.inner.remote.lock().expect("node set").get(id) {
            return Ok(NodeHandle::Remote(remote.clone()));
        }
        let mut conn = db.acquire().await?;
        let row = nodes::get(&mut conn, id).await?;
        drop(conn);
        let away = |why: String| ServiceError::NodeAway {
            node: id.to_owned(),
            why,
        };
        let row = row.ok_or_else(|| away("it is not registered".into()))?;
        if row.advertise_url.is_empty() {
            return Err(away(
                "it serves only its own process (its node.listen is empty)".into(),
            ));
        }
        // The node's address and the reason go to this process's log; the caller (the model)
        // reads that the node cannot be reached.
        let unreachable = |why: &dyn std::fmt::Display| {
            tracing::error!(node = id, url = %row.advertise_url, "cannot reach a sandbox node: {why}");
            away("this gateway cannot reach it (its log says why)".into())
        };
        // Cleartext only to this host's own loopback; anything else over mutual TLS, to a node
        // certificate naming the URL's host (`RemoteNode`'s rule).
        let remote = match &self.inner.tls {
            Some(tls) if row.advertise_url.starts_with("https://") => {
                RemoteNode::connect_lazy(&row.advertise_url, tls)
            }
            _ => RemoteNode::connect_lazy_cleartext(&row.advertise_url),
        }
        .map_err(|e| unreachable(&e))?;
        self.inner
            .remote
            .lock()
            .expect("node set")
            .insert(id.to_owned(), remote.clone());
        Ok(NodeHandle::Remote(remote))
    }

    /// Forgets the connection to node `id` (it did not answer; it may come back elsewhere): the
    /// next call reads its row again.
    pub fn forget(&self, id: &str) {
        self.inner.remote.lock().expect("node set").remove(id);
    }

    /// Removes a sandbox's container through its live handle (its own node's, or the remote
    /// node the handle names).
    pub async fn close(
        &self,
        sandbox: SandboxHandle,
    ) -> Result<(), sandgate_sandbox::SandboxError> {
        match (&sandbox, self.local()) {
            (SandboxHandle::Remote(remote), _) => remote.node().remove(remote.container_id()).await,
            (SandboxHandle::Local(_), Some(manager)) => {
                NodeHandle::Local(manager.clone()).close(sandbox).await
            }
            // A local handle exists only in a process with its own node.
            (SandboxHandle::Local(_), None) => Ok(()),
        }
    }

    /// Where a lease may go now, by the one placement rule ([`crate::placement`]), read on
    /// `conn` (a warm lease's transaction, so the choice and the lease are one).
    pub async fn choose(&self, conn: &mut PgConnection) -> Result<Choice, StoreError> {
        placement::choose(
            conn,
            &placement::OwnFirstThenMostRoom,
            self.own_id(),
            self.away_after_seconds(),
        )
        .await
    }

    /// Where a cold start goes, by the one placement rule ([`crate::placement`]).
    pub async fn place(&self, db: &PgPool) -> Result<Placement, ServiceError> {
        let mut conn = db.acquire().await?;
        Ok(self.choose(&mut conn).await?.cold())
    }
}
