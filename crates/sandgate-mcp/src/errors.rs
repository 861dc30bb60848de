//! The one mapping from what can go wrong in a tool call or a resource read to what the client
//! sees, what the audit trail records and which metric label counts it: each kind of the
//! service's error catalogue ([`ErrorKind`]) is mapped here, exhaustively, once.
//!
//! A malformed call is a JSON-RPC invalid-params error; a call that was fine but could not be
//! done is a tool result with `isError: true` whose text tells the model what to do next and
//! whose structured content names the kind (`error`), whether a retry may help (`retryable`)
//! and when (`retry_after_seconds`). Internals are never shown (they are logged with their
//! whole cause chain).

use rmcp::ErrorData;
use rmcp::model::{CallToolResponse, CallToolResult, ContentBlock};
use sandgate_service::audit::{ErrorKind as AuditKind, Outcome};
use sandgate_service::{ErrorKind, Quota, ServiceError};
use serde_json::json;

use super::answer::{Answer, CallError};
use super::schema::ToolErrorOutput;

/// How a failed call is answered and recorded.
#[derive(Debug)]
pub(crate) struct Failure {
    /// The answer to the client.
    pub response: Result<CallToolResponse, ErrorData>,
    /// The audit trail's outcome (and the metric label).
    pub outcome: Outcome,
    /// The audit trail's error kind (none for a user's own mistake the tool reported).
    pub kind: Option<AuditKind>,
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
    pub kind: Option<AuditKind>,
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
                kind: failure.kind,
                sandbox_id: failure.sandbox_id,
            }
        }
    }
}

impl CallError {
    /// The answer and the record for this error.
    pub(crate) fn into_failure(self, tool: &str) -> Failure {
        match self {
            CallError::InvalidParams(message) => Failure {
                response: Err(ErrorData::invalid_params(
                    message,
                    Some(error_data(ErrorKind::InvalidParams)),
                )),
                outcome: Outcome::Refused,
                kind: Some(AuditKind::InvalidParams),
                sandbox_id: None,
            },
            CallError::Cancelled => Failure {
                response: Err(ErrorData::internal_error("the call was cancelled", None)),
                outcome: Outcome::Cancelled,
                kind: Some(AuditKind::Cancelled),
                sandbox_id: None,
            },
            CallError::Service(err) => service_failure(&err, tool),
        }
    }
}

/// The audit trail's outcome and error kind of a failure of `kind`: the one exhaustive map.
fn record_of(kind: ErrorKind, quota: Option<Quota>) -> (Outcome, Option<AuditKind>) {
    let refused = |k| (Outcome::Refused, Some(k));
    let failed = |k| (Outcome::Failed, Some(k));
    match kind {
        ErrorKind::InvalidParams => refused(AuditKind::InvalidParams),
        ErrorKind::NotFound => refused(AuditKind::NotFound),
        ErrorKind::Ended => refused(AuditKind::Ended),
        ErrorKind::Lost => refused(AuditKind::Lost),
        ErrorKind::Limit | ErrorKind::Capacity => refused(AuditKind::Limit),
        ErrorKind::QuotaExceeded => refused(quota.map_or(AuditKind::Limit, quota_kind)),
        ErrorKind::BadPath | ErrorKind::SandboxRefused => refused(AuditKind::SandboxRefused),
        ErrorKind::NodeAway | ErrorKind::Unavailable => failed(AuditKind::Unavailable),
        ErrorKind::Internal => failed(AuditKind::Internal),
        ErrorKind::ConnectionLost | ErrorKind::SandboxFailed | ErrorKind::Timeout => {
            failed(AuditKind::Sandbox)
        }
        // The tool worked; what the user asked for did not (an unknown job, a failed command).
        ErrorKind::NoSuchJob | ErrorKind::CommandFailed => (Outcome::UserError, None),
    }
}

fn service_failure(err: &ServiceError, tool: &str) -> Failure {
    let kind = err.kind();
    let quota = match err {
        ServiceError::Quota { quota, limit, .. } => Some((*quota, *limit)),
        _ => None,
    };
    let (outcome, audit_kind) = record_of(kind, quota.map(|(q, _)| q));
    if outcome == Outcome::Failed {
        tracing::error!(error = ?err, tool, "tool call failed");
    }
    let sandbox_id = match err {
        ServiceError::NotFound(id) | ServiceError::Lost { sandbox_id: id, .. } => Some(id.clone()),
        _ => None,
    };
    let structured = ToolErrorOutput {
        error: kind.as_str().into(),
        retryable: kind.retryable(),
        retry_after_seconds: err.retry_after_seconds(),
        limit: quota.map(|(q, _)| q.as_str().to_owned()),
        value: quota.map(|(_, limit)| limit),
    };
    let mut result = CallToolResult::error(vec![ContentBlock::text(err.public_message())]);
    result.structured_content = Some(serde_json::to_value(structured).expect("serializes"));
    Failure {
        response: Ok(result.into()),
        outcome,
        kind: audit_kind,
        sandbox_id,
    }
}

/// The machine-readable part of a JSON-RPC error: the kind and whether a retry may help.
fn error_data(kind: ErrorKind) -> serde_json::Value {
    json!({ "error": kind.as_str(), "retryable": kind.retryable() })
}

/// A failed `resources/read` or `resources/list`: the JSON-RPC error the client gets, and the
/// audit trail's outcome and kind (the same map as a tool call's).
#[derive(Debug)]
pub(crate) struct ResourceFailure {
    /// The answer to the client.
    pub error: ErrorData,
    /// The audit trail's outcome.
    pub outcome: Outcome,
    /// The audit trail's error kind.
    pub kind: Option<AuditKind>,
}

