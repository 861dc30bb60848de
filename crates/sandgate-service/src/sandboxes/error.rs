//! Why a sandbox operation could not be done, the texts that say so, and the one catalogue of
//! error kinds ([`ErrorKind`]) that every face maps (MCP tool answers and JSON-RPC errors, HTTP
//! statuses) and that integrators branch on.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sandgate_sandbox::{AgentError, ChannelError, ContainerFate, SandboxError};
use sandgate_store::StoreError;
use sandgate_store::sandboxes::{CloseReason, SandboxRow, SandboxState};

use super::Limits;

/// Why a sandbox operation could not be done. The gateway turns each into a tool error whose
/// text tells the model what to do next.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// No such sandbox for this tenant (or it belongs to another tenant: the same answer).
    #[error("no sandbox {0} exists; call create_sandbox to get one")]
    NotFound(String),
    /// The sandbox ended (closed, expired, disconnected).
    #[error("{}", ended_message(sandbox_id, reason, at, *idle_timeout_seconds))]
    Ended {
        /// The sandbox.
        sandbox_id: String,
        /// Why it ended, when recorded.
        reason: Option<CloseReason>,
        /// When it ended.
        at: Option<DateTime<Utc>>,
        /// Its idle timeout, seconds (said when it expired idle).
        idle_timeout_seconds: i32,
    },
    /// Its container vanished or died.
    #[error(
        "sandbox {sandbox_id} was lost ({why}); its files and variables are gone; call create_sandbox for a new one"
    )]
    Lost {
        /// The sandbox.
        sandbox_id: String,
        /// What happened.
        why: String,
    },
    /// The node that runs the sandbox (or would start it) cannot be reached now: retrying
    /// shortly may work; a node silent past `node.lost_after_seconds` has its sandboxes marked
    /// lost.
    #[error(
        "the sandbox node {node} did not answer ({why}); retry in a few seconds; if it stays \
         silent its sandboxes are marked lost and create_sandbox gives you a new one"
    )]
    NodeAway {
        /// The node's registry id.
        node: String,
        /// What failed.
        why: String,
    },
    /// A tenant limit refused the call.
    #[error("limit reached: {limit} ({value}); {hint}")]
    Limit {
        /// The limit's name.
        limit: &'static str,
        /// Its value.
        value: String,
        /// What to do.
        hint: &'static str,
    },
    /// A call quota refused the call; retrying after `retry_after_seconds` may work.
    #[error("{}", quota_message(*quota, *limit, *retry_after_seconds))]
    Quota {
        /// Which quota.
        quota: Quota,
        /// Its value.
        limit: u32,
        /// When a retry may fit, seconds.
        retry_after_seconds: u32,
    },
    /// No place among the starts the sandbox node runs at once came free in time: the node is
    /// busy starting others; retrying in a minute may work.
    #[error(
        "limit reached: sandbox starts (no sandbox could be started within {} s: the sandbox \
         node is busy starting others); retry in a minute; if it persists, tell the user",
        waited.as_secs()
    )]
    StartQueue {
        /// How long the start waited.
        waited: Duration,
    },
    /// A shared resource is at its bound for the moment (transcript loads at once in this
    /// process, bytes in flight on the sandbox node); retrying after `retry_after_seconds` may
    /// work.
    #[error(
        "limit reached: {what} is at its bound for the moment; retry in {retry_after_seconds} s"
    )]
    Busy {
        /// What is busy.
        what: String,
        /// When a retry may fit, seconds.
        retry_after_seconds: u32,
    },
    /// The sandbox has no background job by that id.
    #[error(
        "There is no background job \"{job_id}\" in this sandbox; list_jobs shows its jobs and \
         their job_ids."
    )]
    NoSuchJob {
        /// The job id the caller named.
        job_id: String,
    },
    /// The agent in the sandbox refused the operation (a path outside /home/user, a missing
    /// file, a file that exists, one too large, a full disk); its text says why.
    #[error(transparent)]
    Refused(AgentError),
    /// The sandbox did not answer an operation in time.
    #[error(transparent)]
    Unresponsive(ChannelError),
    /// The connection to a sandbox that still runs dropped while the call ran: its outcome is
    /// unknown, the sandbox is intact and reconnected on the next call.
    #[error(transparent)]
    ConnectionLost(SandboxError),
    /// Postgres is unavailable: retrying shortly may work.
    #[error("sandgate's database is temporarily unavailable; retry in a few seconds")]
    Unavailable(#[source] StoreError),
    /// Postgres was away before the call could even be checked (the token's grant).
    #[error("sandgate's database is temporarily unavailable; retry in a few seconds")]
    DatabaseAway,
    /// Another database failure.
    #[error("internal error (database)")]
    Store(#[source] StoreError),
    /// The sandbox manager failed (launching, talking to the agent).
    #[error(transparent)]
    Sandbox(SandboxError),
}

impl From<SandboxError> for ServiceError {
    fn from(err: SandboxError) -> Self {
        match err {
            // A start that waited too long for its place is a capacity refusal the caller
            // retries, not a failure of the sandbox.
            SandboxError::StartQueue { waited } => ServiceError::StartQueue { waited },
            SandboxError::NodeBusy { what, retry_after } => ServiceError::Busy {
                what,
                retry_after_seconds: u32::try_from(retry_after.as_secs().max(1))
                    .unwrap_or(u32::MAX),
            },
            SandboxError::Channel(ChannelError::Agent(refusal)) => ServiceError::Refused(refusal),
            SandboxError::Channel(err @ ChannelError::Unresponsive { .. }) => {
                ServiceError::Unresponsive(err)
            }
            err @ SandboxError::ConnectionLost { .. } => ServiceError::ConnectionLost(err),
            other => ServiceError::Sandbox(other),
        }
    }
}

impl From<StoreError> for ServiceError {
    fn from(err: StoreError) -> Self {
        if err.is_unavailable() {
            ServiceError::Unavailable(err)
        } else {
            ServiceError::Store(err)
        }
    }
}

impl From<sqlx::Error> for ServiceError {
    /// A failed acquire, begin or commit: classified like any other database failure.
    fn from(err: sqlx::Error) -> Self {
        StoreError::from(err).into()
    }
}

/// A quota on tool calls: each refuses a call that would exceed it with a retryable error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Quota {
    /// Calls a tenant starts per minute (across replicas).
    CallsPerMinute,
    /// Calls of a tenant running at once (across replicas).
    CallsInFlight,
    /// Calls running at once in one sandbox.
    CallsPerSandbox,
}

