//! The agent channel: one attach stream per sandbox, many calls in flight on it.
//!
//! Implements the gateway side of `agent/PROTOCOL.md`. A writer task owns the container's stdin and
//! writes whole frames (flushing after each); a reader task splits the container's stdout into
//! frames and routes each to the call waiting for its id. Calls may overlap (a file read or a ping
//! while a cell runs); the agent decides what runs concurrently. When the stream ends every pending
//! call fails with [`ChannelError::AttachLost`] and the reason; the manager then asks the engine why.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use crate::backend::{AgentStreams, StreamChunk};
use crate::config::ChannelConfig;
use crate::protocol::{
    self, CHUNK_BYTES, Inbound, LineSplitter, MAX_FRAME_BYTES, PROTOCOL_VERSION, ReadyInfo,
    WireError,
};

/// Frames waiting for the writer task; bounds what an upload holds in memory (~350 KB each).
const WRITE_QUEUE_FRAMES: usize = 16;

/// Deliveries waiting for one call; the reader blocks (backpressure) when a call falls behind.
const CALL_QUEUE_FRAMES: usize = 64;

/// Room kept beyond a call's output limit for the agent's own truncation marker.
const MARKER_SLACK: usize = 4096;

/// A failure reported by the agent for one request (PROTOCOL.md, error kinds). The messages are
/// meant for the end user (they reach the model as tool errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// The path resolves outside /home/user (`..`, an absolute path elsewhere, a symlink out).
    #[error("{message}; files are confined to /home/user")]
    OutsideHome {
        /// The agent's text.
        message: String,
    },
    /// The file or directory does not exist.
    #[error("{message}")]
    NotFound {
        /// The agent's text.
        message: String,
    },
    /// The file exists and overwriting was not asked for.
    #[error("{message}; pass overwrite to replace it")]
    Exists {
        /// The agent's text.
        message: String,
    },
    /// A directory was given where a file was expected.
    #[error("{message}")]
    IsDirectory {
        /// The agent's text.
        message: String,
    },
    /// A file was given where a directory was expected.
    #[error("{message}")]
    NotADirectory {
        /// The agent's text.
        message: String,
    },
    /// The file is larger than the caller's limit.
    #[error("{message}")]
    TooLarge {
        /// The file's size, when the agent's text names it.
        size: Option<u64>,
        /// The limit that was asked for.
        limit: u64,
        /// The agent's text.
        message: String,
    },
    /// The request was malformed (a NUL byte in a path, a bad argument).
    #[error("bad request: {message}")]
    BadRequest {
        /// The agent's text.
        message: String,
    },
    /// An I/O error inside the sandbox (disk full, permission denied …).
    #[error("{message}")]
    Io {
        /// The agent's text.
        message: String,
    },
    /// A bug in the agent.
    #[error("the sandbox agent failed: {message}")]
    Internal {
        /// The agent's text.
        message: String,
    },
}

impl AgentError {
    fn from_wire(err: WireError, limit: u64) -> Self {
        let WireError { kind, message } = err;
        match kind.as_str() {
            "outside_home" => Self::OutsideHome { message },
            "not_found" => Self::NotFound { message },
            "exists" => Self::Exists { message },
            "is_directory" => Self::IsDirectory { message },
            "not_a_directory" => Self::NotADirectory { message },
            "too_large" => Self::TooLarge {
                size: size_in_message(&message),
                limit,
                message,
            },
            "bad_request" => Self::BadRequest { message },
            "io" => Self::Io { message },
            "internal" => Self::Internal { message },
            other => Self::Internal {
                message: format!("{other}: {message}"),
            },
        }
    }
}

/// The agent writes "<path> is N bytes, larger than the limit of M"; the size is the number before
/// the first " bytes".
fn size_in_message(message: &str) -> Option<u64> {
    let before = &message[..message.find(" bytes")?];
    let digits = before.rsplit(|c: char| !c.is_ascii_digit()).next()?;
    digits.parse().ok()
}

/// What went wrong talking to a sandbox's agent.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ChannelError {
    /// The attach stream ended or broke; every call in flight fails with this.
    #[error("the connection to the sandbox was lost: {reason}")]
    AttachLost {
        /// What the channel saw (stream ended, read or write error).
        reason: String,
    },
    /// The agent did not say ready in time.
    #[error("the sandbox's agent did not become ready within {}s", waited.as_secs())]
    ReadyTimeout {
        /// How long the channel waited.
        waited: Duration,
    },
    /// The agent speaks another protocol version.
    #[error("the sandbox's agent speaks protocol {found}; this gateway speaks {expected}")]
    ProtocolVersion {
        /// What the agent announced.
        found: u64,
        /// What this gateway speaks.
        expected: u64,
    },
    /// The kernel was restarted while this call was in flight.
    #[error(
        "the Python kernel was restarted before this call finished; variables defined earlier are gone (files in /home/user are kept)"
    )]
    KernelRestarted,
    /// The agent did not answer in time.
    #[error("the sandbox did not answer {op} within {}s", waited.as_secs())]
    Unresponsive {
        /// The operation.
        op: &'static str,
        /// How long the channel waited.
        waited: Duration,
    },
    /// The agent refused or failed the request.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The answer was larger than the gateway accepts and was dropped.
    #[error(
        "the answer was {len} bytes, more than the {limit} bytes the gateway accepts, and was dropped (kernel state is kept; e.g. assign a large value to a variable instead of displaying it)"
    )]
    FrameTooLarge {
        /// Bytes seen.
        len: usize,
        /// The gateway's limit.
        limit: usize,
    },
    /// A file arrived different from what the agent said it sent.
    #[error("the transfer of {path} was corrupted ({detail})")]
    TransferCorrupted {
        /// The file.
        path: String,
        /// What did not match.
        detail: String,
    },
    /// The agent sent something this gateway does not understand.
    #[error("the sandbox's agent sent an unexpected answer: {detail}")]
    Protocol {
        /// What was unexpected.
        detail: String,
    },
}