impl ResourceFailure {
    /// A service error reading `uri`.
    pub(crate) fn service(uri: &str, err: ServiceError) -> Self {
        let quota = match &err {
            ServiceError::Quota { quota, .. } => Some(*quota),
            _ => None,
        };
        let (outcome, kind) = record_of(err.kind(), quota);
        if outcome == Outcome::Failed {
            tracing::error!(error = ?err, uri, "a resource read failed");
        }
        Self {
            error: resource_error(uri, err),
            outcome,
            kind,
        }
    }

    /// No such resource for this tenant.
    pub(crate) fn not_found(uri: &str, message: String) -> Self {
        Self {
            error: resource_not_found(uri, message),
            outcome: Outcome::Refused,
            kind: Some(AuditKind::NotFound),
        }
    }

    /// A malformed request (an unknown URI scheme, a bad cursor).
    pub(crate) fn invalid(error: ErrorData) -> Self {
        Self {
            error,
            outcome: Outcome::Refused,
            kind: Some(AuditKind::InvalidParams),
        }
    }
}

/// The machine-readable part of a failed resource read: the same fields as a failed tool
/// call's structured content (kind, retryable, retry_after_seconds, and a quota's name and
/// value), so a client branches on one shape.
fn resource_error_data(err: &ServiceError) -> serde_json::Value {
    let kind = err.kind();
    let quota = match err {
        ServiceError::Quota { quota, limit, .. } => Some((*quota, *limit)),
        _ => None,
    };
    serde_json::to_value(ToolErrorOutput {
        error: kind.as_str().into(),
        retryable: kind.retryable(),
        retry_after_seconds: err.retry_after_seconds(),
        limit: quota.map(|(q, _)| q.as_str().to_owned()),
        value: quota.map(|(_, limit)| limit),
    })
    .expect("serializes")
}

/// The JSON-RPC error of a failed `resources/read` or `resources/list` of `uri`.
pub(crate) fn resource_error(uri: &str, err: ServiceError) -> ErrorData {
    let kind = err.kind();
    let message = err.public_message();
    let data = resource_error_data(&err);
    match kind {
        ErrorKind::NotFound | ErrorKind::Ended | ErrorKind::Lost => {
            resource_not_found(uri, message)
        }
        ErrorKind::Internal | ErrorKind::Unavailable | ErrorKind::NodeAway => {
            tracing::warn!(error = ?err, "reading a resource failed");
            ErrorData::internal_error(message, Some(data))
        }
        ErrorKind::InvalidParams
        | ErrorKind::ConnectionLost
        | ErrorKind::Limit
        | ErrorKind::Capacity
        | ErrorKind::QuotaExceeded
        | ErrorKind::BadPath
        | ErrorKind::NoSuchJob
        | ErrorKind::SandboxRefused
        | ErrorKind::SandboxFailed
        | ErrorKind::Timeout
        | ErrorKind::CommandFailed => ErrorData::invalid_request(message, Some(data)),
    }
}

/// The JSON-RPC error for a resource that does not exist (or is another tenant's).
pub(crate) fn resource_not_found(uri: &str, message: String) -> ErrorData {
    ErrorData::resource_not_found(
        message,
        Some(json!({ "uri": uri, "error": ErrorKind::NotFound.as_str(), "retryable": false })),
    )
}

/// The audit trail's error kind of a quota refusal.
pub(crate) fn quota_kind(quota: Quota) -> AuditKind {
    match quota {
        Quota::CallsPerMinute => AuditKind::RateLimited,
        Quota::CallsInFlight => AuditKind::CallsInFlight,
        Quota::CallsPerSandbox => AuditKind::SandboxBusy,
    }
}

/// The quota a refusal's error kind names, as metrics label it.
pub(crate) fn quota_limit(kind: AuditKind) -> Option<&'static str> {
    Some(match kind {
        AuditKind::RateLimited => Quota::CallsPerMinute.as_str(),
        AuditKind::CallsInFlight => Quota::CallsInFlight.as_str(),
        AuditKind::SandboxBusy => Quota::CallsPerSandbox.as_str(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_of(response: Result<CallToolResponse, ErrorData>) -> serde_json::Value {
        match response.expect("a tool answer") {
            CallToolResponse::Complete(result) => serde_json::to_value(result).unwrap(),
            other => panic!("a complete tool result, not {other:?}"),
        }
    }

    #[test]
    fn a_quota_refusal_keeps_its_fields_and_names_its_kind() {
        let err = ServiceError::Quota {
            quota: Quota::CallsPerMinute,
            limit: 3,
            retry_after_seconds: 20,
        };
        let failure = CallError::Service(err).into_failure("execute_code");
        let json = json_of(failure.response);
        let structured = &json["structuredContent"];
        assert_eq!(structured["error"], "quota_exceeded");
        assert_eq!(structured["limit"], "max_calls_per_minute");
        assert_eq!(structured["value"], 3);
        assert_eq!(structured["retry_after_seconds"], 20);
        assert_eq!(structured["retryable"], true);
        assert_eq!(json["isError"], true);
        assert_eq!(failure.kind, Some(AuditKind::RateLimited));
    }

    #[test]
    fn a_missing_sandbox_is_a_refusal_naming_its_kind() {
        let failure =
            CallError::Service(ServiceError::NotFound("sbx_x".into())).into_failure("get_file");
        let json = json_of(failure.response);
        assert_eq!(json["structuredContent"]["error"], "not_found");
        assert_eq!(json["structuredContent"]["retryable"], false);
        assert!(
            json["structuredContent"]
                .get("retry_after_seconds")
                .is_none()
        );
        assert_eq!(
            json["content"][0]["text"],
            "no sandbox sbx_x exists; call create_sandbox to get one"
        );
        assert_eq!(failure.outcome, Outcome::Refused);
    }
}
