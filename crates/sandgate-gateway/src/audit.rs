//! The audit trail's writer: tool calls hand their event over and return at once; a background
//! task writes the events in order. While Postgres is away the events wait (up to
//! [`QUEUE_EVENTS`]) and are written when it returns, so calls refused during an outage are still
//! on the record.

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
    queue: mpsc::Sender<AuditEvent>,
}

impl AuditLog {
    /// Starts the writer on `tasks`; it drains what is queued when `stop` is cancelled.
    pub fn start(db: PgPool, stop: CancellationToken, tasks: &TaskTracker) -> Self {
        let (queue, events) = mpsc::channel(QUEUE_EVENTS);
        tasks.spawn(write_events(db, events, stop));
        Self { queue }
    }

    /// Queues an event; never waits.
    pub fn record(&self, event: AuditEvent) {
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