/// How to run a cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOptions {
    /// When the cell is interrupted.
    pub timeout: Duration,
    /// Most bytes of stdout and stderr together kept (the agent caps at this too).
    pub output_limit: usize,
    /// Most bytes of images (decoded PNG) kept from one cell.
    pub display_limit: usize,
}

impl Default for ExecOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            output_limit: 1 << 20,
            display_limit: 32 << 20,
        }
    }
}

/// A MIME bundle: MIME type → content (`text/plain`, `text/html`, base64 for binary types).
pub type MimeBundle = BTreeMap<String, String>;

/// A rich output of a cell (a chart).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Display {
    /// The decoded `image/png`, when the display has one.
    pub png: Option<Vec<u8>>,
    /// The other representations (`text/plain`, `text/html` …).
    pub data: MimeBundle,
    /// Where the agent saved the image under /home/user, when it did.
    pub path: Option<String>,
}

/// Output while a call runs, for progress notifications. Best effort: when the receiver falls
/// behind, events are dropped (the outcome still has all output up to the limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputEvent {
    /// A piece of stdout.
    Stdout(String),
    /// A piece of stderr.
    Stderr(String),
    /// A chart.
    Display(Display),
}

/// An exception raised by a cell.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct CellError {
    /// Exception class, e.g. `ZeroDivisionError`.
    pub name: String,
    /// Its message.
    #[serde(default)]
    pub value: String,
    /// Plain-text traceback lines.
    #[serde(default)]
    pub traceback: Vec<String>,
}

/// What a cell did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExecOutcome {
    /// Everything printed to stdout (by Python and child processes), up to the limit.
    pub stdout: String,
    /// Everything printed to stderr, up to the limit (the truncation marker lands here).
    pub stderr: String,
    /// The value of the last expression, `None` when there is none.
    pub result: Option<MimeBundle>,
    /// The exception, when the cell raised one (`KeyboardInterrupt` when interrupted).
    pub error: Option<CellError>,
    /// The kernel's execution counter for this cell (absent when the kernel was restarted).
    pub execution_count: Option<u64>,
    /// Charts and other rich outputs, in order.
    pub displays: Vec<Display>,
    /// Output (or images) beyond the limits were dropped.
    pub truncated: bool,
    /// The cell hit its timeout and was interrupted.
    pub timed_out: bool,
    /// The cell did not stop when interrupted; the kernel was restarted and its variables are gone.
    pub state_lost: bool,
    /// Wall time of the call.
    pub duration: Duration,
}

/// How to run a shell command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommandOptions {
    /// When the command's process group is killed.
    pub timeout: Duration,
    /// Most bytes of stdout and stderr together kept.
    pub output_limit: usize,
    /// Working directory under /home/user (default: /home/user).
    pub cwd: Option<String>,
}

impl Default for CommandOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            output_limit: 1 << 20,
            cwd: None,
        }
    }
}

/// What a shell command did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CommandOutcome {
    /// Its stdout, up to the limit.
    pub stdout: String,
    /// Its stderr, up to the limit.
    pub stderr: String,
    /// Exit code, when it exited normally.
    pub exit_code: Option<i32>,
    /// The signal that ended it, when one did.
    pub signal: Option<i32>,
    /// It hit its timeout and its process group was killed.
    pub timed_out: bool,
    /// Output beyond the limit was dropped.
    pub truncated: bool,
    /// Wall time of the call.
    pub duration: Duration,
}

/// A file in the sandbox, as written or read.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct FileInfo {
    /// Absolute path under /home/user.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Lower-case hex SHA-256 of the content.
    pub sha256: String,
}

/// The type of a directory entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EntryKind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
    /// A symbolic link (not followed).
    Symlink,
    /// Anything else.
    Other,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct DirEntry {
    /// File name.
    pub name: String,
    /// Its type.
    #[serde(rename = "type")]
    pub kind: EntryKind,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, unix seconds.
    pub modified: f64,
}

/// The agent's answer to a ping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct PingInfo {
    /// The agent's pid.
    pub pid: u64,
    /// Whether a cell is running.
    pub busy: bool,
}

/// What the reader hands to a waiting call.
#[derive(Debug)]
enum Delivery {
    Event {
        event: String,
        frame: Map<String, Value>,
    },
    Final(Result<Value, WireError>),
    Oversized {
        is_event: bool,
        len: usize,
    },
}

#[derive(Debug, Default)]
struct Routes {
    calls: HashMap<u64, mpsc::Sender<Delivery>>,
    lost: Option<String>,
}

/// The link's state, watched by callers waiting for a ready frame.
#[derive(Debug, Clone, Default)]
struct Link {
    /// Ready frames seen (the first at start-up, one more per kernel restart).
    readies: u64,
    ready: Option<ReadyInfo>,
    lost: Option<String>,
}

#[derive(Debug)]
struct Shared {
    label: String,
    routes: Mutex<Routes>,
    link: watch::Sender<Link>,
}

impl Shared {
    fn routes(&self) -> std::sync::MutexGuard<'_, Routes> {
        // A panic while holding this lock leaves a map that is still consistent.
        self.routes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the link: pending calls see their route close and read the reason.
    fn lose(&self, reason: String) {
        let mut routes = self.routes();
        if routes.lost.is_some() {
            return;
        }
        tracing::debug!(sandbox = %self.label, %reason, "agent channel lost");
        routes.lost = Some(reason.clone());
        routes.calls.clear();
        self.link.send_modify(|l| l.lost = Some(reason));
    }

