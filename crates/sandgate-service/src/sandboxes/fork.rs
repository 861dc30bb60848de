//! Fork (issue 27): a new sandbox, with a new id, holding a copy of another's memory and files,
//! so a person or the bot can try something without touching the original. A service
//! operation (the MCP face's `fork_sandbox` and the human console call the same): the source
//! is checkpointed leaving it running, the sealed snapshot goes through the snapshot store
//! (as a pause's does) and is restored into a new container on the source's node, then
//! deleted. The fork counts against the tenant's sandbox limit, is bound to no conversation,
//! and belongs to whoever forked it (their grant), none of the source's links or grant.

use chrono::Utc;
use sandgate_store::pauses::PausedKind;
use sandgate_store::sandboxes::{self, NewLease};
use sandgate_store::snapshots;
use sandgate_transcript::{Entry, ForkMark};
use tokio::io::AsyncWriteExt;

use super::error::over_limit;
use super::{Caller, Resolved, SandboxService, ServiceError};
use crate::snapshots::SnapshotCustody;

/// A fork just made: the new sandbox, and the one it was forked from.
#[derive(Debug, Clone)]
pub struct Forked {
    /// The new sandbox (leased to the caller, marked busy for this call).
    pub fork: Resolved,
    /// The source's id.
    pub source_id: String,
}

impl SandboxService {
    /// A sandbox paused with its files only (its runtime cannot checkpoint) is not forked: a
    /// fork is a checkpoint's copy, and resuming it first would only fail the same way after
    /// spending a resume. The refusal says so (another tenant's is `NotFound` further on).
    async fn refuse_files_only_fork(
        &self,
        caller: &Caller,
        sandbox_id: &str,
    ) -> Result<(), ServiceError> {
        let mut conn = self.db.acquire().await?;
        let row = sandboxes::get(&mut conn, caller.tenant, sandbox_id).await?;
        let files_only = row.is_some_and(|r| {
            r.state == sandboxes::SandboxState::Paused
                && r.paused_kind.as_deref() == Some(PausedKind::Files.as_str())
        });
        if files_only {
            return Err(ServiceError::Limit {
                limit: "forking",
                value: format!(
                    "sandbox {sandbox_id} is paused with its files only (its runtime cannot \
                     checkpoint), and a fork copies a checkpoint of memory and files"
                ),
                hint: "use the sandbox itself (any call resumes it from its files), or fork \
                       on a deployment whose runtime can checkpoint",
            });
        }
        Ok(())
    }

    /// Forks the tenant's sandbox `sandbox_id` (a paused one is resumed first), the copy bound
    /// to no conversation. Another tenant's sandbox is `NotFound`, like a missing one.
    pub async fn fork(&self, caller: &Caller, sandbox_id: &str) -> Result<Forked, ServiceError> {
        self.fork_into(caller, sandbox_id, None).await
    }

    /// Forks as [`Self::fork`] does, binding the copy to `conversation` when one is given (the
    /// console's "take over in a copy": a conversation of its own, so its page, transcript and
    /// tenant checks are a conversation's like any other). A `conversation` that already has a
    /// live sandbox is refused by the store's one-live-sandbox-per-conversation rule.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id = %sandbox_id))]
    pub async fn fork_into(
        &self,
        caller: &Caller,
        sandbox_id: &str,
        conversation: Option<&str>,
    ) -> Result<Forked, ServiceError> {
        let pausing = self.pausing_for("forking")?;
        self.refuse_files_only_fork(caller, sandbox_id).await?;
        let source = self.resolve(caller, Some(sandbox_id), None, None).await?;
        {
            let mut conn = self.db.acquire().await?;
            let live = sandboxes::count_live(&mut conn, caller.tenant).await?;
            if live >= i64::from(caller.limits.max_sandboxes) {
                return Err(over_limit(&caller.limits));
            }
        }
        let node_id = source.row.node.clone();
        let node = self.nodes.get(&self.db, &node_id).await?;
        let snapshot_id = SnapshotCustody::new_id();
        let tenant = caller.tenant;
        let mut out = pausing.store.writer(tenant, &snapshot_id);
        let taken = pausing
            .custody
            .take_as(
                &snapshot_id,
                tenant,
                &node_id,
                &node,
                &source.sandbox,
                true,
                &mut out,
            )
            .await;
        let pending = match taken {
            Ok(pending) => pending,
            Err(err) => {
                let _ = out.abort().await;
                return Err(super::pause::snapshot_error(&source.row.id, err));
            }
        };
        let restored = async {
            out.shutdown().await.map_err(|e| ServiceError::Busy {
                what: format!("sandbox {} (the snapshot store: {e})", source.row.id),
                retry_after_seconds: 10,
            })?;
            let mut conn = self.db.acquire().await?;
            pending.record(&mut conn).await?;
            drop(conn);
            let sealed = pausing
                .store
                .reader(tenant, &snapshot_id)
                .await
                .map_err(|e| super::pause::store_failed(&source.row.id, e))?;
            pausing
                .custody
                .restore_into(tenant, &snapshot_id, &node, sealed, false)
                .await
                .map_err(|e| super::pause::snapshot_error(&source.row.id, e))
        }
        .await;
        // The copy's snapshot served its one restore: it goes, whatever became of it.
        if let Ok(mut conn) = self.db.acquire().await {
            let _ = snapshots::delete(&mut conn, tenant, &snapshot_id).await;
        }
        let _ = pausing.store.delete(tenant, &snapshot_id).await;
        let sandbox = restored?;
        let lease = NewLease {
            tenant_id: tenant,
            conversation_id: conversation,
            idle_timeout_seconds: source
                .row
                .idle_timeout_seconds
                .unwrap_or(i32::try_from(caller.limits.default_idle_seconds).unwrap_or(i32::MAX)),
            expires_at: Utc::now()
                + chrono::Duration::seconds(i64::from(caller.limits.max_lifetime_seconds)),
            grant_id: caller.grant,
        };
        match self.record_lease(caller, &sandbox, &node_id, &lease).await {
            Ok(row) => {
                tracing::info!(sandbox_id = %row.id, source = %source.row.id, "forked a sandbox");
                self.mark_fork(pausing, caller, &source.row, &row).await;
                Ok(Forked {
                    fork: self.newly_leased(row, sandbox),
                    source_id: source.row.id.clone(),
                })
            }
            Err(err) => {
                let _ = self.nodes.close(sandbox).await;
                Err(err)
            }
        }
    }

    /// Marks the fork in both transcripts: the source's names the copy, the copy's the source.
    async fn mark_fork(
        &self,
        pausing: &super::Pausing,
        caller: &Caller,
        source: &sandgate_store::sandboxes::SandboxRow,
        copy: &sandgate_store::sandboxes::SandboxRow,
    ) {
        let mark = |other: &str| ForkMark {
            sandbox_id: other.to_owned(),
            by: caller.person.clone(),
        };
        let bound = pausing.transcripts;
        crate::transcripts::write_mark(&self.db, bound, source, Entry::ForkedInto(mark(&copy.id)))
            .await;
        crate::transcripts::write_mark(&self.db, bound, copy, Entry::ForkedFrom(mark(&source.id)))
            .await;
    }
}
