//! The package index relay (PROTOCOL.md, `index_serve`): pip in the sandbox asks the agent's
//! loopback index, the agent forwards each request here, and an [`IndexHandler`] (the service's
//! package index: policy, wheels only, hashes, the shared cache) answers it.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

use std::path::PathBuf;

use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;

/// One answer to a request of the sandbox's pip, relayed back by the agent.
#[derive(Debug)]
pub struct IndexAnswer {
    /// HTTP status pip sees.
    pub status: u16,
    /// Its `Content-Type`.
    pub content_type: String,
    /// What the sandbox's `pip` command prints when pip fails (why a package was refused).
    pub note: Option<String>,
    /// The body.
    pub body: IndexBody,
}

/// The body of an [`IndexAnswer`]: small pages from memory, wheels streamed from the host's cache
/// or relayed from a gateway in chunks.
pub enum IndexBody {
    /// A page (or an error text) held in memory.
    Bytes(Bytes),
    /// A file on this host (a cached wheel), sent in chunks without holding it in memory.
    File(PathBuf),
    /// Chunks as they arrive from elsewhere (a node relaying its gateway's answer). The stream
    /// bounds itself (size, deadlines). An error before the first chunk becomes the answer (502,
    /// or 504 for [`std::io::ErrorKind::TimedOut`], with the error's text); a later one ends the
    /// answer short, and pip fails on it.
    Stream {
        /// The body's length when known up front.
        length: Option<u64>,
        /// The body's chunks.
        chunks: IndexStream,
    },
}

/// The chunks of a streamed [`IndexBody`].
pub type IndexStream = BoxStream<'static, std::io::Result<Bytes>>;

impl std::fmt::Debug for IndexBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Bytes(b) => f.debug_tuple("Bytes").field(&b.len()).finish(),
            Self::File(p) => f.debug_tuple("File").field(p).finish(),
            Self::Stream { length, .. } => f
                .debug_struct("Stream")
                .field("length", length)
                .finish_non_exhaustive(),
        }
    }
}

impl IndexBody {
    /// The body as its length (when known) and a stream of chunks of at most `CHUNK_BYTES`
    /// (a streamed body passes as it comes); a file is opened now, so that a wheel missing from
    /// the cache is an error here rather than a broken answer.
    pub async fn open(self) -> std::io::Result<(Option<u64>, IndexStream)> {
        match self {
            Self::Bytes(bytes) => {
                let length = bytes.len() as u64;
                let mut chunks = Vec::new();
                let mut rest = bytes;
                while rest.len() > CHUNK_BYTES {
                    chunks.push(Ok(rest.split_to(CHUNK_BYTES)));
                }
                chunks.push(Ok(rest));
                Ok((Some(length), futures::stream::iter(chunks).boxed()))
            }
            Self::File(path) => {
                let file = tokio::fs::File::open(&path).await?;
                let length = file.metadata().await.ok().map(|m| m.len());
                let chunks = futures::stream::try_unfold(
                    (file, vec![0u8; CHUNK_BYTES]),
                    |(mut file, mut buf)| async move {
                        let n = read_full(&mut file, &mut buf).await?;
                        if n == 0 {
                            return Ok(None);
                        }
                        let chunk = Bytes::copy_from_slice(&buf[..n]);
                        Ok(Some((chunk, (file, buf))))
                    },
                );
                Ok((length, chunks.boxed()))
            }
            Self::Stream { length, chunks } => Ok((length, chunks)),
        }
    }
}

impl IndexAnswer {
    /// A plain-text refusal: pip shows `status` and the first line (as the reason phrase of a
    /// failed download), the `pip` command prints the whole text as a note.
    pub fn refused(status: u16, text: impl Into<String>) -> Self {
        let text = text.into();
        Self {
            status,
            content_type: "text/plain; charset=utf-8".into(),
            note: Some(text.clone()),
            body: IndexBody::Bytes(Bytes::from(text)),
        }
    }
}

/// Answers the package index requests of one sandbox. `path` is what pip asked the loopback
/// index for (`/simple/<project>/` or `/files/<sha256>/<filename>`; the agent forwards nothing
/// else).
pub trait IndexHandler: Send + Sync {
    /// The answer to one request.
    fn get<'a>(&'a self, path: &'a str) -> BoxFuture<'a, IndexAnswer>;
}

