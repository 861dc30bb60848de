//! Starting sandboxes (create, start, attach, wait for the agent's ready frame) and adopting
//! running ones after a restart; shared by the manager and its background refills.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::sandbox::WeakSandbox;
use super::{Sandbox, SandboxError};
use crate::backend::{BackendError, ContainerFate, LaunchSpec, SandboxBackend};
use crate::channel::AgentChannel;
use crate::config::{ChannelConfig, SandboxProfile};

/// How long the manager waits, after a sandbox's stream ended, for the engine to report the
/// container as stopped (the stream closes a moment before the engine updates its state).
const SETTLE_TIMEOUT: Duration = Duration::from_secs(3);
const SETTLE_POLL: Duration = Duration::from_millis(50);

/// Launches and adopts sandboxes; shared by the manager and its background refills.
#[derive(Debug, Clone)]
pub(super) struct Launcher {
    pub(super) backend: Arc<dyn SandboxBackend>,
    pub(super) instance: String,
    pub(super) channel: ChannelConfig,
    /// Sandboxes this process started launching, and when (see
    /// [`SandboxManager::launched_within`]).
    pub(super) launched: Arc<Mutex<HashMap<String, std::time::Instant>>>,
    /// Sandboxes whose launch failed or was given up, and when (see
    /// [`SandboxManager::abandoned_launches`]).
    pub(super) abandoned: Arc<Mutex<HashMap<String, std::time::Instant>>>,
    /// The sandboxes this process holds a channel to, by container id: an adopt of one of them
    /// whose channel lives returns it rather than attaching a second time (two channels on one
    /// lean sandbox's socket would each read part of its output).
    pub(super) attached: Arc<Mutex<HashMap<String, WeakSandbox>>>,
    /// One adopt at a time per container: concurrent first calls on a sandbox attach once.
    pub(super) adopting: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

/// How long [`Launcher::launched`] and [`Launcher::abandoned`] remember a launch.
pub(super) const LAUNCH_MEMORY: Duration = Duration::from_secs(600);

/// Sandbox ids and when they were noted, kept for [`LAUNCH_MEMORY`].
type Memory = Mutex<HashMap<String, std::time::Instant>>;

/// Notes `sandbox_id` in `memory` now, forgetting what is older than [`LAUNCH_MEMORY`].
pub(super) fn note(memory: &Memory, sandbox_id: &str) {
    let mut map = memory.lock().unwrap_or_else(|e| e.into_inner());
    map.retain(|_, at| at.elapsed() < LAUNCH_MEMORY);
    map.insert(sandbox_id.to_owned(), std::time::Instant::now());
}

/// A launch's entry in [`Launcher::launched`], kept only if the launch succeeds. A launch that
/// failed or was given up (its future dropped) moves to [`Launcher::abandoned`] at once: nobody
/// will record its container, so a container it left behind (its engine went away before it could
/// be removed, say) is reconciliation's to remove at its next pass, without the grace an unknown
/// container gets.
pub(super) struct LaunchMark<'a> {
    launcher: &'a Launcher,
    sandbox_id: Option<String>,
}

impl<'a> LaunchMark<'a> {
    pub(super) fn new(launcher: &'a Launcher, sandbox_id: &str) -> Self {
        note(&launcher.launched, sandbox_id);
        Self {
            launcher,
            sandbox_id: Some(sandbox_id.to_owned()),
        }
    }

    /// The launch succeeded: its entry stays.
    pub(super) fn keep(mut self) {
        self.sandbox_id = None;
    }
}

impl Drop for LaunchMark<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.sandbox_id.take() {
            self.launcher
                .launched
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&id);
            note(&self.launcher.abandoned, &id);
        }
    }
}

impl Launcher {
    pub(super) async fn launch(&self, profile: &SandboxProfile) -> Result<Sandbox, SandboxError> {
        self.launch_as(profile, None).await
    }

