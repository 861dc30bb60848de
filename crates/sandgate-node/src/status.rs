//! Errors across the RPC: the node turns a [`SandboxError`] into a gRPC status with a typed
//! [`proto::Failure`] in its details; the gateway turns it back, so a lost sandbox, a timeout,
//! an oversized answer or a missing file stay the same errors the model sees in one process.

use std::time::Duration;

use prost::Message;
use sandgate_sandbox::{AgentError, ChannelError, ContainerFate, SandboxError};
use tonic::{Code, Status};

use crate::proto::{self, failure::Kind};

/// The ops the channel names in `Unresponsive` (the error holds a `&'static str`).
const OPS: &[&str] = &[
    "command",
    "read_file",
    "exec",
    "write_file",
    "ping",
    "restart",
];

fn agent_kind(err: &AgentError) -> (&'static str, &str, Option<u64>, u64) {
    match err {
        AgentError::OutsideHome { message } => ("outside_home", message, None, 0),
        AgentError::NotFound { message } => ("not_found", message, None, 0),
        AgentError::Exists { message } => ("exists", message, None, 0),
        AgentError::IsDirectory { message } => ("is_directory", message, None, 0),
        AgentError::NotADirectory { message } => ("not_a_directory", message, None, 0),
        AgentError::TooLarge {
            size,
            limit,
            message,
        } => ("too_large", message, *size, *limit),
        AgentError::BadRequest { message } => ("bad_request", message, None, 0),
        AgentError::Io { message } => ("io", message, None, 0),
        AgentError::Limit { message } => ("limit", message, None, 0),
        AgentError::Internal { message } => ("internal", message, None, 0),
    }
}

fn agent_error(f: proto::AgentFailure) -> AgentError {
    let message = f.message;
    match f.kind.as_str() {
        "outside_home" => AgentError::OutsideHome { message },
        "not_found" => AgentError::NotFound { message },
        "exists" => AgentError::Exists { message },
        "is_directory" => AgentError::IsDirectory { message },
        "not_a_directory" => AgentError::NotADirectory { message },
        "too_large" => AgentError::TooLarge {
            size: f.size,
            limit: f.limit,
            message,
        },
        "bad_request" => AgentError::BadRequest { message },
        "io" => AgentError::Io { message },
        "limit" => AgentError::Limit { message },
        _ => AgentError::Internal { message },
    }
}

/// What a caller reads when the node's Docker engine failed a call on a sandbox.
const ENGINE_FAILED: &str = "the sandbox node could not reach the sandbox through its Docker engine; retry in a few seconds";

/// The status a node answers with for `err`.
pub fn to_status(err: &SandboxError) -> Status {
    let (code, kind) = match err {
        SandboxError::Died { sandbox_id, fate } => (
            Code::FailedPrecondition,
            Kind::Died(proto::Died {
                sandbox_id: sandbox_id.clone(),
                fate: Some(fate.into()),
            }),
        ),
        SandboxError::Channel(ChannelError::Agent(agent)) => {
            let (kind, message, size, limit) = agent_kind(agent);
            let code = match agent {
                AgentError::NotFound { .. } => Code::NotFound,
                AgentError::Exists { .. } => Code::AlreadyExists,
                AgentError::Limit { .. } | AgentError::TooLarge { .. } => Code::ResourceExhausted,
                AgentError::Internal { .. } | AgentError::Io { .. } => Code::Internal,
                _ => Code::InvalidArgument,
            };
            (
                code,
                Kind::Agent(proto::AgentFailure {
                    kind: kind.to_owned(),
                    message: message.to_owned(),
                    size,
                    limit,
                }),
            )
        }
        SandboxError::Channel(ChannelError::AttachLost { reason }) => {
            (Code::Unavailable, Kind::AttachLost(reason.clone()))
        }
        SandboxError::Channel(ChannelError::Unresponsive { op, waited }) => (
            Code::DeadlineExceeded,
            Kind::Unresponsive(proto::Unresponsive {
                op: (*op).to_owned(),
                waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            }),
        ),
        SandboxError::Channel(ChannelError::KernelRestarted) => {
            (Code::Aborted, Kind::KernelRestarted(proto::Empty {}))
        }
        SandboxError::Channel(ChannelError::FrameTooLarge { len, limit }) => (
            Code::ResourceExhausted,
            Kind::FrameTooLarge(proto::FrameTooLarge {
                len: *len as u64,
                limit: *limit as u64,
            }),
        ),
        SandboxError::UnknownProfile(name) => {
            (Code::InvalidArgument, Kind::UnknownProfile(name.clone()))
        }
        SandboxError::NotOurs { container_id } => {
            (Code::NotFound, Kind::NotOurs(container_id.clone()))
        }
        SandboxError::Launch(_) | SandboxError::AgentStart { .. } => {
            (Code::Unavailable, Kind::Launch(chain(err)))
        }
        // The node's engine failed it (stopped, restarting, refused): the caller may retry, and
        // the engine's own words stay in the node's log, not in the text the model reads.
        SandboxError::Backend(_) => {
            tracing::warn!(error = %chain(err), "the Docker engine failed a call on a sandbox");
            (
                Code::Unavailable,
                Kind::AttachLost(ENGINE_FAILED.to_owned()),
            )
        }
        other => (Code::Internal, Kind::Other(chain(other))),
    };
    let failure = proto::Failure { kind: Some(kind) };
    Status::with_details(code, err.to_string(), failure.encode_to_vec().into())
}

