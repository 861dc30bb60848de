//! Leasing a new sandbox: warm when the pool has one that fits, else a bounded cold start; the
//! lease recorded in one transaction that also enforces the tenant's sandbox limit.

use chrono::Utc;
use sandgate_node::{NodeHandle, SandboxHandle, StartTicket};
use sandgate_sandbox::{SandboxProfile, telemetry};
use sandgate_store::StoreError;
use sandgate_store::sandboxes::{self, NewLease, SandboxRow};

use super::busy::BusyGuard;
use super::error::over_limit;
use super::{Caller, Resolved, SandboxService, ServiceError};
use crate::placement::Placement;

impl SandboxService {
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id))]
    pub(super) async fn lease_new(
        &self,
        caller: &Caller,
        conversation: Option<&str>,
        idle: i32,
    ) -> Result<Resolved, ServiceError> {
        let waited = std::time::Instant::now();
        // Cheap early refusal before a container is taken.
        {
            let mut conn = self.db.acquire().await?;
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
            Ok(None) => self.lease_placed(caller, &profile, &lease).await,
            Err(err) => Err(err),
        };
        if let (Ok(_), Some(manager)) = (&leased, self.nodes.local()) {
            manager.record_lease(&self.profile.name);
            telemetry::counters()
                .lease_wait
                .observe(waited.elapsed().as_secs_f64());
        }
        match leased {
            // Another call bound the conversation first: answer with that sandbox.
            Err(ServiceError::Store(StoreError::Conflict(_))) if conversation.is_some() => {
                let mut conn = self.db.acquire().await?;
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

    /// No warm sandbox: a cold start on the node the placement rule ([`crate::placement`])
    /// chooses.
    ///
    /// Cold starts are bounded (with the pool's refills, by a limit that adapts to the machine):
    /// a burst of conversations on an empty pool would otherwise start every container at once
    /// on the same few cores, until all of them miss their ready timeout. Queued leases take a
    /// warm container if a refill made one meanwhile.
    async fn lease_placed(
        &self,
        caller: &Caller,
        profile: &SandboxProfile,
        lease: &NewLease<'_>,
    ) -> Result<Resolved, ServiceError> {
        let node_id = match self.nodes.place(&self.db).await? {
            Placement::On(id) => id,
            Placement::Full { nodes: 0, .. } => {
                return Err(ServiceError::Limit {
                    limit: "sandbox node capacity",
                    value: "no live sandbox node takes new sandboxes now: each is draining or \
                            silent"
                        .into(),
                    hint: "retry in a minute; if it persists, tell the user",
                });
            }
            Placement::Full { nodes, slots } => {
                return Err(ServiceError::Limit {
                    limit: "sandbox node slots",
                    value: format!(
                        "all {slots} slots of the {nodes} live, non-draining node(s) are in use"
                    ),
                    hint: "retry in a minute (ending sandboxes free slots), or close a sandbox \
                           you no longer need",
                });
            }
        };
        let node = self.nodes.get(&self.db, &node_id).await?;
        let permit = node.start_permit(&profile.name).await?;
        if *profile == self.profile
            && let Some(resolved) = self.lease_warm(caller, lease).await?
        {
            return Ok(resolved);
        }
        self.lease_cold(caller, profile, lease, (&node_id, &node), permit)
            .await
    }

    /// A sandbox this call just leased: its handle kept as live here, and marked busy.
    pub(super) fn newly_leased(&self, row: SandboxRow, sandbox: SandboxHandle) -> Resolved {
        self.live
            .lock()
            .expect("live map")
            .insert(row.id.clone(), sandbox.clone());
        let busy = BusyGuard::new(self, &row.id);
        Resolved {
            sandbox,
            row,
            created: true,
            resumed: None,
            replaced: None,
            busy,
        }
    }

    /// Starts a container now and records it as leased.
    async fn lease_cold(
        &self,
        caller: &Caller,
        profile: &SandboxProfile,
        lease: &NewLease<'_>,
        (node_id, node): (&str, &NodeHandle),
        ticket: StartTicket,
    ) -> Result<Resolved, ServiceError> {
        let sandbox = match node.launch(profile, ticket).await {
            Ok(sandbox) => sandbox,
            Err(err) => return Err(self.node_error(node_id, node.local().is_none(), err)),
        };
        tracing::Span::current().record("sandbox_id", sandbox.id());
        match self.record_lease(caller, &sandbox, node_id, lease).await {
            Ok(row) => Ok(self.newly_leased(row, sandbox)),
            Err(err) => {
                // Nothing half-created is left behind: the container goes.
                let node = node.clone();
                tokio::spawn(async move {
                    if let Err(e) = node.close(sandbox).await {
                        tracing::warn!(error = %e, "removing an unrecorded sandbox failed");
                    }
                });
                Err(err)
            }
        }
    }

    /// Records the lease in one transaction that also enforces the tenant's sandbox limit: the
    /// tenant row is locked so concurrent creates cannot both slip under the limit.
    pub(super) async fn record_lease(
        &self,
        caller: &Caller,
        sandbox: &SandboxHandle,
        node_id: &str,
        lease: &NewLease<'_>,
    ) -> Result<SandboxRow, ServiceError> {
        let mut tx = self.db.begin().await?;
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
            node_id,
            lease,
        )
        .await?;
        tx.commit().await?;
        Ok(row)
    }
}
