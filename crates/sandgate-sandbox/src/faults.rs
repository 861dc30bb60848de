//! Faults injected at the steps of a checkpoint or a restore, so that tests can show what each
//! failure leaves behind (issue 26: a checkpoint or restore that fails leaves the sandbox running
//! or cleanly gone, never both, never half, and no plaintext image). Real timing rarely hits these
//! windows; a test arms a step and the next operation fails there.
//!
//! Only code can arm one ([`crate::DockerBackend::with_snapshot_faults`]): no configuration key or
//! request reaches it, so a production process never has one.

use std::sync::Mutex;

use crate::snapshot::SnapshotError;
pub use crate::snapshot::SnapshotStep;

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
