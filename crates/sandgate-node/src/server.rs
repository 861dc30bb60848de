//! The node's side of the RPC: serves one [`SandboxManager`]'s sandboxes to gateways.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::{BoxStream, StreamExt};
use sandgate_sandbox::{
    CommandOptions, ExecOptions, OutputEvent, Sandbox, SandboxError, SandboxManager,
};
use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};

use crate::MAX_MESSAGE_BYTES;
use crate::budget::{ReadBudget, ReadLimits};
use crate::egress::GatewayEgress;
use crate::proto::{self, node_server};
use crate::relay::{GatewayIndex, RelayLimits};
use crate::status::to_status;

/// Output events buffered per streamed call before the cell waits for the gateway.
const EVENT_BUFFER: usize = 64;

/// How long a gateway may take to send a call's request after opening its stream.
const FIRST_INPUT_DEADLINE: Duration = Duration::from_secs(30);

/// The request that opens a call's input stream (the first message); the rest of the stream.
async fn first_input<I, R>(
    inputs: &mut tonic::Streaming<I>,
    start: fn(I) -> Option<R>,
) -> Result<R, Status> {
    let first = tokio::time::timeout(FIRST_INPUT_DEADLINE, inputs.message())
        .await
        .map_err(|_| Status::deadline_exceeded("the call's request did not come"))??;
    first
        .and_then(start)
        .ok_or_else(|| Status::invalid_argument("a call's first message must be its request"))
}

/// What a gateway may send on a call's input stream after its request.
enum Inbound {
    /// A piece of its answer to an index request.
    Index(proto::IndexChunk),
    /// A message of one egress connection.
    Egress(proto::EgressIn),
}

/// Reads a call's input stream to its end, handing index answers to the index relay and egress
/// messages to the egress relay. Anything else (a second request, a message for a relay the
/// call did not ask for) ends the reading: the relays then hear that the gateway is gone.
async fn read_inputs<I>(
    mut inputs: tonic::Streaming<I>,
    inbound: fn(I) -> Option<Inbound>,
    answers: Option<mpsc::Sender<proto::IndexChunk>>,
    egress: Option<Arc<GatewayEgress>>,
) {
    loop {
        let input = match inputs.message().await {
            Ok(Some(input)) => input,
            Ok(None) => break,
            Err(status) => {
                tracing::debug!(%status, "a call's input stream broke");
                break;
            }
        };
        match (inbound(input), &answers, &egress) {
            (Some(Inbound::Index(chunk)), Some(answers), _) => {
                if answers.send(chunk).await.is_err() {
                    break;
                }
            }
            (Some(Inbound::Egress(message)), _, Some(egress)) => egress.deliver(message),
            _ => {
                tracing::debug!("unexpected message on a call's input stream; its relays end");
                break;
            }
        }
    }
    if let Some(egress) = &egress {
        egress.gateway_gone();
    }
}

/// The relays a streamed call asked for, and the reading of its input stream that feeds them.
struct CallRelays<R> {
    index: Option<GatewayIndex>,
    /// The index relay's requests, for the call's output stream.
    asked: Option<mpsc::Receiver<proto::IndexRequest>>,
    egress: Option<Arc<GatewayEgress>>,
    /// The egress relay's messages, for the call's output stream.
    egress_out: Option<mpsc::UnboundedReceiver<proto::EgressOut>>,
    /// Reads the input stream; runs beside the call.
    inputs: R,
}

/// The RPC service of one node: its sandbox manager and the handles it has attached.
#[derive(Debug, Clone)]
pub struct NodeService {
    manager: SandboxManager,
    /// Live handles by container id (launched, claimed or adopted here).
    live: Arc<Mutex<HashMap<String, Sandbox>>>,
    /// Bounds of the package-index relay.
    relay: RelayLimits,
    /// What the node holds for calls (whole files, a cell's images).
    budget: ReadBudget,
}

impl NodeService {
    /// Serves `manager`'s sandboxes.
    pub fn new(manager: SandboxManager) -> Self {
        Self {
            manager,
            live: Arc::default(),
            relay: RelayLimits::default(),
            budget: ReadBudget::new(ReadLimits::default()),
        }
    }

