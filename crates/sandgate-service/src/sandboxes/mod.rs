//! Tenant-scoped sandboxes: the glue between Postgres (who owns what, until when) and the
//! sandbox manager (the containers). Every lookup filters by the caller's tenant, so another
//! tenant's sandbox answers exactly like one that does not exist.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sandgate_node::SandboxHandle;
use sandgate_sandbox::{ChannelError, ContainerFate, SandboxError, SandboxProfile};
use sandgate_store::PgPool;
use sandgate_store::sandboxes::{self, CloseReason};
use uuid::Uuid;

use crate::config::LimitsConfig;

mod busy;
mod endings;
mod error;
mod files;
mod fork;
mod idle_clock;
mod kind;
mod lease;
pub mod lifecycle;
mod limits;
pub mod nodes;
mod ops;
mod partial;
mod pause;
mod pause_halts;
mod people;
mod quota;
mod run;
mod warm;

pub use busy::BusyGuard;
use busy::BusyMap;
pub use endings::Replaced;
pub(crate) use error::ended_error;
pub use error::{Quota, ServiceError, describe_fate};
pub use files::{FilesResume, RESUMED_FROM_FILES};
pub use fork::Forked;
pub use kind::ErrorKind;
pub use limits::{Caller, Limits};
pub use nodes::{NodeSet, OwnNode};
pub use ops::{BoundedRead, Target};
pub use pause::{HeldSandbox, Pausing, Resumed};
pub use pause_halts::{PauseHalts, PauseStep};
pub use people::{ConversationLine, MAX_CONVERSATIONS_LISTED, PeopleNote};
pub use quota::CallPermit;
pub use run::{CommandLine, OutputSink, RunLimits};
/// A sandbox's row, as the faces read it.
pub use sandgate_store::sandboxes::{SandboxRow, SandboxState};

/// A sandbox resolved for a call: the live handle and its row.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The live sandbox, on whichever node runs it.
    pub sandbox: SandboxHandle,
    /// Its row after this call's touch.
    pub row: SandboxRow,
    /// Whether this call created it.
    pub created: bool,
    /// Whether this call resumed it from a pause, and after how long.
    pub resumed: Option<Resumed>,
    /// When this call's sandbox is a new one for a conversation whose sandbox ended: which,
    /// when and why (its state is lost).
    pub replaced: Option<Replaced>,
    /// Marks the sandbox busy while the call runs: the reaper leaves it alone, and its idle
    /// clock restarts when the call ends.
    pub busy: Arc<BusyGuard>,
}

/// Tenant-scoped sandbox operations.
#[derive(Debug, Clone)]
pub struct SandboxService {
    pub(crate) db: PgPool,
    /// The nodes that run sandboxes: this process's own (if any) and the registered others.
    pub(crate) nodes: NodeSet,
    pub(crate) profile: SandboxProfile,
    pub(crate) limits: LimitsConfig,
    /// Live handles of this process, by sandbox id. A leased sandbox missing here (after a
    /// restart, or leased by another replica) is adopted on first use.
    pub(crate) live: Arc<Mutex<HashMap<String, SandboxHandle>>>,
    /// Sandboxes with calls in flight in this process.
    pub(crate) busy: BusyMap,
    /// Calls running in this process, which a person may interrupt.
    pub(crate) running: people::RunningCalls,
    /// Packages on demand, served to pip in cells and commands (none: installs are off).
    pub(crate) packages: Option<crate::packages::PackageIndex>,
    /// The egress component, deciding the CONNECTs of cells and commands (none: no egress).
    pub(crate) egress: Option<crate::egress::EgressService>,
    /// Container removals running behind closes that already answered; drained at shutdown.
    pub(crate) removals: tokio_util::task::TaskTracker,
    /// Other work running behind calls that already answered (freeing their quota slots);
    /// drained at shutdown.
    pub(crate) after_answer: tokio_util::task::TaskTracker,
    /// Live tokens and tenant limits, cached while its listener hears every change.
    pub(crate) cache: crate::cache::ChangeCache,
    /// When this process last wrote each sandbox's idle clock (writes are coalesced).
    pub(crate) idle_clock: idle_clock::IdleClock,
    /// Pause and resume (none: an idle sandbox is closed).
    pub(crate) pausing: Option<Pausing>,
    /// On a node whose deployment's gateways pause: how long past its idle deadline an idle
    /// sandbox is left to them before this node closes it (none: closed at its deadline).
    pub(crate) idle_left_to_gateways: Option<std::time::Duration>,
    /// A test's halt of pauses at a step (none outside tests: nothing configures it).
    pub(crate) pause_halts: Option<Arc<PauseHalts>>,
    /// When this process last swept the snapshot store ([`SandboxService::sweep_snapshots`]).
    pub(crate) snapshot_sweep: Arc<Mutex<Option<std::time::Instant>>>,
}

