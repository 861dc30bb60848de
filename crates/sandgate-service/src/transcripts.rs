//! Transcripts of what ran in each sandbox (issue 13): recorded after every cell, command and
//! file transfer, kept in Postgres (so they survive the sandbox and every replica sees them),
//! bounded per sandbox, readable by the sandbox's tenant only, and exported as a notebook or an
//! HTML page for the person who takes over the conversation.
//!
//! Recording is off the answer's path (issue 16): a call queues its entry (a channel send) and
//! a background writer appends what is queued in batches, per sandbox in the order the calls
//! ended ([`crate::write_behind`]: drained at graceful shutdown, kept and retried while
//! Postgres is away, anything lost counted in `sandgate_transcript_entries_lost_total`). A
//! transcript loaded through this process first waits for the entries it has queued, so the
//! person who takes over sees every call that answered, in order.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, Utc};
use prometheus_client::metrics::counter::Counter;
use sandgate_sandbox::{CommandOutcome, ExecOutcome, FileInfo};
use sandgate_store::sandboxes::SandboxRow;
use sandgate_store::transcripts::{self as store, Appended, NewEntry, Owner};
use sandgate_store::{PgPool, StoreError};
use sandgate_transcript::{Cell, CellError, Command, Entry, FileEvent, Part, Record};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::ServiceError;
use crate::config::RetentionConfig;
use crate::write_behind::{Bounds, Dropped, Sink, WriteBehind};
/// What a load left out (see [`Transcript::omitted`]).
pub use sandgate_transcript::Omitted;
/// The `Content-Security-Policy` an HTML transcript must be served with: a sandboxed,
/// script-less document in an opaque origin (its content came from untrusted code).
pub use sandgate_transcript::html::CONTENT_SECURITY_POLICY;
/// A loaded transcript and its rendering inside another page (the console), for the faces.
pub use sandgate_transcript::html::{HtmlResults, render_parts};
pub use sandgate_transcript::{Bound, Transcript, human_bytes};

/// Most entries waiting to be written. Calls need Postgres to start, so the queue fills only
/// when Postgres goes away with calls running; an entry can be large (output, charts).
const QUEUE_ENTRIES: usize = 10_000;
/// Most entries handed to the writer at once.
const BATCH_ENTRIES: usize = 200;
/// How long a load waits for this process's queued entries before it reads anyway.
const FLUSH_BEFORE_LOAD: Duration = Duration::from_secs(5);
/// How long a load waits for a place among the loads at once before it is refused.
const LOAD_PLACE_WAIT: Duration = Duration::from_secs(5);
/// The retry a refused load suggests, seconds.
const LOAD_RETRY_SECONDS: u32 = 5;

/// Transcript entries never written (queue full, Postgres away through shutdown, or refused by
/// the database): `sandgate_transcript_entries_lost_total` in `/metrics`. Not the entries a
/// full transcript does not keep (those are counted in the transcript itself).
pub fn lost_counter() -> &'static Counter {
    static LOST: OnceLock<Counter> = OnceLock::new();
    LOST.get_or_init(Counter::default)
}

/// Transcript entries not kept because their tenant's transcripts were at their byte budget
/// (`retention.transcript_tenant_max_bytes`): `sandgate_transcript_entries_over_budget_total`.
/// Each transcript counts its own too, and its export says so.
pub fn over_budget_counter() -> &'static Counter {
    static OVER: OnceLock<Counter> = OnceLock::new();
    OVER.get_or_init(Counter::default)
}

/// Records and loads transcripts. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Transcripts {
    db: PgPool,
    bound: Bound,
    retention_seconds: u64,
    queue: WriteBehind<Queued>,
    load: LoadBound,
    /// Places for loads at once in this process (each holds its bytes and a connection).
    loads: Arc<Semaphore>,
}

/// How much one load reads.
#[derive(Debug, Clone, Copy)]
struct LoadBound {
    max_parts: u32,
    max_bytes: u64,
}

/// A transcript's size and shape, read without its entries (for `export_transcript` and the
/// transcripts page): what a load of it would hold and what it would leave out.
#[derive(Debug, Clone, PartialEq)]
pub struct Outline {
    /// The conversation, when the subject is one (or the sandbox was bound to one).
    pub conversation_id: Option<String>,
    /// The sandboxes a load holds, oldest first.
    pub parts: Vec<PartOutline>,
    /// The oldest sandboxes a load leaves out.
    pub omitted: Omitted,
}