    async fn dispatch(&self, frame: Inbound) {
        let (id, delivery) = match frame {
            Inbound::Ready(info) => {
                let mut routes = self.routes();
                let restarted = self.link.borrow().readies > 0;
                if restarted {
                    // PROTOCOL.md, restart: calls pending at a restart are never answered.
                    tracing::info!(sandbox = %self.label, pending = routes.calls.len(), "agent restarted");
                    routes.calls.clear();
                }
                self.link.send_modify(|l| {
                    l.readies += 1;
                    l.ready = Some(info);
                });
                return;
            }
            Inbound::Event { id, event, frame } => (id, Delivery::Event { event, frame }),
            Inbound::Final { id, outcome } => (id, Delivery::Final(outcome)),
            Inbound::Oversized {
                id: Some(id),
                is_event,
                len,
            } => {
                tracing::warn!(sandbox = %self.label, id, len, "dropped an oversized frame");
                (id, Delivery::Oversized { is_event, len })
            }
            Inbound::Oversized { id: None, len, .. } => {
                tracing::warn!(sandbox = %self.label, len, "dropped an oversized frame without id");
                return;
            }
            Inbound::Unattributed(err) => {
                tracing::warn!(sandbox = %self.label, kind = %err.kind, message = %err.message, "agent reported an error without id");
                return;
            }
            Inbound::Garbage { detail } => {
                tracing::warn!(sandbox = %self.label, %detail, "agent wrote a line that is not a frame");
                return;
            }
        };
        let route = self.routes().calls.get(&id).cloned();
        let Some(route) = route else {
            // The answer to a fire-and-forget interrupt, or to a call that was dropped.
            tracing::trace!(sandbox = %self.label, id, "frame for no pending call");
            return;
        };
        if route.send(delivery).await.is_err() {
            self.routes().calls.remove(&id);
        }
    }
}

/// Logs the container's stderr line by line (agent diagnostics, crash tracebacks), bounded.
struct StderrLog {
    label: String,
    line: Vec<u8>,
}

impl StderrLog {
    const MAX_LINE: usize = 8192;

    fn push(&mut self, data: &[u8]) {
        for &b in data {
            if b == b'\n' {
                self.flush();
            } else if self.line.len() < Self::MAX_LINE {
                self.line.push(b);
            }
        }
    }

    fn flush(&mut self) {
        if !self.line.is_empty() {
            let text = String::from_utf8_lossy(&self.line);
            tracing::warn!(sandbox = %self.label, line = %text, "sandbox stderr");
            self.line.clear();
        }
    }
}

async fn read_loop(
    shared: Arc<Shared>,
    mut output: BoxStream<'static, std::io::Result<StreamChunk>>,
) {
    let mut lines = LineSplitter::new(MAX_FRAME_BYTES);
    let mut stderr = StderrLog {
        label: shared.label.clone(),
        line: Vec::new(),
    };
    let reason = loop {
        match output.next().await {
            None => break "the sandbox's output stream ended".to_owned(),
            Some(Err(err)) => break format!("reading the sandbox's output failed: {err}"),
            Some(Ok(StreamChunk::Stderr(data))) => stderr.push(&data),
            Some(Ok(StreamChunk::Stdout(data))) => {
                for frame in lines.push(&data) {
                    shared.dispatch(frame).await;
                }
            }
        }
    };
    stderr.flush();
    shared.lose(reason);
}

async fn write_loop(
    shared: Arc<Shared>,
    mut frames: mpsc::Receiver<Bytes>,
    mut input: std::pin::Pin<Box<dyn AsyncWrite + Send>>,
) {
    while let Some(frame) = frames.recv().await {
        // Flush after every frame: a request must not wait in a buffer for the next one.
        let written = async {
            input.write_all(&frame).await?;
            input.flush().await
        };
        if let Err(err) = written.await {
            shared.lose(format!("writing to the sandbox failed: {err}"));
            return;
        }
    }
    // Every sender is gone: the channel was dropped. The input is dropped without a shutdown, so
    // the container's stdin stays open and the agent keeps running for a later `adopt`.
}

struct Inner {
    shared: Arc<Shared>,
    writer: mpsc::Sender<Bytes>,
    next_id: AtomicU64,
    config: ChannelConfig,
    reader: AbortHandle,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Ends the reader, which releases the output half of the attach stream; the writer task
        // ends on its own once the last sender (ours, or a pending interrupt's) is gone.
        self.reader.abort();
    }
}

/// The conversation with one sandbox's agent over its attach stream. Cheap to clone; calls may run
/// concurrently. Dropping the last clone closes the attach stream but leaves the container and its
/// kernel running.
#[derive(Clone)]
pub struct AgentChannel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AgentChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentChannel")
            .field("sandbox", &self.inner.shared.label)
            .finish_non_exhaustive()
    }
}

/// A registered call: its route from the reader, removed when dropped.
struct Call {
    shared: Arc<Shared>,
    id: u64,
    rx: mpsc::Receiver<Delivery>,
    readies_at_start: u64,
}

impl Drop for Call {
    fn drop(&mut self) {
        self.shared.routes().calls.remove(&self.id);
    }
}

impl Call {
    /// The next delivery; when the route closed, the reason as an error.
    async fn next(&mut self) -> Result<Delivery, ChannelError> {
        match self.rx.recv().await {
            Some(d) => Ok(d),
            None => Err(self.closed_reason()),
        }
    }