/// The error text with its causes, for the other side's logs.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Why a call to a node failed when the node did not say (it could not be reached, the
/// connection broke, the deadline passed).
#[derive(Debug, thiserror::Error)]
#[error("the sandbox node at {node} did not answer: {status}")]
pub struct NodeUnreachable {
    /// The node's address.
    pub node: String,
    /// What the RPC layer saw.
    pub status: String,
}

/// The error a gateway rebuilds from a node's status.
pub fn from_status(node: &str, status: &Status) -> SandboxError {
    let failure = proto::Failure::decode(status.details()).ok();
    let Some(kind) = failure.and_then(|f| f.kind) else {
        // No typed failure: the node never answered this call (transport, deadline, refused).
        // The connection to the sandbox is as good as lost; the service says so plainly.
        return SandboxError::Channel(ChannelError::AttachLost {
            reason: NodeUnreachable {
                node: node.to_owned(),
                status: format!("{:?}: {}", status.code(), status.message()),
            }
            .to_string(),
        });
    };
    match kind {
        Kind::Died(d) => SandboxError::Died {
            sandbox_id: d.sandbox_id,
            fate: d.fate.map_or(ContainerFate::Missing, Into::into),
        },
        Kind::Agent(a) => SandboxError::Channel(ChannelError::Agent(agent_error(a))),
        Kind::AttachLost(reason) => SandboxError::Channel(ChannelError::AttachLost { reason }),
        Kind::Unresponsive(u) => SandboxError::Channel(ChannelError::Unresponsive {
            op: OPS
                .iter()
                .find(|op| **op == u.op)
                .copied()
                .unwrap_or("request"),
            waited: Duration::from_millis(u.waited_ms),
        }),
        Kind::KernelRestarted(_) => SandboxError::Channel(ChannelError::KernelRestarted),
        Kind::FrameTooLarge(f) => SandboxError::Channel(ChannelError::FrameTooLarge {
            len: usize::try_from(f.len).unwrap_or(usize::MAX),
            limit: usize::try_from(f.limit).unwrap_or(usize::MAX),
        }),
        Kind::UnknownProfile(name) => SandboxError::UnknownProfile(name),
        Kind::NotOurs(container_id) => SandboxError::NotOurs { container_id },
        Kind::Launch(text) | Kind::Other(text) => SandboxError::Channel(ChannelError::Protocol {
            detail: format!("the sandbox node at {node} failed: {text}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use sandgate_sandbox::backend::BackendError;

    use super::*;

    #[test]
    fn an_engine_failure_crosses_as_a_retryable_lost_connection_without_the_engines_words() {
        let err = SandboxError::Backend(BackendError::Inspect {
            container_id: "c0ffee".into(),
            source: "client error (Connect): Connection refused (os error 111)".into(),
        });
        let status = to_status(&err);
        assert_eq!(status.code(), Code::Unavailable);
        match from_status("https://127.0.0.1:7443", &status) {
            SandboxError::Channel(ChannelError::AttachLost { reason }) => {
                assert_eq!(reason, ENGINE_FAILED);
                assert!(
                    !reason.contains("os error"),
                    "no engine internals: {reason}"
                );
            }
            other => panic!("expected a lost connection, got {other:?}"),
        }
    }
}
