//! A live sandbox: one container, its agent channel and the operations on it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::mpsc;

use super::SandboxError;
use super::launcher::settled_fate;
use crate::backend::{ContainerFate, SandboxBackend};
use crate::channel::{
    AgentChannel, ChannelError, CommandOptions, CommandOutcome, DirEntry, ExecOptions, ExecOutcome,
    FileChunks, FileInfo, Job, Listing, OutputEvent, PingInfo,
};
use crate::config::SandboxProfile;

struct SandboxInner {
    id: String,
    container_id: String,
    profile: String,
    /// The whole profile it was started from, when this process started it (an adopted sandbox
    /// knows only its profile's name).
    started_from: Option<SandboxProfile>,
    channel: AgentChannel,
    backend: Arc<dyn SandboxBackend>,
    /// Set once the container is known to be gone, so later calls say why at once.
    death: OnceLock<ContainerFate>,
    /// Set before a checkpoint that stops the container: the end of its stream and its exit
    /// (code 0) are then the checkpoint's doing, not a dead agent.
    checkpointed: AtomicBool,
    /// The snapshot it was restored from, when this process restored it.
    restored_from: OnceLock<String>,
}

/// A live sandbox: one container, its agent channel and the operations on it. Cheap to clone;
/// calls may run concurrently. Dropping it leaves the container running (see
/// [`SandboxManager::close`]).
#[derive(Clone)]
pub struct Sandbox {
    inner: Arc<SandboxInner>,
}

/// A [`Sandbox`] that does not keep its channel open.
#[derive(Clone)]
pub(super) struct WeakSandbox {
    inner: std::sync::Weak<SandboxInner>,
}

impl WeakSandbox {
    /// The sandbox, while a handle to it is held somewhere.
    pub(super) fn upgrade(&self) -> Option<Sandbox> {
        self.inner.upgrade().map(|inner| Sandbox { inner })
    }
}

impl std::fmt::Debug for WeakSandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeakSandbox").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Sandbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sandbox")
            .field("id", &self.inner.id)
            .field("container_id", &self.inner.container_id)
            .field("profile", &self.inner.profile)
            .finish_non_exhaustive()
    }
}

impl Sandbox {
    pub(super) fn new(
        id: String,
        container_id: String,
        profile: String,
        started_from: Option<SandboxProfile>,
        channel: AgentChannel,
        backend: Arc<dyn SandboxBackend>,
    ) -> Self {
        Self {
            inner: Arc::new(SandboxInner {
                id,
                container_id,
                profile,
                started_from,
                channel,
                backend,
                death: OnceLock::new(),
                checkpointed: AtomicBool::new(false),
                restored_from: OnceLock::new(),
            }),
        }
    }