/// One sandbox's part of an [`Outline`].
#[derive(Debug, Clone, PartialEq)]
pub struct PartOutline {
    /// `sbx_…`.
    pub sandbox_id: String,
    /// Calls kept.
    pub calls: u64,
    /// Stored bytes kept.
    pub bytes: u64,
    /// Calls not kept.
    pub dropped: u64,
    /// Of those, not kept for the tenant's byte budget.
    pub over_budget: u64,
}

impl Outline {
    /// A short title: the conversation, else the sandbox.
    pub fn title(&self) -> String {
        match (&self.conversation_id, self.parts.first()) {
            (Some(c), _) => format!("Conversation {c}"),
            (None, Some(p)) => format!("Sandbox {}", p.sandbox_id),
            (None, None) => "Empty transcript".to_owned(),
        }
    }
}

/// An entry waiting to be written.
#[derive(Debug)]
struct Queued {
    tenant_id: Uuid,
    sandbox_id: String,
    conversation_id: Option<String>,
    at: DateTime<Utc>,
    entry: Entry,
}

/// Whose transcript.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Subject {
    /// One sandbox's.
    Sandbox(String),
    /// A conversation's: every sandbox it had, oldest first.
    Conversation(String),
}

impl Subject {
    /// `sandbox sbx_…` / `conversation "…"`, for messages.
    pub fn describe(&self) -> String {
        match self {
            Subject::Sandbox(id) => format!("sandbox {id}"),
            Subject::Conversation(id) => format!("conversation {id:?}"),
        }
    }
}

/// A handoff format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Jupyter notebook (nbformat 4.5).
    Notebook,
    /// Self-contained HTML page.
    Html,
}

impl Format {
    /// Parses `ipynb` / `html` (and a few spellings of them).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "ipynb" | "notebook" | "jupyter" => Some(Format::Notebook),
            "html" | "htm" => Some(Format::Html),
            _ => None,
        }
    }

    /// File extension.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Notebook => "ipynb",
            Format::Html => "html",
        }
    }

    /// MIME type.
    pub fn mime_type(self) -> &'static str {
        match self {
            Format::Notebook => "application/x-ipynb+json",
            Format::Html => "text/html",
        }
    }

    /// The transcript in this format.
    pub fn render(self, transcript: &Transcript) -> String {
        match self {
            Format::Notebook => {
                serde_json::to_string_pretty(&sandgate_transcript::notebook::render(transcript))
                    .expect("a notebook serializes")
            }
            Format::Html => sandgate_transcript::html::render(transcript),
        }
    }
}

/// Why a transcript could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TranscriptError {
    /// Nothing for this tenant under that sandbox or conversation (or it was purged).
    #[error(
        "no transcript for {subject}: nothing has run there yet, it belongs to no sandbox of \
         yours, or it was deleted after the retention period ({days} days after the sandbox \
         ended); check the id"
    )]
    NotFound {
        /// What was asked for.
        subject: String,
        /// The retention in force, days.
        days: u64,
    },
    /// Postgres failed.
    #[error("transcripts are temporarily unavailable; retry in a moment")]
    Store(#[from] StoreError),
    /// This process already runs its most transcript loads at once.
    #[error(
        "limit reached: transcript exports at once on this gateway; retry in {LOAD_RETRY_SECONDS} s"
    )]
    Busy,
}

impl From<TranscriptError> for ServiceError {
    fn from(err: TranscriptError) -> Self {
        match err {
            TranscriptError::NotFound { .. } => ServiceError::NotFound(err.to_string()),
            TranscriptError::Store(store) => ServiceError::from(store),
            TranscriptError::Busy => ServiceError::Busy {
                what: "transcript exports at once on this gateway".into(),
                retry_after_seconds: LOAD_RETRY_SECONDS,
            },
        }
    }
}