impl SandboxService {
    /// A service over `nodes`, leasing sandboxes of `profile`.
    pub fn new(db: PgPool, nodes: NodeSet, profile: SandboxProfile, limits: LimitsConfig) -> Self {
        Self {
            db,
            nodes,
            profile,
            limits,
            live: Arc::default(),
            busy: Arc::default(),
            running: people::RunningCalls::default(),
            packages: None,
            egress: None,
            removals: tokio_util::task::TaskTracker::new(),
            after_answer: tokio_util::task::TaskTracker::new(),
            cache: crate::cache::ChangeCache::default(),
            idle_clock: idle_clock::IdleClock::default(),
            pausing: None,
            idle_left_to_gateways: None,
            pause_halts: None,
            snapshot_sweep: Arc::default(),
        }
    }

    /// The nodes that run this service's sandboxes.
    pub fn nodes(&self) -> &NodeSet {
        &self.nodes
    }

    /// The limits in force for `tenant`: its own where set, else the configured defaults.
    #[tracing::instrument(skip_all, fields(tenant_id = %tenant))]
    pub async fn limits(&self, tenant: Uuid) -> Result<Limits, ServiceError> {
        let own = self
            .cache
            .tenant_limits(&self.db, tenant)
            .await?
            .unwrap_or_default();
        Ok(Limits::effective(&own, &self.limits, &self.profile))
    }

    /// Whether an access token may still be used: its grant (if any) live and its `jti` not
    /// revoked (cached; a revocation on any replica takes effect at once, see [`crate::cache`]).
    pub async fn token_is_active(
        &self,
        grant: Option<Uuid>,
        jti: &str,
    ) -> Result<bool, sandgate_store::StoreError> {
        self.cache.token_is_active(&self.db, grant, jti).await
    }

    /// The cache of live tokens and tenant limits (its listener is started with the service).
    pub fn cache(&self) -> &crate::cache::ChangeCache {
        &self.cache
    }

    /// Leased sandboxes recorded on this node and warm ones waiting in its pool (for the node's
    /// heartbeat; zeros when they cannot be counted).
    pub async fn node_counts(&self) -> (i32, i32) {
        let live = async {
            let own = self.nodes.own_id()?;
            let mut conn = self.db.acquire().await.ok()?;
            sandboxes::count_leased_on_node(&mut conn, own).await.ok()
        }
        .await
        .unwrap_or(0);
        let ready = self
            .nodes
            .local()
            .map_or(0, |m| m.ready_count(&self.profile.name));
        (
            i32::try_from(live).unwrap_or(i32::MAX),
            i32::try_from(ready).unwrap_or(i32::MAX),
        )
    }

    /// Whether a call on the sandbox is in flight in this process.
    pub(crate) fn is_busy(&self, id: &str) -> bool {
        self.busy.lock().expect("busy map").contains_key(id)
    }

