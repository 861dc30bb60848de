//! The egress relay over the node RPC (docs/egress.md, docs/scale-out.md "The node RPC").
//!
//! In one process, a client's `CONNECT` to the sandbox's proxy reaches the gateway's egress
//! component through the agent channel ([`sandgate_sandbox::AgentChannel::with_egress`]). With
//! the sandbox on a remote node, the node runs the same relay, but its [`EgressHandler`] is
//! [`GatewayEgress`]: each CONNECT goes back to the gateway that made the call, on that call's
//! own stream (`Exec` and `Command` are bidirectional: `EgressOut` node → gateway, `EgressIn`
//! gateway → node), as the package index relay does ([`crate::relay`]). The node decides
//! nothing and opens no socket: the tenant's policy, the address checks, the dial, the budgets,
//! the secrets and the audit stay in the gateway. And the gateway serves a node's connections
//! only on a call it opened asking for egress, for the sandbox it named ([`serve`]): a node
//! cannot open one on its own, nor on a call that did not ask.
//!
//! Bounds, on both sides: at most [`OPEN_PER_CALL`] connections of one call open at once, a
//! CONNECT's authority of at most [`MAX_AUTHORITY`] bytes, a deadline for the gateway's verdict,
//! and flow control per connection and direction: a side sends at most [`WINDOW_BYTES`] of data
//! the other has not acknowledged, in messages of at most [`MAX_DATA_BYTES`]; the other ends a
//! connection that goes past them. So neither side ever waits to take a message off the call's
//! stream: a connection whose far end stops reading stalls itself only, never the call's output,
//! its outcome, its package index relay or its other connections.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::BoxFuture;
use sandgate_sandbox::{
    EgressEnd, EgressFrame, EgressHandler, EgressRefusal, EgressSink, EgressUpstream,
    relay_connection,
};
use std::sync::atomic::{AtomicBool, AtomicUsize};

use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::task::JoinSet;

use crate::proto::{self, egress_in, egress_out};

/// The most connections of one call open at once; past it a CONNECT is answered `429`.
pub const OPEN_PER_CALL: usize = 64;

/// The longest `CONNECT` authority relayed (a DNS name is at most 253 bytes).
pub const MAX_AUTHORITY: usize = 1024;

/// The most bytes of one connection's data in flight each way over the call's stream (sent and
/// not yet acknowledged).
pub const WINDOW_BYTES: usize = 512 << 10;

/// The largest data message (the relay reads at most this much at a time).
pub const MAX_DATA_BYTES: usize = 256 << 10;

/// Bytes buffered on the node between the agent's side of a connection and the RPC's.
const PIPE_BYTES: usize = 64 << 10;

/// How long the node waits for the gateway to admit or refuse a CONNECT (the gateway's own
/// dial is bounded by `egress.connect_timeout_seconds`).
const VERDICT_DEADLINE: Duration = Duration::from_secs(90);

/// The longest refusal text passed on to the client.
const MAX_REFUSAL_CHARS: usize = 4000;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn refusal(status: u16, text: impl Into<String>) -> EgressRefusal {
    EgressRefusal {
        status,
        text: text.into(),
    }
}

/// Credit to send one connection's data: the bytes the other side still has room for.
#[derive(Clone)]
struct Credit(Arc<Semaphore>);

impl Credit {
    fn new() -> Self {
        Self(Arc::new(Semaphore::new(WINDOW_BYTES)))
    }

    /// Waits until `bytes` may be sent; an error once the connection ended.
    async fn spend(&self, bytes: usize) -> Result<(), ()> {
        let bytes = u32::try_from(bytes.min(MAX_DATA_BYTES)).map_err(|_| ())?;
        let permit = self.0.acquire_many(bytes).await.map_err(|_| ())?;
        permit.forget();
        Ok(())
    }

    /// The other side passed `bytes` on (never more room than the window).
    fn restore(&self, bytes: u64) {
        let room = WINDOW_BYTES.saturating_sub(self.0.available_permits());
        let bytes = usize::try_from(bytes).unwrap_or(usize::MAX).min(room);
        self.0.add_permits(bytes);
    }

    /// The connection ended: a sender waiting for credit stops.
    fn end(&self) {
        self.0.close();
    }
}