impl Transcripts {
    /// Transcripts kept under the `[retention]` settings; their writer runs on `tasks` and
    /// drains its queue when `stop` is cancelled.
    pub fn start(
        db: PgPool,
        config: &RetentionConfig,
        stop: CancellationToken,
        tasks: &TaskTracker,
    ) -> Self {
        let bound = bound_of(config);
        let sink = EntrySink {
            db: db.clone(),
            bound: store_bound(bound),
        };
        let bounds = Bounds {
            queued: QUEUE_ENTRIES,
            batch: BATCH_ENTRIES,
        };
        let lost = Dropped {
            what: "transcript entries",
            counter: lost_counter(),
        };
        Self {
            db,
            bound,
            retention_seconds: config.transcripts_seconds,
            queue: WriteBehind::start(sink, bounds, lost, stop, tasks),
            load: LoadBound {
                max_parts: config.transcript_load_max_parts,
                max_bytes: config.transcript_load_max_bytes,
            },
            loads: Arc::new(Semaphore::new(config.transcript_loads_at_once as usize)),
        }
    }

    /// Appends what just happened in a sandbox to its transcript, behind the answer: the entry
    /// is queued, never waited for, and never fails the call that produced it (the call's own
    /// result is what the model needs).
    pub fn record(&self, row: &SandboxRow, entry: Entry) {
        let Some(tenant_id) = row.tenant_id else {
            return;
        };
        self.queue.push(Queued {
            tenant_id,
            sandbox_id: row.id.clone(),
            conversation_id: row.conversation_id.clone(),
            at: Utc::now(),
            entry,
        });
    }

    /// How much one sandbox's transcript keeps.
    pub fn bound(&self) -> Bound {
        self.bound
    }

    /// The transcript retention in force for a tenant, seconds.
    pub async fn retention_seconds(&self, tenant: Uuid) -> Result<u64, StoreError> {
        crate::retention::tenant_retention(&self.db, self.retention_seconds, tenant).await
    }

    /// What sandgate keeps for `tenant`, as markdown (the data-policy resource).
    pub async fn policy_markdown(&self, tenant: Uuid) -> Result<String, StoreError> {
        let seconds = self.retention_seconds(tenant).await?;
        let bound = self.bound();
        Ok(format!(
            "# What sandgate keeps for your tenant\n\n\
             - Files in a sandbox live only in its container and are deleted when the sandbox ends.\n\
             - A transcript of each sandbox (code, output, charts, errors, file names, sizes and \
               hashes; never the files) is kept for {days} days after the sandbox ends, then deleted. \
               It keeps the first {entries} calls and at most {bytes} per sandbox, at most {tenant} \
               over all your tenant's transcripts, and says so when it dropped some.\n\
             - Only your tenant can read its transcripts: through export_transcript, these resources, \
               download links (15 minutes; they stop when the app that made them is disconnected) and \
               your users' page at /transcripts.\n\
             - The audit trail records who called which tool on which sandbox, the outcome and the \
               duration; never code, output or file contents.\n",
            days = seconds / 86_400,
            entries = bound.max_entries,
            bytes = sandgate_transcript::human_bytes(bound.max_bytes),
            tenant = sandgate_transcript::human_bytes(bound.tenant_max_bytes),
        ))
    }

    /// A tenant's transcript of a sandbox or conversation, rendered in `format`: loaded and
    /// rendered in one of this process's places for loads at once (see [`Self::load`]).
    pub async fn render(
        &self,
        tenant: Uuid,
        subject: &Subject,
        format: Format,
    ) -> Result<String, TranscriptError> {
        let place = self.place().await?;
        let transcript = self.load_in_place(tenant, subject).await?;
        let rendered = format.render(&transcript);
        drop(place);
        Ok(rendered)
    }

    /// A tenant's transcript of a sandbox or conversation: a conversation's newest sandboxes
    /// up to `retention.transcript_load_max_parts` and `transcript_load_max_bytes` (the newest
    /// always), oldest first, with what was left out in [`Transcript::omitted`]. At most
    /// `retention.transcript_loads_at_once` loads run at once in this process; one more waits
    /// a little, then is [`TranscriptError::Busy`].
    pub async fn load(
        &self,
        tenant: Uuid,
        subject: &Subject,
    ) -> Result<Transcript, TranscriptError> {
        let _place = self.place().await?;
        self.load_in_place(tenant, subject).await
    }

