//! Checkpoint and restore as manager operations (issue 26, docs/snapshots.md): a [`Snapshot`]
//! of a live sandbox, and new sandboxes restored from one, each told its identity and re-seeded.

use super::launcher::{LaunchMark, Launcher, settled_fate};
use super::{Sandbox, SandboxError, SandboxManager};
use crate::backend::{BackendError, ContainerFate, LaunchSpec};
use crate::channel::AgentChannel;
use crate::faults::SnapshotStep;
use crate::snapshot::{Snapshot, SnapshotError};

/// How long a sandbox whose checkpoint failed has to answer a ping to count as serving.
const SERVING_PROBE: std::time::Duration = std::time::Duration::from_secs(10);

/// 32 bytes of fresh randomness for a restored agent's re-seed (two v4 UUIDs: the OS generator).
fn seed() -> Vec<u8> {
    let mut seed = uuid::Uuid::new_v4().as_bytes().to_vec();
    seed.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
    seed
}

impl SandboxManager {
    /// Whether sandboxes of `profile` can be checkpointed and restored on this engine; the error
    /// says what is missing (for `/readyz` and the log).
    pub async fn snapshots_available(&self, profile: &str) -> Result<(), SandboxError> {
        let runtime = self.profile(profile)?.runtime;
        self.inner
            .launcher
            .backend
            .snapshot_support(runtime.as_str())
            .await
            .map_err(|reason| SandboxError::SnapshotsUnavailable {
                profile: profile.to_owned(),
                reason,
            })
    }

    /// Checkpoints `sandbox` into a [`Snapshot`] (its image on a tmpfs, deleted with the handle).
    /// With `leave_running` it serves on; without, its container stops and later calls on it fail
    /// with [`SandboxError::Checkpointed`] (remove it with [`Sandbox::close`]). A checkpoint that
    /// fails leaves the sandbox as it was when its container still runs, and removes the
    /// container when the failure came after it stopped: running or cleanly gone, never half.
    #[tracing::instrument(skip_all, fields(sandbox_id = %sandbox.id(), leave_running))]
    pub async fn checkpoint(
        &self,
        sandbox: &Sandbox,
        leave_running: bool,
    ) -> Result<Snapshot, SandboxError> {
        let id = format!("snap_{}", uuid::Uuid::now_v7().simple());
        self.checkpoint_as(sandbox, &id, leave_running).await
    }

    /// [`Self::checkpoint`] under the snapshot id `id` (chosen by the service, which binds its
    /// sealed form to it).
    #[tracing::instrument(skip_all, fields(sandbox_id = %sandbox.id(), snapshot = %id, leave_running))]
    pub async fn checkpoint_as(
        &self,
        sandbox: &Sandbox,
        id: &str,
        leave_running: bool,
    ) -> Result<Snapshot, SandboxError> {
        // The id names the engine's checkpoint and the image's directories.
        let usable = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !usable {
            return Err(SandboxError::Checkpoint {
                sandbox_id: sandbox.id().to_owned(),
                source: Box::new(SnapshotError::NotCheckpointable {
                    container_id: sandbox.container_id().to_owned(),
                    reason: format!("{id:?} is not a snapshot id (letters, digits, _ and -)"),
                }),
            });
        }
        let id = id.to_owned();
        let profile = match sandbox.started_from() {
            Some(profile) => profile.clone(),
            None => self.profile(sandbox.profile())?.clone(),
        };
        let backend = &self.inner.launcher.backend;
        // Before the call: the attach stream ends and the container exits (0) during it.
        sandbox.set_checkpointed(!leave_running);
        let started = std::time::Instant::now();
        match backend
            .checkpoint(sandbox.container_id(), &id, leave_running)
            .await
        {
            Ok(image) => {
                crate::telemetry::counters()
                    .checkpoint_seconds
                    .observe(started.elapsed().as_secs_f64());
                Ok(Snapshot {
                    id,
                    source_sandbox: sandbox.id().to_owned(),
                    profile,
                    image,
                    taken: std::time::SystemTime::now(),
                })
            }
            Err(source) => {
                // Running or cleanly gone, never half: a container the failed checkpoint stopped
                // (its image is gone with the failure) is removed, and calls on the sandbox then
                // say its container is gone rather than that a snapshot holds its state.
                // Whether it serves is the agent's answer, not the engine's state: the runtime
                // may have stopped the agent a moment before the engine records the exit.
                sandbox.set_checkpointed(false);
                let serving = matches!(
                    tokio::time::timeout(SERVING_PROBE, sandbox.ping()).await,
                    Ok(Ok(_))
                );
                if !serving && let Err(err) = backend.remove(sandbox.container_id()).await {
                    tracing::warn!(error = %err, "removing a sandbox whose checkpoint failed failed");
                }
                Err(SandboxError::Checkpoint {
                    sandbox_id: sandbox.id().to_owned(),
                    source: Box::new(source),
                })
            }
        }
    }