/// Bytes of one connection's data received and not yet passed on.
#[derive(Clone, Default)]
struct Unacked(Arc<AtomicUsize>);

impl Unacked {
    /// Counts a data message of `bytes`; false when it breaks the sender's bounds.
    fn receive(&self, bytes: usize) -> bool {
        bytes <= MAX_DATA_BYTES && self.0.fetch_add(bytes, Ordering::AcqRel) + bytes <= WINDOW_BYTES
    }

    fn passed_on(&self, bytes: usize) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(bytes))
            });
    }
}

/// One direction's state of a connection on either side: where its frames go, the credit for
/// what this side sends, the count of what it received.
struct Flow {
    frames: mpsc::UnboundedSender<EgressFrame>,
    credit: Credit,
    unacked: Unacked,
}

impl Flow {
    fn new() -> (Self, mpsc::UnboundedReceiver<EgressFrame>) {
        let (frames, rx) = mpsc::unbounded_channel();
        let flow = Self {
            frames,
            credit: Credit::new(),
            unacked: Unacked::default(),
        };
        (flow, rx)
    }

    /// Takes a frame of the other side; false when the connection is to end (the other side
    /// broke the flow control, or nobody reads its frames any more).
    fn take(&self, frame: EgressFrame) -> bool {
        if let EgressFrame::Data(data) = &frame
            && !self.unacked.receive(data.len())
        {
            tracing::debug!(
                bytes = data.len(),
                "egress data past the window: the connection ends"
            );
            return false;
        }
        if matches!(frame, EgressFrame::Close) {
            self.credit.end();
        }
        self.frames.send(frame).is_ok()
    }
}

impl Drop for Flow {
    fn drop(&mut self) {
        self.credit.end();
    }
}