    /// Which of `ids` have a call in flight on any replica: here, or marked in Postgres by a
    /// call elsewhere that outlived [`busy::MARK_AFTER`].
    pub(crate) async fn busy_anywhere(
        &self,
        ids: &[String],
    ) -> Result<std::collections::HashSet<String>, ServiceError> {
        let mut busy: std::collections::HashSet<String> =
            ids.iter().filter(|id| self.is_busy(id)).cloned().collect();
        let rest: Vec<String> = ids
            .iter()
            .filter(|id| !busy.contains(*id))
            .cloned()
            .collect();
        if !rest.is_empty() {
            let mut conn = self.db.acquire().await?;
            busy.extend(sandgate_store::call_marks::marked(&mut conn, &rest, Utc::now()).await?);
        }
        Ok(busy)
    }

    /// Whether the sandbox of `row` may be ended for its clock: overdue, and no call runs on it
    /// on any replica.
    pub(crate) async fn due_and_unused(&self, row: &SandboxRow) -> Result<bool, ServiceError> {
        if !overdue(row, Utc::now()) {
            return Ok(false);
        }
        let ids = [row.id.clone()];
        Ok(self.busy_anywhere(&ids).await?.is_empty())
    }

    /// The idle timeout for a call that asked for `keep_alive` seconds (bounded by the limits).
    fn idle_timeout(limits: &Limits, keep_alive: Option<u32>) -> Result<i32, ServiceError> {
        match keep_alive {
            None => Ok(limits.default_idle_seconds as i32),
            Some(0) => Err(ServiceError::Limit {
                limit: "keep_alive_seconds",
                value: "0".into(),
                hint: "give at least 1 second",
            }),
            Some(s) if s > limits.max_idle_seconds => Err(ServiceError::Limit {
                limit: "max idle timeout",
                value: format!("{} s", limits.max_idle_seconds),
                hint: "ask for a shorter keep_alive_seconds",
            }),
            Some(s) => Ok(s as i32),
        }
    }

