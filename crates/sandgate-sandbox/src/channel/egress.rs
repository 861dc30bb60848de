//! The egress relay (PROTOCOL.md, `egress_env` and `egress_serve`): a client in the sandbox
//! sends `CONNECT host:port` to the agent's loopback proxy, the agent forwards it here, and an
//! [`EgressHandler`] (the service's egress component: the tenant's policy, the address checks,
//! the dial, the budgets and the audit) decides it. The bytes of an admitted connection are
//! relayed both ways between the agent and the handler's upstream stream; this module decides
//! nothing about where a connection may go.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

use std::sync::atomic::{AtomicBool, AtomicU64};

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::task::JoinSet;

/// Frames of the agent waiting for one connection's upstream writer: the agent's window of
/// unacknowledged data events (16, `EGRESS_WINDOW_EVENTS`) and room for its end.
const CONNECTION_QUEUE_FRAMES: usize = 20;

/// The most connections one relay keeps open at once (the agent itself keeps at most 32).
const OPEN_PER_SERVE: usize = 64;

/// The byte stream of an admitted connection (a TCP stream to the checked address).
pub trait EgressIo: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> EgressIo for T {}

/// A connection an [`EgressHandler`] admitted and dialed.
pub struct EgressUpstream {
    /// The stream to the server.
    pub io: Box<dyn EgressIo>,
    /// Most bytes (both ways together) this connection may carry; past it the connection is
    /// ended. `None`: no limit.
    pub byte_limit: Option<u64>,
    /// A budget this connection shares with others (a rule's bytes per day), charged as its
    /// bytes flow both ways; once a piece does not fit, the connection is ended before that
    /// piece is passed on. `None`: none.
    pub budget: Option<Arc<dyn EgressBudget>>,
    /// Told once how the connection ended and what it carried (also when the relay is dropped
    /// with the connection open).
    pub on_close: Box<dyn FnOnce(EgressTally) + Send>,
}

impl std::fmt::Debug for EgressUpstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EgressUpstream")
            .field("byte_limit", &self.byte_limit)
            .finish_non_exhaustive()
    }
}

/// A byte budget connections share, charged as their bytes flow (so connections open at once
/// cannot together pass it).
pub trait EgressBudget: Send + Sync {
    /// Charges `bytes`; false when they do not fit (the connection then ends).
    fn spend(&self, bytes: u64) -> bool;
}

/// Why a CONNECT was refused: what the client in the sandbox hears.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EgressRefusal {
    /// The HTTP status of the proxy's answer (403 refused by policy, 502 the server did not
    /// answer, 429 over a rate budget).
    pub status: u16,
    /// The text (its first line is the reason phrase).
    pub text: String,
}

/// What a relayed connection carried, and how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EgressTally {
    /// Bytes from the sandbox to the server.
    pub sent: u64,
    /// Bytes from the server to the sandbox.
    pub received: u64,
    /// How it ended.
    pub end: EgressEnd,
}

/// How a relayed connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EgressEnd {
    /// Both sides closed.
    Closed,
    /// The client in the sandbox broke off.
    ClientGone,
    /// Reading from or writing to the server failed.
    ServerError,
    /// The connection reached its byte limit.
    ByteLimit,
    /// The relay ended with it open (the call ended, the channel was lost).
    RelayClosed,
}

impl EgressEnd {
    /// The name shown in the audit trail.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::ClientGone => "client_gone",
            Self::ServerError => "server_error",
            Self::ByteLimit => "byte_budget",
            Self::RelayClosed => "relay_closed",
        }
    }
}

/// Decides and dials the CONNECTs of one sandbox.
pub trait EgressHandler: Send + Sync {
    /// A connection to `authority` (`host:port` as the client sent it), or why not.
    fn open<'a>(
        &'a self,
        authority: &'a str,
    ) -> BoxFuture<'a, Result<EgressUpstream, EgressRefusal>>;
}

/// The agent's answer to `egress_env`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct EgressEnvInfo {
    /// Whether user processes now have the proxy variables.
    pub proxy: bool,
    /// The proxy's port inside the container (none: it could not start).
    pub port: Option<u16>,
    /// Whether the running kernel took them (false: no kernel was ready in time; the next one
    /// gets them at its start).
    #[serde(default)]
    pub kernel_applied: bool,
    /// The secrets' variables user processes now have (names only).
    #[serde(default)]
    pub placeholders: Vec<String>,
}

