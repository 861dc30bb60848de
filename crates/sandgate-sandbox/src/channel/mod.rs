//! The agent channel: one attach stream per sandbox, many calls in flight on it.
//!
//! Implements the gateway side of `agent/PROTOCOL.md`. A writer task owns the container's stdin and
//! writes whole frames (flushing after each); a reader task splits the container's stdout into
//! frames and routes each to the call waiting for its id. Calls may overlap (a file read or a ping
//! while a cell runs); the agent decides what runs concurrently. When the stream ends every pending
//! call fails with [`ChannelError::AttachLost`] and the reason; the manager then asks the engine why.

mod budget;
mod calls;
mod egress;
mod error;
mod files;
mod index;
mod link;
mod output;
#[cfg(test)]
mod tests;
mod types;

use budget::*;
pub use egress::{
    EgressBudget, EgressEnd, EgressEnv, EgressEnvInfo, EgressFrame, EgressHandler, EgressIo,
    EgressRefusal, EgressSink, EgressTally, EgressUpstream, relay_connection,
};
pub use error::{AgentError, ChannelError};
pub use files::FileChunks;
pub use index::{IndexAnswer, IndexBody, IndexHandler, IndexStream};
use link::*;
use output::*;
pub use types::*;

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

pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
    pub(crate) writer: mpsc::Sender<Bytes>,
    pub(crate) next_id: AtomicU64,
    pub(crate) config: ChannelConfig,
    pub(crate) reader: AbortHandle,
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
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for AgentChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentChannel")
            .field("sandbox", &self.inner.shared.label)
            .finish_non_exhaustive()
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
            index_wants: watch::channel(0).0,
            index_serving: std::sync::atomic::AtomicBool::new(false),
            egress_wants: watch::channel(0).0,
            egress_serving: std::sync::atomic::AtomicBool::new(false),
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
    /// lost, files stay. Returns the new kernel's process id.
    pub async fn restart(&self) -> Result<u64, ChannelError> {
        self.restart_because("the kernel was restarted at the gateway's request")
            .await
    }

    /// Restarts the kernel; `reason` is what the cell running in it is told.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub(crate) async fn restart_because(&self, reason: &str) -> Result<u64, ChannelError> {
        let mut call = self.start("restart", json!({"reason": reason})).await?;
        let result = call
            .finish("restart", self.inner.config.ready_timeout)
            .await?;
        #[derive(Deserialize)]
        struct Wire {
            kernel_pid: u64,
        }
        Ok(decode::<Wire>("restart", result)?.kernel_pid)
    }

    /// Checks that the agent answers (it does even while a cell runs).
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn ping(&self) -> Result<PingInfo, ChannelError> {
        let mut call = self.start("ping", json!({})).await?;
        let result = call.finish("ping", self.inner.config.call_timeout).await?;
        decode("ping", result)
    }

    /// Waits (up to `within`) until the kernel is ready and its background import of the data
    /// stack has ended, without running a cell (PROTOCOL.md, `preloaded`): a template sandbox is
    /// checkpointed after it, so its clones start with the imports done and the execution count
    /// at 1.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn preloaded(&self, within: Duration) -> Result<PreloadInfo, ChannelError> {
        let timeout_ms = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
        let mut call = self
            .start("preloaded", json!({"timeout_ms": timeout_ms}))
            .await?;
        let result = call
            .finish("preloaded", within + self.inner.config.call_timeout)
            .await?;
        decode("preloaded", result)
    }

    /// Tells an agent restored from a snapshot its new identity and has it re-seed every
    /// generator a clone must not share, from `seed` mixed with its own entropy (PROTOCOL.md,
    /// `restored`). The first call on a restored sandbox's channel: no ready frame comes.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn restored(
        &self,
        sandbox_id: &str,
        seed: &[u8],
    ) -> Result<RestoredInfo, ChannelError> {
        let fields = json!({"sandbox_id": sandbox_id, "seed": hex::encode(seed)});
        let mut call = self.start("restored", fields).await?;
        let result = call
            .finish("restored", self.inner.config.ready_timeout)
            .await?;
        decode("restored", result)
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
