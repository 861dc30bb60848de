//! Writing behind the answer: a bounded queue that a request puts an item on (a channel send,
//! never a wait) and one background task that writes what is queued in batches: every few
//! milliseconds, or as soon as a batch is full. The audit trail ([`crate::audit`]) and the
//! transcripts ([`crate::transcripts`]) use it.
//!
//! - Graceful shutdown drains the queue: every item of a call that answered is written before
//!   the process exits (while Postgres answers; see below).
//! - While Postgres is away, items stay queued (up to the queue's bound) and the batch in hand
//!   is retried, in order, until Postgres returns. Past the bound, or at shutdown with Postgres
//!   still away after [`FLUSH_AT_SHUTDOWN`], items are dropped: each is counted in the queue's
//!   metric and logged. Items the database refuses (not an outage) are counted the same way.
//! - [`WriteBehind::flush`] waits until everything queued before it is written, for a reader
//!   that must see its own process's writes (a transcript exported right after its cells).
//! - A process killed without warning (SIGKILL) loses the few milliseconds of items not yet
//!   written; that is the price of not waiting for a commit on every call.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use sandgate_store::StoreError;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long the writer gathers items after the first one before it writes them.
const GATHER: Duration = Duration::from_millis(5);
/// Pause between attempts while Postgres does not answer.
const RETRY_EVERY: Duration = Duration::from_millis(500);
/// How long shutdown waits for queued items to be written while Postgres does not answer.
pub const FLUSH_AT_SHUTDOWN: Duration = Duration::from_secs(5);

/// Where a queue's batches go.
pub(crate) trait Sink: Send + Sync + 'static {
    /// What is queued.
    type Item: Send + 'static;

    /// Writes `batch`, removing each item from it once written, or once the database refused it
    /// (counted with [`Dropped::count`]). An outage stops it with the rest still in `batch`
    /// (retried) and is returned as the error.
    fn write(
        &self,
        batch: &mut Vec<Self::Item>,
        dropped: &Dropped,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// How a queue counts and logs what it drops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dropped {
    /// What the items are, for logs ("audit events").
    pub what: &'static str,
    /// The process-wide counter exported in `/metrics`.
    pub counter: &'static Counter,
}

impl Dropped {
    /// Counts and logs `n` items that will never be written.
    pub fn count(&self, n: usize, why: &str) {
        if n == 0 {
            return;
        }
        self.counter.inc_by(n as u64);
        tracing::error!(items = n, what = self.what, why, "queued items dropped");
    }
}

/// The bounds of a queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    /// Most items waiting; beyond, new items are dropped (counted and logged).
    pub queued: usize,
    /// Most items handed to one [`Sink::write`].
    pub batch: usize,
}

enum Message<T> {
    Item(T),
    /// Answered once everything queued before it is written (or dropped).
    Flush(oneshot::Sender<()>),
}

/// A handle to a queue and its writer. Cheap to clone.
pub(crate) struct WriteBehind<T> {
    queue: mpsc::Sender<Message<T>>,
    dropped: Dropped,
}

impl<T> Clone for WriteBehind<T> {
    fn clone(&self) -> Self {
        Self {
            queue: self.queue.clone(),
            dropped: self.dropped,
        }
    }
}

impl<T> std::fmt::Debug for WriteBehind<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteBehind")
            .field("what", &self.dropped.what)
            .field(
                "queued",
                &(self.queue.max_capacity() - self.queue.capacity()),
            )
            .finish()
    }
}