    /// A handle that does not keep it alive.
    pub(super) fn downgrade(&self) -> WeakSandbox {
        WeakSandbox {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// The profile it was started (or restored) from by this process; `None` when adopted.
    pub(super) fn started_from(&self) -> Option<&SandboxProfile> {
        self.inner.started_from.as_ref()
    }

    /// Marks (or unmarks) it as stopped by a checkpoint (see `explain`).
    pub(super) fn set_checkpointed(&self, checkpointed: bool) {
        self.inner
            .checkpointed
            .store(checkpointed, Ordering::SeqCst);
    }

    /// Records that it was restored from snapshot `snapshot_id` (see [`Self::restored_from`]).
    pub(super) fn mark_restored(&self, snapshot_id: &str) {
        let _ = self.inner.restored_from.set(snapshot_id.to_owned());
    }

    /// The snapshot this process restored it from (a pool's template, say); `None` for a
    /// sandbox started afresh, or adopted.
    pub fn restored_from(&self) -> Option<&str> {
        self.inner.restored_from.get().map(String::as_str)
    }

    /// Whether a checkpoint stopped it: it serves no calls, its snapshot holds its state.
    pub fn is_checkpointed(&self) -> bool {
        self.inner.checkpointed.load(Ordering::SeqCst)
    }

    /// The sandbox id (`sbx_…`), also on the container's `sandgate.sandbox_id` label.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The engine's container id.
    pub fn container_id(&self) -> &str {
        &self.inner.container_id
    }

    /// The profile it was made from.
    pub fn profile(&self) -> &str {
        &self.inner.profile
    }

    /// The agent channel, for callers that need it directly.
    pub fn channel(&self) -> &AgentChannel {
        &self.inner.channel
    }

    /// Whether the connection to the agent has ended (the sandbox cannot serve calls).
    pub fn is_lost(&self) -> bool {
        self.inner.channel.is_lost()
    }

    /// What became of the container (asks the engine unless the answer is already known).
    pub async fn fate(&self) -> Result<ContainerFate, SandboxError> {
        if let Some(fate) = self.inner.death.get() {
            return Ok(fate.clone());
        }
        let fate = self
            .inner
            .backend
            .inspect(&self.inner.container_id)
            .await?
            .map_or(ContainerFate::Missing, |c| c.fate);
        Ok(fate)
    }

    /// Turns a lost connection into the reason the container stopped, or, when it still runs
    /// (or the engine cannot say yet), into [`SandboxError::ConnectionLost`]: the caller
    /// re-attaches (see [`SandboxManager::adopt`]) and the sandbox is never given up on a
    /// connection alone.
    async fn explain(&self, err: ChannelError) -> SandboxError {
        let ChannelError::AttachLost { reason } = err else {
            return SandboxError::Channel(err);
        };
        if self.is_checkpointed() {
            return SandboxError::Checkpointed {
                sandbox_id: self.inner.id.clone(),
            };
        }
        let fate = match self.inner.death.get() {
            Some(fate) => fate.clone(),
            None => match settled_fate(self.inner.backend.as_ref(), &self.inner.container_id).await
            {
                Ok(ContainerFate::Running) => {
                    return SandboxError::ConnectionLost {
                        sandbox_id: self.inner.id.clone(),
                        reason,
                    };
                }
                Ok(fate) => self.inner.death.get_or_init(|| fate).clone(),
                Err(inspect) => {
                    tracing::warn!(error = %inspect, "inspecting a lost sandbox failed");
                    return SandboxError::ConnectionLost {
                        sandbox_id: self.inner.id.clone(),
                        reason,
                    };
                }
            },
        };
        SandboxError::Died {
            sandbox_id: self.inner.id.clone(),
            fate,
        }
    }

    /// `result`, with a failure explained by the container's fate (see `explain`).
    async fn explained<T>(&self, result: Result<T, ChannelError>) -> Result<T, SandboxError> {
        match result {
            Ok(value) => Ok(value),
            Err(err) => Err(self.explain(err).await),
        }
    }

    /// Runs a Python cell; see [`AgentChannel::exec`].
    pub async fn exec(
        &self,
        code: &str,
        options: ExecOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<ExecOutcome, SandboxError> {
        self.explained(self.inner.channel.exec(code, options, events).await)
            .await
    }

    /// Runs a shell command; see [`AgentChannel::command`].
    pub async fn command(
        &self,
        command: &str,
        options: CommandOptions,
        events: Option<mpsc::Sender<OutputEvent>>,
    ) -> Result<CommandOutcome, SandboxError> {
        self.explained(self.inner.channel.command(command, options, events).await)
            .await
    }

    /// Writes a file under /home/user; see [`AgentChannel::write_file`].
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        overwrite: bool,
    ) -> Result<FileInfo, SandboxError> {
        self.explained(self.inner.channel.write_file(path, data, overwrite).await)
            .await
    }

    /// Reads a file under /home/user; see [`AgentChannel::read_file`].
    pub async fn read_file(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(Vec<u8>, FileInfo), SandboxError> {
        self.explained(self.inner.channel.read_file(path, max_bytes).await)
            .await
    }

    /// Reads a file under /home/user chunk by chunk; see [`AgentChannel::read_file_stream`].
    /// An error in the middle of the stream is the channel's, unexplained (the response it
    /// feeds has started; the next call on the sandbox says what became of it).
    pub async fn read_file_stream(
        &self,
        path: &str,
        max_bytes: u64,
    ) -> Result<(bytes::Bytes, FileChunks), SandboxError> {
        self.explained(self.inner.channel.read_file_stream(path, max_bytes).await)
            .await
    }

    /// Lists a directory under /home/user; see [`AgentChannel::list_dir`].
    pub async fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>, SandboxError> {
        self.explained(self.inner.channel.list_dir(path).await)
            .await
    }

    /// Lists a directory with the space used and left; see [`AgentChannel::list`].
    pub async fn list(&self, path: &str) -> Result<Listing, SandboxError> {
        self.explained(self.inner.channel.list(path).await).await
    }

    /// Starts a background job; see [`AgentChannel::start_job`].
    pub async fn start_job(&self, command: &str, cwd: Option<&str>) -> Result<Job, SandboxError> {
        self.explained(self.inner.channel.start_job(command, cwd).await)
            .await
    }

    /// Lists the background jobs; see [`AgentChannel::jobs`].
    pub async fn jobs(&self) -> Result<Vec<Job>, SandboxError> {
        self.explained(self.inner.channel.jobs().await).await
    }

    /// Kills a background job; see [`AgentChannel::kill_job`].
    pub async fn kill_job(&self, job: &str) -> Result<Job, SandboxError> {
        self.explained(self.inner.channel.kill_job(job).await).await
    }

    /// Checks that the agent answers.
    pub async fn ping(&self) -> Result<PingInfo, SandboxError> {
        self.explained(self.inner.channel.ping().await).await
    }

    /// Restarts the kernel: variables are lost, files stay.
    pub async fn restart(&self) -> Result<(), SandboxError> {
        self.explained(self.inner.channel.restart().await)
            .await
            .map(|_| ())
    }

    /// Removes the container (its files and kernel go with it).
    #[tracing::instrument(skip_all, fields(sandbox_id = %self.inner.id))]
    pub async fn close(self) -> Result<(), SandboxError> {
        self.inner.backend.remove(&self.inner.container_id).await?;
        Ok(())
    }
}
