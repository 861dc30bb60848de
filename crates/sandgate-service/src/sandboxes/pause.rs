//! Pause and resume (DESIGN §4a, issue 27): an idle leased sandbox is checkpointed into the
//! snapshot store and its container removed; the next call naming it, or its conversation,
//! restores it on a node the placement chooses, under the same `sandbox_id`.
//!
//! Each step is one conditional statement ([`sandgate_store::pauses`]): `leased → pausing`
//! (only while still idle), the checkpoint *leaving the container running*, then the snapshot's
//! row and `pausing → paused` in one transaction, and only then the container removed. A crash
//! before that commit leaves the sandbox running (`pausing` is undone to `leased`); after it,
//! paused. A resume is `paused → resuming` (one caller wins; the others wait), the restore, then
//! `resuming → leased` with its new container: a crash in between leaves it paused.
//!
//! Who decides to pause is one place, with the key custody: the reaper of every process that
//! holds it (`serve`, `serve --gateway-only`) pauses idle sandboxes on any node, through the
//! node RPCs (`CheckpointSealed`, the sealed stream coming back through this process into its
//! store). A `sandgate node` holds neither keys nor store: with `snapshots.paused_by_gateways`
//! it leaves idle sandboxes to the gateways. The `begin_pause` statement decides each race: of
//! the processes that saw a sandbox idle, one takes it `pausing` (a call that touched it since
//! wins over all of them), and a node's close (`leased` only) cannot end it any more.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sandgate_node::SandboxHandle;
use sandgate_store::pauses::{self, PausedKind};
use sandgate_store::sandboxes::{SandboxRow, SandboxState};
use sandgate_store::snapshots;
use sandgate_transcript::{Entry, PauseCause, PauseMark, ResumeMark};
use tokio::io::AsyncWriteExt;

use super::{Caller, Resolved, SandboxService, ServiceError};
use crate::snapshots::{SnapshotCustody, SnapshotServiceError, SnapshotStore, SnapshotStoreError};

/// How often a call that found its sandbox pausing or resuming looks again.
const SETTLE_POLL: Duration = Duration::from_millis(50);

/// What pausing needs: the key custody, the store and the limits on paused sandboxes.
#[derive(Debug, Clone)]
pub struct Pausing {
    /// Key custody and the snapshots' rows.
    pub custody: SnapshotCustody,
    /// Where sealed snapshots rest.
    pub store: SnapshotStore,
    /// Whether the reaper pauses idle sandboxes (else it closes them).
    pub on_idle: bool,
    /// A transition older than this was cut short by a crash.
    pub transition_deadline: Duration,
    /// Most paused sandboxes per tenant.
    pub max_paused: u32,
    /// Most sealed bytes per tenant.
    pub tenant_max_bytes: u64,
    /// How long a paused sandbox is kept.
    pub retention: Duration,
    /// How much a sandbox's transcript keeps (its pause, resume and fork marks count in it).
    pub transcripts: crate::transcripts::Bound,
}

/// What the reaper's pause of an idle sandbox came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IdlePause {
    /// Paused now.
    Paused,
    /// Not this process's to pause any more: a call touched it, or another process took it.
    Skipped,
    /// To be closed instead (over the tenant's paused limits, or a runtime that cannot
    /// checkpoint).
    Close,
}

/// That a call's sandbox was resumed from a pause, and after how long.
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed {
    /// How long it was paused, seconds.
    pub paused_seconds: f64,
    /// When the pause kept only its files (a runtime that cannot checkpoint): a fresh kernel,
    /// its variables gone; what of its files and packages came back.
    pub files: Option<super::FilesResume>,
}

impl SandboxService {
    /// Turns pausing on, with `pausing`'s custody, store and limits.
    pub fn with_pausing(mut self, pausing: Pausing) -> Self {
        self.pausing = Some(pausing);
        self
    }