impl<T: Send + 'static> WriteBehind<T> {
    /// Starts the writer of `sink` on `tasks`; it drains what is queued when `stop` is
    /// cancelled, then ends.
    pub fn start<S: Sink<Item = T>>(
        sink: S,
        bounds: Bounds,
        dropped: Dropped,
        stop: CancellationToken,
        tasks: &TaskTracker,
    ) -> Self {
        let (queue, items) = mpsc::channel(bounds.queued);
        tasks.spawn(write_items(sink, items, bounds.batch, dropped, stop));
        Self { queue, dropped }
    }

    /// Queues an item; never waits. A full queue (Postgres away for long) or a stopped writer
    /// drops it, counted and logged.
    pub fn push(&self, item: T) {
        if let Err(err) = self.queue.try_send(Message::Item(item)) {
            self.dropped
                .count(1, &format!("the queue is full or closed: {err}"));
        }
    }

    /// Waits until every item queued before this call is written (or dropped), at most `wait`.
    /// `false` when it gave up waiting (Postgres away, or the queue full).
    pub async fn flush(&self, wait: Duration) -> bool {
        let (done, written) = oneshot::channel();
        let flushed = async {
            if self.queue.send(Message::Flush(done)).await.is_err() {
                // The writer has ended: everything it was given is written or dropped.
                return;
            }
            let _ = written.await;
        };
        tokio::time::timeout(wait, flushed).await.is_ok()
    }
}

/// The writer: gathers what is queued into batches and writes each, retrying while Postgres is
/// away; at `stop`, drains the queue and ends.
async fn write_items<S: Sink>(
    sink: S,
    mut items: mpsc::Receiver<Message<S::Item>>,
    most: usize,
    dropped: Dropped,
    stop: CancellationToken,
) {
    let mut stopping = false;
    let mut batch = Vec::with_capacity(most);
    // Flushes answered once the batch in hand is written.
    let mut flushes = Vec::new();
    loop {
        if batch.is_empty() {
            let first = tokio::select! {
                message = items.recv() => message,
                () = stop.cancelled(), if !stopping => {
                    // Every request has answered by now: take what is queued, then end.
                    stopping = true;
                    items.close();
                    continue;
                }
            };
            match first {
                None => return,
                Some(Message::Flush(done)) => {
                    let _ = done.send(());
                    continue;
                }
                Some(Message::Item(item)) => batch.push(item),
            }
            if !stopping {
                gather(&mut items, &mut batch, &mut flushes, most).await;
            }
        }
        while batch.len() < most {
            match items.try_recv() {
                Ok(Message::Item(item)) => batch.push(item),
                Ok(Message::Flush(done)) => flushes.push(done),
                Err(_) => break,
            }
        }
        if !write_batch(&sink, &mut batch, dropped, &stop, stopping).await {
            let left = batch.len() + items.len();
            dropped.count(
                left,
                "Postgres is still away at shutdown; queued items are lost",
            );
            return;
        }
        for done in flushes.drain(..) {
            let _ = done.send(());
        }
    }
}

/// Waits up to [`GATHER`] for more items to join `batch` (fewer, larger writes under load); a
/// flush ends the wait, so a reader waiting for it is not held up.
async fn gather<T>(
    items: &mut mpsc::Receiver<Message<T>>,
    batch: &mut Vec<T>,
    flushes: &mut Vec<oneshot::Sender<()>>,
    most: usize,
) {
    let until = tokio::time::Instant::now() + GATHER;
    while batch.len() < most {
        match tokio::time::timeout_at(until, items.recv()).await {
            Ok(Some(Message::Item(item))) => batch.push(item),
            Ok(Some(Message::Flush(done))) => {
                flushes.push(done);
                return;
            }
            Ok(None) | Err(_) => return,
        }
    }
}