/// The frames a relay reads from an unbounded receiver.
fn frames_of(
    mut rx: mpsc::UnboundedReceiver<EgressFrame>,
) -> impl futures::Stream<Item = EgressFrame> + Send + Unpin {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

// ---------------------------------------------------------------------------------------------
// The node's side

/// The gateway's verdict on one CONNECT.
enum Verdict {
    Accepted,
    Refused(EgressRefusal),
}

/// One connection of the call, as the node knows it.
struct Connection {
    /// Where the gateway's verdict goes, until it came.
    verdict: Option<oneshot::Sender<Verdict>>,
    /// The server's bytes as the gateway relays them, and the credit for the client's.
    flow: Flow,
}

/// The node's [`EgressHandler`] for one call: relays each CONNECT to the gateway that made it.
pub(crate) struct GatewayEgress {
    /// The call's output stream (its `EgressOut` messages; each connection's data bounded by its
    /// window).
    out: mpsc::UnboundedSender<proto::EgressOut>,
    connections: Arc<Mutex<HashMap<u64, Connection>>>,
    next_cid: AtomicU64,
    /// The gateway's side of the call's stream ended: nothing more can be relayed.
    gone: AtomicBool,
    /// Each admitted connection's side towards the gateway; ended with the call.
    bridges: Mutex<JoinSet<()>>,
}

impl GatewayEgress {
    /// The relay of one call; its messages for the gateway come out of the receiver, to go on
    /// the call's output stream.
    pub(crate) fn new() -> (Arc<Self>, mpsc::UnboundedReceiver<proto::EgressOut>) {
        let (out, rx) = mpsc::unbounded_channel();
        let relay = Self {
            out,
            connections: Arc::default(),
            next_cid: AtomicU64::new(1),
            gone: AtomicBool::new(false),
            bridges: Mutex::new(JoinSet::new()),
        };
        (Arc::new(relay), rx)
    }

    /// Hands one of the gateway's messages to its connection, without waiting (one the node
    /// does not know, or knows no more, is dropped; a kind this build does not know is ignored).
    pub(crate) fn deliver(&self, input: proto::EgressIn) {
        let cid = input.cid;
        let frame = match input.what {
            Some(egress_in::What::Accepted(_)) => return self.verdict(cid, Verdict::Accepted),
            Some(egress_in::What::Refused(r)) => {
                // Shown to the client as the proxy's answer: a status it can parse, a bounded text.
                let status = u16::try_from(r.status)
                    .ok()
                    .filter(|s| (400..600).contains(s))
                    .unwrap_or(502);
                let text: String = r.text.chars().take(MAX_REFUSAL_CHARS).collect();
                return self.verdict(cid, Verdict::Refused(refusal(status, text)));
            }
            Some(egress_in::What::Ack(bytes)) => {
                if let Some(c) = lock(&self.connections).get(&cid) {
                    c.flow.credit.restore(bytes);
                }
                return;
            }
            Some(egress_in::What::Data(data)) => EgressFrame::Data(data),
            Some(egress_in::What::Eof(_)) => EgressFrame::Eof,
            Some(egress_in::What::Close(_)) => EgressFrame::Close,
            None => return,
        };
        let mut connections = lock(&self.connections);
        if let Some(c) = connections.get(&cid)
            && !c.flow.take(frame)
        {
            // Dropping its flow ends the bridge, which tells the gateway.
            connections.remove(&cid);
        }
    }

    /// The gateway's side of the call's stream ended: every connection ends with it, a CONNECT
    /// waiting for a verdict gets none, and new ones are refused at once.
    pub(crate) fn gateway_gone(&self) {
        self.gone.store(true, Ordering::Release);
        lock(&self.connections).clear();
    }

    fn verdict(&self, cid: u64, verdict: Verdict) {
        let waiting = lock(&self.connections)
            .get_mut(&cid)
            .and_then(|c| c.verdict.take());
        if let Some(waiting) = waiting {
            let _ = waiting.send(verdict);
        }
    }

    fn forget(&self, cid: u64) {
        lock(&self.connections).remove(&cid);
    }

    async fn open_relayed(&self, authority: &str) -> Result<EgressUpstream, EgressRefusal> {
        let gone = || refusal(502, "the gateway stopped relaying this call's connections");
        if self.gone.load(Ordering::Acquire) {
            return Err(gone());
        }
        if authority.len() > MAX_AUTHORITY {
            return Err(refusal(
                400,
                format!("a CONNECT target longer than {MAX_AUTHORITY} bytes is not relayed"),
            ));
        }
        let cid = self.next_cid.fetch_add(1, Ordering::Relaxed);
        let (verdict_tx, verdict_rx) = oneshot::channel();
        let (flow, from_gateway) = Flow::new();
        let credit = flow.credit.clone();
        let unacked = flow.unacked.clone();
        {
            let mut connections = lock(&self.connections);
            // A connection whose bridge ended (or that never got its verdict) holds no place.
            connections.retain(|_, c| !c.flow.frames.is_closed());
            if connections.len() >= OPEN_PER_CALL {
                return Err(refusal(
                    429,
                    format!(
                        "this call has {OPEN_PER_CALL} connections open already; close one and \
                         try again"
                    ),
                ));
            }
            connections.insert(
                cid,
                Connection {
                    verdict: Some(verdict_tx),
                    flow,
                },
            );
        }
        let open = proto::EgressOut {
            cid,
            what: Some(egress_out::What::Open(authority.to_owned())),
        };
        if self.out.send(open).is_err() {
            self.forget(cid);
            return Err(gone());
        }
        match tokio::time::timeout(VERDICT_DEADLINE, verdict_rx).await {
            Ok(Ok(Verdict::Accepted)) => {}
            Ok(Ok(Verdict::Refused(refused))) => {
                self.forget(cid);
                return Err(refused);
            }
            Ok(Err(_)) => {
                self.forget(cid);
                return Err(gone());
            }
            Err(_) => {
                self.forget(cid);
                // The gateway may admit it later: tell it the client is gone.
                let _ = self.out.send(close(cid));
                return Err(refusal(
                    504,
                    format!(
                        "the gateway did not admit or refuse this connection within {} s; try again",
                        VERDICT_DEADLINE.as_secs()
                    ),
                ));
            }
        }
        // The agent's relay reads and writes `near`; the bridge carries `far` over the RPC.
        let (near, far) = tokio::io::duplex(PIPE_BYTES);
        let connections = self.connections.clone();
        let far = EgressUpstream {
            io: Box::new(far),
            byte_limit: None,
            budget: None,
            on_close: Box::new(move |_| {
                lock(&connections).remove(&cid);
            }),
        };
        let sink = RpcSink {
            cid,
            out: self.out.clone(),
            credit,
            unacked,
        };
        {
            let mut bridges = lock(&self.bridges);
            while bridges.try_join_next().is_some() {}
            bridges.spawn(async move {
                relay_connection(far, frames_of(from_gateway), &sink).await;
            });
        }
        let out = self.out.clone();
        Ok(EgressUpstream {
            io: Box::new(near),
            // The gateway counts and bounds the bytes.
            byte_limit: None,
            budget: None,
            on_close: Box::new(move |tally| {
                // The client broke off: the gateway hears it now, not when the pipe drains.
                if tally.end != EgressEnd::Closed {
                    let _ = out.send(close(cid));
                }
            }),
        })
    }
}

fn close(cid: u64) -> proto::EgressOut {
    proto::EgressOut {
        cid,
        what: Some(egress_out::What::Close(proto::Empty {})),
    }
}

impl EgressHandler for GatewayEgress {
    fn open<'a>(
        &'a self,
        authority: &'a str,
    ) -> BoxFuture<'a, Result<EgressUpstream, EgressRefusal>> {
        Box::pin(self.open_relayed(authority))
    }
}

