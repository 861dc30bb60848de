//! The audit trail's writer. A call's event is queued (never waited for) and a background task
//! writes the queue in batches ([`crate::write_behind`]): every few milliseconds, or as soon as
//! a batch is full, one `INSERT` carries every event waiting. The request path costs a channel
//! send.
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

use prometheus_client::metrics::counter::Counter;
use sandgate_store::audit;
use sandgate_store::{PgPool, StoreError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::write_behind::{Bounds, Dropped, Sink, WriteBehind};

pub use crate::write_behind::FLUSH_AT_SHUTDOWN;
/// The audit trail's records, for the faces that fill them in (the store's types).
pub use sandgate_store::audit::{AuditEvent, ErrorKind, Outcome};

/// Most events waiting to be written; beyond, new events are dropped (counted and logged).
pub const QUEUE_EVENTS: usize = 100_000;
/// Most events in one `INSERT` (10 parameters each, far below Postgres's 65,535).
const BATCH_EVENTS: usize = 500;

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
    queue: WriteBehind<AuditEvent>,
}

impl AuditLog {
    /// Starts the writer on `tasks`; it drains what is queued when `stop` is cancelled.
    pub fn start(db: PgPool, stop: CancellationToken, tasks: &TaskTracker) -> Self {
        let bounds = Bounds {
            queued: QUEUE_EVENTS,
            batch: BATCH_EVENTS,
        };
        let dropped = Dropped {
            what: "audit events",
            counter: dropped_counter(),
        };
        Self {
            queue: WriteBehind::start(AuditSink { db }, bounds, dropped, stop, tasks),
        }
    }

    /// Queues an event for the writer; never waits. A full queue (Postgres away for long)
    /// drops it, counted and logged.
    pub fn record(&self, event: AuditEvent) {
        self.queue.push(event);
    }
}

/// Writes a batch of events in one `INSERT`.
struct AuditSink {
    db: PgPool,
}

impl Sink for AuditSink {
    type Item = AuditEvent;

    async fn write(
        &self,
        batch: &mut Vec<AuditEvent>,
        dropped: &Dropped,
    ) -> Result<(), StoreError> {
        let written = async {
            let mut conn = self.db.acquire().await?;
            audit::record_batch(&mut conn, batch).await
        }
        .await;
        match written {
            Ok(()) => {}
            Err(err) if err.is_unavailable() => return Err(err),
            // Not an outage (a constraint, a bad value): retrying would not help.
            Err(err) => dropped.count(batch.len(), &format!("refused by the database: {err}")),
        }
        batch.clear();
        Ok(())
    }
}
