//! A pause stopped dead at one of its steps, as a crash of the process running it would leave
//! it (a test hook: only code can arm it, no configuration key reaches it). The pause's task
//! waits at the armed step for ever, so a test can abort it there (every later step, every
//! clean-up a failure would run, never happens) and check what a restarted process makes of
//! the sandbox: running or paused, never lost.

use std::sync::Mutex;

/// A step of a pause, in order; a halt at one leaves everything before it done and nothing
/// after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PauseStep {
    /// The row says `pausing`; no checkpoint yet.
    Begun,
    /// The checkpoint is taken and its sealed bytes streamed, the store's write not finished.
    Checkpointed,
    /// The sealed snapshot is whole in the store, not yet recorded.
    Stored,
    /// The snapshot is recorded and the row `paused`; the container not yet removed.
    Recorded,
}

impl PauseStep {
    /// Every step, in order.
    pub const ALL: [PauseStep; 4] = [
        PauseStep::Begun,
        PauseStep::Checkpointed,
        PauseStep::Stored,
        PauseStep::Recorded,
    ];
}

impl std::fmt::Display for PauseStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PauseStep::Begun => "begun",
            PauseStep::Checkpointed => "checkpointed",
            PauseStep::Stored => "stored",
            PauseStep::Recorded => "recorded",
        })
    }
}

/// The armed halt: the next pause that reaches its step stops there for ever.
#[derive(Debug, Default)]
pub struct PauseHalts {
    armed: Mutex<Option<PauseStep>>,
    reached: tokio::sync::Notify,
}

impl PauseHalts {
    /// Makes the next pause that reaches `step` stop there.
    pub fn arm(&self, step: PauseStep) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) = Some(step);
    }

    /// Waits until a pause has stopped at the armed step.
    pub async fn reached(&self) {
        self.reached.notified().await;
    }

    /// Stops here for ever when `step` is armed (disarming it), after saying so.
    pub(crate) async fn at(&self, step: PauseStep) {
        {
            let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
            if *armed != Some(step) {
                return;
            }
            *armed = None;
        }
        tracing::warn!(%step, "halting a pause here (a test hook)");
        self.reached.notify_one();
        std::future::pending::<()>().await;
    }
}
