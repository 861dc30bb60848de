//! The one mapping from what can go wrong in a tool call to what the client sees, what the
//! audit trail records and which metric label counts it.
//!
//! A malformed call is a JSON-RPC invalid-params error; a call that was fine but could not be
//! done is a tool result with `isError: true` whose text tells the model what to do next and
//! never shows internals (those are logged with their whole cause chain).

use rmcp::ErrorData;
use rmcp::model::{CallToolResponse, CallToolResult, ContentBlock};
use sandgate_sandbox::{ChannelError, SandboxError};
use sandgate_service::{Quota, ServiceError};
use sandgate_store::audit::{ErrorKind, Outcome};

use super::calls::Answer;

/// Why a tool call produced no normal result.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// The call itself is malformed: a JSON-RPC invalid-params error.
    #[error("{0}")]
    InvalidParams(String),
    /// The call was fine but could not be done: a tool result with `isError: true`.
    #[error(transparent)]
    Service(#[from] ServiceError),
    /// The client cancelled it.
    #[error("the call was cancelled")]
    Cancelled,
}

/// How a failed call is answered and recorded.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The answer to the client.
    pub response: Result<CallToolResponse, ErrorData>,
    /// The audit trail's outcome (and the metric label).
    pub outcome: Outcome,
    /// The audit trail's error kind.
    pub kind: ErrorKind,
    /// The sandbox the failure names, for the audit trail.
    pub sandbox_id: Option<String>,
}

/// How a call is answered and recorded, whether it worked or not.
#[derive(Debug)]
pub(crate) struct Settled {
    /// The answer to the client.
    pub response: Result<CallToolResponse, ErrorData>,
    /// The audit trail's outcome (and the metric label).
    pub outcome: Outcome,
    /// The audit trail's error kind, when it failed.
    pub kind: Option<ErrorKind>,
    /// The sandbox the call reached or the failure names.
    pub sandbox_id: Option<String>,
}

/// Settles a call of `tool`: its answer, or its error through the one mapping below.
pub(crate) fn settle(result: Result<Answer, CallError>, tool: &str) -> Settled {
    match result {
        Ok(answer) => Settled {
            outcome: if answer.result.is_error == Some(true) {
                Outcome::UserError
            } else {
                Outcome::Ok
            },
            response: Ok(answer.result.into()),
            kind: None,
            sandbox_id: answer.sandbox_id,
        },
        Err(err) => {
            let failure = err.into_failure(tool);
            Settled {
                response: failure.response,
                outcome: failure.outcome,
                kind: Some(failure.kind),
                sandbox_id: failure.sandbox_id,
            }
        }
    }
}

impl CallError {
    /// The answer and the record for this error: the one exhaustive mapping.
    pub(crate) fn into_failure(self, tool: &str) -> Failure {
        match self {
            CallError::InvalidParams(message) => Failure {
                response: Err(ErrorData::invalid_params(message, None)),
                outcome: Outcome::Refused,
                kind: ErrorKind::InvalidParams,
                sandbox_id: None,
            },
            CallError::Cancelled => Failure {
                response: Err(ErrorData::internal_error("the call was cancelled", None)),
                outcome: Outcome::Cancelled,
                kind: ErrorKind::Cancelled,
                sandbox_id: None,
            },
            CallError::Service(err) => service_failure(&err, tool),
        }
    }
}

fn service_failure(err: &ServiceError, tool: &str) -> Failure {
    use ServiceError as E;
    let refused = |kind, sandbox_id: Option<&String>| (Outcome::Refused, kind, sandbox_id.cloned());
    let (outcome, kind, sandbox_id) = match err {
        E::NotFound(id) => refused(ErrorKind::NotFound, Some(id)),
        E::Ended { .. } => refused(ErrorKind::Ended, None),
        E::Lost { sandbox_id, .. } => refused(ErrorKind::Lost, Some(sandbox_id)),
        E::Limit { .. } => refused(ErrorKind::Limit, None),
        E::Quota { quota, .. } => refused(quota_kind(*quota), None),
        E::Unavailable(_) | E::DatabaseAway | E::NodeAway { .. } => {
            (Outcome::Failed, ErrorKind::Unavailable, None)
        }
        E::Store(_) => (Outcome::Failed, ErrorKind::Internal, None),
        E::Sandbox(SandboxError::Channel(ChannelError::Agent(_))) => {
            refused(ErrorKind::SandboxRefused, None)
        }
        E::Sandbox(_) => (Outcome::Failed, ErrorKind::Sandbox, None),
    };
    if outcome == Outcome::Failed {
        tracing::error!(error = ?err, tool, "tool call failed");
    }
    let mut result = CallToolResult::error(vec![ContentBlock::text(public_message(err))]);
    if let E::Quota {
        quota,
        limit,
        retry_after_seconds,
    } = err
    {
        // Retryable: say which limit and when, machine-readably too.
        result.structured_content = Some(serde_json::json!({
            "error": "quota_exceeded",
            "limit": quota.as_str(),
            "value": limit,
            "retry_after_seconds": retry_after_seconds,
        }));
    }
    Failure {
        response: Ok(result.into()),
        outcome,
        kind,
        sandbox_id,
    }
}