    /// Halts pauses at the step `halts` is armed with, as a crash there would (for tests of
    /// what a restarted process makes of a pause cut short; see [`super::PauseHalts`]).
    pub fn with_pause_halts(mut self, halts: Arc<super::PauseHalts>) -> Self {
        self.pause_halts = Some(halts);
        self
    }

    /// Stops here for ever when a test armed a halt at `step`.
    async fn halt_at(&self, step: super::PauseStep) {
        if let Some(halts) = &self.pause_halts {
            halts.at(step).await;
        }
    }

    /// Whether the reaper pauses idle sandboxes.
    pub(crate) fn pauses_on_idle(&self) -> bool {
        self.pausing.as_ref().is_some_and(|p| p.on_idle)
    }

    fn pausing(&self) -> Result<&Pausing, ServiceError> {
        self.pausing_for("pausing")
    }

    /// The pause machinery for `what` (pausing, forking), or the refusal saying it is off.
    pub(super) fn pausing_for(&self, what: &'static str) -> Result<&Pausing, ServiceError> {
        self.pausing.as_ref().ok_or(ServiceError::Limit {
            limit: what,
            value: "off on this deployment (no snapshot store)".into(),
            hint: "ask the operator to configure a snapshot store (snapshots.store)",
        })
    }

    /// Pauses an idle leased sandbox on any node (the reaper's choice); see [`IdlePause`].
    #[tracing::instrument(skip_all, fields(sandbox_id = %row.id, node = %row.node))]
    pub(crate) async fn pause_idle(&self, row: &SandboxRow) -> Result<IdlePause, ServiceError> {
        let pausing = self.pausing()?;
        let tenant = row.tenant_id.expect("a leased sandbox has a tenant");
        let mut conn = self.db.acquire().await?;
        let paused = pauses::count_paused(&mut conn, tenant).await?;
        let bytes = snapshots::sealed_bytes_of_tenant(&mut conn, tenant).await?;
        if paused >= i64::from(pausing.max_paused) || bytes >= pausing.tenant_max_bytes {
            tracing::info!(
                paused,
                bytes,
                "the tenant's paused limits are reached; closing instead"
            );
            return Ok(IdlePause::Close);
        }
        let Some(row) = pauses::begin_pause(&mut conn, &row.id, true).await? else {
            return Ok(IdlePause::Skipped);
        };
        drop(conn);
        let mark = PauseMark {
            cause: PauseCause::Idle,
            by: None,
        };
        match self.pause_row(pausing, &row, mark).await {
            Ok(_) => Ok(IdlePause::Paused),
            // A runtime that cannot checkpoint (runc here) keeps the files instead; where even
            // they cannot be kept (over the quota, no room for their archive), the sandbox is
            // closed, as without pauses, and the conversation's next call hears that its state
            // was lost.
            Err(ServiceError::Limit { value, .. }) => {
                tracing::info!(why = %value, "a files-only pause was refused; closing the sandbox instead");
                Ok(IdlePause::Close)
            }
            Err(err) => Err(err),
        }
    }

    /// Checkpoints a `pausing` row into the store and records it paused, `mark` in its
    /// transcript (where its runtime cannot checkpoint, keeps its files only:
    /// [`super::files`]); on failure the row is leased again (its container still runs).
    async fn pause_row(
        &self,
        pausing: &Pausing,
        row: &SandboxRow,
        mark: PauseMark,
    ) -> Result<SandboxRow, ServiceError> {
        self.halt_at(super::PauseStep::Begun).await;
        let kept = match self.checkpoint_into_store(pausing, row).await {
            Err(ServiceError::Sandbox(err)) if checkpoints_unavailable(&err) => {
                tracing::info!(error = %err, "this sandbox's runtime cannot checkpoint; keeping its files only");
                self.pause_files(pausing, row).await
            }
            other => other,
        };
        match kept {
            Ok(paused) => {
                self.halt_at(super::PauseStep::Recorded).await;
                self.remove_container(&row.id, Some(row)).await;
                crate::transcripts::write_mark(
                    &self.db,
                    pausing.transcripts,
                    &paused,
                    Entry::Pause(mark),
                )
                .await;
                tracing::info!(sandbox_id = %row.id, snapshot = ?paused.snapshot_id, "paused an idle sandbox");
                Ok(paused)
            }
            Err(err) => {
                tracing::warn!(error = %err, sandbox_id = %row.id, "pausing failed; the sandbox runs on");
                let mut conn = self.db.acquire().await?;
                pauses::abort_pause(&mut conn, row).await?;
                Err(err)
            }
        }
    }

