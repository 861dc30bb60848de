//! Tenant-scoped sandboxes: the glue between Postgres (who owns what, until when) and the
//! sandbox manager (the containers). Every lookup filters by the caller's tenant, so another
//! tenant's sandbox answers exactly like one that does not exist.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sandgate_sandbox::{ContainerFate, Sandbox, SandboxError, SandboxManager, SandboxProfile};
use sandgate_store::sandboxes::{self, NewLease, SandboxRow, SandboxState};
use sandgate_store::tenants::TenantLimits;
use sandgate_store::{PgPool, StoreError};
use uuid::Uuid;

use crate::config::LimitsConfig;

/// How many warm rows one lease tries before falling back to a cold start, when the containers
/// behind them turn out to be gone.
const WARM_ATTEMPTS: usize = 3;

/// Who is calling: the verified token's tenant and ids, and the limits in force for it.
#[derive(Debug, Clone)]
pub struct Caller {
    /// The tenant whose sandboxes the call may reach.
    pub tenant: Uuid,
    /// The token's subject.
    pub subject: String,
    /// The token's id (audit).
    pub token_id: String,
    /// The OAuth grant the token was issued under, recorded on sandboxes it leases.
    pub grant: Option<Uuid>,
    /// The tenant's limits (its own where set, else the configured defaults).
    pub limits: Limits,
}

/// A tenant's limits in force: its own (Postgres) where set, else the gateway's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Most live sandboxes at once.
    pub max_sandboxes: u32,
    /// Idle timeout of a sandbox when the caller names none, seconds.
    pub default_idle_seconds: u32,
    /// Longest idle timeout a caller may ask for, seconds.
    pub max_idle_seconds: u32,
    /// Hard lifetime of a sandbox, seconds.
    pub max_lifetime_seconds: u32,
    /// Memory per sandbox, MiB.
    pub memory_mb: u64,
    /// CPU quota per sandbox, cores.
    pub cpus: f64,
    /// Most tool calls per minute.
    pub max_calls_per_minute: u32,
}

impl Limits {
    /// Combines a tenant's own limits with the configured defaults and the profile's resources.
    pub fn effective(
        own: &TenantLimits,
        defaults: &LimitsConfig,
        profile: &SandboxProfile,
    ) -> Self {
        let pick = |own: Option<i32>, default: u32| {
            own.and_then(|v| u32::try_from(v).ok()).unwrap_or(default)
        };
        let max_idle_seconds = pick(own.max_idle_seconds, defaults.max_idle_timeout_seconds);
        Self {
            max_sandboxes: pick(own.max_sandboxes, defaults.max_sandboxes),
            default_idle_seconds: defaults.idle_timeout_seconds.min(max_idle_seconds),
            max_idle_seconds,
            max_lifetime_seconds: pick(own.max_lifetime_seconds, defaults.max_lifetime_seconds),
            memory_mb: own
                .memory_mb
                .and_then(|v| u64::try_from(v).ok())
                .unwrap_or(profile.memory_mb),
            cpus: own.cpus.map_or(profile.cpus, f64::from),
            max_calls_per_minute: pick(own.max_calls_per_minute, defaults.max_calls_per_minute),
        }
    }

    /// The profile a sandbox of this tenant is made from: `base` with the tenant's memory and
    /// CPU.
    pub fn profile(&self, base: &SandboxProfile) -> SandboxProfile {
        SandboxProfile {
            memory_mb: self.memory_mb,
            cpus: self.cpus,
            ..base.clone()
        }
    }
}

