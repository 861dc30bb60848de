//! The warm pool, in one place: the sandbox manager keeps the ready containers of this process,
//! Postgres keeps a `warm` row for each so a lease is one transaction whichever process started
//! the container. This module is the only one that moves sandboxes in or out of the manager's
//! pool or writes warm rows: recording them as they become ready, leasing one, checking the
//! pool against the rows, and leaving them for the next start at shutdown.

use std::collections::HashMap;
use std::time::Duration;

use sandgate_node::SandboxHandle;
use sandgate_sandbox::{ContainerFate, Sandbox, SandboxError};
use sandgate_store::StoreError;
use sandgate_store::sandboxes::{self, CloseReason, NewLease, SandboxRow, SandboxState};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::error::over_limit;
use super::lifecycle::LifecycleError;
use super::{Caller, Resolved, SandboxService, ServiceError};

/// Why a just-leased warm row's container cannot serve (the text is kept as its close reason).
#[derive(Debug, thiserror::Error)]
enum Unusable {
    /// It stopped while waiting.
    #[error("warm container died: {0}")]
    Died(ContainerFate),
    /// Its fate could not be learnt.
    #[error("warm container unreachable: {0}")]
    Unreachable(#[source] SandboxError),
    /// The node could not hand it over (out of its pool, or attached to).
    #[error("warm container could not be claimed: {0}")]
    NotAdopted(#[source] SandboxError),
    /// Its node could not be reached.
    #[error("warm container's node is away: {0}")]
    NodeAway(String),
}

/// How many warm rows one lease tries before falling back to a cold start, when the containers
/// behind them turn out to be gone.
const WARM_ATTEMPTS: usize = 3;

impl SandboxService {
    /// Leases a warm row: one transaction checks the tenant's limit, asks the placement rule
    /// which nodes may take the lease and flips a row of the first that has one (`FOR UPDATE
    /// SKIP LOCKED`, so no two leases anywhere get the same row); then the container's
    /// handle comes from this process's pool, or is adopted when another process started it.
    /// `None` when there is no warm row.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub(super) async fn lease_warm(
        &self,
        caller: &Caller,
        lease: &NewLease<'_>,
    ) -> Result<Option<Resolved>, ServiceError> {
        for _ in 0..WARM_ATTEMPTS {
            let mut tx = self.db.begin().await?;
            sandgate_store::tenants::lock(&mut tx, lease.tenant_id).await?;
            let live = sandboxes::count_live(&mut tx, lease.tenant_id).await?;
            if live >= i64::from(caller.limits.max_sandboxes) {
                return Err(over_limit(&caller.limits));
            }
            // The placement rule's choice, in the same transaction as the lease.
            let choice = self.nodes.choose(&mut tx).await?;
            let Some(row) =
                sandboxes::lease_warm(&mut tx, &self.profile.name, &choice.order, lease).await?
            else {
                return Ok(None);
            };
            tx.commit().await?;
            tracing::Span::current().record("sandbox_id", &row.id);
            // A remote node's pool refills there when it hands the sandbox over.
            if let Some(manager) = self.nodes.local()
                && self.nodes.own_id() == Some(row.node.as_str())
            {
                let _ = manager.refill(&self.profile.name);
            }
            match self.warm_handle(&row).await {
                Ok(sandbox) => return Ok(Some(self.newly_leased(row, sandbox))),
                Err(why) => {
                    // The warm container is gone: the row is, too; try the next one.
                    tracing::warn!(sandbox_id = %row.id, why = %why, "a warm sandbox was unusable");
                    let mut conn = self.db.acquire().await?;
                    sandboxes::end(&mut conn, &row.id, &CloseReason::Lost(why.to_string())).await?;
                    drop(conn);
                    self.remove_container(&row.id, Some(&row)).await;
                }
            }
        }
        Ok(None)
    }

    /// The handle of a just-leased warm row's container: from this process's pool, else adopted.
    /// The error says why the container cannot serve.
    async fn warm_handle(&self, row: &SandboxRow) -> Result<SandboxHandle, Unusable> {
        let node = self
            .nodes
            .get(&self.db, &row.node)
            .await
            .map_err(|e| Unusable::NodeAway(e.to_string()))?;
        let sandbox = node
            .claim(&row.id, &row.container_id)
            .await
            .map_err(Unusable::NotAdopted)?;
        if !sandbox.is_lost() {
            return Ok(sandbox);
        }
        Err(match sandbox.fate().await {
            Ok(fate) => Unusable::Died(fate),
            Err(err) => Unusable::Unreachable(err),
        })
    }

    /// Records a ready warm sandbox as a `warm` row (idempotent).
    #[tracing::instrument(skip_all, fields(sandbox_id = %sandbox.id()))]
    pub(super) async fn record_warm(&self, sandbox: &Sandbox) -> Result<(), StoreError> {
        // Only a process with its own node has warm sandboxes.
        let Some(node) = self.nodes.own_id() else {
            return Ok(());
        };
        let mut conn = self.db.acquire().await?;
        sandboxes::insert_warm(
            &mut conn,
            sandbox.id(),
            sandbox.profile(),
            sandbox.container_id(),
            node,
        )
        .await
    }

    /// Checks this process's warm pool against Postgres: a sandbox whose row another process
    /// leased is let go (without touching its container), one whose row ended or whose
    /// connection died is removed, one without a row yet is recorded. Then refills.
    #[tracing::instrument(skip_all)]
    pub async fn sync_pool(&self) -> Result<(), LifecycleError> {
        // The pool is the work of the process that runs the node.
        let Some(manager) = self.nodes.local() else {
            return Ok(());
        };
        let ids = manager.ready_ids();
        if !ids.is_empty() {
            let mut conn = self.db.acquire().await?;
            let rows: HashMap<String, SandboxState> = sandboxes::by_ids(&mut conn, &ids)
                .await?
                .into_iter()
                .map(|r| (r.id, r.state))
                .collect();
            drop(conn);
            for id in ids {
                match rows.get(&id) {
                    Some(SandboxState::Warm) => {
                        let Some(sandbox) = manager.take_ready_id(&id) else {
                            continue;
                        };
                        if !sandbox.is_lost() {
                            let _ = manager.offer(sandbox);
                            continue;
                        }
                        tracing::warn!(sandbox_id = %id, "a warm sandbox died while waiting");
                        let mut conn = self.db.acquire().await?;
                        let why = CloseReason::Lost("its warm container died".into());
                        sandboxes::end(&mut conn, &id, &why).await?;
                        drop(conn);
                        let _ = manager.close(sandbox).await;
                    }
                    Some(
                        SandboxState::Leased
                        | SandboxState::Pausing
                        | SandboxState::Paused
                        | SandboxState::Resuming,
                    ) => {
                        // Another process leased it (and adopted the container): not ours to
                        // hand out any more, and not ours to remove.
                        if manager.take_ready_id(&id).is_some() {
                            tracing::debug!(sandbox_id = %id, "a warm sandbox was leased elsewhere");
                        }
                    }
                    Some(SandboxState::Closed | SandboxState::Lost) => {
                        if let Some(sandbox) = manager.take_ready_id(&id) {
                            let _ = manager.close(sandbox).await;
                        }
                    }
                    None => {
                        if let Some(sandbox) = manager.take_ready_id(&id) {
                            let recorded = self.record_warm(&sandbox).await;
                            let _ = manager.offer(sandbox);
                            recorded?;
                        }
                    }
                }
            }
        }
        // A draining node's pool stops refilling (its warm sandboxes are retired by
        // `trim_pool`).
        if !self.nodes.draining() {
            manager.refill(&self.profile.name)?;
        }
        Ok(())
    }

    /// Gives up the warm sandboxes beyond the pool's target (demand fell): each row is retired
    /// while still `warm` and its container removed; one that another process leased meanwhile is
    /// let go without touching its container. Returns how many were removed.
    #[tracing::instrument(skip_all)]
    pub async fn trim_pool(&self) -> Result<usize, StoreError> {
        let Some(manager) = self.nodes.local() else {
            return Ok(0);
        };
        // A draining node gives up every warm sandbox: it takes no new leases.
        let surplus = if self.nodes.draining() {
            manager
                .ready_ids()
                .iter()
                .filter_map(|id| manager.take_ready_id(id))
                .collect()
        } else {
            manager.take_surplus(&self.profile.name)
        };
        let mut removed = 0;
        for (at, sandbox) in surplus.iter().enumerate() {
            let retired = async {
                let mut conn = self.db.acquire().await?;
                sandboxes::retire_warm(&mut conn, sandbox.id()).await
            }
            .await;
            match retired {
                Ok(Some(_)) => {
                    tracing::debug!(sandbox_id = %sandbox.id(), "demand fell: removing a warm sandbox");
                    if let Err(err) = manager.close(sandbox.clone()).await {
                        // Its row is retired: reconciliation removes the container once the
                        // engine answers again, not sparing it as a fresh launch of ours.
                        tracing::warn!(error = %err, "removing a surplus warm sandbox failed; reconciliation removes it");
                        manager.abandon(sandbox.id());
                    }
                    removed += 1;
                }
                // Not warm: not recorded yet, or leased elsewhere or ended meanwhile. Back into
                // the pool: the next pass of `sync_pool` lets go of one leased elsewhere and
                // removes one that ended; one not recorded yet is recorded, then trimmed later.
                Ok(None) => {
                    let _ = manager.offer(sandbox.clone());
                }
                Err(err) => {
                    // Postgres is away: keep the rest in the pool, retry at the next tick.
                    for sandbox in surplus.into_iter().skip(at) {
                        let _ = manager.offer(sandbox);
                    }
                    return Err(err);
                }
            }
        }
        Ok(removed)
    }

    /// Records each sandbox the pool makes ready as a warm row; while Postgres is away, retries
    /// (the sandbox waits in the pool, unleasable until recorded).
    pub(super) async fn record_ready(
        self,
        mut ready: mpsc::UnboundedReceiver<Sandbox>,
        stop: CancellationToken,
    ) {
        loop {
            let sandbox = tokio::select! {
                next = ready.recv() => match next {
                    Some(sandbox) => sandbox,
                    None => return,
                },
                () = stop.cancelled() => return,
            };
            loop {
                match self.record_warm(&sandbox).await {
                    Ok(()) => break,
                    Err(err) => {
                        tracing::warn!(error = %err, sandbox_id = %sandbox.id(), "recording a warm sandbox failed; retrying");
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_secs(1)) => {}
                            () = stop.cancelled() => return,
                        }
                    }
                }
            }
        }
    }

    /// At shutdown: stops the pool and touches only what this process alone owns. A warm
    /// sandbox with a `warm` row stays running for the next start (or another replica) to lease;
    /// one whose row another replica leased meanwhile is that replica's now (this pool had not let
    /// go of it yet) and is left alone; only a sandbox with no row (nobody else can know it) or an
    /// ended row is removed. When Postgres cannot say, everything is left running: reconciliation
    /// removes what turns out to be an orphan. Leased sandboxes stay running for the next start
    /// to re-attach to.
    #[tracing::instrument(skip_all)]
    pub async fn shutdown(&self) {
        // Closes that already answered finish removing their containers first.
        self.drain_removals().await;
        let Some(manager) = self.nodes.local() else {
            return;
        };
        let warm = manager.stop().await;
        if warm.is_empty() {
            return;
        }
        let ids: Vec<String> = warm.iter().map(|s| s.id().to_owned()).collect();
        let rows = async {
            let mut conn = self.db.acquire().await?;
            sandboxes::by_ids(&mut conn, &ids).await
        }
        .await;
        let states: HashMap<String, SandboxState> = match rows {
            Ok(rows) => rows.into_iter().map(|r| (r.id, r.state)).collect(),
            Err(err) => {
                tracing::warn!(error = %err, "checking the warm pool at shutdown failed; leaving its sandboxes running");
                return;
            }
        };
        for sandbox in warm {
            let remove = match states.get(sandbox.id()) {
                None | Some(SandboxState::Closed | SandboxState::Lost) => true,
                Some(
                    SandboxState::Warm
                    | SandboxState::Leased
                    | SandboxState::Pausing
                    | SandboxState::Paused
                    | SandboxState::Resuming,
                ) => false,
            };
            if remove && let Err(err) = manager.close(sandbox).await {
                tracing::warn!(error = %err, "removing an unrecorded warm sandbox failed");
            }
        }
    }
}