    fn closed_reason(&self) -> ChannelError {
        let link = self.shared.link.borrow();
        if link.readies > self.readies_at_start {
            ChannelError::KernelRestarted
        } else if let Some(reason) = &link.lost {
            ChannelError::AttachLost {
                reason: reason.clone(),
            }
        } else {
            ChannelError::Protocol {
                detail: "the call's route closed unexpectedly".into(),
            }
        }
    }

    /// Waits for the final answer, ignoring events, within `timeout`.
    async fn finish(&mut self, op: &'static str, timeout: Duration) -> Result<Value, ChannelError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let delivery = tokio::time::timeout_at(deadline, self.next())
                .await
                .map_err(|_| ChannelError::Unresponsive {
                    op,
                    waited: timeout,
                })??;
            match delivery {
                Delivery::Event { .. } | Delivery::Oversized { is_event: true, .. } => {}
                Delivery::Final(outcome) => {
                    return outcome.map_err(|e| AgentError::from_wire(e, 0).into());
                }
                Delivery::Oversized { len, .. } => {
                    return Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    });
                }
            }
        }
    }
}

/// Sends `interrupt` for a call when dropped while armed: a caller that gives up on a running cell
/// or command (its future dropped) stops it instead of leaving it running.
struct InterruptOnDrop {
    channel: Option<AgentChannel>,
    target: u64,
}

impl InterruptOnDrop {
    fn disarm(&mut self) {
        self.channel = None;
    }
}

impl Drop for InterruptOnDrop {
    fn drop(&mut self) {
        let Some(channel) = self.channel.take() else {
            return;
        };
        let target = self.target;
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tracing::debug!(sandbox = %channel.inner.shared.label, target, "call dropped; interrupting it");
                let _ = channel.send_interrupt(target).await;
            });
        }
    }
}

/// Bounded accumulation of a call's output: the agent caps output too, but the gateway does not
/// rely on it.
struct OutputBuffer {
    stdout: String,
    stderr: String,
    room: usize,
    dropped: bool,
    displays: Vec<Display>,
    display_room: usize,
}

impl OutputBuffer {
    fn new(output_limit: usize, display_limit: usize) -> Self {
        Self {
            stdout: String::new(),
            stderr: String::new(),
            room: output_limit.saturating_add(MARKER_SLACK),
            dropped: false,
            displays: Vec::new(),
            display_room: display_limit,
        }
    }

    /// Keeps what fits; returns the kept part (to forward as an event), if any.
    fn push_text(&mut self, stderr: bool, text: &str) -> Option<String> {
        let keep = floor_char_boundary(text, self.room);
        if keep < text.len() {
            self.dropped = true;
        }
        if keep == 0 {
            return None;
        }
        let kept = &text[..keep];
        self.room -= keep;
        if stderr {
            self.stderr.push_str(kept);
        } else {
            self.stdout.push_str(kept);
        }
        Some(kept.to_owned())
    }