/// What `egress_env` gives a sandbox's user processes.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct EgressEnv {
    /// The proxy variables on (CONNECTs relayed) or off (taken out, CONNECTs refused).
    pub proxy: bool,
    /// A CA certificate (PEM) the egress component signs intercepted connections with: the agent
    /// adds it to the bundle the CA variables name. Never a key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    /// Secrets' placeholders: variable name -> opaque token (never a value).
    pub placeholders: std::collections::BTreeMap<String, String>,
}

/// What one side of a relayed connection said: bytes, that it will send no more (its write
/// half closed), or that it broke off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EgressFrame {
    /// Bytes of the connection.
    Data(Bytes),
    /// This side sends no more; it still reads.
    Eof,
    /// This side broke off: the connection ends.
    Close,
}

/// Where [`relay_connection`] sends what the server said, towards the client in the sandbox:
/// the agent's channel in one process, the call's stream over the node RPC.
pub trait EgressSink: Send + Sync {
    /// Tells the client's side the connection was admitted and bytes may flow (the first thing
    /// [`relay_connection`] sends); an error: nobody listens any more.
    fn accepted(&self) -> BoxFuture<'_, Result<(), ()>> {
        Box::pin(async { Ok(()) })
    }

    /// Sends one frame; an error: nobody listens any more (the relay is gone).
    fn send(&self, frame: EgressFrame) -> BoxFuture<'_, Result<(), ()>>;

    /// `bytes` of the client's data were written to the upstream: a sink that grants the
    /// client's side credit for its data (the node RPC's flow control) returns it here.
    fn consumed(&self, bytes: usize) -> BoxFuture<'_, Result<(), ()>> {
        let _ = bytes;
        Box::pin(async { Ok(()) })
    }
}

impl AgentChannel {
    /// Turns the sandbox's egress proxy on (`proxy`: the proxy variables for the kernel and
    /// commands, CONNECTs relayed) or off (variables taken out, CONNECTs refused by the agent).
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn set_egress_env(&self, env: &EgressEnv) -> Result<EgressEnvInfo, ChannelError> {
        let frame = serde_json::to_value(env).expect("an egress env serializes");
        let mut call = self.start("egress_env", frame).await?;
        // The agent waits up to 30 s for a kernel that is still starting.
        let waited = self.inner.config.call_timeout + Duration::from_secs(30);
        let result = call.finish("egress_env", waited).await?;
        decode("egress_env", result)
    }