    /// What a load of the transcript would hold and leave out, read without its entries.
    pub async fn outline(
        &self,
        tenant: Uuid,
        subject: &Subject,
    ) -> Result<Outline, TranscriptError> {
        self.flush_queued().await;
        let mut conn = sandgate_store::acquire(&self.db).await?;
        let (summaries, conversation_id, omitted) = self.chosen(&mut conn, tenant, subject).await?;
        drop(conn);
        Ok(Outline {
            conversation_id,
            parts: summaries
                .into_iter()
                .map(|s| PartOutline {
                    sandbox_id: s.sandbox_id,
                    calls: s.entries.max(0) as u64,
                    bytes: s.bytes.max(0) as u64,
                    dropped: s.dropped.max(0) as u64,
                    over_budget: s.over_budget.max(0) as u64,
                })
                .collect(),
            omitted,
        })
    }

    /// A place among the loads at once, waited for a little.
    async fn place(&self) -> Result<tokio::sync::OwnedSemaphorePermit, TranscriptError> {
        tokio::time::timeout(LOAD_PLACE_WAIT, self.loads.clone().acquire_owned())
            .await
            .map_err(|_| TranscriptError::Busy)?
            .map_err(|_| TranscriptError::Busy)
    }

    /// What this process's calls queued is written first: the person who takes over sees
    /// every call that answered. (Another replica's last few milliseconds may still be on
    /// their way.)
    async fn flush_queued(&self) {
        if !self.queue.flush(FLUSH_BEFORE_LOAD).await {
            tracing::warn!("transcript entries still queued; loading what is written");
        }
    }

    async fn load_in_place(
        &self,
        tenant: Uuid,
        subject: &Subject,
    ) -> Result<Transcript, TranscriptError> {
        self.flush_queued().await;
        let mut conn = sandgate_store::acquire(&self.db).await?;
        let (summaries, conversation_id, omitted) = self.chosen(&mut conn, tenant, subject).await?;
        let mut parts = Vec::with_capacity(summaries.len());
        for summary in summaries {
            let rows = store::entries(&mut conn, &summary.sandbox_id).await?;
            parts.push(part_of(summary, rows));
        }
        Ok(Transcript {
            conversation_id,
            parts,
            bound: self.bound,
            omitted,
            exported_at: Utc::now(),
        })
    }

    /// The sandboxes a load of `subject` reads (oldest first), its conversation, and what it
    /// leaves out; `NotFound` when there is nothing.
    async fn chosen(
        &self,
        conn: &mut sqlx::PgConnection,
        tenant: Uuid,
        subject: &Subject,
    ) -> Result<(Vec<store::Summary>, Option<String>, Omitted), TranscriptError> {
        let (mut summaries, conversation_id) = match subject {
            Subject::Sandbox(id) => {
                let found = store::of_sandbox(conn, tenant, id).await?;
                // A legacy MCP session standing in for the conversation is not shown.
                let conversation = found
                    .as_ref()
                    .and_then(|s| s.conversation_id.clone())
                    .filter(|c| !c.starts_with("mcp-session:"));
                (found.into_iter().collect::<Vec<_>>(), conversation)
            }
            Subject::Conversation(id) => {
                let limit = i64::from(self.load.max_parts);
                let newest = store::of_conversation(conn, tenant, id, limit).await?;
                (newest, Some(id.clone()))
            }
        };
        if summaries.is_empty() {
            let seconds = self.retention_seconds(tenant).await?;
            return Err(TranscriptError::NotFound {
                subject: subject.describe(),
                days: seconds / 86_400,
            });
        }
        // Newest first: keep while the bytes fit (the newest whatever its size).
        let mut bytes = 0u64;
        let mut kept = 0;
        for summary in &summaries {
            let size = summary.bytes.max(0) as u64;
            if kept > 0 && bytes + size > self.load.max_bytes {
                break;
            }
            bytes += size;
            kept += 1;
        }
        let mut omitted = Omitted::default();
        for left in summaries.drain(kept..) {
            omitted.parts += 1;
            omitted.calls += left.entries.max(0) as u64;
            omitted.bytes += left.bytes.max(0) as u64;
        }
        if let Subject::Conversation(id) = subject {
            let skip = i64::from(self.load.max_parts);
            let (parts, calls, older) =
                store::older_of_conversation(conn, tenant, id, skip).await?;
            omitted.parts += parts.max(0) as u32;
            omitted.calls += calls.max(0) as u64;
            omitted.bytes += older.max(0) as u64;
        }
        summaries.reverse();
        Ok((summaries, conversation_id, omitted))
    }
}