/// A connection's frames towards the gateway, on the call's output stream.
struct RpcSink {
    cid: u64,
    out: mpsc::UnboundedSender<proto::EgressOut>,
    /// Credit for the client's data.
    credit: Credit,
    /// The gateway's data held here.
    unacked: Unacked,
}

impl RpcSink {
    fn say(&self, what: egress_out::What) -> Result<(), ()> {
        let message = proto::EgressOut {
            cid: self.cid,
            what: Some(what),
        };
        self.out.send(message).map_err(|_| ())
    }
}

impl EgressSink for RpcSink {
    fn send(&self, frame: EgressFrame) -> BoxFuture<'_, Result<(), ()>> {
        Box::pin(async move {
            let what = match frame {
                EgressFrame::Data(data) => {
                    self.credit.spend(data.len()).await?;
                    egress_out::What::Data(data)
                }
                EgressFrame::Eof => egress_out::What::Eof(proto::Empty {}),
                EgressFrame::Close => egress_out::What::Close(proto::Empty {}),
            };
            self.say(what)
        })
    }

    fn consumed(&self, bytes: usize) -> BoxFuture<'_, Result<(), ()>> {
        self.unacked.passed_on(bytes);
        let said = self.say(egress_out::What::Ack(bytes as u64));
        Box::pin(async move { said })
    }
}

// ---------------------------------------------------------------------------------------------
// The gateway's side

tokio::task_local! {
    /// The egress relay of the call running in this task: set by [`serve`] around a call to one
    /// sandbox.
    static EGRESS: Scope;
}

struct Scope {
    container_id: String,
    handler: Arc<dyn EgressHandler>,
}

/// The egress handler of a call to sandbox `container_id` when it runs under [`serve`] for it.
pub(crate) fn current(container_id: &str) -> Option<Arc<dyn EgressHandler>> {
    EGRESS
        .try_with(|scope| (scope.container_id == container_id).then(|| scope.handler.clone()))
        .ok()
        .flatten()
}

/// Runs `call` (a cell or a command on the remote sandbox `container_id`) with the CONNECTs its
/// node relays decided by `handler`; the call's output.
pub(crate) async fn serve<T>(
    container_id: &str,
    handler: Arc<dyn EgressHandler>,
    call: impl Future<Output = T>,
) -> T {
    let scope = Scope {
        container_id: container_id.to_owned(),
        handler,
    };
    EGRESS.scope(scope, call).await
}

/// A call's egress relay on the gateway: the node's connections of this call, each decided by
/// the handler and relayed. Dropped with the call: its connections end then.
pub(crate) struct CallEgress {
    handler: Arc<dyn EgressHandler>,
    /// The call's input stream (its `EgressIn` messages; each connection's data bounded by its
    /// window).
    to_node: mpsc::UnboundedSender<proto::EgressIn>,
    connections: HashMap<u64, Flow>,
    tasks: JoinSet<()>,
}

impl CallEgress {
    /// The relay of one call; its messages for the node come out of the receiver, to go on the
    /// call's input stream.
    pub(crate) fn new(
        handler: Arc<dyn EgressHandler>,
    ) -> (Self, mpsc::UnboundedReceiver<proto::EgressIn>) {
        let (to_node, rx) = mpsc::unbounded_channel();
        let relay = Self {
            handler,
            to_node,
            connections: HashMap::new(),
            tasks: JoinSet::new(),
        };
        (relay, rx)
    }

