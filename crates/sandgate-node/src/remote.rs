//! The gateway's side of the RPC: a node in another process, reached over mutual TLS.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use sandgate_sandbox::{
    CommandOptions, CommandOutcome, ContainerFate, EgressEnv, EgressEnvInfo, EgressHandler,
    ExecOptions, ExecOutcome, FileChunks, FileInfo, IndexHandler, Job, Listing, OutputEvent,
    PingInfo, PoolStats, SandboxError, SandboxProfile,
};
use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::MAX_MESSAGE_BYTES;
use crate::egress::{self, CallEgress};
use crate::proto::{self, node_client::NodeClient};
use crate::relay;
use crate::status::from_status;
use crate::tls::NodeTls;
use crate::version::StampVersion;

/// The node RPC client, every request stamped with this build's version.
pub(crate) type Client = NodeClient<InterceptedService<Channel, StampVersion>>;

/// How long a call other than a cell or command may take on the node (file transfers included).
pub(crate) const CALL_DEADLINE: Duration = Duration::from_secs(300);

/// How long past its own timeout a cell or command may take before the gateway gives up on the
/// node (the node interrupts at the timeout, then restarts the kernel after a grace period).
const STREAM_GRACE: Duration = Duration::from_secs(60);

/// Why a node could not be set up as a client.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL is not one tonic can dial.
    #[error("cannot use the sandbox node at {url}: {source}")]
    Url {
        /// The URL.
        url: String,
        /// What tonic said.
        #[source]
        source: tonic::transport::Error,
    },
    /// An `https://` node and no certificates to reach it with.
    #[error(
        "the sandbox node at {url} serves over TLS and this process has no node.tls_cert, \
         node.tls_key and node.tls_ca to reach it"
    )]
    NoTls {
        /// The URL.
        url: String,
    },
    /// A cleartext URL of a host other than this one's loopback: a gateway sends nothing (a
    /// tenant's code and files, the package relay) in clear beyond it.
    #[error(
        "refused to dial the sandbox node at {url} in cleartext: http:// is only for a node on \
         127.0.0.1, [::1] or localhost; another host is reached over https:// with mutual TLS"
    )]
    CleartextElsewhere {
        /// The URL.
        url: String,
    },
}

/// Whether `url` is `http://` to this host's own loopback (127.0.0.1, ::1, localhost): the only
/// place a gateway dials in cleartext. Other loopback addresses (127.0.0.2, …) are refused too:
/// nothing needs them, and they stand for "another host" in the tests.
pub fn cleartext_allowed(url: &str) -> bool {
    url.starts_with("http://")
        && crate::tls::url_host(url)
            .is_some_and(|h| matches!(h.as_str(), "127.0.0.1" | "::1" | "localhost"))
}

/// A sandbox node in another process. Cheap to clone; one HTTP/2 connection multiplexes every
/// call.
#[derive(Debug, Clone)]
pub struct RemoteNode {
    inner: Arc<RemoteInner>,
}

#[derive(Debug)]
struct RemoteInner {
    url: String,
    client: Client,
}

/// A channel to the node at `url`, connecting on first use: over mutual TLS with `tls` (the
/// material of the moment at each new connection), else cleartext to this host's loopback only.
pub fn channel_lazy(url: &str, tls: Option<&NodeTls>) -> Result<Channel, ConnectError> {
    let err = |source| ConnectError::Url {
        url: url.to_owned(),
        source,
    };
    let endpoint = |url: String| {
        Ok::<_, ConnectError>(
            Endpoint::from_shared(url)
                .map_err(err)?
                .connect_timeout(Duration::from_secs(10))
                // A node that stops answering mid-call (frozen, its host gone) fails the call
                // within interval + timeout, rather than at the call's deadline.
                .http2_keep_alive_interval(Duration::from_secs(20))
                .keep_alive_timeout(Duration::from_secs(10))
                .keep_alive_while_idle(true),
        )
    };
    match (url.strip_prefix("https://"), tls) {
        // TLS is made by the connector (tonic's own would fix the certificates at start), so the
        // channel itself speaks HTTP/2 over what it is handed.
        (Some(rest), Some(tls)) => Ok(endpoint(format!("http://{rest}"))?
            .connect_with_connector_lazy(crate::tls::connector(tls.clone()))),
        (Some(_), None) => Err(ConnectError::NoTls {
            url: url.to_owned(),
        }),
        (None, _) if cleartext_allowed(url) => Ok(endpoint(url.to_owned())?.connect_lazy()),
        (None, _) => Err(ConnectError::CleartextElsewhere {
            url: url.to_owned(),
        }),
    }
}