    fn push_display(&mut self, frame: &Map<String, Value>) -> Option<Display> {
        let Some(Value::Object(data)) = frame.get("data") else {
            return None;
        };
        let mut display = Display {
            path: frame.get("path").and_then(Value::as_str).map(str::to_owned),
            ..Display::default()
        };
        let mut size = 0;
        for (mime, value) in data {
            if mime == "image/png" {
                match value.as_str().map(|b64| BASE64.decode(b64)) {
                    Some(Ok(png)) => {
                        size += png.len();
                        display.png = Some(png);
                    }
                    _ => tracing::warn!("display with an undecodable image/png dropped"),
                }
            } else {
                let text = match value {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                size += text.len();
                display.data.insert(mime.clone(), text);
            }
        }
        if size > self.display_room {
            self.dropped = true;
            return None;
        }
        self.display_room -= size;
        self.displays.push(display.clone());
        Some(display)
    }

    /// Appends the gateway's own marker when it dropped output the agent had not already marked.
    fn mark_if_dropped(&mut self, agent_truncated: bool, limit: usize) {
        if self.dropped && !agent_truncated {
            self.stderr.push_str(&format!(
                "\n[output truncated by the gateway: limit of {limit} bytes reached]\n"
            ));
        }
    }
}

fn floor_char_boundary(text: &str, max: usize) -> usize {
    if max >= text.len() {
        return text.len();
    }
    let mut at = max;
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn mime_bundle(value: &Value) -> Option<MimeBundle> {
    let Value::Object(map) = value else {
        return None;
    };
    if map.is_empty() {
        return None;
    }
    Some(
        map.iter()
            .map(|(k, v)| {
                let text = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                (k.clone(), text)
            })
            .collect(),
    )
}

fn decode<T: serde::de::DeserializeOwned>(op: &str, value: Value) -> Result<T, ChannelError> {
    serde_json::from_value(value).map_err(|e| ChannelError::Protocol {
        detail: format!("malformed {op} result: {e}"),
    })
}

fn forward(events: Option<&mpsc::Sender<OutputEvent>>, event: OutputEvent) {
    if let Some(tx) = events {
        // Progress is best effort; a slow consumer must not stall the sandbox's reader.
        if let Err(mpsc::error::TrySendError::Full(_)) = tx.try_send(event) {
            tracing::debug!("output event dropped: receiver is behind");
        }
    }
}

impl AgentChannel {
    /// Starts the reader and writer tasks over a container's attach streams. `label` names the
    /// sandbox in logs. Must be called inside a Tokio runtime.
    pub fn open(label: impl Into<String>, streams: AgentStreams, config: ChannelConfig) -> Self {
        let label = label.into();
        let (link, _) = watch::channel(Link::default());
        let shared = Arc::new(Shared {
            label,
            routes: Mutex::new(Routes::default()),
            link,
        });
        let (writer, frames) = mpsc::channel(WRITE_QUEUE_FRAMES);
        let reader = tokio::spawn(read_loop(shared.clone(), streams.output)).abort_handle();
        tokio::spawn(write_loop(shared.clone(), frames, streams.input));
        Self {
            inner: Arc::new(Inner {
                shared,
                writer,
                next_id: AtomicU64::new(first_request_id()),
                config,
                reader,
            }),
        }
    }

    /// The timing this channel was opened with.
    pub fn config(&self) -> &ChannelConfig {
        &self.inner.config
    }

    /// Whether the attach stream has ended (every call would fail).
    pub fn is_lost(&self) -> bool {
        self.inner.shared.link.borrow().lost.is_some()
    }

    /// The last ready frame seen, if any.
    pub fn ready_info(&self) -> Option<ReadyInfo> {
        self.inner.shared.link.borrow().ready.clone()
    }

    /// Waits for the agent's first ready frame (a freshly started container).
    pub async fn wait_ready(&self, timeout: Duration) -> Result<ReadyInfo, ChannelError> {
        self.wait_ready_after(0, timeout).await
    }

    async fn wait_ready_after(
        &self,
        seen: u64,
        timeout: Duration,
    ) -> Result<ReadyInfo, ChannelError> {
        let mut link = self.inner.shared.link.subscribe();
        let waited = tokio::time::timeout(
            timeout,
            link.wait_for(|l| l.readies > seen || l.lost.is_some()),
        )
        .await;
        let link = match waited {
            Err(_) => return Err(ChannelError::ReadyTimeout { waited: timeout }),
            Ok(Err(_)) => {
                return Err(ChannelError::AttachLost {
                    reason: "the channel was closed".into(),
                });
            }
            Ok(Ok(link)) => link.clone(),
        };
        match (link.readies > seen, link.ready, link.lost) {
            (true, Some(info), _) if info.protocol != PROTOCOL_VERSION => {
                Err(ChannelError::ProtocolVersion {
                    found: info.protocol,
                    expected: PROTOCOL_VERSION,
                })
            }
            (true, Some(info), _) => Ok(info),
            (_, _, lost) => Err(ChannelError::AttachLost {
                reason: lost.unwrap_or_else(|| "no ready frame".into()),
            }),
        }
    }

    fn register(&self) -> Result<Call, ChannelError> {
        let shared = &self.inner.shared;
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(CALL_QUEUE_FRAMES);
        let mut routes = shared.routes();
        if let Some(reason) = &routes.lost {
            return Err(ChannelError::AttachLost {
                reason: reason.clone(),
            });
        }
        routes.calls.insert(id, tx);
        // Read under the routes lock: a restart bumps the count and clears routes under it too.
        let readies_at_start = shared.link.borrow().readies;
        drop(routes);
        Ok(Call {
            shared: shared.clone(),
            id,
            rx,
            readies_at_start,
        })
    }

    async fn send(&self, line: Bytes) -> Result<(), ChannelError> {
        self.inner.writer.send(line).await.map_err(|_| {
            let reason = self.inner.shared.link.borrow().lost.clone();
            ChannelError::AttachLost {
                reason: reason.unwrap_or_else(|| "the sandbox's input is closed".into()),
            }
        })
    }

    async fn start(&self, op: &str, fields: Value) -> Result<Call, ChannelError> {
        let call = self.register()?;
        let Value::Object(fields) = fields else {
            unreachable!("request fields are always a JSON object")
        };
        self.send(protocol::request_line(call.id, op, fields))
            .await?;
        Ok(call)
    }

    /// Fire-and-forget `interrupt` of `target` (its answer is not awaited).
    async fn send_interrupt(&self, target: u64) -> Result<(), ChannelError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let mut fields = Map::new();
        fields.insert("target".into(), target.into());
        self.send(protocol::request_line(id, "interrupt", fields))
            .await
    }

    /// Restarts the kernel (last resort for a cell that ignores interrupts): all variables are
    /// lost, files stay. Returns the new ready frame.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn restart(&self) -> Result<ReadyInfo, ChannelError> {
        let seen = self.inner.shared.link.borrow().readies;
        // The `{"restarting": true}` answer is not needed: the new ready frame is what counts.
        drop(self.start("restart", json!({})).await?);
        self.wait_ready_after(seen, self.inner.config.ready_timeout)
            .await
    }

    /// Checks that the agent answers (it does even while a cell runs).
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn ping(&self) -> Result<PingInfo, ChannelError> {
        let mut call = self.start("ping", json!({})).await?;
        let result = call.finish("ping", self.inner.config.call_timeout).await?;
        decode("ping", result)
    }