/// How much one sandbox's transcript keeps, from the `[retention]` settings.
pub fn bound_of(config: &RetentionConfig) -> Bound {
    Bound {
        max_entries: config.transcript_max_entries,
        max_bytes: config.transcript_max_bytes,
        tenant_max_bytes: config.transcript_tenant_max_bytes,
    }
}

/// A bound in the store's terms.
fn store_bound(bound: Bound) -> store::Bound {
    store::Bound {
        max_entries: i32::try_from(bound.max_entries).unwrap_or(i32::MAX),
        max_bytes: i64::try_from(bound.max_bytes).unwrap_or(i64::MAX),
        tenant_max_bytes: i64::try_from(bound.tenant_max_bytes).unwrap_or(i64::MAX),
    }
}

/// Writes a mark of what happened to a sandbox itself (its pause, its resume, a fork) into its
/// transcript now, under `bound`, in a transaction of its own once the transition it marks has
/// committed: not through a process's queue, because the service operations that make marks
/// (the reaper's pause, a resume, a fork) run where no [`Transcripts`] is at hand, and a
/// resume's mark must come before the entry of the call that resumed it. A mark that cannot be
/// written is logged and counted lost; the transition stands.
pub(crate) async fn write_mark(db: &PgPool, bound: Bound, row: &SandboxRow, entry: Entry) {
    let Some(tenant_id) = row.tenant_id else {
        return;
    };
    let sink = EntrySink {
        db: db.clone(),
        bound: store_bound(bound),
    };
    let kind = entry.kind();
    let queued = Queued {
        tenant_id,
        sandbox_id: row.id.clone(),
        conversation_id: row.conversation_id.clone(),
        at: Utc::now(),
        entry,
    };
    if let Err(err) = sink.append(&[&queued]).await {
        lost_counter().inc();
        tracing::warn!(error = %err, sandbox_id = %row.id, kind, "a transcript mark was not written");
    }
}

/// A stored sandbox transcript as a part of a [`Transcript`] (an unreadable entry is skipped
/// and logged).
fn part_of(summary: store::Summary, rows: Vec<store::EntryRow>) -> Part {
    let records = rows
        .into_iter()
        .filter_map(|row| match serde_json::from_value::<Entry>(row.body) {
            Ok(entry) => Some(Record {
                seq: row.seq,
                at: row.at,
                entry,
            }),
            Err(err) => {
                tracing::warn!(error = %err, sandbox_id = %summary.sandbox_id, seq = row.seq, "skipping an unreadable transcript entry");
                None
            }
        })
        .collect();
    Part {
        sandbox_id: summary.sandbox_id,
        started_at: summary.leased_at,
        closed_at: summary.closed_at,
        records,
        dropped: summary.dropped.max(0) as u32,
        over_budget: summary.over_budget.max(0) as u32,
    }
}

/// Appends queued entries, one transaction per sandbox, each sandbox's in queue order.
struct EntrySink {
    db: PgPool,
    bound: store::Bound,
}

impl Sink for EntrySink {
    type Item = Queued;

    async fn write(&self, batch: &mut Vec<Queued>, lost: &Dropped) -> Result<(), StoreError> {
        // Sandboxes in the order their first entry was queued; each one's entries in order.
        let mut sandboxes: Vec<&str> = Vec::new();
        for queued in batch.iter() {
            if !sandboxes.contains(&queued.sandbox_id.as_str()) {
                sandboxes.push(&queued.sandbox_id);
            }
        }
        let mut done: Vec<String> = Vec::with_capacity(sandboxes.len());
        let mut outage = None;
        for sandbox in sandboxes {
            let entries: Vec<&Queued> = batch.iter().filter(|q| q.sandbox_id == sandbox).collect();
            match self.append(&entries).await {
                Ok(()) => {}
                Err(err) if err.is_unavailable() => {
                    outage = Some(err);
                    break;
                }
                // Not an outage (the sandbox's row is gone, a bad value): retrying would not
                // help, and the other sandboxes' entries must not wait for it.
                Err(err) => lost.count(
                    entries.len(),
                    &format!("refused by the database for sandbox {sandbox}: {err}"),
                ),
            }
            done.push(sandbox.to_owned());
        }
        batch.retain(|q| !done.contains(&q.sandbox_id));
        outage.map_or(Ok(()), Err)
    }
}