impl RemoteNode {
    /// A client of the node at `url` (`https://host:port`), connecting on first use.
    pub fn connect_lazy(url: &str, tls: &NodeTls) -> Result<Self, ConnectError> {
        Self::lazy(url, Some(tls))
    }

    /// A client of a node serving cleartext HTTP/2 at `url` (`http://127.0.0.1:port`: a node
    /// without TLS listens on loopback only), connecting on first use; any other host is refused
    /// ([`cleartext_allowed`]).
    pub fn connect_lazy_cleartext(url: &str) -> Result<Self, ConnectError> {
        Self::lazy(url, None)
    }

    fn lazy(url: &str, tls: Option<&NodeTls>) -> Result<Self, ConnectError> {
        let channel = channel_lazy(url, tls)?;
        let client = NodeClient::with_interceptor(channel, StampVersion)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self {
            inner: Arc::new(RemoteInner {
                url: url.to_owned(),
                client,
            }),
        })
    }

    /// The node's address.
    pub fn url(&self) -> &str {
        &self.inner.url
    }

    pub(crate) fn client(&self) -> Client {
        self.inner.client.clone()
    }

    pub(crate) fn error(&self, status: &tonic::Status) -> SandboxError {
        from_status(&self.inner.url, status)
    }

    fn request<T>(message: T, deadline: Duration) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(deadline);
        request
    }

    pub(crate) fn sandbox(&self, r: proto::SandboxRef) -> RemoteSandbox {
        RemoteSandbox {
            node: self.clone(),
            inner: Arc::new(r),
        }
    }

    /// Starts a sandbox from the node's profile of `profile`'s name, with its memory and CPUs.
    pub async fn launch(&self, profile: &SandboxProfile) -> Result<RemoteSandbox, SandboxError> {
        self.launch_as(profile, None).await
    }

    /// [`Self::launch`] under `sandbox_id` when given (see [`crate::NodeHandle::launch_as`]).
    pub async fn launch_as(
        &self,
        profile: &SandboxProfile,
        sandbox_id: Option<&str>,
    ) -> Result<RemoteSandbox, SandboxError> {
        let req = proto::LaunchRequest {
            profile: profile.name.clone(),
            memory_mb: profile.memory_mb,
            cpus: profile.cpus,
            sandbox_id: sandbox_id.unwrap_or_default().to_owned(),
        };
        let r = self
            .client()
            .launch(Self::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(self.sandbox(r.into_inner()))
    }

    /// Takes the warm sandbox out of the node's pool, else attaches to its container.
    pub async fn claim(
        &self,
        sandbox_id: &str,
        container_id: &str,
    ) -> Result<RemoteSandbox, SandboxError> {
        let req = proto::ClaimRequest {
            sandbox_id: sandbox_id.to_owned(),
            container_id: container_id.to_owned(),
        };
        let r = self
            .client()
            .claim(Self::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(self.sandbox(r.into_inner()))
    }

    /// Attaches to a running container of the node.
    pub async fn adopt(&self, container_id: &str) -> Result<RemoteSandbox, SandboxError> {
        let req = proto::AdoptRequest {
            container_id: container_id.to_owned(),
        };
        let r = self
            .client()
            .adopt(Self::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(self.sandbox(r.into_inner()))
    }

    /// Removes a container of the node.
    pub async fn remove(&self, container_id: &str) -> Result<(), SandboxError> {
        let req = proto::RemoveRequest {
            container_id: container_id.to_owned(),
        };
        self.client()
            .remove(Self::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(())
    }

    /// The node's pool numbers for `profile` (`None` when the node cannot be asked).
    pub async fn pool_stats(&self, profile: &str) -> Option<PoolStats> {
        let req = proto::PoolStatsRequest {
            profile: profile.to_owned(),
        };
        let r = self
            .client()
            .pool_stats(Self::request(req, Duration::from_secs(5)))
            .await
            .ok()?;
        r.into_inner().into_stats()
    }
}

/// A sandbox on a remote node. Cheap to clone.
#[derive(Debug, Clone)]
pub struct RemoteSandbox {
    node: RemoteNode,
    inner: Arc<proto::SandboxRef>,
}

impl RemoteSandbox {
    /// The sandbox id.
    pub fn id(&self) -> &str {
        &self.inner.sandbox_id
    }

    /// The engine's container id on its node.
    pub fn container_id(&self) -> &str {
        &self.inner.container_id
    }

    /// The profile it was made from.
    pub fn profile(&self) -> &str {
        &self.inner.profile
    }

    /// The node it runs on.
    pub fn node(&self) -> &RemoteNode {
        &self.node
    }

    pub(crate) fn call(&self) -> proto::SandboxCall {
        proto::SandboxCall {
            sandbox_id: self.inner.sandbox_id.clone(),
            container_id: self.inner.container_id.clone(),
        }
    }

    pub(crate) fn error(&self, status: &tonic::Status) -> SandboxError {
        self.node.error(status)
    }

    /// What became of the container.
    pub async fn fate(&self) -> Result<ContainerFate, SandboxError> {
        let r = self
            .node
            .client()
            .fate(RemoteNode::request(self.call(), CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Runs a cell on the node; output events are forwarded to `events` as they arrive. Dropping
    /// the future cancels the RPC stream, and the node interrupts the cell. Under
    /// [`Self::with_index`], pip in the cell reaches the package index through this call; under
    /// [`Self::with_egress`], the CONNECTs of the sandbox's proxy are relayed through it.
    pub async fn exec(
        &self,
        code: &str,
        options: ExecOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<ExecOutcome, SandboxError> {
        let relay = relay::current(self.container_id());
        let egress = egress::current(self.container_id());
        let request = proto::ExecRequest {
            sandbox: Some(self.call()),
            code: code.to_owned(),
            timeout_ms: u64::try_from(options.timeout.as_millis()).unwrap_or(u64::MAX),
            output_limit: options.output_limit as u64,
            display_limit: options.display_limit as u64,
            stream: events.is_some(),
            index: relay.is_some(),
            egress: egress.is_some(),
        };
        let first = proto::ExecInput {
            input: Some(proto::exec_input::Input::Start(request)),
        };
        let (inputs, relay) = relay::call_inputs(first, relay, |chunk| proto::ExecInput {
            input: Some(proto::exec_input::Input::IndexAnswer(chunk)),
        });
        let (egress, to_node) = egress.map(CallEgress::new).unzip();
        let inputs = inputs.with_egress(to_node, |message| proto::ExecInput {
            input: Some(proto::exec_input::Input::Egress(message)),
        });
        let deadline = options.timeout + STREAM_GRACE;
        let answer = self
            .node
            .client()
            .exec(RemoteNode::request(inputs, deadline))
            .await;
        self.finish(answer, &events, relay, egress, |m| match m.event {
            Some(proto::exec_event::Event::Output(e)) => Step::Output(e),
            Some(proto::exec_event::Event::Outcome(o)) => Step::Outcome(o.into()),
            Some(proto::exec_event::Event::IndexRequest(r)) => Step::Index(r),
            Some(proto::exec_event::Event::Egress(m)) => Step::Egress(m),
            None => Step::Nothing,
        })
        .await
    }

    /// Runs a shell command on the node; see [`Self::exec`].
    pub async fn command(
        &self,
        command: &str,
        options: CommandOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<CommandOutcome, SandboxError> {
        let relay = relay::current(self.container_id());
        let egress = egress::current(self.container_id());
        let timeout = options.timeout;
        let request = proto::CommandRequest {
            sandbox: Some(self.call()),
            command: command.to_owned(),
            timeout_ms: u64::try_from(options.timeout.as_millis()).unwrap_or(u64::MAX),
            output_limit: options.output_limit as u64,
            cwd: options.cwd,
            stream: events.is_some(),
            index: relay.is_some(),
            egress: egress.is_some(),
        };
        let first = proto::CommandInput {
            input: Some(proto::command_input::Input::Start(request)),
        };
        let (inputs, relay) = relay::call_inputs(first, relay, |chunk| proto::CommandInput {
            input: Some(proto::command_input::Input::IndexAnswer(chunk)),
        });
        let (egress, to_node) = egress.map(CallEgress::new).unzip();
        let inputs = inputs.with_egress(to_node, |message| proto::CommandInput {
            input: Some(proto::command_input::Input::Egress(message)),
        });
        let deadline = timeout + STREAM_GRACE;
        let answer = self
            .node
            .client()
            .command(RemoteNode::request(inputs, deadline))
            .await;
        self.finish(answer, &events, relay, egress, |m| match m.event {
            Some(proto::command_event::Event::Output(e)) => Step::Output(e),
            Some(proto::command_event::Event::Outcome(o)) => Step::Outcome(o.into()),
            Some(proto::command_event::Event::IndexRequest(r)) => Step::Index(r),
            Some(proto::command_event::Event::Egress(m)) => Step::Egress(m),
            None => Step::Nothing,
        })
        .await
    }

    /// Runs `call` (a cell or a command on this sandbox) with the package index served by
    /// `handler`: the node relays each request pip makes in that call back here, on the call's
    /// own stream. A call that pip never asks in sends nothing more than without it.
    pub async fn with_index<T>(
        &self,
        handler: &dyn IndexHandler,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        relay::serve(self.container_id(), handler, call).await
    }

    /// Runs `call` (a cell or a command on this sandbox) with the sandbox's CONNECTs decided by
    /// `handler`: the node relays each one a client in the sandbox makes in that call back here,
    /// on the call's own stream, and this process dials, relays and audits it. Only a call made
    /// under it for this sandbox asks the node for that: a node's connections on any other call
    /// are never served.
    pub async fn with_egress<T>(
        &self,
        handler: Arc<dyn EgressHandler>,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        egress::serve(self.container_id(), handler, call).await
    }

    /// Turns the sandbox's egress proxy on or off (the agent's `egress_env`).
    pub async fn set_egress_env(&self, env: &EgressEnv) -> Result<EgressEnvInfo, SandboxError> {
        let req = proto::SetEgressEnvRequest {
            sandbox: Some(self.call()),
            proxy: env.proxy,
            ca_pem: env.ca_pem.clone(),
            placeholders: env.placeholders.clone().into_iter().collect(),
        };
        let r = self
            .node
            .client()
            .set_egress_env(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Reads a streamed call's messages: output events forwarded to `events`, the node's package
    /// index requests to the call's index relay, its egress messages to the call's egress relay,
    /// until the outcome.
    async fn finish<M, O>(
        &self,
        answer: Result<tonic::Response<tonic::Streaming<M>>, tonic::Status>,
        events: &Option<mpsc::Sender<OutputEvent>>,
        relay: Option<relay::CallRelay>,
        mut egress: Option<CallEgress>,
        step: impl Fn(M) -> Step<O>,
    ) -> Result<O, SandboxError> {
        let mut stream = answer.map_err(|s| self.error(&s))?.into_inner();
        let mut warned = false;
        while let Some(message) = stream.next().await {
            match step(message.map_err(|s| self.error(&s))?) {
                Step::Output(e) => forward(events, e).await,
                Step::Outcome(o) => return Ok(o),
                // A node asking a call that serves no index gets no answer (it gives up at its
                // deadline).
                Step::Index(request) => {
                    if let Some(relay) = &relay {
                        relay.ask(request);
                    }
                }
                // A node's connection on a call that asked for no egress goes nowhere (said
                // once a call: a rogue node's flood of them is not a flood of the log).
                Step::Egress(message) => match &mut egress {
                    Some(egress) => egress.take(message),
                    None if !warned => {
                        warned = true;
                        tracing::warn!(
                            node = self.node.url(),
                            "a node sent egress messages on a call that asked for no egress; \
                             ignored"
                        );
                    }
                    None => {}
                },
                Step::Nothing => {}
            }
        }
        Err(self.error(&tonic::Status::unavailable(
            "the stream ended without an outcome",
        )))
    }

    /// Writes a file under /home/user.
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        overwrite: bool,
    ) -> Result<FileInfo, SandboxError> {
        let req = proto::WriteFileRequest {
            sandbox: Some(self.call()),
            path: path.to_owned(),
            data: bytes::Bytes::copy_from_slice(data),
            overwrite,
        };
        let r = self
            .node
            .client()
            .write_file(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Reads a file chunk by chunk: the first chunk (or the refusal), then the rest.
    pub async fn read_file_stream(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(bytes::Bytes, FileChunks), SandboxError> {
        let req = proto::ReadFileRequest {
            sandbox: Some(self.call()),
            path: path.to_owned(),
            max_bytes,
        };
        let mut stream = self
            .node
            .client()
            .read_file(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?
            .into_inner();
        let first = match stream.next().await {
            Some(chunk) => chunk.map_err(|s| self.error(&s))?.data,
            None => bytes::Bytes::new(),
        };
        let this = self.clone();
        let rest = stream.map(move |chunk| {
            chunk.map(|c| c.data).map_err(|s| match this.error(&s) {
                SandboxError::Channel(e) => e,
                other => sandgate_sandbox::ChannelError::Protocol {
                    detail: other.to_string(),
                },
            })
        });
        Ok((first, rest.boxed()))
    }

    /// Reads a whole file, up to `max_bytes`.
    pub async fn read_file(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, FileInfo), SandboxError> {
        let req = proto::ReadFileRequest {
            sandbox: Some(self.call()),
            path: path.to_owned(),
            max_bytes,
        };
        let r = self
            .node
            .client()
            .read_whole_file(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?
            .into_inner();
        let info = r.info.ok_or_else(|| {
            self.error(&tonic::Status::internal(
                "the node sent a file without its info",
            ))
        })?;
        Ok((r.data.to_vec(), info.into()))
    }

    /// Lists a directory with the space used and left.
    pub async fn list(&self, path: &str) -> Result<Listing, SandboxError> {
        let req = proto::PathRequest {
            sandbox: Some(self.call()),
            path: path.to_owned(),
        };
        let r = self
            .node
            .client()
            .list(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Starts a background job.
    pub async fn start_job(&self, command: &str, cwd: Option<&str>) -> Result<Job, SandboxError> {
        let req = proto::StartJobRequest {
            sandbox: Some(self.call()),
            command: command.to_owned(),
            cwd: cwd.map(str::to_owned),
        };
        let r = self
            .node
            .client()
            .start_job(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Lists the background jobs.
    pub async fn jobs(&self) -> Result<Vec<Job>, SandboxError> {
        let r = self
            .node
            .client()
            .jobs(RemoteNode::request(self.call(), CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().jobs.into_iter().map(Into::into).collect())
    }

    /// Kills a background job.
    pub async fn kill_job(&self, job: &str) -> Result<Job, SandboxError> {
        let req = proto::KillJobRequest {
            sandbox: Some(self.call()),
            job: job.to_owned(),
        };
        let r = self
            .node
            .client()
            .kill_job(RemoteNode::request(req, CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Checks that the agent answers.
    pub async fn ping(&self) -> Result<PingInfo, SandboxError> {
        let r = self
            .node
            .client()
            .ping(RemoteNode::request(self.call(), CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(r.into_inner().into())
    }

    /// Restarts the kernel.
    pub async fn restart(&self) -> Result<(), SandboxError> {
        self.node
            .client()
            .restart(RemoteNode::request(self.call(), CALL_DEADLINE))
            .await
            .map_err(|s| self.error(&s))?;
        Ok(())
    }
}

/// One message of a streamed call.
enum Step<O> {
    Output(proto::OutputEvent),
    Outcome(O),
    Index(proto::IndexRequest),
    Egress(proto::EgressOut),
    Nothing,
}

/// Forwards one output event to the caller's progress channel (if it still listens).
async fn forward(events: &Option<mpsc::Sender<OutputEvent>>, event: proto::OutputEvent) {
    if let (Some(tx), Some(event)) = (events, event.into_event()) {
        let _ = tx.send(event).await;
    }
}