    /// The checkpoint (leaving the container running), the sealed stream into the store, then
    /// the snapshot's row and `paused` in one transaction.
    async fn checkpoint_into_store(
        &self,
        pausing: &Pausing,
        row: &SandboxRow,
    ) -> Result<SandboxRow, ServiceError> {
        let tenant = row.tenant_id.expect("a leased sandbox has a tenant");
        let sandbox = self.handle(row).await?;
        let node = self.nodes.get(&self.db, &row.node).await?;
        let snapshot_id = SnapshotCustody::new_id();
        let mut out = pausing.store.writer(tenant, &snapshot_id);
        let taken = pausing
            .custody
            .take_as(
                &snapshot_id,
                tenant,
                &row.node,
                &node,
                &sandbox,
                true,
                &mut out,
            )
            .await;
        let pending = match taken {
            Ok(pending) => pending,
            Err(err) => {
                let _ = out.abort().await;
                return Err(snapshot_error(&row.id, err));
            }
        };
        self.halt_at(super::PauseStep::Checkpointed).await;
        out.shutdown()
            .await
            .map_err(|e| store_failed(&row.id, pausing.store.write_failed(e)))?;
        self.halt_at(super::PauseStep::Stored).await;
        let recorded = async {
            let mut tx = self.db.begin().await?;
            pending.record(&mut tx).await?;
            let paused =
                pauses::finish_pause(&mut tx, row, &snapshot_id, PausedKind::Memory).await?;
            if paused.is_some() {
                tx.commit().await?;
            }
            Ok::<_, ServiceError>(paused)
        }
        .await;
        match recorded {
            Ok(Some(paused)) => Ok(paused),
            other => {
                // Nothing records these bytes (no row holds their key): they go.
                let _ = pausing.store.delete(tenant, &snapshot_id).await;
                match other {
                    Err(err) => Err(err),
                    _ => Err(ServiceError::NotFound(row.id.clone())),
                }
            }
        }
    }

    /// The tenant's sandbox `sandbox_id` paused now (the `pause_sandbox` tool: the bot knows
    /// the conversation will wait). A paused one answers as it is.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id = %sandbox_id))]
    pub async fn pause(
        &self,
        caller: &Caller,
        sandbox_id: &str,
    ) -> Result<SandboxRow, ServiceError> {
        let pausing = self.pausing()?;
        let row = self.settled(caller, sandbox_id).await?;
        match row.state {
            SandboxState::Paused => return Ok(row),
            SandboxState::Leased => {}
            _ => return Err(super::ended_error(&row)),
        }
        if self.is_busy(&row.id) {
            return Err(ServiceError::Busy {
                what: format!("sandbox {} (a call runs in it)", row.id),
                retry_after_seconds: 5,
            });
        }
        let mut conn = self.db.acquire().await?;
        let Some(row) = pauses::begin_pause(&mut conn, &row.id, false).await? else {
            drop(conn);
            return Box::pin(self.pause(caller, sandbox_id)).await;
        };
        drop(conn);
        let mark = PauseMark {
            cause: PauseCause::Asked,
            by: caller.person.clone(),
        };
        self.pause_row(pausing, &row, mark).await
    }

