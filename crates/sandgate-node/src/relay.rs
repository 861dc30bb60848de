//! The package-index relay over the node RPC (docs/scale-out.md, "The node RPC").
//!
//! In one process, pip in a sandbox reaches the gateway's package index through the agent
//! channel ([`sandgate_sandbox::AgentChannel::with_index`]). With the sandbox on a remote node,
//! the node runs the same relay, but its [`IndexHandler`] is [`GatewayIndex`]: each request pip
//! makes goes back to the gateway that made the call, on that call's own stream (`Exec` and
//! `Command` are bidirectional: `IndexRequest` node → gateway, `IndexChunk`s gateway → node). The
//! node never answers from an index of its own: tenant policy, wheels and hashes stay in the
//! gateway. Nothing is sent when pip does not ask, so a plain cell costs what it did.
//!
//! Bounds on the node: one request in flight per call (the channel serves them one after the
//! other), a deadline for each piece of the answer, a cap on an answer's size and on each chunk's,
//! and a check of every head (status, content type) before it reaches the agent; whatever breaks
//! a bound becomes an error status pip shows, and the call goes on.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{BoxStream, StreamExt};
use sandgate_sandbox::{IndexAnswer, IndexBody, IndexHandler};
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};
use tokio::time::Instant;

use crate::proto;

/// The largest chunk of an answer either side sends (the gateway sends at most 256 KiB).
pub const MAX_INDEX_CHUNK_BYTES: usize = 1 << 20;

/// The longest path relayed (the agent forwards at most 1024 bytes).
const MAX_INDEX_PATH: usize = 1024;

/// The chunks a gateway sends: the agent's own chunk size.
const ANSWER_PIECE_BYTES: usize = 256 << 10;

/// Index requests a gateway call holds before it answers them (the node sends one at a time).
const ASKS_QUEUED: usize = 4;

/// Chunks of an answer buffered towards the node before the gateway waits for it.
const ANSWER_CHUNKS_QUEUED: usize = 4;

/// How a node bounds the answers its gateways relay.
#[derive(Debug, Clone, Copy)]
pub struct RelayLimits {
    /// The largest answer (a page or a wheel), bytes. The gateway applies its own
    /// `packages.max_wheel_mb`; this only stops a gateway that never ends an answer.
    pub max_answer_bytes: u64,
    /// How long the node waits for the gateway's next piece of an answer (its head, then each
    /// chunk) before pip gets 504. Shorter than the agent's own 120 s.
    pub deadline: Duration,
}