    /// The same service with other bounds on what it holds for calls.
    #[must_use]
    pub fn with_read_limits(mut self, limits: ReadLimits) -> Self {
        self.budget = ReadBudget::new(limits);
        self
    }

    /// The same service with other bounds for the package-index relay.
    #[must_use]
    pub fn with_relay_limits(mut self, limits: RelayLimits) -> Self {
        self.relay = limits;
        self
    }

    /// The tonic service, with this crate's message limits, refusing callers older than
    /// [`crate::version::RPC_OLDEST`].
    pub fn into_server(
        self,
    ) -> InterceptedService<node_server::NodeServer<Self>, crate::version::CheckVersion> {
        self.into_server_with(crate::version::CheckVersion::default())
    }

    /// [`NodeService::into_server`] with another version check (tests play other versions).
    pub fn into_server_with(
        self,
        check: crate::version::CheckVersion,
    ) -> InterceptedService<node_server::NodeServer<Self>, crate::version::CheckVersion> {
        InterceptedService::new(
            node_server::NodeServer::new(self)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
            check,
        )
    }

    fn keep(&self, sandbox: &Sandbox) -> proto::SandboxRef {
        self.live
            .lock()
            .expect("live map")
            .insert(sandbox.container_id().to_owned(), sandbox.clone());
        proto::SandboxRef {
            sandbox_id: sandbox.id().to_owned(),
            container_id: sandbox.container_id().to_owned(),
            profile: sandbox.profile().to_owned(),
        }
    }

    /// The live handle of the sandbox a call names: kept here, else attached now (only a
    /// container of this node's instance can be: another is `NotOurs`).
    async fn sandbox(&self, call: Option<proto::SandboxCall>) -> Result<Sandbox, Status> {
        let call = call.ok_or_else(|| Status::invalid_argument("the call names no sandbox"))?;
        let cached = self
            .live
            .lock()
            .expect("live map")
            .get(&call.container_id)
            .cloned();
        if let Some(sandbox) = cached {
            if !sandbox.is_lost() {
                return Ok(sandbox);
            }
            self.live
                .lock()
                .expect("live map")
                .remove(&call.container_id);
            return Err(to_status(&SandboxError::Died {
                sandbox_id: sandbox.id().to_owned(),
                fate: sandbox.fate().await.map_err(|e| to_status(&e))?,
            }));
        }
        let sandbox = self
            .manager
            .adopt(&call.container_id)
            .await
            .map_err(|e| to_status(&e))?;
        self.keep(&sandbox);
        Ok(sandbox)
    }

    /// The relays of a call: the package index when its gateway serves it (pip's requests go
    /// out on the call's stream), egress when its gateway relays it (the CONNECTs go out there);
    /// the answers come from its `inputs`.
    fn relays<I: Send + 'static>(
        &self,
        index: bool,
        egress: bool,
        inputs: tonic::Streaming<I>,
        inbound: fn(I) -> Option<Inbound>,
    ) -> CallRelays<impl Future<Output = ()> + Send + 'static> {
        let (answers, index, asked) = if index {
            let (answers, rx) = mpsc::channel(ANSWERS_QUEUED);
            let answers_in = tokio_stream::wrappers::ReceiverStream::new(rx)
                .map(Ok)
                .boxed();
            let (relay, asked) = GatewayIndex::new(answers_in, self.relay);
            (Some(answers), Some(relay), Some(asked))
        } else {
            (None, None, None)
        };
        let (egress, egress_out) = if egress {
            let (relay, out) = GatewayEgress::new();
            (Some(relay), Some(out))
        } else {
            (None, None)
        };
        let inputs = read_inputs(inputs, inbound, answers, egress.clone());
        CallRelays {
            index,
            asked,
            egress,
            egress_out,
            inputs,
        }
    }
}

/// Pieces of index answers read from a call's stream before the index relay takes them.
const ANSWERS_QUEUED: usize = 4;

type Reply<T> = Result<Response<T>, Status>;