    /// The tenant's sandbox once no pause or resume of it is under way: a call that finds it
    /// pausing or resuming waits for that to end (up to the transition deadline).
    pub(crate) async fn settled(
        &self,
        caller: &Caller,
        sandbox_id: &str,
    ) -> Result<SandboxRow, ServiceError> {
        let deadline = tokio::time::Instant::now()
            + self
                .pausing
                .as_ref()
                .map_or(Duration::from_secs(600), |p| p.transition_deadline);
        loop {
            let mut conn = self.db.acquire().await?;
            let row = sandgate_store::sandboxes::get(&mut conn, caller.tenant, sandbox_id)
                .await?
                .ok_or_else(|| ServiceError::NotFound(sandbox_id.to_owned()))?;
            drop(conn);
            if !matches!(row.state, SandboxState::Pausing | SandboxState::Resuming) {
                return Ok(row);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(ServiceError::Busy {
                    what: format!("sandbox {sandbox_id} (it is being paused or resumed)"),
                    retry_after_seconds: 5,
                });
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }

    /// Resolves a call on a sandbox that is pausing, paused or resuming: waits for a transition
    /// under way, resumes a paused one (one caller restores it; the others wait for it), and
    /// answers with the live sandbox, saying it was resumed.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant, sandbox_id = %row.id))]
    pub(super) async fn resume_for_call(
        &self,
        caller: &Caller,
        row: SandboxRow,
        new_idle: Option<i32>,
    ) -> Result<Resolved, ServiceError> {
        let mut row = row;
        loop {
            match row.state {
                SandboxState::Pausing | SandboxState::Resuming => {
                    row = self.settled(caller, &row.id).await?;
                }
                SandboxState::Paused => match self.resume(caller, &row).await? {
                    Some((live, resumed)) => {
                        let mut resolved =
                            Box::pin(self.resolve_row(caller, live, new_idle)).await?;
                        resolved.resumed = Some(resumed);
                        return Ok(resolved);
                    }
                    // Another caller began resuming it first: wait for that.
                    None => row = self.settled(caller, &row.id).await?,
                },
                _ => return Box::pin(self.resolve_row(caller, row, new_idle)).await,
            }
        }
    }

    /// Restores a paused sandbox on a node the placement chooses; `None` when another caller
    /// began resuming it first.
    async fn resume(
        &self,
        caller: &Caller,
        row: &SandboxRow,
    ) -> Result<Option<(SandboxRow, Resumed)>, ServiceError> {
        let pausing = self.pausing()?;
        let mut conn = self.db.acquire().await?;
        let Some(row) = pauses::begin_resume(&mut conn, caller.tenant, &row.id).await? else {
            return Ok(None);
        };
        drop(conn);
        let restored = if row.paused_kind.as_deref() == Some(PausedKind::Files.as_str()) {
            self.restore_files(pausing, caller, &row)
                .await
                .map(|(live, sandbox, files)| (live, sandbox, Some(files)))
        } else {
            self.restore_from_store(pausing, caller, &row)
                .await
                .map(|(live, sandbox)| (live, sandbox, None))
        };
        match restored {
            Ok((live, sandbox, files)) => {
                self.live
                    .lock()
                    .expect("live map")
                    .insert(live.id.clone(), sandbox);
                let paused_seconds = row
                    .paused_at
                    .map_or(0.0, |at| (Utc::now() - at).as_seconds_f64().max(0.0));
                tracing::info!(sandbox_id = %live.id, node = %live.node, paused_seconds, from_files = files.is_some(), "resumed a paused sandbox");
                let mark = ResumeMark {
                    paused_seconds,
                    by: caller.person.clone(),
                };
                crate::transcripts::write_mark(
                    &self.db,
                    pausing.transcripts,
                    &live,
                    Entry::Resume(mark),
                )
                .await;
                Ok(Some((
                    live,
                    Resumed {
                        paused_seconds,
                        files,
                    },
                )))
            }
            Err(err) => {
                let mut conn = self.db.acquire().await?;
                pauses::abort_resume(&mut conn, &row).await?;
                Err(err)
            }
        }
    }

    /// A resuming sandbox whose snapshot is gone from the store is lost, and the snapshot's row
    /// goes with it, in one transaction (else the row would count in the tenant's snapshot
    /// quota for ever: the sweep only sees what the store holds).
    pub(super) async fn lose_with_snapshot(
        &self,
        tenant: uuid::Uuid,
        began: &SandboxRow,
        snapshot_id: &str,
    ) -> ServiceError {
        let why = "its snapshot is gone from the snapshot store";
        let recorded = async {
            let mut tx = self.db.begin().await?;
            snapshots::delete(&mut tx, tenant, snapshot_id).await?;
            if pauses::lose_resuming(&mut tx, began, why).await?.is_some() {
                tx.commit().await?;
            }
            Ok::<_, ServiceError>(())
        }
        .await;
        if let Err(err) = recorded {
            tracing::warn!(error = %err, sandbox_id = %began.id, "recording a lost sandbox failed");
        }
        ServiceError::Lost {
            sandbox_id: began.id.clone(),
            why: why.to_owned(),
        }
    }

    /// The restore of a `resuming` row's snapshot (same sandbox id) and `resuming → leased`;
    /// then its snapshot is deleted.
    async fn restore_from_store(
        &self,
        pausing: &Pausing,
        caller: &Caller,
        row: &SandboxRow,
    ) -> Result<(SandboxRow, SandboxHandle), ServiceError> {
        let snapshot_id = row
            .snapshot_id
            .clone()
            .ok_or_else(|| ServiceError::NotFound(row.id.clone()))?;
        let node_id = match self.nodes.place(&self.db).await? {
            crate::placement::Placement::On(id) => id,
            _ => {
                return Err(ServiceError::Busy {
                    what: format!("sandbox {} (no node has room to resume it)", row.id),
                    retry_after_seconds: 30,
                });
            }
        };
        let node = self.nodes.get(&self.db, &node_id).await?;
        let sealed = match pausing.store.reader(caller.tenant, &snapshot_id).await {
            Ok(sealed) => sealed,
            Err(SnapshotStoreError::Missing { .. }) => {
                return Err(self
                    .lose_with_snapshot(caller.tenant, row, &snapshot_id)
                    .await);
            }
            Err(err) => return Err(store_failed(&row.id, err)),
        };
        let sandbox = pausing
            .custody
            .restore_into(caller.tenant, &snapshot_id, &node, sealed, true)
            .await
            .map_err(|e| snapshot_error(&row.id, e))?;
        let mut conn = self.db.acquire().await?;
        let live = pauses::finish_resume(&mut conn, row, sandbox.container_id(), &node_id).await?;
        let Some(live) = live else {
            drop(conn);
            let _ = self.nodes.close(sandbox).await;
            return Err(ServiceError::NotFound(row.id.clone()));
        };
        snapshots::delete(&mut conn, caller.tenant, &snapshot_id).await?;
        drop(conn);
        if let Err(err) = pausing.store.delete(caller.tenant, &snapshot_id).await {
            tracing::warn!(error = %err, snapshot = %snapshot_id, "deleting a resumed sandbox's snapshot failed");
        }
        Ok((live, sandbox))
    }

    /// Closes paused sandboxes past their lifetime or retention and deletes their snapshots;
    /// undoes transitions a crash cut short. Returns how many it closed.
    pub(crate) async fn reap_paused(&self) -> Result<usize, ServiceError> {
        let Some(pausing) = self.pausing.as_ref() else {
            return Ok(0);
        };
        let mut conn = self.db.acquire().await?;
        let deadline = i64::try_from(pausing.transition_deadline.as_secs()).unwrap_or(i64::MAX);
        for row in pauses::undo_cut_transitions(&mut conn, None, deadline).await? {
            tracing::warn!(sandbox_id = %row.id, state = ?row.state, "a pause or resume was cut short; undone");
        }
        let retention = i64::try_from(pausing.retention.as_secs()).unwrap_or(i64::MAX);
        let due = pauses::paused_overdue(&mut conn, Utc::now(), retention).await?;
        drop(conn);
        let mut closed = 0;
        for row in due {
            let reason = if row.expires_at.is_some_and(|e| e <= Utc::now()) {
                "lifetime"
            } else {
                "retention"
            };
            if self.end_paused(&row, reason).await?.is_some() {
                closed += 1;
            }
        }
        // Once per transition deadline, the snapshots no sandbox holds that are older than a
        // day at least (see [`sweep_age`]). A failed sweep keeps no other work of the reaper
        // from its pass; the next sweep tries again.
        let sweep_due = {
            let mut last = self.snapshot_sweep.lock().expect("sweep clock");
            let due = last.is_none_or(|at| at.elapsed() >= pausing.transition_deadline);
            if due {
                *last = Some(std::time::Instant::now());
            }
            due
        };
        if sweep_due
            && let Err(err) = self
                .sweep_snapshots(sweep_age(pausing.transition_deadline))
                .await
        {
            tracing::warn!(error = %err, "sweeping the snapshot store failed; the next sweep tries again");
        }
        Ok(closed)
    }

    /// Deletes the snapshots in the store that no paused or resuming sandbox holds, written
    /// more than `older_than` ago, with their rows: what a pause or a fork whose process died
    /// between the store's write and its end left (a pause cut before its record has no row:
    /// its data key is gone and nobody can open its bytes, but they still take room). Younger
    /// ones may belong to a pause or fork in flight and stay. Returns how many went.
    pub async fn sweep_snapshots(&self, older_than: Duration) -> Result<usize, ServiceError> {
        let Some(pausing) = self.pausing.as_ref() else {
            return Ok(0);
        };
        let before =
            Utc::now() - chrono::Duration::from_std(older_than).unwrap_or(chrono::Duration::zero());
        let written = match pausing.store.written_before(before).await {
            Ok(written) => written,
            Err(err) => {
                tracing::warn!(error = %err, "listing the snapshot store failed; the next sweep tries again");
                return Ok(0);
            }
        };
        let mut swept = 0;
        for (tenant, snapshot_id) in written {
            let mut conn = self.db.acquire().await?;
            // A tenant this deployment does not know: the object is not ours to judge (a store
            // shared with another deployment); a deleted tenant's purge took its own.
            if sandgate_store::tenants::get(&mut conn, tenant)
                .await?
                .is_none()
                || snapshots::is_held(&mut conn, tenant, &snapshot_id).await?
            {
                continue;
            }
            snapshots::delete(&mut conn, tenant, &snapshot_id).await?;
            drop(conn);
            match pausing.store.delete(tenant, &snapshot_id).await {
                Ok(()) => {
                    tracing::info!(snapshot = %snapshot_id, tenant_id = %tenant, "deleted a snapshot no sandbox holds (a pause or fork cut short)");
                    swept += 1;
                }
                Err(err) => {
                    tracing::warn!(error = %err, snapshot = %snapshot_id, "deleting a snapshot no sandbox holds failed; the next sweep tries again");
                }
            }
        }
        Ok(swept)
    }

    /// Ends a paused row (`closed` with `reason`) and deletes its snapshot (row and object).
    /// `None` when it was not paused any more.
    pub(crate) async fn end_paused(
        &self,
        row: &SandboxRow,
        reason: &str,
    ) -> Result<Option<SandboxRow>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        let Some(ended) = pauses::end_paused(&mut conn, &row.id, reason).await? else {
            return Ok(None);
        };
        let (Some(tenant), Some(snapshot_id)) = (ended.tenant_id, ended.snapshot_id.clone()) else {
            return Ok(Some(ended));
        };
        let snapshot_id = snapshot_id.as_str();
        snapshots::delete(&mut conn, tenant, snapshot_id).await?;
        drop(conn);
        if let Some(pausing) = self.pausing.as_ref()
            && let Err(err) = pausing.store.delete(tenant, snapshot_id).await
        {
            tracing::warn!(error = %err, snapshot = %snapshot_id, "deleting an ended sandbox's snapshot failed");
        }
        tracing::info!(sandbox_id = %row.id, reason, "closed a paused sandbox and deleted its snapshot");
        Ok(Some(ended))
    }
}

/// Whether a checkpoint failed because this runtime or engine cannot take one at all.
/// How old an unheld snapshot must be before the reaper's sweep deletes it: twice the transition
/// deadline and a day at least. A pause or fork that wrote it is long over by then, however long
/// its upload took (an S3 multipart object is dated from the upload's start) and whatever the
/// store's clock says against ours; what it leaks meanwhile is a day of room.
fn sweep_age(transition_deadline: Duration) -> Duration {
    (transition_deadline * 2).max(Duration::from_secs(24 * 3600))
}

fn checkpoints_unavailable(err: &sandgate_sandbox::SandboxError) -> bool {
    use sandgate_sandbox::{SandboxError, SnapshotError};
    match err {
        SandboxError::SnapshotsUnavailable { .. } => true,
        SandboxError::Checkpoint { source, .. } => {
            matches!(source.as_ref(), SnapshotError::Unavailable(_))
        }
        _ => false,
    }
}

pub(super) fn snapshot_error(sandbox_id: &str, err: SnapshotServiceError) -> ServiceError {
    match err {
        SnapshotServiceError::SandboxNotFound { .. } | SnapshotServiceError::NotFound { .. } => {
            ServiceError::NotFound(sandbox_id.to_owned())
        }
        SnapshotServiceError::Sandbox(err) => ServiceError::from(*err),
        SnapshotServiceError::Store(err) => ServiceError::from(err),
        SnapshotServiceError::Unwrap(err) => {
            tracing::error!(error = %err, sandbox_id, "a snapshot's key does not unwrap");
            ServiceError::Busy {
                what: format!("sandbox {sandbox_id} (its snapshot cannot be opened)"),
                retry_after_seconds: 60,
            }
        }
    }
}

pub(super) fn store_failed(sandbox_id: &str, err: SnapshotStoreError) -> ServiceError {
    tracing::warn!(error = %err, sandbox_id, "the snapshot store failed");
    ServiceError::Busy {
        what: format!("sandbox {sandbox_id} (the snapshot store)"),
        retry_after_seconds: 10,
    }
}

/// One of a tenant's sandboxes that is live or paused (for `list_sandboxes`).
#[derive(Debug, Clone)]
pub struct HeldSandbox {
    /// Its row.
    pub row: SandboxRow,
    /// The sealed size of a paused one's snapshot, bytes.
    pub snapshot_bytes: Option<u64>,
}

impl HeldSandbox {
    /// Its state as shown: `running`, `pausing`, `paused` or `resuming`.
    pub fn state(&self) -> &'static str {
        match self.row.state {
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
            _ => "running",
        }
    }
}

impl SandboxService {
    /// The tenant's live and paused sandboxes, those of `conversation` when one is named,
    /// newest first (at most 1000).
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant))]
    pub async fn list_held(
        &self,
        caller: &Caller,
        conversation: Option<&str>,
    ) -> Result<Vec<HeldSandbox>, ServiceError> {
        let mut conn = self.db.acquire().await?;
        let rows = pauses::held_of_tenant(&mut conn, caller.tenant, conversation).await?;
        Ok(rows
            .into_iter()
            .map(|(row, bytes)| HeldSandbox {
                row,
                snapshot_bytes: bytes.and_then(|b| u64::try_from(b).ok()),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweep_waits_a_day_or_twice_the_transition_deadline() {
        let day = Duration::from_secs(24 * 3600);
        assert_eq!(sweep_age(Duration::from_secs(10)), day);
        assert_eq!(sweep_age(Duration::from_secs(600)), day);
        assert_eq!(
            sweep_age(Duration::from_secs(86_400)),
            Duration::from_secs(2 * 86_400)
        );
    }
}
