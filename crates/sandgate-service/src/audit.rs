//! The audit trail's writer. A call's event is queued (never waited for) and a background task
//! writes the queue in batches: every few milliseconds, or as soon as a batch is full, one
//! `INSERT` carries every event waiting. The request path costs a channel send.
//!
//! - Graceful shutdown drains the queue: every event of a call that answered is written
//!   before the process exits (while Postgres answers; see below).
//! - While Postgres is away, events stay queued (up to [`QUEUE_EVENTS`]) and the batch in hand
//!   is retried until Postgres returns, in order. Past the bound, or at shutdown with Postgres
//!   still away after [`FLUSH_AT_SHUTDOWN`], events are dropped: each is counted in
//!   `sandgate_audit_dropped_total` and logged.
//! - A process killed without warning (SIGKILL) loses the few milliseconds of events not yet
//!   flushed; that is the price of not waiting for a commit on every call.
//!
//! Nothing else depends on audit rows: quotas and rate limits keep their own counters
//! (`sandgate_store::quotas`), so a delayed or dropped audit row never lets a call through.

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use sandgate_store::PgPool;
use sandgate_store::audit::{self, AuditEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Most events waiting to be written; beyond, new events are dropped (counted and logged).
pub const QUEUE_EVENTS: usize = 100_000;
/// Most events in one `INSERT` (10 parameters each, far below Postgres's 65,535).
const BATCH_EVENTS: usize = 500;
/// How long the writer gathers events after the first one before it writes them.
const GATHER: Duration = Duration::from_millis(5);
/// Pause between attempts while Postgres does not answer.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// How long shutdown waits for queued events to be written while Postgres does not answer.
pub const FLUSH_AT_SHUTDOWN: Duration = Duration::from_secs(5);

/// Audit events dropped (queue full, Postgres away through shutdown, or refused by the
/// database): `sandgate_audit_dropped_total` in `/metrics`. Process-wide, like the sandbox
/// crate's counters.
pub fn dropped_counter() -> &'static Counter {
    static DROPPED: OnceLock<Counter> = OnceLock::new();
    DROPPED.get_or_init(Counter::default)
}

/// A handle to the audit writer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AuditLog {
    queue: mpsc::Sender<AuditEvent>,
}

impl AuditLog {
    /// Starts the writer on `tasks`; it drains what is queued when `stop` is cancelled.
    pub fn start(db: PgPool, stop: CancellationToken, tasks: &TaskTracker) -> Self {
        let (queue, events) = mpsc::channel(QUEUE_EVENTS);
        tasks.spawn(write_events(db, events, stop));
        Self { queue }
    }

    /// Queues an event for the writer; never waits. A full queue (Postgres away for long)
    /// drops it, counted and logged.
    pub fn record(&self, event: AuditEvent) {
        if let Err(err) = self.queue.try_send(event) {
            dropped(1, &format!("the audit queue is full or closed: {err}"));
        }
    }
}

fn dropped(n: usize, why: &str) {
    dropped_counter().inc_by(n as u64);
    tracing::error!(events = n, why, "audit events dropped");
}

/// The writer: gathers what is queued into batches and writes each, retrying while Postgres is
/// away; at `stop`, drains the queue and ends.
async fn write_events(db: PgPool, mut events: mpsc::Receiver<AuditEvent>, stop: CancellationToken) {
    let mut stopping = false;
    let mut batch = Vec::with_capacity(BATCH_EVENTS);
    loop {
        if batch.is_empty() {
            let first = tokio::select! {
                event = events.recv() => event,
                () = stop.cancelled(), if !stopping => {
                    // Every request has answered by now: take what is queued, then end.
                    stopping = true;
                    events.close();
                    continue;
                }
            };
            let Some(first) = first else { return };
            batch.push(first);
            if !stopping {
                gather(&mut events, &mut batch).await;
            }
        }
        while batch.len() < BATCH_EVENTS {
            match events.try_recv() {
                Ok(event) => batch.push(event),
                Err(_) => break,
            }
        }
        if !write_batch(&db, &mut batch, &stop, stopping).await {
            let left = batch.len() + events.len();
            dropped(
                left,
                "Postgres is still away at shutdown; queued events are lost",
            );
            return;
        }
    }
}

/// Waits up to [`GATHER`] for more events to join `batch` (fewer, larger writes under load).
async fn gather(events: &mut mpsc::Receiver<AuditEvent>, batch: &mut Vec<AuditEvent>) {
    let until = tokio::time::Instant::now() + GATHER;
    while batch.len() < BATCH_EVENTS {
        match tokio::time::timeout_at(until, events.recv()).await {
            Ok(Some(event)) => batch.push(event),
            Ok(None) | Err(_) => return,
        }
    }
}

/// Writes `batch` (emptying it), retrying while Postgres is unavailable. `false` when it gave
/// up: shutting down and Postgres away for [`FLUSH_AT_SHUTDOWN`].
async fn write_batch(
    db: &PgPool,
    batch: &mut Vec<AuditEvent>,
    stop: &CancellationToken,
    stopping: bool,
) -> bool {
    let mut give_up_at = stopping.then(|| tokio::time::Instant::now() + FLUSH_AT_SHUTDOWN);
    loop {
        let written = async {
            let mut conn = db.acquire().await?;
            audit::record_batch(&mut conn, batch).await
        }
        .await;
        match written {
            Ok(()) => {
                batch.clear();
                return true;
            }
            Err(err) if err.is_unavailable() => {
                if stop.is_cancelled() && give_up_at.is_none() {
                    give_up_at = Some(tokio::time::Instant::now() + FLUSH_AT_SHUTDOWN);
                }
                if give_up_at.is_some_and(|at| tokio::time::Instant::now() >= at) {
                    return false;
                }
                tracing::warn!(error = %err, events = batch.len(), "writing audit events failed; kept and retried");
                tokio::time::sleep(RETRY_EVERY).await;
            }
            Err(err) => {
                // Not an outage (a constraint, a bad value): retrying would not help.
                dropped(batch.len(), &format!("refused by the database: {err}"));
                batch.clear();
                return true;
            }
        }
    }
}