/// Why a sandbox operation could not be done. The gateway turns each into a tool error whose
/// text tells the model what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// No such sandbox for this tenant (or it belongs to another tenant: the same answer).
    #[error("no sandbox {0} exists; call create_sandbox to get one")]
    NotFound(String),
    /// The sandbox ended (closed, expired, disconnected).
    #[error("{0}")]
    Ended(String),
    /// Its container vanished or died.
    #[error(
        "sandbox {sandbox_id} was lost ({why}); its files and variables are gone; call create_sandbox for a new one"
    )]
    Lost {
        /// The sandbox.
        sandbox_id: String,
        /// What happened.
        why: String,
    },
    /// A tenant limit refused the call.
    #[error("limit reached: {limit} ({value}); {hint}")]
    Limit {
        /// The limit's name.
        limit: &'static str,
        /// Its value.
        value: String,
        /// What to do.
        hint: &'static str,
    },
    /// The tenant made too many calls in the last minute.
    #[error(
        "limit reached: max calls per minute ({per_minute}); wait a little and retry (the limit counts the last 60 s)"
    )]
    RateLimited {
        /// The limit.
        per_minute: u32,
    },
    /// Postgres is unavailable: retrying shortly may work.
    #[error("sandgate's database is temporarily unavailable; retry in a few seconds")]
    Unavailable(#[source] StoreError),
    /// Postgres was away before the call could even be checked (the token's grant).
    #[error("sandgate's database is temporarily unavailable; retry in a few seconds")]
    DatabaseAway,
    /// Another database failure.
    #[error("internal error (database)")]
    Store(#[source] StoreError),
    /// The sandbox manager failed (launching, talking to the agent).
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
}

impl From<StoreError> for ServiceError {
    fn from(err: StoreError) -> Self {
        if err.is_unavailable() {
            ServiceError::Unavailable(err)
        } else {
            ServiceError::Store(err)
        }
    }
}

/// A sandbox resolved for a call: the live handle and its row.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// The live sandbox.
    pub sandbox: Sandbox,
    /// Its row after this call's touch.
    pub row: SandboxRow,
    /// Whether this call created it.
    pub created: bool,
    /// Marks the sandbox busy while the call runs: the reaper leaves it alone, and its idle
    /// clock restarts when the call ends.
    pub busy: Arc<BusyGuard>,
}

/// Sandboxes with calls in flight in this process, by id, with how many.
pub(crate) type BusyMap = Arc<Mutex<HashMap<String, usize>>>;

/// Held while a call uses a sandbox; see [`Resolved::busy`].
#[derive(Debug)]
pub struct BusyGuard {
    id: String,
    busy: BusyMap,
    db: PgPool,
}

impl BusyGuard {
    fn new(id: &str, busy: &BusyMap, db: &PgPool) -> Arc<Self> {
        *busy
            .lock()
            .expect("busy map")
            .entry(id.to_owned())
            .or_default() += 1;
        Arc::new(Self {
            id: id.to_owned(),
            busy: busy.clone(),
            db: db.clone(),
        })
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        {
            let mut busy = self.busy.lock().expect("busy map");
            if let Some(n) = busy.get_mut(&self.id) {
                *n -= 1;
                if *n == 0 {
                    busy.remove(&self.id);
                }
            }
        }
        // The end of a call is use too: a long cell must not leave its sandbox already idle.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let db = self.db.clone();
            let ids = vec![self.id.clone()];
            runtime.spawn(async move {
                let result = async {
                    let mut conn = db.acquire().await?;
                    sandboxes::touch_live(&mut conn, &ids).await
                }
                .await;
                if let Err(err) = result {
                    tracing::warn!(error = %err, sandbox_id = %ids[0], "refreshing the idle clock after a call failed");
                }
            });
        }
    }
}

/// Tenant-scoped sandbox operations.
#[derive(Debug, Clone)]
pub struct SandboxService {
    pub(crate) db: PgPool,
    pub(crate) manager: SandboxManager,
    pub(crate) profile: SandboxProfile,
    pub(crate) node: String,
    limits: LimitsConfig,
    /// Live handles of this process, by sandbox id. A leased sandbox missing here (after a
    /// restart, or leased by another replica) is adopted on first use.
    pub(crate) live: Arc<Mutex<HashMap<String, Sandbox>>>,
    /// Sandboxes with calls in flight in this process.
    pub(crate) busy: BusyMap,
    /// Cold starts running at once in this process (`pool.max_concurrent_starts`).
    cold_starts: Arc<tokio::sync::Semaphore>,
}