    /// Takes one of the node's messages without waiting: a CONNECT is decided beside the call,
    /// bytes go to their connection (a kind this build does not know is ignored).
    pub(crate) fn take(&mut self, message: proto::EgressOut) {
        let cid = message.cid;
        let frame = match message.what {
            Some(egress_out::What::Open(authority)) => return self.open(cid, authority),
            Some(egress_out::What::Ack(bytes)) => {
                if let Some(flow) = self.connections.get(&cid) {
                    flow.credit.restore(bytes);
                }
                return;
            }
            Some(egress_out::What::Data(data)) => EgressFrame::Data(data),
            Some(egress_out::What::Eof(_)) => EgressFrame::Eof,
            Some(egress_out::What::Close(_)) => EgressFrame::Close,
            None => return,
        };
        if let Some(flow) = self.connections.get(&cid)
            && !flow.take(frame)
        {
            // Dropping its flow ends the relay, which tells the node.
            self.connections.remove(&cid);
        }
    }

    fn open(&mut self, cid: u64, authority: String) {
        while self.tasks.try_join_next().is_some() {}
        self.connections.retain(|_, flow| !flow.frames.is_closed());
        let refused = if self.connections.contains_key(&cid) {
            tracing::debug!(cid, "a node reused the id of an open egress connection");
            return;
        } else if authority.len() > MAX_AUTHORITY {
            Some(refusal(
                400,
                format!("a CONNECT target longer than {MAX_AUTHORITY} bytes is not relayed"),
            ))
        } else if self.connections.len() >= OPEN_PER_CALL {
            Some(refusal(
                429,
                format!(
                    "this call has {OPEN_PER_CALL} connections open already; close one and try \
                     again"
                ),
            ))
        } else {
            None
        };
        let (flow, from_client) = Flow::new();
        let sink = NodeSink {
            cid,
            to_node: self.to_node.clone(),
            credit: flow.credit.clone(),
            unacked: flow.unacked.clone(),
        };
        if let Some(refused) = refused {
            let _ = sink.refuse(refused);
            return;
        }
        self.connections.insert(cid, flow);
        let handler = self.handler.clone();
        self.tasks.spawn(async move {
            match handler.open(&authority).await {
                Err(refused) => {
                    let _ = sink.refuse(refused);
                }
                Ok(upstream) => relay_connection(upstream, frames_of(from_client), &sink).await,
            }
        });
    }
}

/// A connection's frames towards the node, on the call's input stream.
struct NodeSink {
    cid: u64,
    to_node: mpsc::UnboundedSender<proto::EgressIn>,
    /// Credit for the server's data.
    credit: Credit,
    /// The node's data held here.
    unacked: Unacked,
}

impl NodeSink {
    fn say(&self, what: egress_in::What) -> Result<(), ()> {
        let message = proto::EgressIn {
            cid: self.cid,
            what: Some(what),
        };
        self.to_node.send(message).map_err(|_| ())
    }

    fn refuse(&self, refused: EgressRefusal) -> Result<(), ()> {
        self.say(egress_in::What::Refused(proto::EgressRefused {
            status: refused.status.into(),
            text: refused.text,
        }))
    }
}

impl EgressSink for NodeSink {
    fn accepted(&self) -> BoxFuture<'_, Result<(), ()>> {
        let said = self.say(egress_in::What::Accepted(proto::Empty {}));
        Box::pin(async move { said })
    }

    fn send(&self, frame: EgressFrame) -> BoxFuture<'_, Result<(), ()>> {
        Box::pin(async move {
            let what = match frame {
                EgressFrame::Data(data) => {
                    self.credit.spend(data.len()).await?;
                    egress_in::What::Data(data)
                }
                EgressFrame::Eof => egress_in::What::Eof(proto::Empty {}),
                EgressFrame::Close => egress_in::What::Close(proto::Empty {}),
            };
            self.say(what)
        })
    }

    fn consumed(&self, bytes: usize) -> BoxFuture<'_, Result<(), ()>> {
        self.unacked.passed_on(bytes);
        let said = self.say(egress_in::What::Ack(bytes as u64));
        Box::pin(async move { said })
    }
}