    /// Returns the conversation's live sandbox, or leases a new one (bound to the conversation
    /// when one is named). `created` says which.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn create(
        &self,
        caller: &Caller,
        conversation: Option<&str>,
        keep_alive: Option<u32>,
    ) -> Result<Resolved, ServiceError> {
        let idle = Self::idle_timeout(&caller.limits, keep_alive)?;
        let mut previous = None;
        if let Some(conversation) = conversation {
            let mut conn = self.db.acquire().await?;
            if let Some(row) =
                sandboxes::by_conversation(&mut conn, caller.tenant, conversation).await?
            {
                drop(conn);
                return self
                    .resolve_row(caller, row, keep_alive.map(|_| idle))
                    .await;
            }
            previous =
                sandboxes::last_for_conversation(&mut conn, caller.tenant, conversation).await?;
        }
        let mut resolved = self.lease_new(caller, conversation, idle).await?;
        if resolved.created {
            resolved.replaced = previous
                .filter(|p| p.id != resolved.row.id && p.closed_at.is_some())
                .map(|p| Replaced::of(&p));
        }
        Ok(resolved)
    }

    /// Finds the sandbox a call should use: `sandbox_id` if given, else the conversation's (or a
    /// new one bound to it), else a new unbound one. Refreshes its idle timer.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub async fn resolve(
        &self,
        caller: &Caller,
        sandbox_id: Option<&str>,
        conversation: Option<&str>,
        keep_alive: Option<u32>,
    ) -> Result<Resolved, ServiceError> {
        match sandbox_id {
            Some(id) => {
                let idle = Self::idle_timeout(&caller.limits, keep_alive)?;
                let new_idle = keep_alive.map(|_| idle);
                // The common case in one statement: found, owned, live, clock refreshed.
                match self.touch_for_call(caller, id, new_idle).await? {
                    idle_clock::Touched::Live(row) => self.resolve_touched(row).await,
                    idle_clock::Touched::Untouched(row) => {
                        let row = row.ok_or_else(|| ServiceError::NotFound(id.to_owned()))?;
                        self.resolve_row(caller, row, new_idle).await
                    }
                }
            }
            None => self.create(caller, conversation, keep_alive).await,
        }
    }

    async fn resolve_row(
        &self,
        caller: &Caller,
        row: SandboxRow,
        new_idle: Option<i32>,
    ) -> Result<Resolved, ServiceError> {
        tracing::Span::current().record("sandbox_id", &row.id);
        match row.state {
            SandboxState::Leased => {}
            SandboxState::Pausing | SandboxState::Paused | SandboxState::Resuming => {
                return self.resume_for_call(caller, row, new_idle).await;
            }
            _ => return Err(ended_error(&row)),
        }
        let now = Utc::now();
        // A sandbox with a call in flight (here or on another replica) is in use, whatever its
        // clock says.
        if self.due_and_unused(&row).await? {
            // The reaper has not got to it yet: end it now rather than serve past its time.
            let reason = if row.expires_at.is_some_and(|e| e <= now) {
                CloseReason::Lifetime
            } else {
                CloseReason::Idle
            };
            let ended = self.end(&row, reason).await?.unwrap_or(row);
            return Err(ended_error(&ended));
        }
        let busy = self.mark_busy(&row.id)?;
        let mut conn = self.db.acquire().await?;
        let touched = sandboxes::touch(&mut conn, caller.tenant, &row.id, new_idle).await?;
        let row = match touched {
            Some(row) => row,
            // It ended between the read and the touch (the reaper, a close): say how.
            None => {
                let now = sandboxes::get(&mut conn, caller.tenant, &row.id)
                    .await?
                    .ok_or_else(|| ServiceError::NotFound(row.id.clone()))?;
                return Err(ended_error(&now));
            }
        };
        drop(conn);
        self.resolved(row, busy).await
    }

    /// A live row whose clock [`Self::touch_for_call`] refreshed: the call's busy mark and
    /// handle.
    async fn resolve_touched(&self, row: SandboxRow) -> Result<Resolved, ServiceError> {
        tracing::Span::current().record("sandbox_id", &row.id);
        let busy = self.mark_busy(&row.id)?;
        self.resolved(row, busy).await
    }

    /// The end of resolving an existing sandbox for a call: its live, touched `row`, the call's
    /// `busy` mark, and the handle (from this process, else adopted).
    async fn resolved(
        &self,
        row: SandboxRow,
        busy: Arc<BusyGuard>,
    ) -> Result<Resolved, ServiceError> {
        let sandbox = self.handle(&row).await?;
        Ok(Resolved {
            sandbox,
            row,
            created: false,
            resumed: None,
            replaced: None,
            busy,
        })
    }

    /// Marks a call on the sandbox (see [`Resolved::busy`]), unless it runs its most already.
    fn mark_busy(&self, id: &str) -> Result<Arc<BusyGuard>, ServiceError> {
        BusyGuard::try_new(self, id)
    }

    /// The live handle for a leased row: from this process, else adopted from the engine.
    async fn handle(&self, row: &SandboxRow) -> Result<SandboxHandle, ServiceError> {
        let cached = self.live.lock().expect("live map").get(&row.id).cloned();
        if let Some(sandbox) = cached {
            if !sandbox.is_lost() {
                return Ok(sandbox);
            }
            self.live.lock().expect("live map").remove(&row.id);
            // The attach stream ended. A container that still runs (the engine restarted with
            // live-restore, the connection dropped) keeps its kernel: re-attach below. Only one
            // that stopped or vanished is lost; an engine that cannot say is retried later.
            match sandbox.fate().await? {
                ContainerFate::Running => {
                    tracing::info!(sandbox_id = %row.id, "the attach stream of a running sandbox ended; re-attaching");
                }
                fate => return Err(self.lose(&row.id, describe_fate(&fate)).await),
            }
        }
        let node = self.nodes.get(&self.db, &row.node).await?;
        match node.adopt(&row.container_id).await {
            Ok(sandbox) => {
                self.live
                    .lock()
                    .expect("live map")
                    .insert(row.id.clone(), sandbox.clone());
                Ok(sandbox)
            }
            Err(SandboxError::Died { fate, .. }) => {
                Err(self.lose(&row.id, describe_fate(&fate)).await)
            }
            Err(err) => Err(self.node_error(&row.node, node.local().is_none(), err)),
        }
    }

    /// A failure of a call to node `node`: when a remote node did not answer (it may come back
    /// at another address, or be swept as lost), a retryable [`ServiceError::NodeAway`].
    pub(super) fn node_error(&self, node: &str, remote: bool, err: SandboxError) -> ServiceError {
        match err {
            SandboxError::Channel(ChannelError::AttachLost { reason }) if remote => {
                self.nodes.forget(node);
                ServiceError::NodeAway {
                    node: node.to_owned(),
                    why: reason,
                }
            }
            other => other.into(),
        }
    }

    /// Marks a sandbox lost and builds the error that says so.
    #[tracing::instrument(skip_all, fields(sandbox_id = %sandbox_id))]
    pub async fn lose(&self, sandbox_id: &str, why: String) -> ServiceError {
        let result = async {
            let mut conn = self.db.acquire().await?;
            let row =
                sandboxes::end(&mut conn, sandbox_id, &CloseReason::Lost(why.clone())).await?;
            drop(conn);
            self.remove_container(sandbox_id, row.as_ref()).await;
            Ok::<_, ServiceError>(())
        }
        .await;
        if let Err(err) = result {
            tracing::warn!(error = %err, sandbox_id, "recording a lost sandbox failed");
        }
        ServiceError::Lost {
            sandbox_id: sandbox_id.to_owned(),
            why,
        }
    }

    /// Ends a live row (`closed` or `lost`) and removes its container. `None` when the row was
    /// not live any more (someone else ended it, and removes the container).
    #[tracing::instrument(skip_all, fields(sandbox_id = %row.id))]
    pub(crate) async fn end(
        &self,
        row: &SandboxRow,
        reason: CloseReason,
    ) -> Result<Option<SandboxRow>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        let ended = sandboxes::end(&mut conn, &row.id, &reason).await?;
        drop(conn);
        if ended.is_some() {
            self.remove_container(&row.id, Some(row)).await;
        }
        Ok(ended)
    }

    /// Removes a sandbox's container: through this process's handle when it has one, else by
    /// container id on the node of its `row` (another process's, or one from before a
    /// restart). A node that cannot be reached removes it itself when its reconciliation finds
    /// the row ended.
    #[tracing::instrument(skip_all, fields(sandbox_id = %sandbox_id))]
    pub(crate) async fn remove_container(&self, sandbox_id: &str, row: Option<&SandboxRow>) {
        let handle = self.live.lock().expect("live map").remove(sandbox_id);
        let result = match (handle, row) {
            (Some(sandbox), _) => self.nodes.close(sandbox).await.map_err(ServiceError::from),
            (None, Some(row)) => match self.nodes.get(&self.db, &row.node).await {
                Ok(node) => node
                    .remove_container(&row.container_id)
                    .await
                    .map_err(ServiceError::from),
                Err(err) => Err(err),
            },
            (None, None) => Ok(()),
        };
        if let Err(err) = result {
            tracing::warn!(error = %err, sandbox_id, "removing the container failed");
        }
    }

    /// Closes a tenant's sandbox. A sandbox that already ended answers like a missing one would
    /// not: it says when and why it ended.
    ///
    /// Answers once the row is marked closed: from then on no call can use the sandbox. Its
    /// container is removed behind the answer (a tracked task, drained at graceful shutdown);
    /// should the process die first, reconciliation removes the container of a closed row.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id = %sandbox_id))]
    pub async fn close(
        &self,
        caller: &Caller,
        sandbox_id: &str,
    ) -> Result<SandboxRow, ServiceError> {
        // A pause or resume under way ends first; a paused sandbox is closed with its snapshot.
        let row = self.settled(caller, sandbox_id).await?;
        if row.state == SandboxState::Paused {
            return self
                .end_paused(&row, CloseReason::Closed.as_str())
                .await?
                .ok_or_else(|| ServiceError::NotFound(sandbox_id.to_owned()));
        }
        if row.state != SandboxState::Leased {
            return Err(ended_error(&row));
        }
        let mut conn = self.db.acquire().await?;
        let ended = sandboxes::end(&mut conn, &row.id, &CloseReason::Closed).await?;
        drop(conn);
        match ended {
            Some(ended) => {
                self.remove_in_background(&row);
                Ok(ended)
            }
            // Ended concurrently; whatever ended it, it is gone (and removes the container).
            None => Err(ServiceError::NotFound(sandbox_id.to_owned())),
        }
    }

    /// Removes an ended row's container on a tracked task (see [`Self::close`]).
    fn remove_in_background(&self, row: &SandboxRow) {
        let this = self.clone();
        let row = row.clone();
        self.removals.spawn(async move {
            this.remove_container(&row.id, Some(&row)).await;
        });
    }

    /// Waits for the container removals still running behind answered closes, and for the
    /// other work behind answered calls (quota slot releases).
    pub async fn drain_removals(&self) {
        self.removals.close();
        self.removals.wait().await;
        self.after_answer.close();
        self.after_answer.wait().await;
        self.removals.reopen();
        self.after_answer.reopen();
    }

    /// Closes every live sandbox leased under `grant_id` (its app was disconnected). Returns
    /// how many were closed.
    #[tracing::instrument(skip_all, fields(grant_id = %grant_id))]
    pub async fn close_grant(&self, grant_id: Uuid) -> Result<usize, ServiceError> {
        let mut conn = self.db.acquire().await?;
        let rows = sandboxes::live_of_grant(&mut conn, grant_id).await?;
        drop(conn);
        let mut closed = 0;
        for row in rows {
            // `end` removes the container too, by handle or by id.
            if self.end(&row, CloseReason::Disconnected).await?.is_some() {
                closed += 1;
            }
        }
        Ok(closed)
    }

    /// The live sandbox bound to a tenant's conversation, if any.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant))]
    pub async fn find_conversation(
        &self,
        caller: &Caller,
        conversation: &str,
    ) -> Result<Option<String>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        Ok(
            sandboxes::by_conversation(&mut conn, caller.tenant, conversation)
                .await?
                .map(|row| row.id),
        )
    }

    /// The live sandbox of a tenant's conversation, by id; `NotFound` when it has none.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant))]
    pub async fn conversation_sandbox(
        &self,
        caller: &Caller,
        conversation: &str,
    ) -> Result<String, ServiceError> {
        self.find_conversation(caller, conversation)
            .await?
            .ok_or_else(|| ServiceError::NotFound(format!("for conversation {conversation:?}")))
    }

    /// Passes a sandbox operation's result through, recording and explaining a sandbox that
    /// died underneath it (see [`Self::check_death`]).
    #[tracing::instrument(skip_all)]
    pub async fn checked<T>(
        &self,
        resolved: &Resolved,
        result: Result<T, SandboxError>,
    ) -> Result<T, ServiceError> {
        match result {
            Ok(value) => Ok(value),
            Err(err) => Err(self.check_death(resolved, err).await),
        }
    }

    /// The sandbox's handle is dead: record why and say so.
    #[tracing::instrument(skip_all)]
    pub async fn check_death(&self, resolved: &Resolved, err: SandboxError) -> ServiceError {
        match err {
            SandboxError::Died { fate, .. } => {
                self.lose(&resolved.row.id, describe_fate(&fate)).await
            }
            other => {
                let remote = matches!(resolved.sandbox, SandboxHandle::Remote(_));
                if remote {
                    // The next call adopts the sandbox again (the node may have restarted).
                    self.live.lock().expect("live map").remove(&resolved.row.id);
                }
                self.node_error(&resolved.row.node, remote, other)
            }
        }
    }
}

fn overdue(row: &SandboxRow, now: DateTime<Utc>) -> bool {
    row.expires_at.is_some_and(|e| e <= now) || row.idle_deadline().is_some_and(|d| d <= now)
}