/// Room in the node's budget held by an answer (kept in its extensions until the transport
/// takes the response).
#[derive(Debug, Clone)]
struct HeldRoom(#[allow(dead_code)] Arc<tokio::sync::OwnedSemaphorePermit>); // held, never read

fn reply<T, U: Into<T>>(result: Result<U, SandboxError>) -> Reply<T> {
    result
        .map(|v| Response::new(v.into()))
        .map_err(|e| to_status(&e))
}

/// One kind of streamed call (exec, command) as it travels over the RPC: its request opens the
/// input stream and the gateway's answers to index requests follow it; output events, index
/// requests and the outcome go back. The two kinds differ only in what is said here, so one
/// relay step ([`NodeService::streamed_call`]) serves both.
trait StreamedCall: Sized + Send + 'static {
    /// A message of the call's input stream.
    type Input: Send + 'static;
    /// What the sandbox answers the call with.
    type Outcome: Send + 'static;
    /// A message of the call's output stream.
    type Event: Send + 'static;

    /// The request, when `input` is the message that opens the call.
    fn request(input: Self::Input) -> Option<Self>;
    /// What `input` is, when it is not the request.
    fn inbound(input: Self::Input) -> Option<Inbound>;
    /// The sandbox the request names, taken out of it.
    fn take_sandbox(&mut self) -> Option<proto::SandboxCall>;
    /// Whether the caller wants the call's output events (progress) at all.
    fn streams(&self) -> bool;
    /// The request within the node's own bounds (a cell's images).
    fn bounded(self, _limits: ReadLimits) -> Self {
        self
    }

    /// Whether the caller serves the sandbox's package index for this call.
    fn serves_index(&self) -> bool;
    /// Whether the caller relays the sandbox's CONNECTs during this call.
    fn relays_egress(&self) -> bool;
    /// Runs the call on `sandbox`, its output events sent to `events`.
    fn run(
        self,
        sandbox: &Sandbox,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> impl Future<Output = Result<Self::Outcome, SandboxError>> + Send;
    /// The output message of an output event.
    fn output(event: proto::OutputEvent) -> Self::Event;
    /// The output message of an index request of the sandbox's pip.
    fn index_request(request: proto::IndexRequest) -> Self::Event;
    /// The output message of an egress connection's message.
    fn egress(message: proto::EgressOut) -> Self::Event;
    /// The last output message: the call's outcome.
    fn outcome(outcome: Self::Outcome) -> Self::Event;
}

impl StreamedCall for proto::ExecRequest {
    type Input = proto::ExecInput;
    type Outcome = sandgate_sandbox::ExecOutcome;
    type Event = proto::ExecEvent;

    fn request(input: proto::ExecInput) -> Option<Self> {
        match input.input {
            Some(proto::exec_input::Input::Start(request)) => Some(request),
            _ => None,
        }
    }

    fn inbound(input: proto::ExecInput) -> Option<Inbound> {
        match input.input {
            Some(proto::exec_input::Input::IndexAnswer(chunk)) => Some(Inbound::Index(chunk)),
            Some(proto::exec_input::Input::Egress(message)) => Some(Inbound::Egress(message)),
            _ => None,
        }
    }

    fn take_sandbox(&mut self) -> Option<proto::SandboxCall> {
        self.sandbox.take()
    }

    fn streams(&self) -> bool {
        self.stream
    }

    fn bounded(mut self, limits: ReadLimits) -> Self {
        self.display_limit = self.display_limit.min(limits.display_bytes_per_call);
        self
    }

    fn serves_index(&self) -> bool {
        self.index
    }

    fn relays_egress(&self) -> bool {
        self.egress
    }

    fn run(
        self,
        sandbox: &Sandbox,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> impl Future<Output = Result<Self::Outcome, SandboxError>> + Send {
        let options = ExecOptions {
            timeout: Duration::from_millis(self.timeout_ms),
            output_limit: usize::try_from(self.output_limit).unwrap_or(usize::MAX),
            display_limit: usize::try_from(self.display_limit).unwrap_or(usize::MAX),
        };
        async move { sandbox.exec(&self.code, options, events).await }
    }

    fn output(event: proto::OutputEvent) -> proto::ExecEvent {
        proto::ExecEvent {
            event: Some(proto::exec_event::Event::Output(event)),
        }
    }

    fn index_request(request: proto::IndexRequest) -> proto::ExecEvent {
        proto::ExecEvent {
            event: Some(proto::exec_event::Event::IndexRequest(request)),
        }
    }

    fn egress(message: proto::EgressOut) -> proto::ExecEvent {
        proto::ExecEvent {
            event: Some(proto::exec_event::Event::Egress(message)),
        }
    }

    fn outcome(outcome: Self::Outcome) -> proto::ExecEvent {
        proto::ExecEvent {
            event: Some(proto::exec_event::Event::Outcome(outcome.into())),
        }
    }
}

impl StreamedCall for proto::CommandRequest {
    type Input = proto::CommandInput;
    type Outcome = sandgate_sandbox::CommandOutcome;
    type Event = proto::CommandEvent;

    fn request(input: proto::CommandInput) -> Option<Self> {
        match input.input {
            Some(proto::command_input::Input::Start(request)) => Some(request),
            _ => None,
        }
    }

    fn inbound(input: proto::CommandInput) -> Option<Inbound> {
        match input.input {
            Some(proto::command_input::Input::IndexAnswer(chunk)) => Some(Inbound::Index(chunk)),
            Some(proto::command_input::Input::Egress(message)) => Some(Inbound::Egress(message)),
            _ => None,
        }
    }

    fn take_sandbox(&mut self) -> Option<proto::SandboxCall> {
        self.sandbox.take()
    }

    fn streams(&self) -> bool {
        self.stream
    }

    fn serves_index(&self) -> bool {
        self.index
    }

    fn relays_egress(&self) -> bool {
        self.egress
    }

    fn run(
        self,
        sandbox: &Sandbox,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> impl Future<Output = Result<Self::Outcome, SandboxError>> + Send {
        let options = CommandOptions {
            timeout: Duration::from_millis(self.timeout_ms),
            output_limit: usize::try_from(self.output_limit).unwrap_or(usize::MAX),
            cwd: self.cwd,
        };
        async move { sandbox.command(&self.command, options, events).await }
    }

    fn output(event: proto::OutputEvent) -> proto::CommandEvent {
        proto::CommandEvent {
            event: Some(proto::command_event::Event::Output(event)),
        }
    }

    fn index_request(request: proto::IndexRequest) -> proto::CommandEvent {
        proto::CommandEvent {
            event: Some(proto::command_event::Event::IndexRequest(request)),
        }
    }

    fn egress(message: proto::EgressOut) -> proto::CommandEvent {
        proto::CommandEvent {
            event: Some(proto::command_event::Event::Egress(message)),
        }
    }

    fn outcome(outcome: Self::Outcome) -> proto::CommandEvent {
        proto::CommandEvent {
            event: Some(proto::command_event::Event::Outcome(outcome.into())),
        }
    }
}

impl NodeService {
    /// Serves one streamed call of kind `C`: reads its request, finds its sandbox, opens the
    /// package-index relay when the gateway serves the index, and streams the call's messages.
    async fn streamed_call<C: StreamedCall>(
        &self,
        request: Request<tonic::Streaming<C::Input>>,
    ) -> Reply<BoxStream<'static, Result<C::Event, Status>>> {
        let mut inputs = request.into_inner();
        let mut req = first_input(&mut inputs, C::request)
            .await?
            .bounded(self.budget.limits());
        let sandbox = self.sandbox(req.take_sandbox()).await?;
        tracing::Span::current().record("sandbox_id", sandbox.id());
        let (tx, rx) = mpsc::channel(EVENT_BUFFER);
        let events = req.streams().then_some(tx);
        let CallRelays {
            index,
            asked,
            egress,
            egress_out,
            inputs,
        } = self.relays(req.serves_index(), req.relays_egress(), inputs, C::inbound);
        let call = async move {
            let channel = sandbox.channel();
            let run = req.run(&sandbox, events);
            let run = async {
                match &index {
                    Some(relay) => channel.with_index(relay, run).await,
                    None => run.await,
                }
            };
            let run = async {
                match egress {
                    Some(relay) => channel.with_egress(relay, run).await,
                    None => run.await,
                }
            };
            // The input stream is read beside the call, and for as long as it runs.
            let inputs = async {
                inputs.await;
                std::future::pending::<()>().await;
            };
            tokio::select! {
                out = run => out,
                () = inputs => unreachable!("reading the inputs never ends the call"),
            }
        };
        Ok(Response::new(call_stream::<C>(call, rx, asked, egress_out)))
    }
}

/// A streamed call's messages: its output events, the package index requests of its index
/// relay and the messages of its egress relay as they come, then its outcome. Nothing is spawned: dropping the stream (the gateway went
/// away or cancelled) drops the call, and the channel interrupts the cell or kills the command
/// as it does in one process.
fn call_stream<C: StreamedCall>(
    call: impl Future<Output = Result<C::Outcome, SandboxError>> + Send + 'static,
    events: mpsc::Receiver<OutputEvent>,
    index: Option<mpsc::Receiver<proto::IndexRequest>>,
    egress: Option<mpsc::UnboundedReceiver<proto::EgressOut>>,
) -> BoxStream<'static, Result<C::Event, Status>> {
    enum State<F, M> {
        Running(Pin<Box<F>>, mpsc::Receiver<OutputEvent>),
        Draining(mpsc::Receiver<OutputEvent>, Result<M, Status>),
        Done,
    }
    let start = State::Running(Box::pin(call), events);
    let relays = (index, egress);
    futures::stream::unfold((start, relays), move |(state, mut relays)| async move {
        let mut state = state;
        loop {
            state = match state {
                State::Running(mut call, mut events) => {
                    let (index, egress) = &mut relays;
                    let asked = async {
                        match index.as_mut() {
                            Some(rx) => rx.recv().await,
                            None => std::future::pending().await,
                        }
                    };
                    let egressed = async {
                        match egress.as_mut() {
                            Some(rx) => rx.recv().await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        biased;
                        Some(e) = events.recv() => {
                            let m = C::output(e.into());
                            return Some((Ok(m), (State::Running(call, events), relays)));
                        }
                        Some(r) = asked => {
                            let m = C::index_request(r);
                            return Some((Ok(m), (State::Running(call, events), relays)));
                        }
                        Some(o) = egressed => {
                            let m = C::egress(o);
                            return Some((Ok(m), (State::Running(call, events), relays)));
                        }
                        out = &mut call => {
                            let last = out.map(C::outcome).map_err(|e| to_status(&e));
                            State::Draining(events, last)
                        }
                    }
                }
                State::Draining(mut events, last) => match events.recv().await {
                    Some(e) => {
                        let m = C::output(e.into());
                        return Some((Ok(m), (State::Draining(events, last), relays)));
                    }
                    None => return Some((last, (State::Done, relays))),
                },
                State::Done => return None,
            };
        }
    })
    .boxed()
}

#[tonic::async_trait]
impl node_server::Node for NodeService {
    #[tracing::instrument(skip_all, fields(profile = %request.get_ref().profile))]
    async fn launch(&self, request: Request<proto::LaunchRequest>) -> Reply<proto::SandboxRef> {
        let req = request.into_inner();
        let base = self
            .manager
            .profile(&req.profile)
            .map_err(|e| to_status(&e))?;
        let mut profile = base.clone();
        if req.memory_mb > 0 {
            profile.memory_mb = req.memory_mb;
        }
        if req.cpus > 0.0 {
            profile.cpus = req.cpus;
        }
        let permit = self
            .manager
            .start_permit(&profile.name)
            .await
            .map_err(|e| to_status(&e))?;
        let id = (!req.sandbox_id.is_empty()).then_some(req.sandbox_id.as_str());
        let sandbox = self
            .manager
            .launch_permitted_as(&profile, permit, id)
            .await
            .map_err(|e| to_status(&e))?;
        self.manager.record_lease(&profile.name);
        Ok(Response::new(self.keep(&sandbox)))
    }

    #[tracing::instrument(skip_all, fields(sandbox_id = %request.get_ref().sandbox_id))]
    async fn claim(&self, request: Request<proto::ClaimRequest>) -> Reply<proto::SandboxRef> {
        let req = request.into_inner();
        let sandbox = match self.manager.take_ready_id(&req.sandbox_id) {
            Some(sandbox) => sandbox,
            None => self
                .manager
                .adopt(&req.container_id)
                .await
                .map_err(|e| to_status(&e))?,
        };
        if sandbox.is_lost() {
            let fate = sandbox.fate().await.map_err(|e| to_status(&e))?;
            return Err(to_status(&SandboxError::Died {
                sandbox_id: sandbox.id().to_owned(),
                fate,
            }));
        }
        let _ = self.manager.refill(sandbox.profile());
        Ok(Response::new(self.keep(&sandbox)))
    }

    async fn adopt(&self, request: Request<proto::AdoptRequest>) -> Reply<proto::SandboxRef> {
        let req = request.into_inner();
        let sandbox = self
            .manager
            .adopt(&req.container_id)
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(self.keep(&sandbox)))
    }

    async fn remove(&self, request: Request<proto::RemoveRequest>) -> Reply<proto::Empty> {
        let req = request.into_inner();
        let handle = self
            .live
            .lock()
            .expect("live map")
            .remove(&req.container_id);
        let removed = match handle {
            Some(sandbox) => self.manager.close(sandbox).await,
            None => self.manager.remove_container(&req.container_id).await,
        };
        reply(removed.map(|()| proto::Empty {}))
    }

    async fn fate(&self, request: Request<proto::SandboxCall>) -> Reply<proto::ContainerFate> {
        let req = request.into_inner();
        let cached = self
            .live
            .lock()
            .expect("live map")
            .get(&req.container_id)
            .cloned();
        match cached {
            Some(sandbox) => reply(sandbox.fate().await.map(|f| proto::ContainerFate::from(&f))),
            None => match self.manager.adopt(&req.container_id).await {
                Ok(sandbox) => {
                    self.keep(&sandbox);
                    reply(sandbox.fate().await.map(|f| proto::ContainerFate::from(&f)))
                }
                Err(SandboxError::Died { fate, .. }) => {
                    Ok(Response::new(proto::ContainerFate::from(&fate)))
                }
                Err(err) => Err(to_status(&err)),
            },
        }
    }

    type ExecStream = BoxStream<'static, Result<proto::ExecEvent, Status>>;

    #[tracing::instrument(skip_all, fields(sandbox_id))]
    async fn exec(
        &self,
        request: Request<tonic::Streaming<proto::ExecInput>>,
    ) -> Reply<Self::ExecStream> {
        self.streamed_call::<proto::ExecRequest>(request).await
    }

    type CommandStream = BoxStream<'static, Result<proto::CommandEvent, Status>>;

    #[tracing::instrument(skip_all, fields(sandbox_id))]
    async fn command(
        &self,
        request: Request<tonic::Streaming<proto::CommandInput>>,
    ) -> Reply<Self::CommandStream> {
        self.streamed_call::<proto::CommandRequest>(request).await
    }

    async fn write_file(
        &self,
        request: Request<proto::WriteFileRequest>,
    ) -> Reply<proto::FileInfo> {
        let req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox).await?;
        reply(
            sandbox
                .write_file(&req.path, &req.data, req.overwrite)
                .await,
        )
    }

    type ReadFileStream = BoxStream<'static, Result<proto::FileChunk, Status>>;

    async fn read_file(
        &self,
        request: Request<proto::ReadFileRequest>,
    ) -> Reply<Self::ReadFileStream> {
        let req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox).await?;
        let (first, rest) = sandbox
            .read_file_stream(&req.path, req.max_bytes)
            .await
            .map_err(|e| to_status(&e))?;
        let first = futures::stream::once(async move { Ok(proto::FileChunk { data: first }) });
        let rest = rest.map(|chunk| {
            chunk
                .map(|data| proto::FileChunk { data })
                .map_err(|e| to_status(&SandboxError::Channel(e)))
        });
        Ok(Response::new(first.chain(rest).boxed()))
    }

    async fn read_whole_file(
        &self,
        request: Request<proto::ReadFileRequest>,
    ) -> Reply<proto::FileContent> {
        let req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox).await?;
        // The whole file is held here, then once more while it is encoded: room for both is
        // reserved before anything is read, and held until the answer goes to the transport.
        let max_bytes = self.budget.per_call(req.max_bytes);
        let room = self
            .budget
            .reserve(max_bytes.saturating_mul(2))
            .map_err(|e| to_status(&e))?;
        let mut answer = reply(sandbox.read_file(&req.path, max_bytes).await.map(
            |(data, info)| proto::FileContent {
                data: data.into(),
                info: Some(info.into()),
            },
        ))?;
        answer.extensions_mut().insert(HeldRoom(Arc::new(room)));
        Ok(answer)
    }

    async fn list(&self, request: Request<proto::PathRequest>) -> Reply<proto::Listing> {
        let req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox).await?;
        reply(sandbox.list(&req.path).await)
    }

    async fn start_job(&self, request: Request<proto::StartJobRequest>) -> Reply<proto::Job> {
        let req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox).await?;
        reply(sandbox.start_job(&req.command, req.cwd.as_deref()).await)
    }

    async fn jobs(&self, request: Request<proto::SandboxCall>) -> Reply<proto::JobList> {
        let sandbox = self.sandbox(Some(request.into_inner())).await?;
        reply(sandbox.jobs().await.map(|jobs| proto::JobList {
            jobs: jobs.into_iter().map(Into::into).collect(),
        }))
    }

    async fn kill_job(&self, request: Request<proto::KillJobRequest>) -> Reply<proto::Job> {
        let req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox).await?;
        reply(sandbox.kill_job(&req.job).await)
    }

    type CheckpointSealedStream = BoxStream<'static, Result<proto::SealedOut, Status>>;

    #[tracing::instrument(skip_all)]
    async fn checkpoint_sealed(
        &self,
        request: Request<proto::CheckpointSealedRequest>,
    ) -> Reply<Self::CheckpointSealedStream> {
        let mut req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox.take()).await?;
        crate::sealed::serve_checkpoint(self.manager.clone(), sandbox, req).map(Response::new)
    }

    #[tracing::instrument(skip_all)]
    async fn restore_sealed(
        &self,
        request: Request<tonic::Streaming<proto::RestoreSealedInput>>,
    ) -> Reply<proto::SandboxRef> {
        let sandbox = crate::sealed::serve_restore(&self.manager, request.into_inner()).await?;
        Ok(Response::new(self.keep(&sandbox)))
    }

    async fn set_egress_env(
        &self,
        request: Request<proto::SetEgressEnvRequest>,
    ) -> Reply<proto::EgressEnvReply> {
        let mut req = request.into_inner();
        let sandbox = self.sandbox(req.sandbox.take()).await?;
        let env = sandgate_sandbox::EgressEnv::from(req);
        reply(
            sandbox
                .channel()
                .set_egress_env(&env)
                .await
                .map_err(SandboxError::from),
        )
    }

    async fn ping(&self, request: Request<proto::SandboxCall>) -> Reply<proto::PingInfo> {
        let sandbox = self.sandbox(Some(request.into_inner())).await?;
        reply(sandbox.ping().await)
    }

    async fn restart(&self, request: Request<proto::SandboxCall>) -> Reply<proto::Empty> {
        let sandbox = self.sandbox(Some(request.into_inner())).await?;
        reply(sandbox.restart().await.map(|()| proto::Empty {}))
    }

    async fn pool_stats(
        &self,
        request: Request<proto::PoolStatsRequest>,
    ) -> Reply<proto::PoolStatsReply> {
        let req = request.into_inner();
        Ok(Response::new(
            self.manager
                .pool_stats(&req.profile)
                .map(Into::into)
                .unwrap_or_default(),
        ))
    }
}

/// Why the node RPC stopped serving.
#[derive(Debug, thiserror::Error)]
#[error("the node RPC server failed")]
pub struct ServeError(#[source] tonic::transport::Error);

/// Serves `service` on `listener` until `shutdown` resolves: over mutual TLS when `tls` is given
/// (only clients with a gateway certificate of the deployment's CA get past the handshake, each
/// handshake with the certificates of its moment; plain HTTP/2 never does), else in cleartext
/// (configuration allows that on loopback only).
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: NodeService,
    tls: Option<&crate::NodeTls>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .add_service(service.into_server());
    match tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(crate::tls::incoming(listener, tls.clone()), shutdown)
                .await
        }
        // TCP_NODELAY on every accepted connection (`Server::tcp_nodelay` applies only to
        // sockets tonic binds itself): without it a reply's last small frame (the trailers)
        // waits for the ACK of the previous one, and the caller's delayed ACK adds ~40 ms to
        // every call.
        None => {
            router
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                    shutdown,
                )
                .await
        }
    }
    .map_err(ServeError)
}