/// The audit trail's error kind of a quota refusal.
fn quota_kind(quota: Quota) -> ErrorKind {
    match quota {
        Quota::CallsPerMinute => ErrorKind::RateLimited,
        Quota::CallsInFlight => ErrorKind::CallsInFlight,
        Quota::CallsPerSandbox => ErrorKind::SandboxBusy,
    }
}

/// The quota a refusal's error kind names, as metrics label it.
pub(crate) fn quota_limit(kind: ErrorKind) -> Option<&'static str> {
    Some(match kind {
        ErrorKind::RateLimited => Quota::CallsPerMinute.as_str(),
        ErrorKind::CallsInFlight => Quota::CallsInFlight.as_str(),
        ErrorKind::SandboxBusy => Quota::CallsPerSandbox.as_str(),
        _ => return None,
    })
}

/// The text the model sees for a failed call: specific, with what to do next; never internals.
pub(super) fn public_message(err: &ServiceError) -> String {
    match err {
        ServiceError::Store(_) => {
            "sandgate hit an internal error; retry the call, and if it persists, tell the user"
                .into()
        }
        ServiceError::Sandbox(inner) => match inner {
            SandboxError::Channel(ch) => ch.to_string(),
            SandboxError::Died { .. } | SandboxError::ConnectionLost { .. } => inner.to_string(),
            // A node in another process reads the same as this process's own engine: the node
            // logged the reason under an incident id, which the gateway's log names.
            SandboxError::Launch(_)
            | SandboxError::AgentStart { .. }
            | SandboxError::NodeFailed { starting: true, .. } => {
                "starting a sandbox failed; retry in a few seconds".into()
            }
            // Mapped to a limit by the service; a stray one still reads as what it is.
            SandboxError::StartQueue { .. } => inner.to_string(),
            SandboxError::UnknownProfile(_)
            | SandboxError::InvalidProfile { .. }
            | SandboxError::NotOurs { .. }
            | SandboxError::Backend(_)
            // Snapshots (issue 26) are not offered to the model yet; their words are the node's.
            | SandboxError::SnapshotsUnavailable { .. }
            | SandboxError::Checkpoint { .. }
            | SandboxError::Restore { .. }
            | SandboxError::RestoredAgent { .. }
            | SandboxError::Checkpointed { .. }
            | SandboxError::NodeFailed {
                starting: false, ..
            } => "the sandbox could not do that; retry, or call create_sandbox for a fresh one"
                .into(),
        },
        ServiceError::NotFound(_)
        | ServiceError::Ended { .. }
        | ServiceError::Lost { .. }
        | ServiceError::Limit { .. }
        | ServiceError::Quota { .. }
        | ServiceError::Unavailable(_)
        | ServiceError::DatabaseAway
        | ServiceError::NodeAway { .. } => err.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use sandgate_sandbox::ProfileError;
    use sandgate_sandbox::backend::BackendError;

    use super::*;

    fn text(err: SandboxError) -> String {
        public_message(&ServiceError::Sandbox(err))
    }

    #[test]
    fn a_remote_nodes_logged_failure_reads_as_the_same_failure_in_one_process() {
        let node = |starting| SandboxError::NodeFailed {
            node: "https://10.1.2.3:7443".into(),
            incident: "0123456789ab".into(),
            starting,
        };
        let local_start = SandboxError::Launch(BackendError::Create {
            sandbox_id: "sbx_1".into(),
            source: "No such image: private:tag".into(),
        });
        assert_eq!(text(node(true)), text(local_start));
        let local_call = SandboxError::InvalidProfile {
            name: "default".into(),
            reason: ProfileError::Cpus(1000.0),
        };
        assert_eq!(text(node(false)), text(local_call));
        for starting in [true, false] {
            let shown = text(node(starting));
            assert!(
                !shown.contains("10.1.2.3") && !shown.contains("0123456789ab"),
                "no address or incident for the model: {shown}"
            );
            assert!(shown.contains("retry"), "says what to do next: {shown}");
        }
    }
}