impl Quota {
    /// The quota's name, as tool results, the audit trail and metrics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Quota::CallsPerMinute => "max_calls_per_minute",
            Quota::CallsInFlight => "max_calls_in_flight",
            Quota::CallsPerSandbox => "max_calls_per_sandbox",
        }
    }
}

impl std::fmt::Display for Quota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

fn quota_message(quota: Quota, limit: u32, retry_after: u32) -> String {
    let what = match quota {
        Quota::CallsPerMinute => format!(
            "this tenant may start {limit} tool calls per minute (a burst of {limit}, then one \
             every {:.1} s)",
            60.0 / f64::from(limit.max(1))
        ),
        Quota::CallsInFlight => format!(
            "this tenant may have {limit} tool calls running at once; wait for a running call \
             to finish"
        ),
        Quota::CallsPerSandbox => format!(
            "one sandbox may run {limit} tool calls at once; wait for one of its calls to finish"
        ),
    };
    format!(
        "limit reached: {quota} ({limit}): {what}, then retry in {retry_after} s \
         (retry_after_seconds)"
    )
}

pub(super) fn over_limit(limits: &Limits) -> ServiceError {
    ServiceError::Limit {
        limit: "max concurrent sandboxes per tenant",
        value: limits.max_sandboxes.to_string(),
        hint: "close a sandbox you no longer need (close_sandbox) and try again",
    }
}

/// Describes what happened to a container, for the model.
pub fn describe_fate(fate: &ContainerFate) -> String {
    fate.to_string()
}

/// The error for a call on a sandbox that is no longer live, saying when and why.
pub(crate) fn ended_error(row: &SandboxRow) -> ServiceError {
    if matches!(
        row.state,
        SandboxState::Pausing | SandboxState::Paused | SandboxState::Resuming
    ) {
        // Not ended: reached by a path that does not resume (a download link).
        return ServiceError::Busy {
            what: format!(
                "sandbox {} (it is paused: any tool call naming it resumes it)",
                row.id
            ),
            retry_after_seconds: 5,
        };
    }
    match row.close_reason() {
        Some(CloseReason::Lost(why)) => ServiceError::Lost {
            sandbox_id: row.id.clone(),
            why,
        },
        _ if row.state == SandboxState::Lost => ServiceError::Lost {
            sandbox_id: row.id.clone(),
            why: "its container disappeared".into(),
        },
        reason => ServiceError::Ended {
            sandbox_id: row.id.clone(),
            reason,
            at: row.closed_at,
            idle_timeout_seconds: row.idle_timeout_seconds.unwrap_or_default(),
        },
    }
}

/// What the model reads about a sandbox that ended: when, why, and what to do.
fn ended_message(
    id: &str,
    reason: &Option<CloseReason>,
    at: &Option<DateTime<Utc>>,
    idle_timeout_seconds: i32,
) -> String {
    let at = at
        .map(|t| t.format("%Y-%m-%d %H:%M:%S UTC").to_string())
        .unwrap_or_else(|| "an unknown time".into());
    match reason {
        Some(CloseReason::Idle) => format!(
            "sandbox {id} expired after {idle_timeout_seconds} s idle at {at}; its files and variables are gone; call create_sandbox for a new one"
        ),
        Some(CloseReason::Lifetime) => format!(
            "sandbox {id} reached its maximum lifetime at {at} and was closed; call create_sandbox for a new one"
        ),
        Some(CloseReason::Disconnected) => {
            format!("sandbox {id} was closed at {at} because its app was disconnected")
        }
        Some(CloseReason::Closed | CloseReason::Lost(_)) | None => {
            format!("sandbox {id} was closed at {at}; call create_sandbox for a new one")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_start_queue_is_a_retryable_limit_not_a_sandbox_failure() {
        let err = ServiceError::from(SandboxError::StartQueue {
            waited: std::time::Duration::from_secs(120),
        });
        assert!(matches!(err, ServiceError::StartQueue { .. }), "{err:?}");
        assert_eq!(err.kind(), super::super::ErrorKind::Capacity);
        assert!(err.retryable());
        let text = err.to_string();
        assert!(
            text.contains("limit reached: sandbox starts")
                && text.contains("within 120 s")
                && text.contains("retry in a minute"),
            "{text}"
        );
    }
}