impl AgentChannel {
    /// Serves the sandbox's package index requests with `handler` until the future is dropped
    /// (then the agent is told to stop relaying) or the channel is lost. Run it beside a call
    /// (a cell or a command) so that pip in that call can install packages.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn serve_index(&self, handler: &dyn IndexHandler) -> Result<(), ChannelError> {
        let mut call = self.start("index_serve", json!({})).await?;
        let _close = InterruptOnDrop {
            channel: Some(self.clone()),
            target: call.id,
        };
        loop {
            match call.next().await? {
                Delivery::Event { event, frame } if event == "index_request" => {
                    let rid = frame.get("rid").and_then(Value::as_u64);
                    let path = frame.get("path").and_then(Value::as_str);
                    let (Some(rid), Some(path)) = (rid, path) else {
                        tracing::debug!("index_request without rid or path ignored");
                        continue;
                    };
                    let answer = handler.get(path).await;
                    self.send_index_answer(call.id, rid, answer).await?;
                }
                Delivery::Event { .. } | Delivery::Oversized { is_event: true, .. } => {}
                // Another call took the relay over, or the agent refused the op: nothing to serve.
                Delivery::Final(_) | Delivery::Oversized { .. } => return Ok(()),
            }
        }
    }

    /// Runs `call` (a cell or a command on this channel) with the package index served by
    /// `handler` on demand, so that pip in that call can install; returns the call's output.
    ///
    /// Nothing is opened up front: a cell that never runs pip costs no extra op. When pip asks
    /// the agent's loopback index, the agent sends `index_wanted` on a running call, and one
    /// call under `with_index` (at most one per channel at a time) opens the relay and serves it
    /// until that call ends (or the relay ends earlier; the call goes on).
    pub async fn with_index<T>(
        &self,
        handler: &dyn IndexHandler,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        let shared = &self.inner.shared;
        let mut wants = shared.index_wants.subscribe();
        wants.borrow_and_update();
        tokio::pin!(call);
        loop {
            tokio::select! {
                out = &mut call => return out,
                changed = wants.changed() => {
                    if changed.is_err() {
                        return call.await;
                    }
                    let Some(_serving) = ServingRelay::take(shared) else {
                        // Another call serves it already.
                        continue;
                    };
                    let serve = self.serve_index(handler);
                    tokio::pin!(serve);
                    tokio::select! {
                        out = &mut call => return out,
                        ended = &mut serve => {
                            if let Err(err) = ended {
                                tracing::debug!(%err, "package index relay ended");
                            }
                        }
                    }
                }
            }
        }
    }

    async fn send_index_answer(
        &self,
        id: u64,
        rid: u64,
        answer: IndexAnswer,
    ) -> Result<(), ChannelError> {
        let IndexAnswer {
            status,
            content_type,
            note,
            body,
        } = answer;
        let head = |length: Option<u64>, data: &[u8], last: bool| {
            let mut frame = Map::new();
            frame.insert("rid".into(), rid.into());
            frame.insert("status".into(), status.into());
            frame.insert("content_type".into(), content_type.clone().into());
            frame.insert("note".into(), note.clone().into());
            frame.insert("length".into(), length.into());
            frame.insert("data".into(), BASE64.encode(data).into());
            frame.insert("last".into(), last.into());
            protocol::request_line(id, "chunk", frame)
        };
        let (length, mut chunks) = match body {
            // A page: one frame, as it always was.
            IndexBody::Bytes(bytes) => {
                return self
                    .send(head(Some(bytes.len() as u64), &bytes, true))
                    .await;
            }
            body @ IndexBody::File(_) => match body.open().await {
                Ok(opened) => opened,
                Err(err) => {
                    tracing::warn!(%err, "cached wheel unreadable");
                    let text = "the gateway could not read this wheel from its cache; try again";
                    let refused = IndexAnswer::refused(502, text);
                    return Box::pin(self.send_index_answer(id, rid, refused)).await;
                }
            },
            IndexBody::Stream { length, chunks } => (length, chunks),
        };
        // Frames of at most CHUNK_BYTES, whatever sizes the body comes in; the first carries the
        // head, the last says so. A body that breaks off ends short (pip then fails on it).
        let mut buf = bytes::BytesMut::new();
        let mut first = true;
        loop {
            let done = match chunks.next().await {
                Some(Ok(data)) => {
                    buf.extend_from_slice(&data);
                    false
                }
                Some(Err(err)) if first => {
                    // Nothing sent yet: pip can still get a clear error instead of a short body.
                    let status = if err.kind() == std::io::ErrorKind::TimedOut {
                        504
                    } else {
                        502
                    };
                    let refused = IndexAnswer::refused(status, err.to_string());
                    return Box::pin(self.send_index_answer(id, rid, refused)).await;
                }
                Some(Err(err)) => {
                    tracing::debug!(%err, "package index answer broke off");
                    true
                }
                None => true,
            };
            while buf.len() > CHUNK_BYTES || (done && (first || !buf.is_empty())) {
                let data = buf.split_to(buf.len().min(CHUNK_BYTES));
                let last = done && buf.is_empty();
                let line = if std::mem::take(&mut first) {
                    head(length, &data, last)
                } else {
                    let mut frame = Map::new();
                    frame.insert("rid".into(), rid.into());
                    frame.insert("data".into(), BASE64.encode(&data).into());
                    frame.insert("last".into(), last.into());
                    protocol::request_line(id, "chunk", frame)
                };
                self.send(line).await?;
                if last {
                    return Ok(());
                }
            }
            if done {
                // Everything was sent in full frames: an empty one says the body ended.
                let mut frame = Map::new();
                frame.insert("rid".into(), rid.into());
                frame.insert("data".into(), "".into());
                frame.insert("last".into(), true.into());
                return self.send(protocol::request_line(id, "chunk", frame)).await;
            }
        }
    }
}

/// Reads until `buf` is full or the file ends; the number of bytes read.
async fn read_full(file: &mut tokio::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = file.read(&mut buf[filled..]).await?;
        if n == 0 {
            break;
        }
        filled += n;
    }
    Ok(filled)
}

/// The one call of a channel that serves the package index relay; freed when dropped.
struct ServingRelay<'a>(&'a Shared);

impl<'a> ServingRelay<'a> {
    fn take(shared: &'a Shared) -> Option<Self> {
        shared
            .index_serving
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then_some(Self(shared))
    }
}

impl Drop for ServingRelay<'_> {
    fn drop(&mut self) {
        self.0.index_serving.store(false, Ordering::Release);
    }
}