    /// [`Self::launch`] under `sandbox_id` when given (a files-only resume keeps its sandbox's
    /// id), else a fresh one.
    #[tracing::instrument(skip_all, fields(sandbox_id, profile = %profile.name))]
    pub(super) async fn launch_as(
        &self,
        profile: &SandboxProfile,
        sandbox_id: Option<&str>,
    ) -> Result<Sandbox, SandboxError> {
        let sandbox_id = match sandbox_id {
            Some(id) => id.to_owned(),
            None => format!("sbx_{}", uuid::Uuid::now_v7().simple()),
        };
        tracing::Span::current().record("sandbox_id", &sandbox_id);
        let mark = LaunchMark::new(self, &sandbox_id);
        let spec = LaunchSpec {
            profile: profile.clone(),
            instance: self.instance.clone(),
            sandbox_id: sandbox_id.clone(),
        };
        // The engine's part (create, attach, start) is bounded like the agent's: an engine that
        // hangs (one coming back from a crash, say) must not hold the launch, and with it the
        // container's exemption from reconciliation, for as long as its client's own timeout.
        let after = self.channel.ready_timeout;
        let launched = tokio::time::timeout(after, self.backend.launch(&spec))
            .await
            .map_err(|_| {
                SandboxError::Launch(BackendError::TimedOut {
                    sandbox_id: sandbox_id.clone(),
                    after,
                })
            })?
            .map_err(SandboxError::Launch)?;
        let channel = AgentChannel::open(&sandbox_id, launched.streams, self.channel.clone());
        if let Err(source) = channel.wait_ready(self.channel.ready_timeout).await {
            let fate = settled_fate(self.backend.as_ref(), &launched.container_id)
                .await
                .unwrap_or(ContainerFate::Missing);
            if let Err(err) = self.backend.remove(&launched.container_id).await {
                tracing::warn!(error = %err, "removing a sandbox that failed to start failed");
            }
            return Err(SandboxError::AgentStart {
                sandbox_id,
                fate,
                source,
            });
        }
        mark.keep();
        let sandbox = Sandbox::new(
            sandbox_id,
            launched.container_id,
            profile.name.clone(),
            Some(profile.clone()),
            channel,
            self.backend.clone(),
        );
        self.remember(&sandbox);
        Ok(sandbox)
    }

    /// Notes that this process holds a channel to the sandbox's container.
    fn remember(&self, sandbox: &Sandbox) {
        let mut attached = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        attached.retain(|_, weak| weak.upgrade().is_some());
        attached.insert(sandbox.container_id().to_owned(), sandbox.downgrade());
    }

    /// The sandbox of `container_id` this process holds a live channel to, if any.
    fn attached(&self, container_id: &str) -> Option<Sandbox> {
        let attached = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        attached
            .get(container_id)
            .and_then(WeakSandbox::upgrade)
            .filter(|s| !s.is_lost())
    }

    /// The gate that lets one adopt of `container_id` run at a time.
    fn adopt_gate(&self, container_id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut gates = self.adopting.lock().unwrap_or_else(|e| e.into_inner());
        gates.retain(|_, gate| Arc::strong_count(gate) > 1);
        gates.entry(container_id.to_owned()).or_default().clone()
    }

    #[tracing::instrument(skip_all, fields(container_id = %container_id, sandbox_id))]
    pub(super) async fn adopt(&self, container_id: &str) -> Result<Sandbox, SandboxError> {
        let gate = self.adopt_gate(container_id);
        let _one_at_a_time = gate.lock().await;
        if let Some(sandbox) = self.attached(container_id) {
            return Ok(sandbox);
        }
        let found = self.backend.inspect(container_id).await?;
        let Some(found) = found else {
            return Err(SandboxError::Died {
                sandbox_id: container_id.to_owned(),
                fate: ContainerFate::Missing,
            });
        };
        if !found.managed || found.instance != self.instance {
            return Err(SandboxError::NotOurs {
                container_id: container_id.to_owned(),
            });
        }
        tracing::Span::current().record("sandbox_id", &found.sandbox_id);
        if found.fate != ContainerFate::Running {
            return Err(SandboxError::Died {
                sandbox_id: found.sandbox_id,
                fate: found.fate,
            });
        }
        let streams = self.backend.attach(&found.container_id).await?;
        let channel = AgentChannel::open(&found.sandbox_id, streams, self.channel.clone());
        let sandbox = Sandbox::new(
            found.sandbox_id,
            found.container_id,
            found.profile,
            None,
            channel,
            self.backend.clone(),
        );
        // Attach delivers only new output, so there is no ready frame to wait for: a ping proves
        // the agent (and with it the kernel's state) is still there.
        sandbox.ping().await?;
        self.remember(&sandbox);
        Ok(sandbox)
    }
}

/// Asks the engine what became of a container whose stream ended, giving it a moment to notice.
pub(super) async fn settled_fate(
    backend: &dyn SandboxBackend,
    container_id: &str,
) -> Result<ContainerFate, BackendError> {
    let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
    loop {
        let fate = backend
            .inspect(container_id)
            .await?
            .map_or(ContainerFate::Missing, |c| c.fate);
        if fate != ContainerFate::Running || tokio::time::Instant::now() >= deadline {
            return Ok(fate);
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}