    /// Runs a Python cell. At `options.timeout` the cell is interrupted (its variables survive); if
    /// it has not stopped after the grace period the kernel is restarted and the outcome says
    /// `state_lost`. Output events go to `events` as they arrive. Dropping the future interrupts
    /// the cell.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn exec(
        &self,
        code: &str,
        options: ExecOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<ExecOutcome, ChannelError> {
        let started = Instant::now();
        let mut call = self
            .start(
                "exec",
                json!({"code": code, "output_limit": options.output_limit}),
            )
            .await?;
        let mut guard = InterruptOnDrop {
            channel: Some(self.clone()),
            target: call.id,
        };
        let mut out = OutputBuffer::new(options.output_limit, options.display_limit);
        let mut deadline = tokio::time::Instant::now() + options.timeout;
        let mut timed_out = false;
        let mut oversized_events = false;
        loop {
            let delivery = match tokio::time::timeout_at(deadline, call.next()).await {
                Ok(delivery) => delivery?,
                Err(_) if !timed_out => {
                    timed_out = true;
                    self.send_interrupt(call.id).await?;
                    deadline = tokio::time::Instant::now() + self.inner.config.interrupt_grace;
                    continue;
                }
                Err(_) => {
                    // The cell ignored the interrupt (e.g. stuck in C code): restart the kernel.
                    tracing::warn!("cell ignored its interrupt; restarting the kernel");
                    guard.disarm();
                    // Its route goes first: events it still emits must not fill a queue nobody reads.
                    drop(call);
                    self.restart().await?;
                    out.mark_if_dropped(false, options.output_limit);
                    return Ok(ExecOutcome {
                        stdout: out.stdout,
                        stderr: out.stderr,
                        result: None,
                        error: Some(CellError {
                            name: "TimeoutError".into(),
                            value: format!(
                                "the cell ran past its timeout of {}s and did not stop when interrupted; the Python kernel was restarted and all variables are lost (files in /home/user are kept)",
                                options.timeout.as_secs_f64()
                            ),
                            traceback: Vec::new(),
                        }),
                        execution_count: None,
                        displays: out.displays,
                        truncated: out.dropped || oversized_events,
                        timed_out: true,
                        state_lost: true,
                        duration: started.elapsed(),
                    });
                }
            };
            match delivery {
                Delivery::Event { event, frame } => match event.as_str() {
                    "stdout" | "stderr" => {
                        let is_err = event == "stderr";
                        let text = frame.get("data").and_then(Value::as_str).unwrap_or("");
                        if let Some(kept) = out.push_text(is_err, text) {
                            let ev = if is_err {
                                OutputEvent::Stderr(kept)
                            } else {
                                OutputEvent::Stdout(kept)
                            };
                            forward(events.as_ref(), ev);
                        }
                    }
                    "display" => {
                        if let Some(display) = out.push_display(&frame) {
                            forward(events.as_ref(), OutputEvent::Display(display));
                        }
                    }
                    other => tracing::debug!(event = other, "unexpected exec event ignored"),
                },
                Delivery::Oversized { is_event: true, .. } => oversized_events = true,
                Delivery::Oversized { len, .. } => {
                    guard.disarm();
                    return Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    });
                }
                Delivery::Final(outcome) => {
                    guard.disarm();
                    let result = outcome.map_err(|e| AgentError::from_wire(e, 0))?;
                    #[derive(Deserialize)]
                    struct Wire {
                        execution_count: Option<u64>,
                        #[serde(default)]
                        result: Value,
                        error: Option<CellError>,
                        #[serde(default)]
                        truncated: bool,
                    }
                    let wire: Wire = decode("exec", result)?;
                    out.mark_if_dropped(wire.truncated, options.output_limit);
                    return Ok(ExecOutcome {
                        stdout: out.stdout,
                        stderr: out.stderr,
                        result: mime_bundle(&wire.result),
                        error: wire.error,
                        execution_count: wire.execution_count,
                        displays: out.displays,
                        truncated: wire.truncated || out.dropped || oversized_events,
                        timed_out,
                        state_lost: false,
                        duration: started.elapsed(),
                    });
                }
            }
        }
    }

    /// Runs `bash -lc <command>` in its own process group. The agent kills the whole group at the
    /// timeout; should it not answer within the grace period after that, the gateway interrupts the
    /// command itself. Dropping the future kills the command.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn command(
        &self,
        command: &str,
        options: CommandOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<CommandOutcome, ChannelError> {
        let started = Instant::now();
        let timeout_ms = u64::try_from(options.timeout.as_millis()).unwrap_or(u64::MAX);
        let mut call = self
            .start(
                "command",
                json!({
                    "command": command,
                    "timeout_ms": timeout_ms,
                    "cwd": options.cwd,
                    "output_limit": options.output_limit,
                }),
            )
            .await?;
        let mut guard = InterruptOnDrop {
            channel: Some(self.clone()),
            target: call.id,
        };
        let grace = self.inner.config.interrupt_grace;
        let mut deadline = tokio::time::Instant::now() + options.timeout + grace;
        let mut interrupted = false;
        let mut out = OutputBuffer::new(options.output_limit, 0);
        loop {
            let delivery = match tokio::time::timeout_at(deadline, call.next()).await {
                Ok(delivery) => delivery?,
                Err(_) if !interrupted => {
                    interrupted = true;
                    self.send_interrupt(call.id).await?;
                    deadline = tokio::time::Instant::now() + grace;
                    continue;
                }
                Err(_) => {
                    guard.disarm();
                    return Err(ChannelError::Unresponsive {
                        op: "command",
                        waited: options.timeout + grace + grace,
                    });
                }
            };
            match delivery {
                Delivery::Event { event, frame } if event == "stdout" || event == "stderr" => {
                    let is_err = event == "stderr";
                    let text = frame.get("data").and_then(Value::as_str).unwrap_or("");
                    if let Some(kept) = out.push_text(is_err, text) {
                        let ev = if is_err {
                            OutputEvent::Stderr(kept)
                        } else {
                            OutputEvent::Stdout(kept)
                        };
                        forward(events.as_ref(), ev);
                    }
                }
                Delivery::Event { event, .. } => {
                    tracing::debug!(event, "unexpected command event ignored");
                }
                Delivery::Oversized { is_event: true, .. } => out.dropped = true,
                Delivery::Oversized { len, .. } => {
                    guard.disarm();
                    return Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    });
                }
                Delivery::Final(outcome) => {
                    guard.disarm();
                    let result = outcome.map_err(|e| AgentError::from_wire(e, 0))?;
                    #[derive(Deserialize)]
                    struct Wire {
                        exit_code: Option<i32>,
                        signal: Option<i32>,
                        #[serde(default)]
                        timed_out: bool,
                        #[serde(default)]
                        truncated: bool,
                    }
                    let wire: Wire = decode("command", result)?;
                    out.mark_if_dropped(wire.truncated, options.output_limit);
                    return Ok(CommandOutcome {
                        stdout: out.stdout,
                        stderr: out.stderr,
                        exit_code: wire.exit_code,
                        signal: wire.signal,
                        timed_out: wire.timed_out || interrupted,
                        truncated: wire.truncated || out.dropped,
                        duration: started.elapsed(),
                    });
                }
            }
        }
    }

    /// Writes `data` to `path` under /home/user (parents created), in chunks of at most 256 KiB.
    /// The agent's checksum is compared with the gateway's.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label, size = data.len()))]
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        overwrite: bool,
    ) -> Result<FileInfo, ChannelError> {
        let mut call = self
            .start(
                "write_file",
                json!({"path": path, "overwrite": overwrite, "size": data.len()}),
            )
            .await?;
        let mut hasher = Sha256::new();
        let mut chunks = data.chunks(CHUNK_BYTES).peekable();
        if chunks.peek().is_none() {
            self.send(protocol::chunk_line(call.id, "", true)).await?;
        }
        while let Some(chunk) = chunks.next() {
            // A refusal (`exists`, `outside_home`) arrives before any data is needed: stop sending.
            if let Ok(delivery) = call.rx.try_recv() {
                if let Delivery::Final(Err(err)) = delivery {
                    return Err(AgentError::from_wire(err, 0).into());
                }
                return Err(ChannelError::Protocol {
                    detail: "write_file answered before its last chunk".into(),
                });
            }
            hasher.update(chunk);
            let last = chunks.peek().is_none();
            self.send(protocol::chunk_line(call.id, &BASE64.encode(chunk), last))
                .await?;
        }
        let result = call
            .finish("write_file", self.inner.config.call_timeout)
            .await?;
        let info: FileInfo = decode("write_file", result)?;
        let sha256 = hex::encode(hasher.finalize());
        if info.size != data.len() as u64 || info.sha256 != sha256 {
            return Err(ChannelError::TransferCorrupted {
                path: info.path,
                detail: format!(
                    "sent {} bytes with sha256 {sha256}, the sandbox stored {} bytes with sha256 {}",
                    data.len(),
                    info.size,
                    info.sha256
                ),
            });
        }
        Ok(info)
    }

    /// Reads a file under /home/user; refused with [`AgentError::TooLarge`] when it is larger than
    /// `max_bytes`. The content is checked against the agent's checksum.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn read_file(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, FileInfo), ChannelError> {
        let mut call = self
            .start("read_file", json!({"path": path, "max_bytes": max_bytes}))
            .await?;
        let stall = self.inner.config.call_timeout;
        let mut content = Vec::new();
        let mut hasher = Sha256::new();
        loop {
            let delivery = tokio::time::timeout(stall, call.next())
                .await
                .map_err(|_| ChannelError::Unresponsive {
                    op: "read_file",
                    waited: stall,
                })??;
            match delivery {
                Delivery::Event { event, frame } if event == "chunk" => {
                    let piece = frame
                        .get("data")
                        .and_then(Value::as_str)
                        .map(|b64| BASE64.decode(b64))
                        .ok_or_else(|| ChannelError::Protocol {
                            detail: "chunk without data".into(),
                        })?
                        .map_err(|e| ChannelError::Protocol {
                            detail: format!("chunk is not base64: {e}"),
                        })?;
                    if (content.len() + piece.len()) as u64 > max_bytes {
                        return Err(ChannelError::Protocol {
                            detail: format!(
                                "the agent sent more than the {max_bytes} bytes asked for"
                            ),
                        });
                    }
                    hasher.update(&piece);
                    content.extend_from_slice(&piece);
                }
                Delivery::Event { event, .. } => {
                    tracing::debug!(event, "unexpected read_file event ignored");
                }
                Delivery::Oversized { len, .. } => {
                    return Err(ChannelError::FrameTooLarge {
                        len,
                        limit: MAX_FRAME_BYTES,
                    });
                }
                Delivery::Final(outcome) => {
                    let result = outcome.map_err(|e| AgentError::from_wire(e, max_bytes))?;
                    let info: FileInfo = decode("read_file", result)?;
                    let sha256 = hex::encode(hasher.finalize());
                    if info.size != content.len() as u64 || info.sha256 != sha256 {
                        return Err(ChannelError::TransferCorrupted {
                            path: info.path,
                            detail: format!(
                                "received {} bytes with sha256 {sha256}, the sandbox announced {} bytes with sha256 {}",
                                content.len(),
                                info.size,
                                info.sha256
                            ),
                        });
                    }
                    return Ok((content, info));
                }
            }
        }
    }

    /// Lists a directory under /home/user (`""` or `"."` for the home itself), sorted by name.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, ChannelError> {
        let path = if path.is_empty() { "." } else { path };
        let mut call = self.start("list_dir", json!({"path": path})).await?;
        let result = call
            .finish("list_dir", self.inner.config.call_timeout)
            .await?;
        #[derive(Deserialize)]
        struct Wire {
            entries: Vec<DirEntry>,
        }
        let wire: Wire = decode("list_dir", result)?;
        Ok(wire.entries)
    }
}