impl Default for RelayLimits {
    fn default() -> Self {
        Self {
            max_answer_bytes: 1 << 30,
            deadline: Duration::from_secs(90),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The node's side

/// Whether `path` is one the package index serves (the agent forwards only these; the node
/// checks again, since the sandbox's side of the channel is not to be trusted).
fn is_index_path(path: &str) -> bool {
    let name_ok = |s: &str| {
        !s.is_empty()
            && s != "."
            && s != ".."
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-+!".contains(&b))
    };
    if path.len() > MAX_INDEX_PATH {
        return false;
    }
    if path == "/simple/" {
        return true;
    }
    if let Some(project) = path
        .strip_prefix("/simple/")
        .and_then(|p| p.strip_suffix('/'))
    {
        return name_ok(project) && !project.contains(['+', '!']);
    }
    if let Some((sha256, filename)) = path
        .strip_prefix("/files/")
        .and_then(|rest| rest.split_once('/'))
    {
        return sha256.len() == 64
            && sha256
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
            && name_ok(filename);
    }
    false
}

/// The gateway's answers as they arrive on the call's input stream.
pub(crate) type Answers = BoxStream<'static, Result<proto::IndexChunk, tonic::Status>>;

struct Inbox {
    answers: Answers,
    /// The gateway's side of the stream ended or broke: nothing more will come.
    ended: bool,
}

/// The node's [`IndexHandler`] for one call: relays each request to the gateway that made it.
pub(crate) struct GatewayIndex {
    requests: mpsc::Sender<proto::IndexRequest>,
    inbox: Arc<Mutex<Inbox>>,
    next_rid: AtomicU64,
    limits: RelayLimits,
}

/// Why a relayed request got no (whole) answer; becomes the status pip sees.
struct Failure {
    status: u16,
    text: String,
}

impl Failure {
    fn garbage(what: &str) -> Self {
        tracing::warn!(
            what,
            "the gateway answered a package index request with garbage"
        );
        Self {
            status: 502,
            text: format!(
                "the gateway sent a malformed answer to this package index request ({what}); try again"
            ),
        }
    }

    fn gone() -> Self {
        Self {
            status: 502,
            text: "the gateway stopped answering package index requests for this call; \
                   run the install again"
                .into(),
        }
    }

    fn late(deadline: Duration) -> Self {
        Self {
            status: 504,
            text: format!(
                "the gateway did not answer this package index request within {} s; try again",
                deadline.as_secs()
            ),
        }
    }

    fn answer(self) -> IndexAnswer {
        IndexAnswer::refused(self.status, self.text)
    }

    /// As the error of a streamed body (the channel answers 504 for `TimedOut`, else 502).
    fn into_io(self) -> std::io::Error {
        let kind = if self.status == 504 {
            std::io::ErrorKind::TimedOut
        } else {
            std::io::ErrorKind::Other
        };
        std::io::Error::new(kind, self.text)
    }
}

impl GatewayIndex {
    /// A relay for one call, reading the gateway's answers from `answers`; the requests it sends
    /// come out of the receiver, to go on the call's response stream.
    pub(crate) fn new(
        answers: Answers,
        limits: RelayLimits,
    ) -> (Self, mpsc::Receiver<proto::IndexRequest>) {
        let (requests, rx) = mpsc::channel(1);
        let relay = Self {
            requests,
            inbox: Arc::new(Mutex::new(Inbox {
                answers,
                ended: false,
            })),
            next_rid: AtomicU64::new(1),
            limits,
        };
        (relay, rx)
    }

    async fn relay(&self, path: &str) -> Result<IndexAnswer, Failure> {
        // One request at a time: the inbox stays locked until the answer's body was read.
        let mut inbox = self.inbox.clone().lock_owned().await;
        if inbox.ended {
            return Err(Failure::gone());
        }
        let rid = self.next_rid.fetch_add(1, Ordering::Relaxed);
        let deadline = self.limits.deadline;
        let request = proto::IndexRequest {
            rid,
            path: path.to_owned(),
        };
        match tokio::time::timeout(deadline, self.requests.send(request)).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => return Err(Failure::gone()),
            Err(_) => return Err(Failure::late(deadline)),
        }
        let first = next_chunk(&mut inbox, rid, deadline).await?;
        let head = first.head.ok_or_else(|| Failure::garbage("no head"))?;
        let status = u16::try_from(head.status)
            .ok()
            .filter(|s| (100..600).contains(s))
            .ok_or_else(|| Failure::garbage("a status outside 100-599"))?;
        // It becomes a header of the agent's HTTP answer: printable ASCII only.
        let content_type = head.content_type;
        if content_type.len() > 200 || !content_type.bytes().all(|b| (0x20..0x7f).contains(&b)) {
            return Err(Failure::garbage(
                "a content type that is not a header value",
            ));
        }
        let note = head.note.map(|n| n.chars().take(4000).collect());
        let max = self.limits.max_answer_bytes;
        if head.length.is_some_and(|l| l > max) {
            return Err(Failure::garbage("an answer larger than the node accepts"));
        }
        let mut body = Body {
            inbox,
            rid,
            length: head.length,
            received: 0,
            limits: self.limits,
            done: false,
        };
        let data = body.take(first.data, first.last)?;
        let body = if first.last {
            IndexBody::Bytes(data)
        } else {
            IndexBody::Stream {
                length: head.length,
                chunks: body.into_stream(data),
            }
        };
        Ok(IndexAnswer {
            status,
            content_type,
            note,
            body,
        })
    }
}

impl IndexHandler for GatewayIndex {
    fn get<'a>(&'a self, path: &'a str) -> BoxFuture<'a, IndexAnswer> {
        Box::pin(async move {
            if !is_index_path(path) {
                // As the gateway's own index would answer it; the gateway is not asked.
                return IndexAnswer::refused(404, format!("not a package index path: {path}"));
            }
            self.relay(path).await.unwrap_or_else(Failure::answer)
        })
    }
}

/// The next chunk of answer `rid`, within `deadline`; chunks of earlier requests (answers that
/// came too late) are skipped.
async fn next_chunk(
    inbox: &mut Inbox,
    rid: u64,
    deadline: Duration,
) -> Result<proto::IndexChunk, Failure> {
    let until = Instant::now() + deadline;
    loop {
        let chunk = match tokio::time::timeout_at(until, inbox.answers.next()).await {
            Err(_) => return Err(Failure::late(deadline)),
            Ok(None) => {
                inbox.ended = true;
                return Err(Failure::gone());
            }
            Ok(Some(Err(status))) => {
                inbox.ended = true;
                tracing::debug!(%status, "the gateway's side of an index relay broke");
                return Err(Failure::gone());
            }
            Ok(Some(Ok(chunk))) => chunk,
        };
        if chunk.rid < rid {
            continue;
        }
        if chunk.rid > rid {
            return Err(Failure::garbage("an answer to a request not made yet"));
        }
        if chunk.data.len() > MAX_INDEX_CHUNK_BYTES {
            return Err(Failure::garbage("a chunk larger than 1 MiB"));
        }
        return Ok(chunk);
    }
}

/// The rest of an answer's body, read from the inbox (locked until the body is dropped).
struct Body {
    inbox: OwnedMutexGuard<Inbox>,
    rid: u64,
    length: Option<u64>,
    received: u64,
    limits: RelayLimits,
    done: bool,
}

impl Body {
    /// Counts `data` against the limits; the data, or why the answer is refused.
    fn take(&mut self, data: Bytes, last: bool) -> Result<Bytes, Failure> {
        self.received += data.len() as u64;
        if self.received > self.limits.max_answer_bytes {
            return Err(Failure::garbage("an answer larger than the node accepts"));
        }
        if self
            .length
            .is_some_and(|l| self.received > l || (last && self.received != l))
        {
            return Err(Failure::garbage("a body of another length than announced"));
        }
        self.done = last;
        Ok(data)
    }

    async fn next(&mut self) -> Result<Option<Bytes>, Failure> {
        if self.done {
            return Ok(None);
        }
        let chunk = next_chunk(&mut self.inbox, self.rid, self.limits.deadline).await?;
        if chunk.head.is_some() {
            return Err(Failure::garbage("a second head"));
        }
        self.take(chunk.data, chunk.last).map(Some)
    }

    /// `first`, then the chunks still to come; a broken bound ends the stream with an error (the
    /// agent then ends pip's answer short, and pip fails on it).
    fn into_stream(self, first: Bytes) -> sandgate_sandbox::IndexStream {
        let first = futures::stream::iter([Ok::<_, std::io::Error>(first)]);
        let rest = futures::stream::try_unfold(self, |mut body| async move {
            match body.next().await {
                Ok(Some(data)) => Ok(Some((data, body))),
                Ok(None) => Ok(None),
                Err(failure) => Err(failure.into_io()),
            }
        });
        first.chain(rest).boxed()
    }
}

// ---------------------------------------------------------------------------------------------
// The gateway's side

tokio::task_local! {
    /// The relay of the call running in this task: set by [`serve`] around a call to one sandbox.
    static RELAY: Scope;
}

struct Scope {
    container_id: String,
    asks: mpsc::Sender<Ask>,
}

/// One request of a node, with where its answer goes.
pub(crate) struct Ask {
    request: proto::IndexRequest,
    answers: mpsc::Sender<proto::IndexChunk>,
}

/// Where a call to sandbox `container_id` sends its node's index requests: set when the call
/// runs under [`serve`] for that sandbox.
pub(crate) struct Asks(mpsc::Sender<Ask>);

/// The relay of a call to sandbox `container_id` when it runs under [`serve`] for it.
pub(crate) fn current(container_id: &str) -> Option<Asks> {
    RELAY
        .try_with(|scope| (scope.container_id == container_id).then(|| Asks(scope.asks.clone())))
        .ok()
        .flatten()
}

/// Runs `call` (a cell or a command on the remote sandbox `container_id`) with its node's index
/// requests answered by `handler`; the call's output.
pub(crate) async fn serve<T>(
    container_id: &str,
    handler: &dyn IndexHandler,
    call: impl Future<Output = T>,
) -> T {
    let (asks, mut rx) = mpsc::channel(ASKS_QUEUED);
    let scope = Scope {
        container_id: container_id.to_owned(),
        asks,
    };
    let call = RELAY.scope(scope, call);
    tokio::pin!(call);
    loop {
        tokio::select! {
            out = &mut call => return out,
            Some(ask) = rx.recv() => {
                let answer = answer(handler, ask);
                tokio::pin!(answer);
                tokio::select! {
                    out = &mut call => return out,
                    () = &mut answer => {}
                }
            }
        }
    }
}

/// A call's relay on the gateway: whether it asks the node for one, and what the call's stream
/// does with the node's requests.
pub(crate) struct CallRelay {
    asks: mpsc::Sender<Ask>,
    answers: mpsc::Sender<proto::IndexChunk>,
}

/// The input stream of a call: its request `first`, then (with the call's relay) the answers
/// to the node's index requests, wrapped by `wrap`. [`CallInputs::with_egress`] adds the
/// messages of the call's egress relay.
pub(crate) fn call_inputs<M>(
    first: M,
    relay: Option<Asks>,
    wrap: fn(proto::IndexChunk) -> M,
) -> (CallInputs<M>, Option<CallRelay>) {
    let Some(Asks(asks)) = relay else {
        let inputs = CallInputs {
            first: Some(first),
            answers: None,
            wrap,
            egress: None,
        };
        return (inputs, None);
    };
    let (answers, rx) = mpsc::channel(ANSWER_CHUNKS_QUEUED);
    let inputs = CallInputs {
        first: Some(first),
        answers: Some(rx),
        wrap,
        egress: None,
    };
    (inputs, Some(CallRelay { asks, answers }))
}

/// A call's input stream (see [`call_inputs`]). A type of its own rather than a boxed stream:
/// tonic's streaming client future is `Send` with a concrete stream only (a boxed one trips
/// the compiler's higher-ranked `Send` check). It ends when every relay it carries has ended.
pub(crate) struct CallInputs<M> {
    first: Option<M>,
    answers: Option<mpsc::Receiver<proto::IndexChunk>>,
    wrap: fn(proto::IndexChunk) -> M,
    /// The egress relay's messages, and how they are wrapped.
    egress: Option<EgressInputs<M>>,
}

/// The egress relay's messages for a call's input stream, and how each is wrapped.
type EgressInputs<M> = (
    mpsc::UnboundedReceiver<proto::EgressIn>,
    fn(proto::EgressIn) -> M,
);

impl<M> CallInputs<M> {
    /// The same stream, carrying also the egress relay's messages from `messages`.
    pub(crate) fn with_egress(
        mut self,
        messages: Option<mpsc::UnboundedReceiver<proto::EgressIn>>,
        wrap: fn(proto::EgressIn) -> M,
    ) -> Self {
        self.egress = messages.map(|rx| (rx, wrap));
        self
    }
}

impl<M: Unpin> futures::Stream for CallInputs<M> {
    type Item = M;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<M>> {
        use std::task::Poll;
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(first));
        }
        if let Some(rx) = &mut this.answers {
            match rx.poll_recv(cx) {
                Poll::Ready(Some(chunk)) => return Poll::Ready(Some((this.wrap)(chunk))),
                Poll::Ready(None) => this.answers = None,
                Poll::Pending => {}
            }
        }
        if let Some((rx, wrap)) = &mut this.egress {
            match rx.poll_recv(cx) {
                Poll::Ready(Some(message)) => return Poll::Ready(Some(wrap(message))),
                Poll::Ready(None) => this.egress = None,
                Poll::Pending => {}
            }
        }
        if this.answers.is_none() && this.egress.is_none() {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

impl CallRelay {
    /// Hands a request of the node to the call's [`serve`] loop. Never waits: the node sends one
    /// request at a time, so a full queue means a node misbehaving, whose extra requests are
    /// dropped (it then gives up on them at its deadline).
    pub(crate) fn ask(&self, request: proto::IndexRequest) {
        let ask = Ask {
            request,
            answers: self.answers.clone(),
        };
        if self.asks.try_send(ask).is_err() {
            tracing::warn!("package index request of a node dropped: too many at once");
        }
    }
}

/// Answers one request with `handler`, in chunks of at most 256 KiB.
async fn answer(handler: &dyn IndexHandler, ask: Ask) {
    let Ask { request, answers } = ask;
    let rid = request.rid;
    let IndexAnswer {
        status,
        content_type,
        note,
        body,
    } = handler.get(&request.path).await;
    let (head, chunks) = match body.open().await {
        Ok((length, chunks)) => (
            proto::IndexHead {
                status: status.into(),
                content_type,
                note,
                length,
            },
            chunks,
        ),
        Err(err) => {
            tracing::warn!(%err, "cached wheel unreadable");
            let text = "the gateway could not read this wheel from its cache; try again";
            let bytes = Bytes::from(text);
            let head = proto::IndexHead {
                status: 502,
                content_type: "text/plain; charset=utf-8".into(),
                note: Some(text.into()),
                length: Some(bytes.len() as u64),
            };
            (
                head,
                futures::stream::once(async move { Ok(bytes) }).boxed(),
            )
        }
    };
    let mut chunks = chunks.peekable();
    let mut head = Some(head);
    while let Some(item) = chunks.next().await {
        let (data, last) = match item {
            Ok(data) => (data, std::pin::Pin::new(&mut chunks).peek().await.is_none()),
            Err(err) => {
                // The body ends short here: the node's length check fails, or pip's hash check.
                tracing::warn!(%err, "package index answer broke off");
                (Bytes::new(), true)
            }
        };
        if !send(&answers, rid, &mut head, data, last).await || last {
            return;
        }
    }
    // An empty body: the head alone ends it.
    if head.is_some() {
        send(&answers, rid, &mut head, Bytes::new(), true).await;
    }
}

/// Sends `data` as chunks of at most 256 KiB (the head on the very first); false once the call
/// has ended (nobody reads the answer any more).
async fn send(
    answers: &mpsc::Sender<proto::IndexChunk>,
    rid: u64,
    head: &mut Option<proto::IndexHead>,
    mut data: Bytes,
    last: bool,
) -> bool {
    loop {
        let piece = data.split_to(data.len().min(ANSWER_PIECE_BYTES));
        let chunk = proto::IndexChunk {
            rid,
            head: head.take(),
            data: piece,
            last: last && data.is_empty(),
        };
        if answers.send(chunk).await.is_err() {
            return false;
        }
        if data.is_empty() {
            return true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_index_path;

    #[test]
    fn only_index_paths_are_relayed() {
        let sha = "0".repeat(64);
        for good in [
            "/simple/".to_owned(),
            "/simple/requests/".to_owned(),
            "/simple/zope.interface/".to_owned(),
            format!("/files/{sha}/numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl"),
        ] {
            assert!(is_index_path(&good), "{good} is an index path");
        }
        for bad in [
            String::new(),
            "/".to_owned(),
            "/simple".to_owned(),
            "/simple/requests".to_owned(),
            "/simple/../../etc/passwd/".to_owned(),
            "/simple/a/b/".to_owned(),
            "/simple/../".to_owned(),
            "/simple/c++/".to_owned(),
            "/files/abc/x.whl".to_owned(),
            format!("/files/{}/x.whl", "A".repeat(64)),
            format!("/files/{sha}/.."),
            format!("/files/{sha}/a/b.whl"),
            format!("/files/{sha}/"),
            "/_sandgate/notes".to_owned(),
            format!("/simple/{}/", "a".repeat(2000)),
            "/simple/ws /".to_owned(),
        ] {
            assert!(!is_index_path(&bad), "{bad:?} is not an index path");
        }
    }
}
