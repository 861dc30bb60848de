//! Faults injected at the steps of a checkpoint or a restore, so that tests can show what each
//! failure leaves behind (issue 26: a checkpoint or restore that fails leaves the sandbox running
//! or cleanly gone, never both, never half, and no plaintext image). Real timing rarely hits these
//! windows; a test arms a step and the next operation fails there.
//!
//! Only code can arm one ([`crate::DockerBackend::with_snapshot_faults`]): no configuration key or
//! request reaches it, so a production process never has one.

use std::sync::Mutex;

use crate::snapshot::SnapshotError;

/// A step of a checkpoint or a restore at which a fault can be injected, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SnapshotStep {
    /// Checkpoint: the container's checkpoint directory is linked into the tmpfs.
    CheckpointLinked,
    /// Checkpoint: the engine's checkpoint call has returned (a stopping checkpoint has stopped
    /// the container, or is stopping it).
    CheckpointTaken,
    /// Checkpoint: the image is out of the engine's reach, under the manager's images; the last
    /// step before the snapshot is handed over.
    CheckpointMoved,
    /// Restore: the new container is created and attached, not started.
    RestoreCreated,
    /// Restore: the image is in the new container's checkpoint directory.
    RestorePlaced,
    /// Restore: the engine has started the container from the image (the agent runs).
    RestoreStarted,
    /// Restore: the restored agent is about to be told its identity (the manager's step).
    RestoreAgent,
}

impl SnapshotStep {
    /// The checkpoint's steps, in order.
    pub const CHECKPOINT: [SnapshotStep; 3] = [
        SnapshotStep::CheckpointLinked,
        SnapshotStep::CheckpointTaken,
        SnapshotStep::CheckpointMoved,
    ];
    /// The restore's steps, in order.
    pub const RESTORE: [SnapshotStep; 4] = [
        SnapshotStep::RestoreCreated,
        SnapshotStep::RestorePlaced,
        SnapshotStep::RestoreStarted,
        SnapshotStep::RestoreAgent,
    ];
}

impl std::fmt::Display for SnapshotStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SnapshotStep::CheckpointLinked => "checkpoint: directory linked",
            SnapshotStep::CheckpointTaken => "checkpoint: engine call returned",
            SnapshotStep::CheckpointMoved => "checkpoint: image moved",
            SnapshotStep::RestoreCreated => "restore: container created",
            SnapshotStep::RestorePlaced => "restore: image placed",
            SnapshotStep::RestoreStarted => "restore: container started",
            SnapshotStep::RestoreAgent => "restore: agent to be told",
        })
    }
}

/// The armed faults: each fires once, at the next operation that reaches its step.
#[derive(Debug, Default)]
pub struct SnapshotFaults {
    armed: Mutex<Vec<SnapshotStep>>,
}

impl SnapshotFaults {
    /// Makes the next operation that reaches `step` fail there.
    pub fn arm(&self, step: SnapshotStep) {
        self.armed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(step);
    }

    /// Whether a fault is still armed (it has not fired yet).
    pub fn pending(&self) -> bool {
        !self
            .armed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// Fails with [`SnapshotError::Injected`] when `step` is armed, disarming it.
    pub(crate) fn at(&self, step: SnapshotStep) -> Result<(), SnapshotError> {
        let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        match armed.iter().position(|s| *s == step) {
            Some(at) => {
                armed.remove(at);
                tracing::warn!(%step, "injecting a snapshot fault (a test hook)");
                Err(SnapshotError::Injected { step })
            }
            None => Ok(()),
        }
    }
}
