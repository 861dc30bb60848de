//! One live sandbox, wherever its node runs.

use std::sync::Arc;

use sandgate_sandbox::{
    CommandOptions, CommandOutcome, ContainerFate, DirEntry, EgressEnv, EgressEnvInfo,
    EgressHandler, ExecOptions, ExecOutcome, FileChunks, FileInfo, IndexHandler, Job, Listing,
    OutputEvent, PingInfo, Sandbox, SandboxError,
};
use tokio::sync::mpsc;

use crate::RemoteSandbox;

/// A live sandbox on a node. Cheap to clone; calls may run concurrently. Dropping it leaves the
/// container running (see [`crate::NodeHandle::close`]).
///
/// Cancellation is dropping the call's future: in-process, the channel interrupts the cell or
/// kills the command, as [`Sandbox`] promises.
#[derive(Debug, Clone)]
pub enum SandboxHandle {
    /// A sandbox of this process's own node.
    Local(Sandbox),
    /// A sandbox on a node in another process, reached over the node RPC.
    Remote(RemoteSandbox),
}

impl From<Sandbox> for SandboxHandle {
    fn from(sandbox: Sandbox) -> Self {
        Self::Local(sandbox)
    }
}

impl SandboxHandle {
    /// The sandbox id (`sbx_…`).
    pub fn id(&self) -> &str {
        match self {
            Self::Local(s) => s.id(),
            Self::Remote(s) => s.id(),
        }
    }

    /// The engine's container id.
    pub fn container_id(&self) -> &str {
        match self {
            Self::Local(s) => s.container_id(),
            Self::Remote(s) => s.container_id(),
        }
    }

    /// The profile it was made from.
    pub fn profile(&self) -> &str {
        match self {
            Self::Local(s) => s.profile(),
            Self::Remote(s) => s.profile(),
        }
    }

    /// Whether the connection to the agent has ended (the sandbox cannot serve calls).
    pub fn is_lost(&self) -> bool {
        match self {
            Self::Local(s) => s.is_lost(),
            // A remote sandbox's loss shows as the error of its next call.
            Self::Remote(_) => false,
        }
    }

    /// What became of the container.
    pub async fn fate(&self) -> Result<ContainerFate, SandboxError> {
        match self {
            Self::Local(s) => s.fate().await,
            Self::Remote(s) => s.fate().await,
        }
    }

    /// Runs a Python cell, streaming output events to `events`; see [`Sandbox::exec`].
    pub async fn exec(
        &self,
        code: &str,
        options: ExecOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<ExecOutcome, SandboxError> {
        match self {
            Self::Local(s) => s.exec(code, options, events).await,
            Self::Remote(s) => s.exec(code, options, events).await,
        }
    }

    /// Runs a shell command, streaming output events to `events`; see [`Sandbox::command`].
    pub async fn command(
        &self,
        command: &str,
        options: CommandOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<CommandOutcome, SandboxError> {
        match self {
            Self::Local(s) => s.command(command, options, events).await,
            Self::Remote(s) => s.command(command, options, events).await,
        }
    }

    /// Writes a file under /home/user.
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        overwrite: bool,
    ) -> Result<FileInfo, SandboxError> {
        match self {
            Self::Local(s) => s.write_file(path, data, overwrite).await,
            Self::Remote(s) => s.write_file(path, data, overwrite).await,
        }
    }

    /// Reads a file under /home/user, up to `max_bytes`.
    pub async fn read_file(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, FileInfo), SandboxError> {
        match self {
            Self::Local(s) => s.read_file(path, max_bytes).await,
            Self::Remote(s) => s.read_file(path, max_bytes).await,
        }
    }

    /// Reads a file under /home/user chunk by chunk: the first chunk, then the rest.
    pub async fn read_file_stream(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(bytes::Bytes, FileChunks), SandboxError> {
        match self {
            Self::Local(s) => s.read_file_stream(path, max_bytes).await,
            Self::Remote(s) => s.read_file_stream(path, max_bytes).await,
        }
    }

    /// Lists a directory under /home/user.
    pub async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, SandboxError> {
        match self {
            Self::Local(s) => s.list_dir(path).await,
            Self::Remote(s) => s.list(path).await.map(|l| l.entries),
        }
    }

    /// Lists a directory with the space used and left.
    pub async fn list(&self, path: &str) -> Result<Listing, SandboxError> {
        match self {
            Self::Local(s) => s.list(path).await,
            Self::Remote(s) => s.list(path).await,
        }
    }

    /// Starts a background job.
    pub async fn start_job(&self, command: &str, cwd: Option<&str>) -> Result<Job, SandboxError> {
        match self {
            Self::Local(s) => s.start_job(command, cwd).await,
            Self::Remote(s) => s.start_job(command, cwd).await,
        }
    }

    /// Lists the background jobs.
    pub async fn jobs(&self) -> Result<Vec<Job>, SandboxError> {
        match self {
            Self::Local(s) => s.jobs().await,
            Self::Remote(s) => s.jobs().await,
        }
    }

    /// Kills a background job.
    pub async fn kill_job(&self, job: &str) -> Result<Job, SandboxError> {
        match self {
            Self::Local(s) => s.kill_job(job).await,
            Self::Remote(s) => s.kill_job(job).await,
        }
    }

    /// Checks that the agent answers.
    pub async fn ping(&self) -> Result<PingInfo, SandboxError> {
        match self {
            Self::Local(s) => s.ping().await,
            Self::Remote(s) => s.ping().await,
        }
    }

    /// Restarts the kernel: variables are lost, files stay.
    pub async fn restart(&self) -> Result<(), SandboxError> {
        match self {
            Self::Local(s) => s.restart().await,
            Self::Remote(s) => s.restart().await,
        }
    }

    /// Turns the sandbox's egress proxy on or off (PROTOCOL.md, `egress_env`; for a sandbox on
    /// another node through its node, which passes it to the agent).
    pub async fn set_egress_env(&self, env: &EgressEnv) -> Result<EgressEnvInfo, SandboxError> {
        match self {
            Self::Local(s) => s.channel().set_egress_env(env).await.map_err(Into::into),
            Self::Remote(s) => s.set_egress_env(env).await,
        }
    }

    /// Runs `call` with the sandbox's CONNECTs relayed to `handler` beside it (on demand, as the
    /// package index is). On another node, the node relays them back over the call's own
    /// stream, and `handler` (in this process) decides and dials them.
    pub async fn with_egress<T>(
        &self,
        handler: Arc<dyn EgressHandler>,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        match self {
            Self::Local(s) => s.channel().with_egress(handler, call).await,
            Self::Remote(s) => s.with_egress(handler, call).await,
        }
    }

    /// Runs `call` (a cell or a command on this sandbox) with the package index served by
    /// `handler` beside it, so that pip in that call can install; returns the call's output.
    pub async fn with_index<T>(
        &self,
        handler: &dyn IndexHandler,
        call: impl std::future::Future<Output = T>,
    ) -> T {
        match self {
            Self::Local(s) => s.channel().with_index(handler, call).await,
            // The node relays pip's requests back over the call's own stream.
            Self::Remote(s) => s.with_index(handler, call).await,
        }
    }
}