/// The first request id of a new channel: the clock in microseconds. A channel re-attached after
/// a gateway restart must not reuse the ids of the dead channel, whose calls may still be running
/// in the agent (a cell that was running when the gateway was killed answers later; with ids from
/// 1 again its answer would be taken for a new call's). Microseconds stay below 2^53, so the ids
/// survive any JSON parser.
fn first_request_id() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| u64::try_from(d.as_micros()).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{FakeAgent, eventually, fake_agent};

    async fn open() -> (AgentChannel, FakeAgent) {
        let (streams, agent) = fake_agent(true);
        let config = ChannelConfig {
            interrupt_grace: Duration::from_millis(100),
            ready_timeout: Duration::from_secs(5),
            call_timeout: Duration::from_secs(5),
        };
        let channel = AgentChannel::open("sbx_test", streams, config);
        channel
            .wait_ready(Duration::from_secs(5))
            .await
            .expect("fake agent is ready");
        (channel, agent)
    }

    fn quick(timeout_ms: u64) -> ExecOptions {
        ExecOptions {
            timeout: Duration::from_millis(timeout_ms),
            ..ExecOptions::default()
        }
    }

    #[tokio::test]
    async fn a_ping_is_answered_while_a_cell_runs() {
        let (channel, _agent) = open().await;
        let slow = channel.exec("sleep:2000", quick(10_000), None);
        let ping = async {
            let started = Instant::now();
            channel.ping().await.expect("ping answered");
            started.elapsed()
        };
        tokio::pin!(slow);
        let waited = tokio::select! {
            waited = ping => waited,
            _ = &mut slow => panic!("the cell finished before the ping was answered"),
        };
        assert!(waited < Duration::from_secs(1), "ping took {waited:?}");
    }

    #[tokio::test]
    async fn a_cell_past_its_deadline_is_interrupted_and_keeps_state() {
        let (channel, agent) = open().await;
        let outcome = channel.exec("sleep:10000", quick(50), None).await.unwrap();
        assert!(outcome.timed_out && !outcome.state_lost, "{outcome:?}");
        assert_eq!(outcome.error.unwrap().name, "KeyboardInterrupt");
        assert!(agent.received_ops().contains(&"interrupt".to_owned()));
        assert!(!agent.received_ops().contains(&"restart".to_owned()));
    }

    #[tokio::test]
    async fn a_cell_ignoring_its_interrupt_gets_the_kernel_restarted() {
        let (channel, agent) = open().await;
        let outcome = channel.exec("stuck", quick(50), None).await.unwrap();
        assert!(outcome.timed_out && outcome.state_lost, "{outcome:?}");
        assert!(agent.received_ops().contains(&"restart".to_owned()));
        let next = channel.exec("1+1", quick(5000), None).await.unwrap();
        assert_eq!(next.result.unwrap()["text/plain"], "1+1");
    }

    #[tokio::test]
    async fn calls_in_flight_and_later_fail_with_the_reason_when_the_stream_ends() {
        let (channel, agent) = open().await;
        let pending = tokio::spawn({
            let channel = channel.clone();
            async move { channel.exec("sleep:10000", quick(60_000), None).await }
        });
        eventually(
            "the exec to reach the agent",
            Duration::from_secs(5),
            || agent.received_ops().contains(&"exec".to_owned()),
        )
        .await;
        agent.kill.send(true).unwrap();
        let err = pending.await.unwrap().expect_err("the exec fails");
        assert!(matches!(err, ChannelError::AttachLost { .. }), "{err:?}");
        assert!(err.to_string().contains("stream ended"), "{err}");
        let later = channel.ping().await.expect_err("later calls fail too");
        assert!(
            matches!(later, ChannelError::AttachLost { .. }),
            "{later:?}"
        );
        assert!(channel.is_lost());
    }

    #[tokio::test]
    async fn dropping_a_running_exec_interrupts_it() {
        let (channel, agent) = open().await;
        let exec = channel.exec("sleep:10000", quick(60_000), None);
        let _ = tokio::time::timeout(Duration::from_millis(50), exec).await;
        eventually(
            "an interrupt after the drop",
            Duration::from_secs(5),
            || agent.received_ops().contains(&"interrupt".to_owned()),
        )
        .await;
    }

    #[tokio::test]
    async fn output_beyond_the_limit_is_not_accumulated_even_if_the_agent_sends_it() {
        let (channel, _agent) = open().await;
        let (tx, mut rx) = mpsc::channel(1024);
        let options = ExecOptions {
            output_limit: 1000,
            ..quick(10_000)
        };
        let outcome = channel
            .exec("print:3000000", options, Some(tx))
            .await
            .unwrap();
        assert!(
            outcome.stdout.len() <= 1000 + MARKER_SLACK,
            "kept {}",
            outcome.stdout.len()
        );
        assert!(outcome.truncated);
        assert!(
            outcome.stderr.contains("[output truncated"),
            "{:?}",
            outcome.stderr
        );
        let mut streamed = 0;
        while let Ok(OutputEvent::Stdout(s)) = rx.try_recv() {
            streamed += s.len();
        }
        assert_eq!(
            streamed,
            outcome.stdout.len(),
            "events carry only what was kept"
        );
    }

    #[test]
    fn too_large_messages_yield_the_size() {
        assert_eq!(
            size_in_message("/home/user/big is 12345 bytes, larger than the limit of 10"),
            Some(12345)
        );
        assert_eq!(size_in_message("no numbers here"), None);
    }

    #[test]
    fn output_is_bounded_at_a_char_boundary_and_marked() {
        let mut out = OutputBuffer::new(10, 0);
        let big = "é".repeat(10_000);
        let kept = out.push_text(false, &big).expect("some output kept");
        assert!(kept.len() <= 10 + MARKER_SLACK);
        assert!(out.push_text(true, "more").is_none());
        out.mark_if_dropped(false, 10);
        assert!(out.dropped);
        assert!(out.stderr.contains("[output truncated by the gateway"));
    }
}