impl SandboxService {
    /// A service over `manager`, leasing from `profile`'s pool, recording rows for `node`.
    pub fn new(
        db: PgPool,
        manager: SandboxManager,
        profile: SandboxProfile,
        node: String,
        limits: LimitsConfig,
        max_cold_starts: usize,
    ) -> Self {
        Self {
            db,
            manager,
            profile,
            node,
            limits,
            live: Arc::default(),
            busy: Arc::default(),
            cold_starts: Arc::new(tokio::sync::Semaphore::new(max_cold_starts.max(1))),
        }
    }

    /// The manager underneath.
    pub fn manager(&self) -> &SandboxManager {
        &self.manager
    }

    /// The limits in force for `tenant`: its own where set, else the configured defaults.
    pub async fn limits(&self, tenant: Uuid) -> Result<Limits, ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let own = sandgate_store::tenants::limits(&mut conn, tenant)
            .await?
            .unwrap_or_default();
        Ok(Limits::effective(&own, &self.limits, &self.profile))
    }

    /// Refuses the call when the tenant made `max_calls_per_minute` calls in the last minute.
    pub async fn check_rate(&self, caller: &Caller) -> Result<(), ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let calls = sandgate_store::audit::calls_last_minute(&mut conn, caller.tenant).await?;
        if calls >= i64::from(caller.limits.max_calls_per_minute) {
            return Err(ServiceError::RateLimited {
                per_minute: caller.limits.max_calls_per_minute,
            });
        }
        Ok(())
    }

    /// Whether a call on the sandbox is in flight in this process.
    pub(crate) fn is_busy(&self, id: &str) -> bool {
        self.busy.lock().expect("busy map").contains_key(id)
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
        if let Some(conversation) = conversation {
            let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
            if let Some(row) =
                sandboxes::by_conversation(&mut conn, caller.tenant, conversation).await?
            {
                drop(conn);
                return self
                    .resolve_row(caller, row, keep_alive.map(|_| idle))
                    .await;
            }
        }
        self.lease_new(caller, conversation, idle).await
    }

    async fn lease_new(
        &self,
        caller: &Caller,
        conversation: Option<&str>,
        idle: i32,
    ) -> Result<Resolved, ServiceError> {
        // Cheap early refusal before a container is taken.
        {
            let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
            let live = sandboxes::count_live(&mut conn, caller.tenant).await?;
            if live >= i64::from(caller.limits.max_sandboxes) {
                return Err(over_limit(&caller.limits));
            }
        }
        let expires_at =
            Utc::now() + chrono::Duration::seconds(i64::from(caller.limits.max_lifetime_seconds));
        let lease = NewLease {
            tenant_id: caller.tenant,
            conversation_id: conversation,
            idle_timeout_seconds: idle,
            expires_at,
            grant_id: caller.grant,
        };
        let profile = caller.limits.profile(&self.profile);
        // Only a tenant whose limits match the pool's profile can take a warm container; others
        // get a cold start with their own memory and CPU.
        let leased = if profile == self.profile {
            self.lease_warm(caller, &lease).await
        } else {
            Ok(None)
        };
        let leased = match leased {
            Ok(Some(resolved)) => Ok(resolved),
            Ok(None) => {
                // Cold starts are bounded: a burst of conversations on an empty pool would
                // otherwise start every container at once, each loading the data stack on the
                // same few cores, until all of them miss their ready timeout. Queued leases
                // start one by one, and take a warm container if the refill made one meanwhile.
                let _permit = self
                    .cold_starts
                    .acquire()
                    .await
                    .expect("the cold-start semaphore is never closed");
                let rewarmed = if profile == self.profile {
                    self.lease_warm(caller, &lease).await
                } else {
                    Ok(None)
                };
                match rewarmed {
                    Ok(Some(resolved)) => Ok(resolved),
                    Ok(None) => self.lease_cold(caller, &profile, &lease).await,
                    Err(err) => Err(err),
                }
            }
            Err(err) => Err(err),
        };
        match leased {
            // Another call bound the conversation first: answer with that sandbox.
            Err(ServiceError::Store(StoreError::Conflict(_))) if conversation.is_some() => {
                let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
                let row = sandboxes::by_conversation(
                    &mut conn,
                    caller.tenant,
                    conversation.unwrap_or_default(),
                )
                .await?
                .ok_or_else(|| ServiceError::NotFound(String::from("(conversation)")))?;
                drop(conn);
                self.resolve_row(caller, row, None).await
            }
            other => other,
        }
    }

    /// Leases a warm row: one transaction checks the tenant's limit and flips the row (`FOR
    /// UPDATE SKIP LOCKED`, so no two leases anywhere get the same row); then the container's
    /// handle comes from this process's pool, or is adopted when another process started it.
    /// `None` when there is no warm row.
    async fn lease_warm(
        &self,
        caller: &Caller,
        lease: &NewLease<'_>,
    ) -> Result<Option<Resolved>, ServiceError> {
        for _ in 0..WARM_ATTEMPTS {
            let mut tx = self.db.begin().await.map_err(StoreError::from)?;
            sandgate_store::tenants::lock(&mut tx, lease.tenant_id).await?;
            let live = sandboxes::count_live(&mut tx, lease.tenant_id).await?;
            if live >= i64::from(caller.limits.max_sandboxes) {
                return Err(over_limit(&caller.limits));
            }
            let Some(row) =
                sandboxes::lease_warm(&mut tx, &self.profile.name, &self.node, lease).await?
            else {
                return Ok(None);
            };
            tx.commit().await.map_err(StoreError::from)?;
            tracing::Span::current().record("sandbox_id", &row.id);
            let _ = self.manager.refill(&self.profile.name);
            match self.warm_handle(&row).await {
                Ok(sandbox) => {
                    self.live
                        .lock()
                        .expect("live map")
                        .insert(row.id.clone(), sandbox.clone());
                    let busy = BusyGuard::new(&row.id, &self.busy, &self.db);
                    return Ok(Some(Resolved {
                        sandbox,
                        row,
                        created: true,
                        busy,
                    }));
                }
                Err(why) => {
                    // The warm container is gone: the row is, too; try the next one.
                    tracing::warn!(sandbox_id = %row.id, why = %why, "a warm sandbox was unusable");
                    let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
                    sandboxes::end(&mut conn, &row.id, SandboxState::Lost, &why).await?;
                    drop(conn);
                    if let Err(err) = self.manager.remove_container(&row.container_id).await {
                        tracing::warn!(error = %err, "removing an unusable warm container failed");
                    }
                }
            }
        }
        Ok(None)
    }

    /// The handle of a just-leased warm row's container: from this process's pool, else adopted.
    /// The error says why the container cannot serve.
    async fn warm_handle(&self, row: &SandboxRow) -> Result<Sandbox, String> {
        if let Some(sandbox) = self.manager.take_ready_id(&row.id) {
            if !sandbox.is_lost() {
                return Ok(sandbox);
            }
            return Err(match sandbox.fate().await {
                Ok(fate) => format!("warm container died: {fate}"),
                Err(err) => format!("warm container unreachable: {err}"),
            });
        }
        self.manager
            .adopt(&row.container_id)
            .await
            .map_err(|err| format!("warm container could not be adopted: {err}"))
    }

    /// Starts a container now and records it as leased.
    async fn lease_cold(
        &self,
        caller: &Caller,
        profile: &SandboxProfile,
        lease: &NewLease<'_>,
    ) -> Result<Resolved, ServiceError> {
        let sandbox = self.manager.launch_with(profile).await?;
        tracing::Span::current().record("sandbox_id", sandbox.id());
        match self.record_lease(caller, &sandbox, lease).await {
            Ok(row) => {
                self.live
                    .lock()
                    .expect("live map")
                    .insert(row.id.clone(), sandbox.clone());
                let busy = BusyGuard::new(&row.id, &self.busy, &self.db);
                Ok(Resolved {
                    sandbox,
                    row,
                    created: true,
                    busy,
                })
            }
            Err(err) => {
                // Nothing half-created is left behind: the container goes.
                let manager = self.manager.clone();
                tokio::spawn(async move {
                    if let Err(e) = manager.close(sandbox).await {
                        tracing::warn!(error = %e, "removing an unrecorded sandbox failed");
                    }
                });
                Err(err)
            }
        }
    }

    /// Records the lease in one transaction that also enforces the tenant's sandbox limit: the
    /// tenant row is locked so concurrent creates cannot both slip under the limit.
    async fn record_lease(
        &self,
        caller: &Caller,
        sandbox: &Sandbox,
        lease: &NewLease<'_>,
    ) -> Result<SandboxRow, ServiceError> {
        let mut tx = self.db.begin().await.map_err(StoreError::from)?;
        sandgate_store::tenants::lock(&mut tx, lease.tenant_id).await?;
        let live = sandboxes::count_live(&mut tx, lease.tenant_id).await?;
        if live >= i64::from(caller.limits.max_sandboxes) {
            return Err(over_limit(&caller.limits));
        }
        let row = sandboxes::insert_leased(
            &mut tx,
            sandbox.id(),
            sandbox.profile(),
            sandbox.container_id(),
            &self.node,
            lease,
        )
        .await?;
        tx.commit().await.map_err(StoreError::from)?;
        Ok(row)
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
                let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
                let row = sandboxes::get(&mut conn, caller.tenant, id)
                    .await?
                    .ok_or_else(|| ServiceError::NotFound(id.to_owned()))?;
                drop(conn);
                self.resolve_row(caller, row, keep_alive.map(|_| idle))
                    .await
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
        if row.state != SandboxState::Leased {
            return Err(ended_error(&row));
        }
        let now = Utc::now();
        // A sandbox with a call in flight here is in use, whatever its clock says.
        if overdue(&row, now) && !self.is_busy(&row.id) {
            // The reaper has not got to it yet: end it now rather than serve past its time.
            let reason = if row.expires_at.is_some_and(|e| e <= now) {
                "lifetime"
            } else {
                "idle"
            };
            let ended = self
                .end(&row, SandboxState::Closed, reason)
                .await?
                .unwrap_or(row);
            return Err(ended_error(&ended));
        }
        let busy = BusyGuard::new(&row.id, &self.busy, &self.db);
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
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
        let sandbox = self.handle(&row).await?;
        Ok(Resolved {
            sandbox,
            row,
            created: false,
            busy,
        })
    }

    /// The live handle for a leased row: from this process, else adopted from the engine.
    async fn handle(&self, row: &SandboxRow) -> Result<Sandbox, ServiceError> {
        let cached = self.live.lock().expect("live map").get(&row.id).cloned();
        if let Some(sandbox) = cached {
            if !sandbox.is_lost() {
                return Ok(sandbox);
            }
            self.live.lock().expect("live map").remove(&row.id);
            let why = match sandbox.fate().await {
                Ok(fate) => describe_fate(&fate),
                Err(err) => format!("its connection broke: {err}"),
            };
            return Err(self.lose(&row.id, why).await);
        }
        match self.manager.adopt(&row.container_id).await {
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
            Err(err) => Err(err.into()),
        }
    }

    /// Marks a sandbox lost and builds the error that says so.
    pub async fn lose(&self, sandbox_id: &str, why: String) -> ServiceError {
        let result = async {
            let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
            let row = sandboxes::end(&mut conn, sandbox_id, SandboxState::Lost, &why).await?;
            drop(conn);
            self.remove_container(sandbox_id, row.as_ref().map(|r| r.container_id.as_str()))
                .await;
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
    pub(crate) async fn end(
        &self,
        row: &SandboxRow,
        state: SandboxState,
        reason: &str,
    ) -> Result<Option<SandboxRow>, ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let ended = sandboxes::end(&mut conn, &row.id, state, reason).await?;
        drop(conn);
        if ended.is_some() {
            self.remove_container(&row.id, Some(&row.container_id))
                .await;
        }
        Ok(ended)
    }

    /// Removes a sandbox's container: through this process's handle when it has one, else by
    /// container id (another process's, or one from before a restart).
    pub(crate) async fn remove_container(&self, sandbox_id: &str, container_id: Option<&str>) {
        let handle = self.live.lock().expect("live map").remove(sandbox_id);
        let result = match (handle, container_id) {
            (Some(sandbox), _) => self.manager.close(sandbox).await,
            (None, Some(container_id)) => self.manager.remove_container(container_id).await,
            (None, None) => Ok(()),
        };
        if let Err(err) = result {
            tracing::warn!(error = %err, sandbox_id, "removing the container failed");
        }
    }

    /// Closes a tenant's sandbox. A sandbox that already ended answers like a missing one would
    /// not: it says when and why it ended.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id = %sandbox_id))]
    pub async fn close(
        &self,
        caller: &Caller,
        sandbox_id: &str,
    ) -> Result<SandboxRow, ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let row = sandboxes::get(&mut conn, caller.tenant, sandbox_id)
            .await?
            .ok_or_else(|| ServiceError::NotFound(sandbox_id.to_owned()))?;
        drop(conn);
        if row.state != SandboxState::Leased {
            return Err(ended_error(&row));
        }
        let ended = self.end(&row, SandboxState::Closed, "closed").await?;
        match ended {
            Some(ended) => Ok(ended),
            // Ended concurrently; whatever ended it, it is gone.
            None => Err(ServiceError::NotFound(sandbox_id.to_owned())),
        }
    }

    /// Closes every live sandbox leased under `grant_id` (its app was disconnected). Returns
    /// how many were closed.
    #[tracing::instrument(skip_all, fields(grant_id = %grant_id))]
    pub async fn close_grant(&self, grant_id: Uuid) -> Result<usize, ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let rows = sandboxes::live_of_grant(&mut conn, grant_id).await?;
        drop(conn);
        let mut closed = 0;
        for row in rows {
            // `end` removes the container too, by handle or by id.
            if self
                .end(&row, SandboxState::Closed, "disconnected")
                .await?
                .is_some()
            {
                closed += 1;
            }
        }
        Ok(closed)
    }

    /// The live sandbox bound to a tenant's conversation, if any.
    pub async fn find_conversation(
        &self,
        caller: &Caller,
        conversation: &str,
    ) -> Result<Option<String>, ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        Ok(
            sandboxes::by_conversation(&mut conn, caller.tenant, conversation)
                .await?
                .map(|row| row.id),
        )
    }

    /// The live sandbox of a tenant's conversation, by id; `NotFound` when it has none.
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
    pub async fn check_death(&self, resolved: &Resolved, err: SandboxError) -> ServiceError {
        match err {
            SandboxError::Died { fate, .. } => {
                self.lose(&resolved.row.id, describe_fate(&fate)).await
            }
            other => other.into(),
        }
    }
}

