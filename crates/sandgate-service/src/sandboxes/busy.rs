//! Which sandboxes have calls in flight in this process: the reaper leaves those alone, the end
//! of a call restarts a sandbox's idle clock, and a sandbox takes at most
//! `limits.max_calls_per_sandbox` calls at once (more would run it out of processes).
//!
//! The cap is counted where the sandbox's attach channel lives (this process): every call into
//! a sandbox goes through its channel here (and, with scale-out, through its node).
//!
//! Other replicas see a call only through Postgres: a call that outlives [`MARK_AFTER`] marks its
//! sandbox (`sandbox_call_marks`), renewed every third of `limits.call_slot_ttl_seconds` and
//! removed when it ends, so every replica's reaper leaves the sandbox alone; the mark of a
//! replica that died expires by itself. Short calls never write a mark.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use sandgate_store::PgPool;
use sandgate_store::{call_marks, sandboxes};
use tokio::task::AbortHandle;
use uuid::Uuid;

use super::error::Quota;
use super::idle_clock::IdleClock;
use super::{SandboxService, ServiceError};

/// Sandboxes with calls in flight in this process, by id, with how many.
pub(crate) type BusyMap = Arc<Mutex<HashMap<String, usize>>>;

/// How long a call runs before it marks its sandbox busy in Postgres for the other replicas.
pub(crate) const MARK_AFTER: Duration = Duration::from_secs(1);

/// Held while a call uses a sandbox; see [`Resolved::busy`].
#[derive(Debug)]
pub struct BusyGuard {
    id: String,
    busy: BusyMap,
    db: PgPool,
    mark: CallMark,
    /// The process's idle-clock writes, which coalesce the one at the call's end.
    clock: IdleClock,
    /// The work behind answered calls, which `SandboxService::drain_removals` waits for: the
    /// write at the call's end runs there.
    after: tokio_util::task::TaskTracker,
}

/// A call's mark in Postgres: written by a task once the call has run [`MARK_AFTER`], renewed
/// while it runs, removed when the guard drops.
#[derive(Debug)]
struct CallMark {
    id: Uuid,
    /// Set before the mark is first written: whether there may be a row to remove.
    written: Arc<AtomicBool>,
    task: Option<AbortHandle>,
}

impl CallMark {
    fn start(db: &PgPool, sandbox_id: &str, ttl_seconds: u32) -> Self {
        let id = Uuid::new_v4();
        let written = Arc::new(AtomicBool::new(false));
        let task = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            runtime
                .spawn(renew_mark(
                    db.clone(),
                    id,
                    sandbox_id.to_owned(),
                    ttl_seconds,
                    written.clone(),
                ))
                .abort_handle()
        });
        Self { id, written, task }
    }
}

/// Marks the call after [`MARK_AFTER`], then renews the mark every third of its time to live.
async fn renew_mark(
    db: PgPool,
    mark: Uuid,
    sandbox_id: String,
    ttl_seconds: u32,
    written: Arc<AtomicBool>,
) {
    let ttl = Duration::from_secs(u64::from(ttl_seconds.max(3)));
    tokio::time::sleep(MARK_AFTER).await;
    loop {
        written.store(true, Ordering::SeqCst);
        let until = Utc::now() + ttl;
        let renewed = async {
            let mut conn = db.acquire().await?;
            call_marks::renew(&mut conn, mark, &sandbox_id, until).await
        }
        .await;
        if let Err(err) = renewed {
            // The next renewal retries; meanwhile only this replica knows the call runs.
            tracing::warn!(error = %err, sandbox_id = %sandbox_id, "marking a running call in Postgres failed");
        }
        tokio::time::sleep(ttl / 3).await;
    }
}

impl BusyGuard {
    /// Marks a call on `id` unless the sandbox already runs `limits.max_calls_per_sandbox`.
    pub(super) fn try_new(service: &SandboxService, id: &str) -> Result<Arc<Self>, ServiceError> {
        let cap = service.limits.max_calls_per_sandbox;
        {
            let mut map = service.busy.lock().expect("busy map");
            let running = map.entry(id.to_owned()).or_default();
            if *running >= cap as usize {
                if *running == 0 {
                    map.remove(id);
                }
                return Err(ServiceError::Quota {
                    quota: Quota::CallsPerSandbox,
                    limit: cap,
                    retry_after_seconds: 1,
                });
            }
            *running += 1;
        }
        Ok(Self::counted(service, id))
    }

    /// Marks a call on `id` whatever the sandbox runs (a sandbox this call just leased).
    pub(super) fn new(service: &SandboxService, id: &str) -> Arc<Self> {
        *service
            .busy
            .lock()
            .expect("busy map")
            .entry(id.to_owned())
            .or_default() += 1;
        Self::counted(service, id)
    }

    /// The guard of a call already counted in the busy map.
    fn counted(service: &SandboxService, id: &str) -> Arc<Self> {
        Arc::new(Self {
            id: id.to_owned(),
            busy: service.busy.clone(),
            db: service.db.clone(),
            mark: CallMark::start(&service.db, id, service.limits.call_slot_ttl_seconds),
            clock: service.idle_clock.clone(),
            after: service.after_answer.clone(),
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
        if let Some(task) = self.mark.task.take() {
            task.abort();
        }
        // A renewal aborted mid-statement may still land after this removal; that mark then
        // expires by itself within the slot's time to live.
        let mark = self
            .mark
            .written
            .load(Ordering::SeqCst)
            .then_some(self.mark.id);
        // The end of a call is use too: a long cell must not leave its sandbox already idle.
        // Coalesced (see `idle_clock`): nothing to write when the clock already reads later.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let touch = self.clock.call_ended(&self.id);
        if touch.is_none() && mark.is_none() {
            return;
        }
        let (db, clock) = (self.db.clone(), self.clock.clone());
        let ids = vec![self.id.clone()];
        // Tracked, so that a drain waits for it: a reaper pass after a drain sees the clock and
        // the mark as this call left them.
        runtime.spawn(self.after.track_future(async move {
            let mut touched = touch.is_none();
            let result = async {
                let mut conn = db.acquire().await?;
                // The clock first: between the two no reaper may find the sandbox idle.
                if let Some(at) = touch {
                    sandboxes::touch_live(&mut conn, &ids, at).await?;
                    touched = true;
                }
                if let Some(mark) = mark {
                    call_marks::remove(&mut conn, mark).await?;
                }
                Ok::<_, sandgate_store::StoreError>(())
            }
            .await;
            if let Err(err) = result {
                if let (Some(at), false) = (touch, touched) {
                    clock.end_write_failed(&ids[0], at);
                }
                tracing::warn!(error = %err, sandbox_id = %ids[0], "refreshing the idle clock after a call failed");
            }
        }));
    }
}
