//! Tenant-scoped sandboxes: the glue between Postgres (who owns what, until when) and the
//! sandbox manager (the containers). Every lookup filters by the caller's tenant, so another
//! tenant's sandbox answers exactly like one that does not exist.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use chrono::{DateTime, Utc};
use sandgate_sandbox::{ContainerFate, Sandbox, SandboxError, SandboxManager};
use sandgate_store::sandboxes::{self, NewLease, SandboxRow, SandboxState};
use sandgate_store::{PgPool, StoreError};
use uuid::Uuid;

use crate::config::LimitsConfig;

/// Who is calling: the verified token's tenant and ids.
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
    /// Postgres is unavailable: retrying shortly may work.
    #[error("sandgate's database is temporarily unavailable; retry in a few seconds")]
    Unavailable(#[source] StoreError),
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
}

/// Tenant-scoped sandbox operations.
#[derive(Debug, Clone)]
pub struct SandboxService {
    db: PgPool,
    manager: SandboxManager,
    profile: String,
    node: String,
    limits: LimitsConfig,
    /// Live handles of this process, by sandbox id. A leased sandbox missing here (after a
    /// restart, or leased by another replica) is adopted on first use.
    live: Arc<Mutex<HashMap<String, Sandbox>>>,
}

impl SandboxService {
    /// A service over `manager`, leasing from `profile`, recording rows for `node`.
    pub fn new(
        db: PgPool,
        manager: SandboxManager,
        profile: String,
        node: String,
        limits: LimitsConfig,
    ) -> Self {
        Self {
            db,
            manager,
            profile,
            node,
            limits,
            live: Arc::default(),
        }
    }

    /// The manager underneath.
    pub fn manager(&self) -> &SandboxManager {
        &self.manager
    }