fn over_limit(limits: &Limits) -> ServiceError {
    ServiceError::Limit {
        limit: "max concurrent sandboxes per tenant",
        value: limits.max_sandboxes.to_string(),
        hint: "close a sandbox you no longer need (close_sandbox) and try again",
    }
}

fn overdue(row: &SandboxRow, now: DateTime<Utc>) -> bool {
    row.expires_at.is_some_and(|e| e <= now) || row.idle_deadline().is_some_and(|d| d <= now)
}

/// Describes what happened to a container, for the model.
pub fn describe_fate(fate: &ContainerFate) -> String {
    fate.to_string()
}

/// The error for a call on a sandbox that is no longer live, saying when and why.
pub(crate) fn ended_error(row: &SandboxRow) -> ServiceError {
    let at = row
        .closed_at
        .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| "an unknown time".into());
    let id = &row.id;
    let message = match (row.state, row.close_reason.as_deref()) {
        (SandboxState::Lost, reason) => {
            return ServiceError::Lost {
                sandbox_id: id.clone(),
                why: reason.unwrap_or("its container disappeared").to_owned(),
            };
        }
        (_, Some("idle")) => format!(
            "sandbox {id} expired after {} s idle at {at}; its files and variables are gone; call create_sandbox for a new one",
            row.idle_timeout_seconds.unwrap_or_default()
        ),
        (_, Some("lifetime")) => format!(
            "sandbox {id} reached its maximum lifetime at {at} and was closed; call create_sandbox for a new one"
        ),
        (_, Some("disconnected")) => {
            format!("sandbox {id} was closed at {at} because its app was disconnected")
        }
        _ => format!("sandbox {id} was closed at {at}; call create_sandbox for a new one"),
    };
    ServiceError::Ended(message)
}
