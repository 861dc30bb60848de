//! Keeping Postgres and Docker in step (DESIGN §4): the reaper and reconciliation (the warm
//! pool's rows are kept by [`super::warm`]).
//!
//! - **Reaper.** Every `lifecycle.reaper_interval_ms`, leased sandboxes past their idle timeout or
//!   lifetime are closed and their containers removed; at start-up this catches what expired while
//!   the gateway was down.
//! - **Reconciliation.** At start-up and every `lifecycle.reconcile_interval_seconds`: rows whose
//!   container vanished or stopped become `lost`; containers of this instance that Postgres does
//!   not know (older than `lifecycle.orphan_grace_seconds`, or at once when this process's launch
//!   of them failed) or knows as ended are removed; this
//!   process's pool is checked against the rows; leased sandboxes are re-attached (start-up).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use sandgate_sandbox::{ContainerFate, ManagedContainer, SandboxError};
use sandgate_store::StoreError;
use sandgate_store::sandboxes::{self, CloseReason, SandboxRow, SandboxState};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::pause::IdlePause;
use super::{SandboxService, ServiceError, describe_fate};
use crate::config::LifecycleConfig;

/// How long this process's own fresh launches are never taken for orphans: well past the agent's
/// ready timeout.
const LAUNCH_GRACE: Duration = Duration::from_secs(180);

/// How many idle sandboxes one reaper pass pauses at once (each a checkpoint on the node).
const PAUSES_AT_ONCE: usize = 4;

/// How often the warm pool is checked for sandboxes beyond its target.
const TRIM_INTERVAL: Duration = Duration::from_secs(1);

/// What one reconciliation pass did (logged; returned for callers that care).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// Rows marked `lost` because their container is gone or stopped.
    pub lost: usize,
    /// Containers removed because Postgres does not know them or knows them as ended.
    pub removed: usize,
    /// Leased sandboxes re-attached.
    pub adopted: usize,
    /// Warm sandboxes retired at start-up because their image is not the profile's any more.
    pub outdated: usize,
}