    /// Restores `snapshot` into a new container with a sandbox id of its own, told its identity
    /// and re-seeded (PROTOCOL.md, `restored`). A clone that does not answer is removed and the
    /// restore tried once more (docs/snapshots.md: one restored gVisor sandbox in ~55 died at
    /// once). At most [`crate::ManagerConfig::max_concurrent_restores`] run at once; the others
    /// wait for a place up to `start_wait`, then fail with [`SandboxError::StartQueue`].
    #[tracing::instrument(skip_all, fields(snapshot = %snapshot.id, sandbox_id))]
    pub async fn restore(&self, snapshot: &Snapshot) -> Result<Sandbox, SandboxError> {
        self.restore_as(snapshot, None).await
    }

    /// [`Self::restore`], the new sandbox taking the id `sandbox_id` when one is given (a
    /// resume of a paused sandbox keeps its id; its old container is gone by then), else a
    /// fresh one.
    #[tracing::instrument(skip_all, fields(snapshot = %snapshot.id, sandbox_id))]
    pub async fn restore_as(
        &self,
        snapshot: &Snapshot,
        sandbox_id: Option<&str>,
    ) -> Result<Sandbox, SandboxError> {
        let _place = self.restore_place().await?;
        self.restore_placed(snapshot, sandbox_id).await
    }

    /// A place among the restores run at once, waited for up to `start_wait`.
    pub(super) async fn restore_place(
        &self,
    ) -> Result<tokio::sync::SemaphorePermit<'_>, SandboxError> {
        let waited = self.inner.config.start_wait;
        Ok(tokio::time::timeout(waited, self.inner.restores.acquire())
            .await
            .map_err(|_| SandboxError::StartQueue { waited })?
            .expect("the restore places are never closed"))
    }

    /// [`Self::restore_as`] once the caller holds a [`Self::restore_place`].
    pub(super) async fn restore_placed(
        &self,
        snapshot: &Snapshot,
        sandbox_id: Option<&str>,
    ) -> Result<Sandbox, SandboxError> {
        match self.inner.launcher.restore(snapshot, sandbox_id).await {
            Err(first @ SandboxError::RestoredAgent { .. }) => {
                tracing::warn!(error = %first, "a restored sandbox did not answer; restoring again");
                self.inner.launcher.restore(snapshot, sandbox_id).await
            }
            other => other,
        }
    }
}

impl Launcher {
    /// One restore of `snapshot` (no retry); the sandbox knows it was restored
    /// ([`Sandbox::restored_from`]).
    pub(super) async fn restore(
        &self,
        snapshot: &Snapshot,
        sandbox_id: Option<&str>,
    ) -> Result<Sandbox, SandboxError> {
        let started = std::time::Instant::now();
        let sandbox_id = sandbox_id.map_or_else(
            || format!("sbx_{}", uuid::Uuid::now_v7().simple()),
            str::to_owned,
        );
        tracing::Span::current().record("sandbox_id", &sandbox_id);
        let mark = LaunchMark::new(self, &sandbox_id);
        let spec = LaunchSpec {
            profile: snapshot.profile.clone(),
            instance: self.instance.clone(),
            sandbox_id: sandbox_id.clone(),
        };
        let failed = |source| SandboxError::Restore {
            snapshot_id: snapshot.id.clone(),
            source: Box::new(source),
        };
        let after = self.channel.ready_timeout;
        let launched = tokio::time::timeout(after, self.backend.restore(&spec, &snapshot.image))
            .await
            .map_err(|_| {
                failed(SnapshotError::Prepare(BackendError::TimedOut {
                    sandbox_id: sandbox_id.clone(),
                    after,
                }))
            })?
            .map_err(failed)?;
        if let Err(fault) = self.backend.snapshot_fault(SnapshotStep::RestoreAgent) {
            if let Err(err) = self.backend.remove(&launched.container_id).await {
                tracing::warn!(error = %err, "removing a restored sandbox that failed failed");
            }
            return Err(failed(fault));
        }
        let channel = AgentChannel::open(&sandbox_id, launched.streams, self.channel.clone());
        // No ready frame comes (the agent was never restarted): `restored` is the first call.
        match channel.restored(&sandbox_id, &seed()).await {
            Ok(info) => {
                if info.kernel_reseeded.is_none() {
                    tracing::warn!("the restored sandbox's kernel was not ready to re-seed");
                }
                tracing::debug!(reseeded = ?info.reseeded, kernel = ?info.kernel_reseeded, "restored");
            }
            Err(source) => {
                let fate = settled_fate(self.backend.as_ref(), &launched.container_id)
                    .await
                    .unwrap_or(ContainerFate::Missing);
                if let Err(err) = self.backend.remove(&launched.container_id).await {
                    tracing::warn!(error = %err, "removing a restored sandbox that failed failed");
                }
                return Err(SandboxError::RestoredAgent {
                    sandbox_id,
                    snapshot_id: snapshot.id.clone(),
                    fate: Box::new(fate),
                    source: Box::new(source),
                });
            }
        }
        mark.keep();
        let sandbox = Sandbox::new(
            sandbox_id,
            launched.container_id,
            snapshot.profile.name.clone(),
            Some(snapshot.profile.clone()),
            channel,
            self.backend.clone(),
        );
        sandbox.mark_restored(&snapshot.id);
        crate::telemetry::counters()
            .restore_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(sandbox)
    }
}