    /// The idle timeout for a call that asked for `keep_alive` seconds (bounded by the limits).
    fn idle_timeout(&self, keep_alive: Option<u32>) -> Result<i32, ServiceError> {
        match keep_alive {
            None => Ok(self.limits.idle_timeout_seconds as i32),
            Some(0) => Err(ServiceError::Limit {
                limit: "keep_alive_seconds",
                value: "0".into(),
                hint: "give at least 1 second",
            }),
            Some(s) if s > self.limits.max_idle_timeout_seconds => Err(ServiceError::Limit {
                limit: "max idle timeout",
                value: format!("{} s", self.limits.max_idle_timeout_seconds),
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
        let idle = self.idle_timeout(keep_alive)?;
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
            if live >= i64::from(self.limits.max_sandboxes) {
                return Err(self.over_limit());
            }
        }
        let sandbox = self.manager.lease(&self.profile).await?;
        tracing::Span::current().record("sandbox_id", sandbox.id());
        let expires_at =
            Utc::now() + chrono::Duration::seconds(i64::from(self.limits.max_lifetime_seconds));
        let lease = NewLease {
            tenant_id: caller.tenant,
            conversation_id: conversation,
            idle_timeout_seconds: idle,
            expires_at,
            grant_id: caller.grant,
        };
        match self.record_lease(&sandbox, &lease).await {
            Ok(row) => {
                self.live
                    .lock()
                    .expect("live map")
                    .insert(row.id.clone(), sandbox.clone());
                Ok(Resolved {
                    sandbox,
                    row,
                    created: true,
                })
            }
            Err(err) => {
                // Nothing half-created is left behind: the container goes.
                let manager = self.manager.clone();
                let orphan = sandbox.clone();
                tokio::spawn(async move {
                    if let Err(e) = manager.close(orphan).await {
                        tracing::warn!(error = %e, "removing an unrecorded sandbox failed");
                    }
                });
                match err {
                    // Another call bound the conversation first: answer with that sandbox.
                    ServiceError::Store(StoreError::Conflict(_)) if conversation.is_some() => {
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
                    other => Err(other),
                }
            }
        }
    }

    fn over_limit(&self) -> ServiceError {
        ServiceError::Limit {
            limit: "max concurrent sandboxes per tenant",
            value: self.limits.max_sandboxes.to_string(),
            hint: "close a sandbox you no longer need (close_sandbox) and try again",
        }
    }

    /// Records the lease in one transaction that also enforces the tenant's sandbox limit: the
    /// tenant row is locked so concurrent creates cannot both slip under the limit.
    async fn record_lease(
        &self,
        sandbox: &Sandbox,
        lease: &NewLease<'_>,
    ) -> Result<SandboxRow, ServiceError> {
        let mut tx = self.db.begin().await.map_err(StoreError::from)?;
        sandgate_store::tenants::lock(&mut tx, lease.tenant_id).await?;
        let live = sandboxes::count_live(&mut tx, lease.tenant_id).await?;
        if live >= i64::from(self.limits.max_sandboxes) {
            return Err(self.over_limit());
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
    ) -> Result<Resolved, ServiceError> {
        match sandbox_id {
            Some(id) => {
                let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
                let row = sandboxes::get(&mut conn, caller.tenant, id)
                    .await?
                    .ok_or_else(|| ServiceError::NotFound(id.to_owned()))?;
                drop(conn);
                self.resolve_row(caller, row, None).await
            }
            None => self.create(caller, conversation, None).await,
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
        if overdue(&row, now) {
            // The reaper has not got to it yet: end it now rather than serve past its time.
            let reason = if row.expires_at.is_some_and(|e| e <= now) {
                "lifetime"
            } else {
                "idle"
            };
            let ended = self
                .end(&row.id, SandboxState::Closed, reason)
                .await?
                .unwrap_or(row);
            return Err(ended_error(&ended));
        }
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let row = sandboxes::touch(&mut conn, caller.tenant, &row.id, new_idle)
            .await?
            .ok_or_else(|| ServiceError::NotFound(row.id.clone()))?;
        drop(conn);
        let sandbox = self.handle(&row).await?;
        Ok(Resolved {
            sandbox,
            row,
            created: false,
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
        if let Err(err) = self.end(sandbox_id, SandboxState::Lost, &why).await {
            tracing::warn!(error = %err, sandbox_id, "recording a lost sandbox failed");
        }
        ServiceError::Lost {
            sandbox_id: sandbox_id.to_owned(),
            why,
        }
    }

    async fn end(
        &self,
        id: &str,
        state: SandboxState,
        reason: &str,
    ) -> Result<Option<SandboxRow>, ServiceError> {
        let mut conn = self.db.acquire().await.map_err(StoreError::from)?;
        let row = sandboxes::end(&mut conn, id, state, reason).await?;
        drop(conn);
        let handle = self.live.lock().expect("live map").remove(id);
        if let Some(sandbox) = handle
            && let Err(err) = self.manager.close(sandbox).await
        {
            tracing::warn!(error = %err, sandbox_id = id, "removing the container failed");
        }
        Ok(row)
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
        let ended = self.end(sandbox_id, SandboxState::Closed, "closed").await?;
        if ended.is_none() {
            // Ended concurrently; whatever ended it, it is gone.
            return Err(ServiceError::NotFound(sandbox_id.to_owned()));
        }
        // A container that was not live in this process (another replica's, or after a restart)
        // is removed by id.
        if let Ok(sandbox) = self.manager.adopt(&row.container_id).await {
            let _ = self.manager.close(sandbox).await;
        }
        Ok(ended.unwrap_or(row))
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
            if self
                .end(&row.id, SandboxState::Closed, "disconnected")
                .await?
                .is_some()
            {
                closed += 1;
            }
            // A container that was not live in this process is removed by id.
            if let Ok(sandbox) = self.manager.adopt(&row.container_id).await {
                let _ = self.manager.close(sandbox).await;
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

fn overdue(row: &SandboxRow, now: DateTime<Utc>) -> bool {
    row.expires_at.is_some_and(|e| e <= now) || row.idle_deadline().is_some_and(|d| d <= now)
}

/// Describes what happened to a container, for the model.
pub fn describe_fate(fate: &ContainerFate) -> String {
    fate.to_string()
}

/// The error for a call on a sandbox that is no longer live, saying when and why.
fn ended_error(row: &SandboxRow) -> ServiceError {
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