/// Writes `batch` (emptying it), retrying while Postgres is unavailable. `false` when it gave
/// up: shutting down and Postgres away for [`FLUSH_AT_SHUTDOWN`].
async fn write_batch<S: Sink>(
    sink: &S,
    batch: &mut Vec<S::Item>,
    dropped: Dropped,
    stop: &CancellationToken,
    stopping: bool,
) -> bool {
    let mut give_up_at = stopping.then(|| tokio::time::Instant::now() + FLUSH_AT_SHUTDOWN);
    loop {
        match sink.write(batch, &dropped).await {
            Ok(()) => {
                // A sink removes what it wrote or the database refused; anything left would be
                // its bug, not a reason to retry forever.
                dropped.count(batch.len(), "the writer left items unwritten");
                batch.clear();
                return true;
            }
            Err(err) => {
                if stop.is_cancelled() && give_up_at.is_none() {
                    give_up_at = Some(tokio::time::Instant::now() + FLUSH_AT_SHUTDOWN);
                }
                if give_up_at.is_some_and(|at| tokio::time::Instant::now() >= at) {
                    return false;
                }
                tracing::warn!(error = %err, items = batch.len(), what = dropped.what, "writing queued items failed; kept and retried");
                tokio::time::sleep(RETRY_EVERY).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex, OnceLock};

    use super::*;

    /// An in-memory sink: records what it was given, and answers "unavailable" while `away`.
    #[derive(Clone, Default)]
    struct Memory {
        written: Arc<Mutex<Vec<u32>>>,
        away: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Sink for Memory {
        type Item = u32;

        async fn write(&self, batch: &mut Vec<u32>, _: &Dropped) -> Result<(), StoreError> {
            if self.away.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(StoreError::Unavailable(sqlx::Error::PoolTimedOut));
            }
            self.written.lock().unwrap().append(batch);
            Ok(())
        }
    }

    fn counter() -> &'static Counter {
        static C: OnceLock<Counter> = OnceLock::new();
        C.get_or_init(Counter::default)
    }

    fn start(sink: &Memory, queued: usize) -> (WriteBehind<u32>, CancellationToken, TaskTracker) {
        let stop = CancellationToken::new();
        let tasks = TaskTracker::new();
        let queue = WriteBehind::start(
            sink.clone(),
            Bounds { queued, batch: 7 },
            Dropped {
                what: "test items",
                counter: counter(),
            },
            stop.clone(),
            &tasks,
        );
        (queue, stop, tasks)
    }

    #[tokio::test]
    async fn a_flush_sees_everything_queued_before_it_in_order() {
        let sink = Memory::default();
        let (queue, _stop, _tasks) = start(&sink, 1000);
        for i in 0..100 {
            queue.push(i);
        }
        assert!(queue.flush(Duration::from_secs(30)).await, "the flush ends");
        assert_eq!(*sink.written.lock().unwrap(), (0..100).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn shutdown_drains_the_queue() {
        let sink = Memory::default();
        let (queue, stop, tasks) = start(&sink, 1000);
        for i in 0..50 {
            queue.push(i);
        }
        stop.cancel();
        tasks.close();
        tasks.wait().await;
        assert_eq!(*sink.written.lock().unwrap(), (0..50).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn items_wait_through_an_outage_and_are_written_after_it_in_order() {
        let sink = Memory::default();
        sink.away.store(true, std::sync::atomic::Ordering::SeqCst);
        let (queue, _stop, _tasks) = start(&sink, 1000);
        for i in 0..20 {
            queue.push(i);
        }
        assert!(
            !queue.flush(Duration::from_millis(50)).await,
            "nothing can be written while Postgres is away"
        );
        assert!(sink.written.lock().unwrap().is_empty());
        sink.away.store(false, std::sync::atomic::Ordering::SeqCst);
        assert!(
            queue.flush(Duration::from_secs(30)).await,
            "written once back"
        );
        assert_eq!(*sink.written.lock().unwrap(), (0..20).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_full_queue_drops_and_counts() {
        let sink = Memory::default();
        sink.away.store(true, std::sync::atomic::Ordering::SeqCst);
        let (queue, _stop, _tasks) = start(&sink, 3);
        let before = counter().get();
        // The writer holds at most one batch in hand and the queue three more; the rest of
        // 100 cannot fit.
        for i in 0..100 {
            queue.push(i);
        }
        assert!(
            counter().get() - before >= 100 - 3 - 7,
            "dropped items are counted"
        );
    }
}
