//! The audit trail's writer. A call's event is written before its answer goes out, so a gateway
//! killed right after answering loses nothing; when that write fails (Postgres away) the event
//! goes to a queue that a background task writes when Postgres returns, so calls refused during
//! an outage are still on the record. While the queue is not empty, new events join it (keeping
//! the trail in order) rather than being written directly.

use std::time::Duration;

use sandgate_store::PgPool;
use sandgate_store::audit::{self, AuditEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Most events waiting to be written; beyond, new events are dropped (and logged).
const QUEUE_EVENTS: usize = 100_000;
/// Pause between attempts while Postgres does not answer.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// How long shutdown waits for queued events to be written.
const FLUSH_AT_SHUTDOWN: Duration = Duration::from_secs(5);

/// A handle to the audit writer. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AuditLog {
    db: PgPool,
    queue: mpsc::Sender<AuditEvent>,
}

impl AuditLog {
    /// Starts the writer on `tasks`; it drains what is queued when `stop` is cancelled.
    pub fn start(db: PgPool, stop: CancellationToken, tasks: &TaskTracker) -> Self {
        let (queue, events) = mpsc::channel(QUEUE_EVENTS);
        tasks.spawn(write_events(db.clone(), events, stop));
        Self { db, queue }
    }

    /// Writes an event, or queues it when Postgres does not take it now. `db_known_down` (the
    /// call itself failed for want of Postgres) skips the direct attempt, which would only make
    /// the caller wait for the pool's acquire timeout a second time.
    #[tracing::instrument(skip_all)]
    pub async fn record(&self, event: AuditEvent, db_known_down: bool) {
        // Events queued earlier go first: the trail stays in order.
        let queue_empty = self.queue.capacity() == self.queue.max_capacity();
        if queue_empty && !db_known_down {
            let written = async {
                let mut conn = self.db.acquire().await?;
                audit::record(&mut conn, &event).await
            }
            .await;
            match written {
                Ok(()) => return,
                Err(err) if err.is_unavailable() => {}
                Err(err) => {
                    tracing::error!(error = %err, tool = %event.tool, "an audit event was refused by the database; dropped");
                    return;
                }
            }
        }
        self.enqueue(event);
    }

    /// Queues an event for the background writer; never waits.
    fn enqueue(&self, event: AuditEvent) {
        if let Err(err) = self.queue.try_send(event) {
            tracing::error!(error = %err, "the audit queue is full or closed; an audit event was dropped");
        }
    }
}

async fn write_events(db: PgPool, mut events: mpsc::Receiver<AuditEvent>, stop: CancellationToken) {
    let mut flush_deadline = None;
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            () = stop.cancelled(), if flush_deadline.is_none() => {
                flush_deadline = Some(tokio::time::Instant::now() + FLUSH_AT_SHUTDOWN);
                events.close();
                continue;
            }
        };
        let Some(event) = event else { return };
        loop {
            let written = async {
                let mut conn = db.acquire().await?;
                audit::record(&mut conn, &event).await
            }
            .await;
            match written {
                Ok(()) => break,
                Err(err) if err.is_unavailable() => {
                    if flush_deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                        tracing::error!(error = %err, queued = events.len() + 1, "Postgres is away at shutdown; queued audit events are lost");
                        return;
                    }
                    tracing::warn!(error = %err, "writing an audit event failed; retrying");
                    tokio::time::sleep(RETRY_EVERY).await;
                }
                Err(err) => {
                    tracing::error!(error = %err, tool = %event.tool, "an audit event was refused by the database; dropped");
                    break;
                }
            }
        }
    }
}