    /// Relays the sandbox's CONNECTs to `handler` until the future is dropped (then the agent is
    /// told to stop relaying, and open connections end) or the channel is lost.
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.shared.label))]
    pub async fn serve_egress(&self, handler: Arc<dyn EgressHandler>) -> Result<(), ChannelError> {
        // `acks`: an agent that knows them keeps each connection within its window of data
        // events not yet acknowledged (PROTOCOL.md), so this loop never waits on a connection.
        let mut call = self.start("egress_serve", json!({"acks": true})).await?;
        let _close = InterruptOnDrop {
            channel: Some(self.clone()),
            target: call.id,
        };
        // Each connection's frames, and whether its agent keeps it within the window.
        let mut connections: HashMap<u64, (mpsc::Sender<EgressFrame>, bool)> = HashMap::new();
        // Dropped with this future: each open connection's tally then says RelayClosed.
        let mut tasks = JoinSet::new();
        loop {
            let delivery = tokio::select! {
                delivery = call.next() => delivery?,
                Some(ended) = tasks.join_next(), if !tasks.is_empty() => {
                    if let Ok(cid) = ended {
                        connections.remove(&cid);
                    }
                    continue;
                }
            };
            let (event, frame) = match delivery {
                Delivery::Event { event, frame } => (event, frame),
                Delivery::Oversized { is_event: true, .. } => continue,
                // Another call took the relay over, or the agent refused the op.
                Delivery::Final(_) | Delivery::Oversized { .. } => return Ok(()),
            };
            let Some(cid) = frame.get("cid").and_then(Value::as_u64) else {
                tracing::debug!(event, "egress event without cid ignored");
                continue;
            };
            let said = match event.as_str() {
                "egress_open" => {
                    let authority = frame
                        .get("authority")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned();
                    let acks = frame.get("acks").and_then(Value::as_bool) == Some(true);
                    let relay = Relay {
                        channel: self.clone(),
                        serve: call.id,
                        cid,
                        acks,
                    };
                    if connections.len() >= OPEN_PER_SERVE {
                        // The agent keeps at most 32 open: more is an agent that does not
                        // close its side of the connections that ended.
                        let refused = format!(
                            "this sandbox has {OPEN_PER_SERVE} egress connections open already; \
                             close one and try again"
                        );
                        let _ = relay
                            .chunk(json!({"refused": refused, "status": 429}))
                            .await;
                        continue;
                    }
                    let (tx, rx) = mpsc::channel(CONNECTION_QUEUE_FRAMES);
                    connections.insert(cid, (tx, acks));
                    tasks.spawn(relay.run(handler.clone(), authority, rx));
                    continue;
                }
                "egress_data" => {
                    let data = frame.get("data").and_then(Value::as_str).unwrap_or("");
                    match BASE64.decode(data) {
                        Ok(raw) => EgressFrame::Data(Bytes::from(raw)),
                        Err(_) => EgressFrame::Close,
                    }
                }
                "egress_eof" => EgressFrame::Eof,
                "egress_close" => EgressFrame::Close,
                other => {
                    tracing::debug!(event = other, "unexpected egress event ignored");
                    continue;
                }
            };
            let Some((tx, acks)) = connections.get(&cid) else {
                continue;
            };
            let kept = if *acks {
                // Within its window the queue has room: a full one is an agent past it, and
                // that connection ends (this loop serves every connection and never waits).
                tx.try_send(said).is_ok()
            } else {
                // An agent of before acknowledgements: its connection's queue may hold the
                // loop up, as it always did.
                tx.send(said).await.is_ok()
            };
            if !kept {
                connections.remove(&cid);
            }
        }
    }

    /// Runs `call` (a cell or a command on this channel) with the sandbox's CONNECTs relayed to
    /// `handler` on demand, as [`Self::with_index`] serves the package index: nothing is opened
    /// until a client in the sandbox connects (the agent then sends `egress_wanted` on a running
    /// call), and the relay ends with the call.
    pub async fn with_egress<T>(
        &self,
        handler: Arc<dyn EgressHandler>,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        let shared = &self.inner.shared;
        let mut wants = shared.egress_wants.subscribe();
        wants.borrow_and_update();
        tokio::pin!(call);
        loop {
            tokio::select! {
                out = &mut call => return out,
                changed = wants.changed() => {
                    if changed.is_err() {
                        return call.await;
                    }
                    let Some(_serving) = ServingEgress::take(&shared.egress_serving) else {
                        continue;
                    };
                    let serve = self.serve_egress(handler.clone());
                    tokio::pin!(serve);
                    tokio::select! {
                        out = &mut call => return out,
                        ended = &mut serve => {
                            if let Err(err) = ended {
                                tracing::debug!(%err, "egress relay ended");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One relayed connection.
struct Relay {
    channel: AgentChannel,
    serve: u64,
    cid: u64,
    /// Whether the agent keeps this connection within its window (then each data event is
    /// acknowledged once written on).
    acks: bool,
}

impl Relay {
    /// Decides the CONNECT, then carries bytes until both sides closed; returns its id.
    async fn run(
        self,
        handler: Arc<dyn EgressHandler>,
        authority: String,
        from_agent: mpsc::Receiver<EgressFrame>,
    ) -> u64 {
        let cid = self.cid;
        match handler.open(&authority).await {
            Err(refusal) => {
                let _ = self
                    .chunk(json!({"refused": refusal.text, "status": refusal.status}))
                    .await;
            }
            Ok(upstream) => {
                let mut from_agent = from_agent;
                let frames = futures::stream::poll_fn(move |cx| from_agent.poll_recv(cx));
                relay_connection(upstream, frames, &self).await;
            }
        }
        cid
    }

    /// A chunk frame of the serve call for this connection.
    async fn chunk(&self, fields: Value) -> Result<(), ChannelError> {
        let Value::Object(mut frame) = fields else {
            unreachable!("chunk fields are always a JSON object")
        };
        frame.insert("cid".into(), self.cid.into());
        self.channel
            .send(protocol::request_line(self.serve, "chunk", frame))
            .await
    }
}

impl EgressSink for Relay {
    fn accepted(&self) -> BoxFuture<'_, Result<(), ()>> {
        Box::pin(async move { self.chunk(json!({"open": true})).await.map_err(|_| ()) })
    }

    fn consumed(&self, bytes: usize) -> BoxFuture<'_, Result<(), ()>> {
        Box::pin(async move {
            if !self.acks {
                return Ok(());
            }
            self.chunk(json!({"ack": bytes})).await.map_err(|_| ())
        })
    }

    fn send(&self, frame: EgressFrame) -> BoxFuture<'_, Result<(), ()>> {
        Box::pin(async move {
            let fields = match frame {
                EgressFrame::Data(data) => json!({"data": BASE64.encode(&data)}),
                EgressFrame::Eof => json!({"eof": true}),
                EgressFrame::Close => json!({"closed": true}),
            };
            self.chunk(fields).await.map_err(|_| ())
        })
    }
}

/// Tells `to_client` that the connection was admitted, then carries its bytes both ways at
/// once (a client may send while the server streams): `from_client`'s frames are written to
/// the upstream, what the upstream says goes to `to_client`, until both sides closed, or one
/// side failed, or the byte limit was reached. The upstream's `on_close` is told how it ended,
/// also when the client's side never heard it was admitted and when this future is dropped
/// mid-way: every connection dialed is reported once.
pub async fn relay_connection(
    upstream: EgressUpstream,
    mut from_client: impl futures::Stream<Item = EgressFrame> + Send + Unpin,
    to_client: &dyn EgressSink,
) {
    let EgressUpstream {
        io,
        byte_limit,
        budget,
        on_close,
    } = upstream;
    // Shared with the guard, which reports them also when this task is dropped mid-way.
    let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let (sent, received) = (&counts.0, &counts.1);
    // After `piece` more bytes were counted: whether the connection is past its own limit or
    // its shared budget (then the piece is not passed on).
    let over = |piece: u64| {
        byte_limit
            .is_some_and(|l| sent.load(Ordering::Relaxed) + received.load(Ordering::Relaxed) > l)
            || budget.as_ref().is_some_and(|b| !b.spend(piece))
    };
    let mut guard = TallyGuard {
        counts: counts.clone(),
        end: EgressEnd::RelayClosed,
        on_close: Some(on_close),
    };
    if to_client.accepted().await.is_err() {
        return;
    }
    let (mut reader, mut writer) = tokio::io::split(io);
    // Each direction ends with `None` when its side closed cleanly, or with why all ends.
    let up = async {
        loop {
            match futures::StreamExt::next(&mut from_client).await {
                Some(EgressFrame::Data(data)) => {
                    sent.fetch_add(data.len() as u64, Ordering::Relaxed);
                    if over(data.len() as u64) {
                        return Some(EgressEnd::ByteLimit);
                    }
                    if writer.write_all(&data).await.is_err() {
                        return Some(EgressEnd::ServerError);
                    }
                    if to_client.consumed(data.len()).await.is_err() {
                        return Some(EgressEnd::RelayClosed);
                    }
                }
                Some(EgressFrame::Eof) => {
                    let _ = writer.shutdown().await;
                    return None;
                }
                Some(EgressFrame::Close) | None => return Some(EgressEnd::ClientGone),
            }
        }
    };
    let down = async {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) => {
                    return match to_client.send(EgressFrame::Eof).await {
                        Ok(()) => None,
                        Err(()) => Some(EgressEnd::RelayClosed),
                    };
                }
                Ok(n) => {
                    received.fetch_add(n as u64, Ordering::Relaxed);
                    if over(n as u64) {
                        return Some(EgressEnd::ByteLimit);
                    }
                    let data = Bytes::copy_from_slice(&buf[..n]);
                    if to_client.send(EgressFrame::Data(data)).await.is_err() {
                        return Some(EgressEnd::RelayClosed);
                    }
                }
                Err(_) => return Some(EgressEnd::ServerError),
            }
        }
    };
    let end = {
        tokio::pin!(up, down);
        let ended = futures::future::select(up, down).await;
        match ended {
            futures::future::Either::Left((Some(end), _))
            | futures::future::Either::Right((Some(end), _)) => end,
            futures::future::Either::Left((None, down)) => down.await.unwrap_or(EgressEnd::Closed),
            futures::future::Either::Right((None, up)) => up.await.unwrap_or(EgressEnd::Closed),
        }
    };
    guard.end = end;
    if !matches!(end, EgressEnd::Closed | EgressEnd::RelayClosed) {
        let _ = to_client.send(EgressFrame::Close).await;
    }
}

/// Tells the handler how a connection ended, also when its task is dropped mid-way.
struct TallyGuard {
    /// Bytes sent and received so far.
    counts: Arc<(AtomicU64, AtomicU64)>,
    end: EgressEnd,
    on_close: Option<Box<dyn FnOnce(EgressTally) + Send>>,
}

impl Drop for TallyGuard {
    fn drop(&mut self) {
        if let Some(on_close) = self.on_close.take() {
            on_close(EgressTally {
                sent: self.counts.0.load(Ordering::Relaxed),
                received: self.counts.1.load(Ordering::Relaxed),
                end: self.end,
            });
        }
    }
}

/// The one call of a channel that serves the egress relay; freed when dropped.
struct ServingEgress<'a>(&'a AtomicBool);

impl<'a> ServingEgress<'a> {
    fn take(flag: &'a AtomicBool) -> Option<Self> {
        flag.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
            .then_some(Self(flag))
    }
}

impl Drop for ServingEgress<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}
