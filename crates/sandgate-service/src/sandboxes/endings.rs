//! Honest endings (issue 27): a call by `conversation_id` that lands on a sandbox other than the
//! one the conversation had (it ended: idle where it could not be paused, its lifetime, closed,
//! lost, its pause past retention) is told so, with the previous sandbox's id, when and why it
//! ended, so the model does not have to guess why its variables vanished.

use chrono::{DateTime, Utc};
use sandgate_store::sandboxes::{CloseReason, SandboxRow};

/// The conversation's previous sandbox, which ended: this call's sandbox is a new one.
#[derive(Debug, Clone, PartialEq)]
pub struct Replaced {
    /// The sandbox the conversation had.
    pub previous_sandbox_id: String,
    /// When it ended.
    pub ended_at: Option<DateTime<Utc>>,
    /// Why it ended, in words.
    pub reason: String,
}

impl Replaced {
    /// What to say about `previous`, an ended sandbox of the conversation.
    pub(crate) fn of(previous: &SandboxRow) -> Self {
        let reason = match previous.close_reason() {
            Some(CloseReason::Idle) => format!(
                "it was idle for {} s and was closed (pausing was not possible)",
                previous.idle_timeout_seconds.unwrap_or_default()
            ),
            Some(CloseReason::Lifetime) => "it reached its maximum lifetime".to_owned(),
            Some(CloseReason::Disconnected) => "its app was disconnected".to_owned(),
            Some(CloseReason::Lost(why)) => format!("it was lost: {why}"),
            Some(CloseReason::Closed) if previous.close_reason.as_deref() == Some("retention") => {
                "it stayed paused past the retention period and its snapshot was deleted".to_owned()
            }
            Some(CloseReason::Closed) | None => "it was closed".to_owned(),
        };
        Self {
            previous_sandbox_id: previous.id.clone(),
            ended_at: previous.closed_at,
            reason,
        }
    }

    /// One sentence for the model.
    pub fn sentence(&self) -> String {
        let at = self
            .ended_at
            .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
            .unwrap_or_else(|| "an unknown time".into());
        format!(
            "this conversation's previous sandbox {} ended at {at} ({}): this is a new sandbox, \
             its variables and files are not here",
            self.previous_sandbox_id, self.reason
        )
    }
}