/// Why a lifecycle pass failed.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// Postgres failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The sandbox manager or engine failed.
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    /// Another service failure.
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl From<sqlx::Error> for LifecycleError {
    /// A failed acquire, begin or commit: classified like any other database failure.
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

impl SandboxService {
    /// One reaper pass; returns how many sandboxes it closed. A process holding the key custody
    /// (pausing on) ends paused sandboxes past their lifetime or retention and pauses idle
    /// leased ones on any node; a process with a node of its own closes that node's leased
    /// sandboxes past their lifetime, and past their idle timeout where it does not pause them
    /// (on a node whose gateways pause: only once they have been left to them long enough).
    /// Sandboxes with a call in flight on any replica are skipped.
    #[tracing::instrument(skip_all)]
    pub async fn reap(&self) -> Result<usize, LifecycleError> {
        let mut closed = 0;
        if self.pausing.is_some() {
            // Any node's: a conditional statement per row, so replicas racing end each once.
            closed += self.reap_paused().await?;
        }
        if self.pauses_on_idle() {
            closed += self.pause_idle_anywhere().await?;
        }
        // Closing for the clock is the work of the process that runs the node (a gateway-only
        // replica has none; the nodes reap their own).
        if let Some(node) = self.nodes.own_id() {
            closed += self.close_overdue(node).await?;
        }
        Ok(closed)
    }

    /// The rows of `rows` with no call in flight on any replica.
    async fn unused(&self, rows: Vec<SandboxRow>) -> Result<Vec<SandboxRow>, LifecycleError> {
        if rows.is_empty() {
            return Ok(rows);
        }
        let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
        let busy = self.busy_anywhere(&ids).await?;
        Ok(rows.into_iter().filter(|r| !busy.contains(&r.id)).collect())
    }

    /// Pauses the idle leased sandboxes of every node that answers (through the node RPCs for
    /// another process's node; an away node's are left alone); closes those it may not pause.
    /// Returns how many it closed.
    async fn pause_idle_anywhere(&self) -> Result<usize, LifecycleError> {
        let mut conn = self.db.acquire().await?;
        // Not those of an away node: it could not checkpoint them now (they wait for it to
        // come back, or to be lost).
        let idle = sandboxes::idle_anywhere(
            &mut conn,
            Utc::now(),
            self.nodes.own_id(),
            self.nodes.away_after_seconds(),
        )
        .await?;
        drop(conn);
        let idle = self.unused(idle).await?;
        let pauses = futures::stream::iter(idle)
            .map(|row| async move {
                let paused = self.pause_idle(&row).await;
                (row, paused)
            })
            .buffer_unordered(PAUSES_AT_ONCE)
            .collect::<Vec<_>>()
            .await;
        let mut closed = 0;
        for (row, paused) in pauses {
            match paused {
                Ok(IdlePause::Paused | IdlePause::Skipped) => {}
                // Over the tenant's paused limits, or a runtime that cannot checkpoint: closed
                // as without pauses.
                Ok(IdlePause::Close) => {
                    if self.end(&row, CloseReason::Idle).await?.is_some() {
                        tracing::info!(sandbox_id = %row.id, node = %row.node, "closed an idle sandbox it could not pause");
                        closed += 1;
                    }
                }
                // Still running (the pause was undone); the next pass tries again.
                Err(err) => {
                    tracing::warn!(error = %err, sandbox_id = %row.id, node = %row.node, "pausing an idle sandbox failed");
                }
            }
        }
        Ok(closed)
    }

    /// Closes this node's leased sandboxes past their lifetime, and past their idle timeout
    /// unless they are paused instead (by this process, or left to the gateways).
    async fn close_overdue(&self, node: &str) -> Result<usize, LifecycleError> {
        let now = Utc::now();
        let mut conn = self.db.acquire().await?;
        let due = sandboxes::overdue(&mut conn, node, now).await?;
        drop(conn);
        let pauses = self.pauses_on_idle();
        let left = self
            .idle_left_to_gateways
            .map(|d| chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX));
        let due: Vec<SandboxRow> = due
            .into_iter()
            .filter(|r| {
                if r.expires_at.is_some_and(|e| e <= now) {
                    return true;
                }
                match (pauses, left) {
                    (true, _) => false,
                    (false, Some(left)) => r.idle_deadline().is_none_or(|d| d + left <= now),
                    (false, None) => true,
                }
            })
            .collect();
        let mut closed = 0;
        for row in self.unused(due).await? {
            let reason = if row.expires_at.is_some_and(|e| e <= now) {
                CloseReason::Lifetime
            } else {
                CloseReason::Idle
            };
            if left.is_some() && reason == CloseReason::Idle {
                tracing::warn!(sandbox_id = %row.id, "no gateway paused this idle sandbox (snapshots.paused_by_gateways); closing it");
            }
            if self.end(&row, reason.clone()).await?.is_some() {
                tracing::info!(sandbox_id = %row.id, tenant_id = ?row.tenant_id, reason = reason.as_str(), "closed an overdue sandbox");
                closed += 1;
            }
        }
        Ok(closed)
    }

    /// On a node whose gateways pause (`snapshots.paused_by_gateways`): idle sandboxes are left
    /// to them for `grace` past their idle deadline before this node closes them.
    pub fn with_idle_left_to_gateways(mut self, grace: Duration) -> Self {
        self.idle_left_to_gateways = Some(grace);
        self
    }

    /// At start-up: the pauses of this node's sandboxes that a crash of this process cut short
    /// are undone (their containers were left running; reconciliation then checks them).
    async fn undo_own_cut_pauses(&self) -> Result<(), LifecycleError> {
        let (Some(node), Some(pausing)) = (self.nodes.own_id(), self.pausing.as_ref()) else {
            return Ok(());
        };
        let deadline = i64::try_from(pausing.transition_deadline.as_secs()).unwrap_or(i64::MAX);
        let mut conn = self.db.acquire().await?;
        for row in
            sandgate_store::pauses::undo_cut_transitions(&mut conn, Some(node), deadline).await?
        {
            tracing::warn!(sandbox_id = %row.id, "a pause was cut short by a restart; the sandbox runs on");
        }
        Ok(())
    }

    /// One reconciliation pass of Docker against Postgres for this node; see the module docs.
    #[tracing::instrument(skip_all, fields(startup))]
    pub async fn reconcile(
        &self,
        orphan_grace: Duration,
        startup: bool,
    ) -> Result<Reconciled, LifecycleError> {
        let mut done = Reconciled::default();
        // Reconciliation is the work of the process that runs the node (it lists its engine).
        let (Some(node), Some(manager)) = (self.nodes.own_id(), self.nodes.local()) else {
            return Ok(done);
        };
        // Rows first, containers second: a row read before the listing whose container is not
        // listed really has no container (containers do not come back), while a container
        // without a row may just be newer than the read. A row the lost-node sweep ended is not
        // live: its container is removed below, never adopted.
        let mut conn = self.db.acquire().await?;
        let rows = sandboxes::live_on_node(&mut conn, node).await?;
        drop(conn);
        let containers = manager.list_containers().await?;
        let adopt = self
            .settle_rows(&rows, &containers, startup, &mut done)
            .await?;
        self.remove_unknown(&rows, &containers, orphan_grace, &mut done)
            .await?;
        if startup {
            self.retire_outdated_warm(&rows, &containers, &mut done)
                .await?;
        }
        self.adopt_leased(adopt, &mut done).await;
        self.sync_pool().await?;
        // Marks of calls whose replica died: expired, so ignored, but not worth keeping.
        let mut conn = self.db.acquire().await?;
        sandgate_store::call_marks::purge_expired(&mut conn, Utc::now()).await?;
        Ok(done)
    }

    /// Marks rows whose container is gone or stopped `lost`; returns the leased rows whose
    /// container runs, to re-attach at start-up.
    async fn settle_rows(
        &self,
        rows: &[SandboxRow],
        containers: &[ManagedContainer],
        startup: bool,
        done: &mut Reconciled,
    ) -> Result<Vec<SandboxRow>, LifecycleError> {
        let by_container: HashMap<&str, &ManagedContainer> = containers
            .iter()
            .map(|c| (c.container_id.as_str(), c))
            .collect();
        let mut adopt = Vec::new();
        for row in rows {
            let why = match by_container.get(row.container_id.as_str()) {
                None => Some(ContainerFate::Missing),
                Some(c) if c.fate != ContainerFate::Running => {
                    // The listing does not say how it ended; inspecting does.
                    Some(match self.own_node().adopt(&row.container_id).await {
                        Err(SandboxError::Died { fate, .. }) => fate,
                        _ => c.fate.clone(),
                    })
                }
                Some(_) => None,
            };
            match why {
                Some(fate) => {
                    let lost = CloseReason::Lost(describe_fate(&fate));
                    let ended = self.end(row, lost).await?;
                    if ended.is_some() {
                        tracing::warn!(sandbox_id = %row.id, fate = %fate, "a sandbox's container is gone; marked lost");
                        done.lost += 1;
                    }
                }
                None if startup && row.state == SandboxState::Leased => adopt.push(row.clone()),
                None => {}
            }
        }
        Ok(adopt)
    }

    /// Removes containers of this instance that Postgres knows as ended, or does not know and
    /// that are older than `orphan_grace` and not this process's own, or were left by a launch
    /// of this process that failed.
    async fn remove_unknown(
        &self,
        rows: &[SandboxRow],
        containers: &[ManagedContainer],
        orphan_grace: Duration,
        done: &mut Reconciled,
    ) -> Result<(), LifecycleError> {
        let known: HashSet<&str> = rows.iter().map(|r| r.container_id.as_str()).collect();
        let unknown: Vec<String> = containers
            .iter()
            .filter(|c| !known.contains(c.container_id.as_str()))
            .map(|c| c.container_id.clone())
            .collect();
        if !unknown.is_empty() {
            let mut conn = self.db.acquire().await?;
            let recorded: HashMap<String, SandboxState> =
                sandboxes::by_containers(&mut conn, &unknown)
                    .await?
                    .into_iter()
                    .map(|r| (r.container_id, r.state))
                    .collect();
            drop(conn);
            // This process's own: waiting in its pool, live here, or launched lately (maybe not
            // recorded yet: a start takes a while on a busy host).
            let manager = self.nodes.local();
            let local: HashSet<String> = manager
                .map(|m| m.ready_ids())
                .unwrap_or_default()
                .into_iter()
                .chain(self.live.lock().expect("live map").keys().cloned())
                .chain(
                    manager
                        .map(|m| m.launched_within(LAUNCH_GRACE))
                        .unwrap_or_default(),
                )
                .collect();
            // Launches of this process that failed or were given up: nobody records them.
            let abandoned = manager.map(|m| m.abandoned_launches()).unwrap_or_default();
            let now = Utc::now().timestamp();
            let grace = i64::try_from(orphan_grace.as_secs()).unwrap_or(i64::MAX);
            for c in containers
                .iter()
                .filter(|c| unknown.contains(&c.container_id))
            {
                let remove = match recorded.get(&c.container_id) {
                    // Recorded since the rows were read: live, leave it.
                    // Pausing: its checkpoint may be running now.
                    Some(SandboxState::Warm | SandboxState::Leased | SandboxState::Pausing) => {
                        false
                    }
                    // Paused or resuming under this container: the pause was recorded, the
                    // container's removal did not happen (a crash): it goes now.
                    Some(
                        SandboxState::Paused
                        | SandboxState::Resuming
                        | SandboxState::Closed
                        | SandboxState::Lost,
                    ) => true,
                    // Unknown: left by a launch of ours that failed (an orphan now); ours
                    // and about to be recorded, or another process's that is; or an orphan
                    // once it is old enough.
                    None => {
                        abandoned.contains(&c.sandbox_id)
                            || (!local.contains(&c.sandbox_id)
                                && c.created_unix.is_none_or(|t| now - t >= grace))
                    }
                };
                if remove {
                    tracing::info!(container_id = %c.container_id, sandbox_id = %c.sandbox_id, "removing a container Postgres does not know as live");
                    // One container the engine will not remove now must not keep the pass from
                    // the others (nor from adopting and syncing the pool): the next pass retries.
                    match self.own_node().remove_container(&c.container_id).await {
                        Ok(()) => done.removed += 1,
                        Err(err) => {
                            tracing::warn!(error = %err, container_id = %c.container_id, "removing a container Postgres does not know as live failed; the next pass tries again");
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// At start-up, retires the warm sandboxes (no tenant yet) whose containers were made from
    /// another image than their profile's now (a node restarted after a new `sandbox.image`),
    /// so that every lease after the roll gets the new image. Leased ones keep theirs until
    /// they end. A row leased meanwhile (by another process) is left alone.
    async fn retire_outdated_warm(
        &self,
        rows: &[SandboxRow],
        containers: &[ManagedContainer],
        done: &mut Reconciled,
    ) -> Result<(), LifecycleError> {
        let Some(manager) = self.nodes.local() else {
            return Ok(());
        };
        let images: HashMap<&str, &str> = containers
            .iter()
            .filter_map(|c| Some((c.container_id.as_str(), c.image_id.as_deref()?)))
            .collect();
        let mut current: HashMap<String, Option<String>> = HashMap::new();
        for row in rows.iter().filter(|r| r.state == SandboxState::Warm) {
            let Some(image) = images.get(row.container_id.as_str()) else {
                continue;
            };
            if !current.contains_key(&row.profile) {
                let id = manager.current_image_id(&row.profile).await;
                current.insert(row.profile.clone(), id);
            }
            // An engine that cannot say which image is current retires nothing.
            let Some(Some(now)) = current.get(&row.profile) else {
                continue;
            };
            if image == now {
                continue;
            }
            let mut conn = self.db.acquire().await?;
            let retired = sandboxes::retire_warm(&mut conn, &row.id).await?;
            drop(conn);
            if retired.is_none() {
                continue;
            }
            tracing::info!(
                sandbox_id = %row.id,
                container_image = %image,
                profile_image = %now,
                "retiring a warm sandbox of a replaced sandbox image"
            );
            if let Some(sandbox) = manager.take_ready_id(&row.id) {
                let _ = manager.close(sandbox).await;
            } else if let Err(err) = self.own_node().remove_container(&row.container_id).await {
                tracing::warn!(error = %err, container_id = %row.container_id, "removing a warm container of a replaced image failed; reconciliation removes it later");
            }
            done.outdated += 1;
        }
        Ok(())
    }

    /// Re-attaches leased sandboxes whose containers run (start-up), so their first call does
    /// not wait for it.
    async fn adopt_leased(&self, adopt: Vec<SandboxRow>, done: &mut Reconciled) {
        for row in adopt {
            if self.live.lock().expect("live map").contains_key(&row.id) {
                continue;
            }
            match self.own_node().adopt(&row.container_id).await {
                Ok(sandbox) => {
                    self.live
                        .lock()
                        .expect("live map")
                        .entry(row.id.clone())
                        .or_insert(sandbox);
                    done.adopted += 1;
                }
                Err(SandboxError::Died { fate, .. }) => {
                    let _ = self.lose(&row.id, describe_fate(&fate)).await;
                    done.lost += 1;
                }
                Err(err) => {
                    // E.g. the agent is slow to answer; the first call adopts it again.
                    tracing::warn!(error = %err, sandbox_id = %row.id, "re-attaching a leased sandbox failed");
                }
            }
        }
    }

    /// This process's own node (reconciliation runs only in a process that has one).
    fn own_node(&self) -> sandgate_node::NodeHandle {
        sandgate_node::NodeHandle::Local(
            self.nodes
                .local()
                .expect("reconciliation runs only with an own node")
                .clone(),
        )
    }

    /// The lost-node sweep (one statement, idempotent; any process runs it): the warm and
    /// leased sandboxes of every node silent past `node.lost_after_seconds` become `lost`,
    /// their reason naming the node. Their containers stay until the node comes back: its
    /// reconciliation removes the containers of rows that ended. Returns how many it marked.
    #[tracing::instrument(skip_all)]
    pub async fn sweep_lost_nodes(&self) -> Result<usize, LifecycleError> {
        let mut conn = self.db.acquire().await?;
        let lost =
            sandboxes::sweep_silent_nodes(&mut conn, self.nodes.lost_after_seconds()).await?;
        drop(conn);
        for row in &lost {
            // A handle this process still holds is of no use any more.
            self.live.lock().expect("live map").remove(&row.id);
            tracing::warn!(sandbox_id = %row.id, node = %row.node, "the sandbox's node stopped answering; marked lost");
        }
        Ok(lost.len())
    }

    /// Every `every`, runs [`Self::sweep_lost_nodes`] until `stop`.
    fn spawn_sweeper(&self, every: Duration, stop: CancellationToken, tasks: &TaskTracker) {
        let sweeper = self.clone();
        spawn_every(every, stop, tasks, move || {
            let sweeper = sweeper.clone();
            async move {
                if let Err(err) = sweeper.sweep_lost_nodes().await {
                    tracing::warn!(error = %err, "the lost-node sweep failed");
                }
            }
        });
    }

    /// Once a second, gives up the warm sandboxes the pool's target no longer covers (the manager
    /// leaves that to this service, which owns their rows), all of them while the node drains.
    fn spawn_trimmer(&self, stop: CancellationToken, tasks: &TaskTracker) {
        let trimmer = self.clone();
        spawn_every(TRIM_INTERVAL, stop, tasks, move || {
            let trimmer = trimmer.clone();
            async move {
                if let Err(err) = trimmer.trim_pool().await {
                    tracing::warn!(error = %err, "shrinking the warm pool failed");
                }
            }
        });
    }

    /// Starts the background work: recording warm sandboxes as they become ready, shrinking the
    /// pool when demand falls, the reaper and periodic reconciliation. Runs one reaper pass and one reconciliation first, so that what
    /// expired or vanished while the gateway was down is settled before it serves (a failure is
    /// logged, not fatal: the periodic passes retry).
    #[tracing::instrument(skip_all)]
    pub async fn start_lifecycle(
        &self,
        config: &LifecycleConfig,
        sweep_every: Duration,
        stop: CancellationToken,
        tasks: &TaskTracker,
    ) {
        let grace = Duration::from_secs(config.orphan_grace_seconds);
        let ready = self.nodes.local().map(|m| m.watch_ready());
        if let Err(err) = self.undo_own_cut_pauses().await {
            tracing::warn!(error = %err, "undoing pauses a crash cut short failed");
        }
        match self.reap().await {
            Ok(n) if n > 0 => tracing::info!(
                closed = n,
                "closed sandboxes that expired while the gateway was down"
            ),
            Ok(_) => {}
            Err(err) => tracing::warn!(error = %err, "the start-up reaper pass failed"),
        }
        match self.reconcile(grace, true).await {
            Ok(done) => tracing::info!(
                lost = done.lost,
                removed = done.removed,
                adopted = done.adopted,
                outdated = done.outdated,
                "start-up reconciliation done"
            ),
            Err(err) => tracing::warn!(error = %err, "start-up reconciliation failed"),
        }
        if let Some(ready) = ready {
            tasks.spawn(self.clone().record_ready(ready, stop.clone()));
        }
        self.spawn_trimmer(stop.clone(), tasks);
        self.spawn_sweeper(sweep_every, stop.clone(), tasks);
        let reaper = self.clone();
        let every = Duration::from_millis(config.reaper_interval_ms);
        let reaper_stop = stop.clone();
        tasks.spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    () = reaper_stop.cancelled() => return,
                }
                if let Err(err) = reaper.reap().await {
                    tracing::warn!(error = %err, "the reaper pass failed");
                }
            }
        });
        let reconciler = self.clone();
        let every = Duration::from_secs(config.reconcile_interval_seconds);
        tasks.spawn(async move {
            let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticker.tick() => {}
                    () = stop.cancelled() => return,
                }
                match reconciler.reconcile(grace, false).await {
                    Ok(done) if done != Reconciled::default() => {
                        tracing::info!(
                            lost = done.lost,
                            removed = done.removed,
                            "reconciliation done"
                        );
                    }
                    Ok(_) => {}
                    Err(err) => tracing::warn!(error = %err, "reconciliation failed"),
                }
            }
        });
    }
}

/// Runs `tick` every `every` (a missed tick waits for the next) until `stop`.
fn spawn_every<F, Fut>(every: Duration, stop: CancellationToken, tasks: &TaskTracker, mut tick: F)
where
    F: FnMut() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    tasks.spawn(async move {
        let mut ticker = tokio::time::interval(every);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                () = stop.cancelled() => return,
            }
            tick().await;
        }
    });
}