impl EntrySink {
    /// Appends one sandbox's queued entries in one transaction.
    async fn append(&self, entries: &[&Queued]) -> Result<(), StoreError> {
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let bodies: Vec<serde_json::Value> = entries
            .iter()
            .map(|q| serde_json::to_value(&q.entry).expect("entries serialize"))
            .collect();
        let new: Vec<NewEntry<'_>> = entries
            .iter()
            .zip(&bodies)
            .map(|(q, body)| NewEntry {
                at: q.at,
                kind: q.entry.kind(),
                body,
                bytes: body.to_string().len() as i64,
            })
            .collect();
        let owner = Owner {
            tenant_id: first.tenant_id,
            sandbox_id: &first.sandbox_id,
            conversation_id: first.conversation_id.as_deref(),
        };
        let mut tx = sandgate_store::begin(&self.db).await?;
        let appended = store::append_all(&mut tx, owner, &new, self.bound).await?;
        sandgate_store::commit(tx).await?;
        if appended.is_empty() {
            tracing::info!(sandbox_id = %first.sandbox_id, entries = entries.len(), "the tenant's content was purged; late transcript entries not written");
        }
        let over_budget = appended
            .iter()
            .filter(|a| matches!(a, Appended::OverBudget))
            .count();
        if over_budget > 0 {
            over_budget_counter().inc_by(over_budget as u64);
            tracing::info!(sandbox_id = %first.sandbox_id, tenant_id = %first.tenant_id, entries = over_budget, "the tenant's transcripts are at their byte budget; entries counted, not kept");
        }
        let full = appended
            .iter()
            .filter(|a| matches!(a, Appended::Dropped))
            .count();
        if full > 0 {
            tracing::debug!(sandbox_id = %first.sandbox_id, entries = full, "transcript full; entries counted, not kept");
        }
        Ok(())
    }
}

/// A cell's transcript entry (charts as base64 PNG in their MIME bundles).
pub fn cell_entry(code: &str, outcome: &ExecOutcome) -> Entry {
    let displays = outcome
        .displays
        .iter()
        .map(|d| {
            let mut bundle: BTreeMap<String, serde_json::Value> = d
                .data
                .iter()
                .filter(|(mime, _)| mime.as_str() != "image/png")
                .map(|(mime, value)| (mime.clone(), serde_json::Value::String(value.clone())))
                .collect();
            if let Some(png) = &d.png {
                bundle.insert("image/png".into(), BASE64.encode(png).into());
            }
            bundle
        })
        .collect();
    Entry::Cell(Cell {
        code: code.to_owned(),
        stdout: outcome.stdout.clone(),
        stderr: outcome.stderr.clone(),
        result: outcome.result.as_ref().map(|bundle| {
            bundle
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect()
        }),
        error: outcome.error.as_ref().map(|e| CellError {
            name: e.name.clone(),
            value: e.value.clone(),
            traceback: e.traceback.clone(),
        }),
        displays,
        execution_count: outcome.execution_count,
        truncated: outcome.truncated,
        timed_out: outcome.timed_out,
        state_lost: outcome.state_lost,
        duration_ms: outcome.duration.as_millis() as u64,
        by: None,
    })
}

/// A command's transcript entry.
pub fn command_entry(command: &str, cwd: Option<&str>, outcome: &CommandOutcome) -> Entry {
    Entry::Command(Command {
        command: command.to_owned(),
        cwd: cwd.map(str::to_owned),
        stdout: outcome.stdout.clone(),
        stderr: outcome.stderr.clone(),
        exit_code: outcome.exit_code,
        signal: outcome.signal,
        timed_out: outcome.timed_out,
        truncated: outcome.truncated,
        duration_ms: outcome.duration.as_millis() as u64,
        by: None,
    })
}

/// An upload's (`fetched: false`) or a fetch's transcript entry: name, size and hash only.
pub fn file_entry(info: &FileInfo, fetched: bool) -> Entry {
    let event = FileEvent {
        path: info.path.clone(),
        size: info.size,
        sha256: info.sha256.clone(),
        by: None,
    };
    if fetched {
        Entry::Fetch(event)
    } else {
        Entry::Upload(event)
    }
}
