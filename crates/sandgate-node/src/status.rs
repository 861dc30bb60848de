//! Errors across the RPC: the node turns a [`SandboxError`] into a gRPC status with a typed
//! [`proto::Failure`] in its details; the gateway turns it back, so a lost sandbox, a timeout,
//! an oversized answer or a missing file stay the same errors the model sees in one process.

use std::time::Duration;

use prost::Message;
use sandgate_sandbox::{AgentError, ChannelError, ContainerFate, SandboxError, SealError};
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

/// Milliseconds of `d`, saturated.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The status a node answers with for `err`. What the model may read crosses typed (the same
/// variants the gateway's mapping shows in one process); a failure whose words are the node's
/// own (its engine's errors, paths, addresses) is logged here with its whole cause chain under
/// a short random incident id, and only that id crosses.
pub fn to_status(err: &SandboxError) -> Status {
    let (code, kind) = match err {
        SandboxError::Died { sandbox_id, fate } => (
            Code::FailedPrecondition,
            Kind::Died(proto::Died {
                sandbox_id: sandbox_id.clone(),
                fate: Some(fate.into()),
            }),
        ),
        SandboxError::ConnectionLost { sandbox_id, reason } => (
            Code::Unavailable,
            Kind::ConnectionLost(proto::ConnectionLost {
                sandbox_id: sandbox_id.clone(),
                reason: reason.clone(),
            }),
        ),
        SandboxError::Channel(channel) => channel_failure(channel),
        SandboxError::UnknownProfile(name) => {
            (Code::InvalidArgument, Kind::UnknownProfile(name.clone()))
        }
        SandboxError::StartQueue { waited } => {
            (Code::ResourceExhausted, Kind::StartQueueMs(millis(*waited)))
        }
        SandboxError::NodeBusy { what, retry_after } => (
            Code::ResourceExhausted,
            Kind::NodeBusy(proto::NodeBusy {
                what: what.clone(),
                retry_after_ms: millis(*retry_after),
            }),
        ),
        SandboxError::NotOurs { container_id } => {
            (Code::NotFound, Kind::NotOurs(container_id.clone()))
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
        SandboxError::Launch(_) | SandboxError::AgentStart { .. } => {
            return logged(
                err,
                Code::Unavailable,
                Kind::Launch,
                "starting a sandbox failed",
            );
        }
        // A checkpoint's or restore's failure speaks of the node's engine and paths: logged,
        // like any failure whose words are the node's own (a refused sealed stream crosses
        // typed: `seal_refusal`).
        SandboxError::SnapshotsUnavailable { .. }
        | SandboxError::Checkpoint { .. }
        | SandboxError::Restore { .. }
        | SandboxError::RestoredAgent { .. }
        | SandboxError::Checkpointed { .. } => {
            return logged(
                err,
                Code::FailedPrecondition,
                Kind::Other,
                "a snapshot of a sandbox failed",
            );
        }
        SandboxError::Seal {
            snapshot_id,
            source,
        } => match seal_refusal(snapshot_id, source) {
            Some(refusal) if refusal.kind == "binding" => {
                (Code::InvalidArgument, Kind::SealRefused(refusal))
            }
            Some(refusal) => (Code::DataLoss, Kind::SealRefused(refusal)),
            // Sealing or opening failed on the node's side (its tmpfs, its I/O).
            None => {
                return logged(
                    err,
                    Code::FailedPrecondition,
                    Kind::Other,
                    "sealing or opening a snapshot failed",
                );
            }
        },
        SandboxError::InvalidProfile { .. }
        | SandboxError::NodeFailed { .. }
        | SandboxError::VersionSkew { .. }
        | SandboxError::OlderNode { .. } => {
            return logged(
                err,
                Code::Internal,
                Kind::Other,
                "a call on a sandbox failed",
            );
        }
    };
    let failure = proto::Failure { kind: Some(kind) };
    Status::with_details(code, err.to_string(), failure.encode_to_vec().into())
}

/// The refusal of a caller older than `oldest` (see [`crate::version`]).
pub(crate) fn version_skew(caller: u32, oldest: u32, newest: u32) -> Status {
    let failure = proto::Failure {
        kind: Some(Kind::VersionSkew(proto::VersionSkew {
            caller,
            oldest,
            newest,
        })),
    };
    Status::with_details(
        Code::FailedPrecondition,
        format!(
            "this node serves node RPC versions {oldest} to {newest}; the caller speaks {caller}: upgrade the gateway"
        ),
        failure.encode_to_vec().into(),
    )
}

/// A refused sealed stream as it crosses: the stream's fault, in words that are ours (no
/// paths, no engine). `None` for failures of the node's own (its tmpfs, its I/O).
fn seal_refusal(snapshot_id: &str, err: &SealError) -> Option<proto::SealRefused> {
    let mut refusal = proto::SealRefused {
        snapshot_id: snapshot_id.to_owned(),
        ..Default::default()
    };
    match err {
        SealError::Binding { expected, found } => {
            refusal.kind = "binding".into();
            refusal.expected = expected.clone();
            refusal.found = found.clone();
        }
        SealError::Unauthentic { chunk } => {
            refusal.kind = "unauthentic".into();
            refusal.chunk = *chunk;
        }
        SealError::Truncated { chunks } => {
            refusal.kind = "truncated".into();
            refusal.chunk = *chunks;
        }
        SealError::Format(what) => {
            refusal.kind = "format".into();
            refusal.found = what.clone();
        }
        SealError::Archive(what) => {
            refusal.kind = "archive".into();
            refusal.found = what.clone();
        }
        SealError::NotTmpfs { .. } | SealError::Io { .. } => return None,
    }
    Some(refusal)
}

/// The typed failure of a channel error: each is what the model reads in one process too.
fn channel_failure(err: &ChannelError) -> (Code, Kind) {
    match err {
        ChannelError::Agent(agent) => {
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
        ChannelError::AttachLost { reason } => {
            (Code::Unavailable, Kind::AttachLost(reason.clone()))
        }
        ChannelError::Unresponsive { op, waited } => (
            Code::DeadlineExceeded,
            Kind::Unresponsive(proto::Unresponsive {
                op: (*op).to_owned(),
                waited_ms: millis(*waited),
            }),
        ),
        ChannelError::KernelRestarted => (Code::Aborted, Kind::KernelRestarted(proto::Empty {})),
        ChannelError::FrameTooLarge { len, limit } => (
            Code::ResourceExhausted,
            Kind::FrameTooLarge(proto::FrameTooLarge {
                len: *len as u64,
                limit: *limit as u64,
            }),
        ),
        ChannelError::ReadyTimeout { waited } => {
            (Code::Unavailable, Kind::ReadyTimeoutMs(millis(*waited)))
        }
        ChannelError::ProtocolVersion { found, expected } => (
            Code::FailedPrecondition,
            Kind::ProtocolVersion(proto::ProtocolVersion {
                found: *found,
                expected: *expected,
            }),
        ),
        ChannelError::TransferCorrupted { path, detail } => (
            Code::DataLoss,
            Kind::TransferCorrupted(proto::TransferCorrupted {
                path: path.clone(),
                detail: detail.clone(),
            }),
        ),
        ChannelError::Protocol { detail } => (Code::Internal, Kind::Protocol(detail.clone())),
    }
}

/// The status of a failure whose words are the node's own: `err` is logged with its whole
/// cause chain under a new incident id (12 hex digits, for an operator to grep the node's log
/// with), and only the id crosses, in `kind` and in the status's message.
fn logged(err: &SandboxError, code: Code, kind: fn(String) -> Kind, what: &str) -> Status {
    let incident = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
    tracing::error!(
        incident = %incident,
        error = %chain(err),
        "{what}; the gateway was sent incident {incident} instead of the reason"
    );
    let message = format!("the sandbox node failed this call (incident {incident} in its log)");
    let failure = proto::Failure {
        kind: Some(kind(incident)),
    };
    Status::with_details(code, message, failure.encode_to_vec().into())
}

/// The error text with its causes, for the node's log.
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
/// connection broke, the deadline passed). Its text is what a caller reads, so it names neither
/// the node's address nor the transport's words; the gateway's log has both.
#[derive(Debug, thiserror::Error)]
#[error("the sandbox node did not answer: {}", unanswered(*code))]
pub struct NodeUnreachable {
    /// The node's address.
    pub node: String,
    /// The status code the RPC layer gave.
    pub code: Code,
    /// What the RPC layer saw.
    pub status: String,
}

/// What a status without a typed failure means, for the caller.
fn unanswered(code: Code) -> &'static str {
    match code {
        Code::Unavailable => "it could not be reached",
        Code::DeadlineExceeded => "the call's deadline passed",
        Code::Cancelled => "the call was cancelled",
        _ => "the connection to it failed",
    }
}

/// The error a gateway rebuilds from a node's status.
pub fn from_status(node: &str, status: &Status) -> SandboxError {
    let failure = proto::Failure::decode(status.details()).ok();
    let Some(kind) = failure.and_then(|f| f.kind) else {
        // A call this node's version does not have (the gateway is newer): not a lost
        // connection, an upgrade out of order.
        if status.code() == Code::Unimplemented {
            tracing::error!(node, status = %status.message(), "a sandbox node does not know a call: it is older than this gateway");
            return SandboxError::OlderNode {
                node: node.to_owned(),
                detail: bounded(status.message().to_owned()),
            };
        }
        // No typed failure: the node never answered this call (transport, deadline, refused).
        // The connection to the sandbox is as good as lost; the service says so plainly.
        let unreachable = NodeUnreachable {
            node: node.to_owned(),
            code: status.code(),
            status: status.message().to_owned(),
        };
        tracing::warn!(node, code = ?status.code(), status = %status.message(), "a call to a sandbox node got no answer");
        return SandboxError::Channel(ChannelError::AttachLost {
            reason: unreachable.to_string(),
        });
    };
    match kind {
        Kind::Died(d) => SandboxError::Died {
            sandbox_id: d.sandbox_id,
            fate: d.fate.map_or(ContainerFate::Missing, Into::into),
        },
        Kind::ConnectionLost(c) => SandboxError::ConnectionLost {
            sandbox_id: c.sandbox_id,
            reason: c.reason,
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
        Kind::StartQueueMs(ms) => SandboxError::StartQueue {
            waited: Duration::from_millis(ms),
        },
        Kind::NodeBusy(b) => SandboxError::NodeBusy {
            what: b.what,
            retry_after: Duration::from_millis(b.retry_after_ms),
        },
        Kind::ReadyTimeoutMs(ms) => SandboxError::Channel(ChannelError::ReadyTimeout {
            waited: Duration::from_millis(ms),
        }),
        Kind::ProtocolVersion(p) => SandboxError::Channel(ChannelError::ProtocolVersion {
            found: p.found,
            expected: p.expected,
        }),
        Kind::TransferCorrupted(t) => SandboxError::Channel(ChannelError::TransferCorrupted {
            path: t.path,
            detail: t.detail,
        }),
        Kind::Protocol(detail) => SandboxError::Channel(ChannelError::Protocol { detail }),
        Kind::UnknownProfile(name) => SandboxError::UnknownProfile(name),
        Kind::NotOurs(container_id) => SandboxError::NotOurs { container_id },
        Kind::Launch(incident) => SandboxError::NodeFailed {
            node: node.to_owned(),
            incident: bounded(incident),
            starting: true,
        },
        Kind::SealRefused(r) => SandboxError::Seal {
            source: Box::new(match r.kind.as_str() {
                "binding" => SealError::Binding {
                    expected: r.expected,
                    found: r.found,
                },
                "unauthentic" => SealError::Unauthentic { chunk: r.chunk },
                "truncated" => SealError::Truncated { chunks: r.chunk },
                "archive" => SealError::Archive(bounded(r.found)),
                _ => SealError::Format(bounded(r.found)),
            }),
            snapshot_id: r.snapshot_id,
        },
        Kind::VersionSkew(v) => {
            tracing::error!(
                node,
                caller = v.caller,
                oldest = v.oldest,
                newest = v.newest,
                "a sandbox node refused this gateway's node RPC version"
            );
            SandboxError::VersionSkew {
                node: node.to_owned(),
                caller: v.caller,
                oldest: v.oldest,
                newest: v.newest,
            }
        }
        Kind::Other(incident) => SandboxError::NodeFailed {
            node: node.to_owned(),
            incident: bounded(incident),
            starting: false,
        },
    }
}

/// An incident id as the gateway keeps it: a node of an older version sent its error text in
/// its place; that text goes only to the gateway's log, cut to a line's worth.
fn bounded(mut incident: String) -> String {
    if incident.len() > 200 {
        let mut end = 200;
        while !incident.is_char_boundary(end) {
            end -= 1;
        }
        incident.truncate(end);
    }
    incident
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use sandgate_sandbox::ProfileError;
    use sandgate_sandbox::backend::BackendError;

    use super::*;

    const NODE: &str = "https://10.1.2.3:7443";

    /// Words of the node's own that must never reach a caller.
    const SECRETS: &[&str] = &[
        "os error",
        "/var/lib/docker",
        "10.9.8.7",
        "No such image",
        "sandgate-private:tag",
        NODE,
        "10.1.2.3",
    ];

    fn engine_error() -> BackendError {
        BackendError::Create {
            sandbox_id: "sbx_1".into(),
            source: "No such image: sandgate-private:tag (dial unix /var/lib/docker/x.sock: \
                     connect 10.9.8.7: os error 111)"
                .into(),
        }
    }

    /// The node's log lines while `f` runs on this thread.
    fn node_log<T>(f: impl FnOnce() -> T) -> (T, String) {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("log buffer").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let out = tracing::subscriber::with_default(subscriber, f);
        let log = String::from_utf8_lossy(&buffer.0.lock().expect("log buffer")).into_owned();
        (out, log)
    }

    fn assert_clean(text: &str, what: &str) {
        for secret in SECRETS {
            assert!(
                !text.contains(secret),
                "{what} shows the node's internals ({secret:?}): {text}"
            );
        }
    }

    #[test]
    fn a_full_start_queue_crosses_typed_with_how_long_it_waited() {
        let err = SandboxError::StartQueue {
            waited: Duration::from_secs(120),
        };
        let status = to_status(&err);
        assert_eq!(status.code(), Code::ResourceExhausted);
        match from_status("https://node-a:9443", &status) {
            SandboxError::StartQueue { waited } => assert_eq!(waited, Duration::from_secs(120)),
            other => panic!("a full start queue comes back as one, not {other:?}"),
        }
    }

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

    #[test]
    fn a_failed_start_crosses_as_an_incident_id_that_the_nodes_log_holds_with_the_chain() {
        let err = SandboxError::Launch(engine_error());
        let (status, log) = node_log(|| to_status(&err));
        let rebuilt = from_status(NODE, &status);
        let SandboxError::NodeFailed {
            incident,
            starting,
            node,
        } = &rebuilt
        else {
            panic!("expected a node failure, got {rebuilt:?}");
        };
        assert!(*starting, "it was a start");
        assert_eq!(node, NODE, "the gateway's log names the node");
        assert!(
            incident.len() == 12 && incident.chars().all(|c| c.is_ascii_hexdigit()),
            "a short incident id: {incident:?}"
        );
        // What crossed the RPC: the typed failure and the status's message.
        assert_clean(status.message(), "the status's message");
        assert_clean(&format!("{:?}", status.details()), "the status's details");
        // The node's log has the id beside the whole chain, for an operator to grep.
        let line = log
            .lines()
            .find(|l| l.contains(incident.as_str()))
            .unwrap_or_else(|| panic!("the node's log names incident {incident}: {log}"));
        assert!(
            line.contains("No such image: sandgate-private:tag") && line.contains("os error 111"),
            "the node's log line holds the chain: {line}"
        );
    }

    #[test]
    fn every_failure_the_node_logs_reaches_the_caller_without_its_words() {
        let errors = [
            SandboxError::Launch(engine_error()),
            SandboxError::AgentStart {
                sandbox_id: "sbx_2".into(),
                fate: ContainerFate::Exited { code: 1 },
                source: ChannelError::AttachLost {
                    reason: "read /var/lib/docker/containers/abc: os error 5".into(),
                },
            },
            SandboxError::InvalidProfile {
                name: "sandgate-private:tag".into(),
                reason: ProfileError::Cpus(1000.0),
            },
            SandboxError::NodeFailed {
                node: NODE.into(),
                incident: "abc".into(),
                starting: false,
            },
        ];
        for err in errors {
            let (status, _) = node_log(|| to_status(&err));
            assert_clean(status.message(), "the status's message");
            let rebuilt = from_status("https://127.0.0.1:1", &status);
            let starting = matches!(
                err,
                SandboxError::Launch(_) | SandboxError::AgentStart { .. }
            );
            assert!(
                matches!(rebuilt, SandboxError::NodeFailed { starting: s, .. } if s == starting),
                "{err:?} came back as {rebuilt:?}"
            );
            let SandboxError::NodeFailed { incident, .. } = &rebuilt else {
                unreachable!()
            };
            assert_clean(incident, "the incident");
        }
    }

    #[test]
    fn what_the_model_reads_in_one_process_crosses_typed_and_reads_the_same() {
        let errors = [
            SandboxError::ConnectionLost {
                sandbox_id: "sbx_3".into(),
                reason: "the attach stream ended".into(),
            },
            SandboxError::Channel(ChannelError::ReadyTimeout {
                waited: Duration::from_secs(30),
            }),
            SandboxError::Channel(ChannelError::ProtocolVersion {
                found: 9,
                expected: 3,
            }),
            SandboxError::Channel(ChannelError::TransferCorrupted {
                path: "/home/user/a.csv".into(),
                detail: "received 3 bytes with sha256 x, the sandbox announced 4 bytes".into(),
            }),
            SandboxError::Channel(ChannelError::Protocol {
                detail: "chunk without data".into(),
            }),
            SandboxError::Channel(ChannelError::KernelRestarted),
            SandboxError::Died {
                sandbox_id: "sbx_4".into(),
                fate: ContainerFate::OomKilled {
                    memory_limit_bytes: Some(512 << 20),
                },
            },
            SandboxError::UnknownProfile("gpu".into()),
        ];
        for err in errors {
            let rebuilt = from_status(NODE, &to_status(&err));
            assert_eq!(
                rebuilt.to_string(),
                err.to_string(),
                "{err:?} reads the same after the RPC"
            );
            assert_eq!(
                std::mem::discriminant(&rebuilt),
                std::mem::discriminant(&err),
                "{err:?} is the same variant after the RPC (so the gateway maps it the same)"
            );
        }
    }

    #[test]
    fn a_node_that_did_not_answer_is_named_without_its_address_or_the_transports_words() {
        let status = Status::unavailable(
            "error trying to connect: tcp connect error: Connection refused (os error 111) \
             to 10.1.2.3:7443",
        );
        match from_status(NODE, &status) {
            SandboxError::Channel(ChannelError::AttachLost { reason }) => {
                assert_eq!(
                    reason,
                    "the sandbox node did not answer: it could not be reached"
                );
                assert_clean(&reason, "the reason");
            }
            other => panic!("expected a lost connection, got {other:?}"),
        }
    }

    #[test]
    fn an_older_nodes_error_text_in_place_of_an_incident_stays_in_the_gateways_log() {
        let failure = proto::Failure {
            kind: Some(Kind::Launch(format!(
                "starting failed: {}",
                "x".repeat(5000)
            ))),
        };
        let status = Status::with_details(
            Code::Unavailable,
            "starting a sandbox failed",
            failure.encode_to_vec().into(),
        );
        match from_status(NODE, &status) {
            SandboxError::NodeFailed {
                incident, starting, ..
            } => {
                assert!(starting);
                assert!(incident.len() <= 200, "bounded: {}", incident.len());
            }
            other => panic!("expected a node failure, got {other:?}"),
        }
    }

    #[test]
    fn a_refused_sealed_stream_crosses_typed_and_a_node_side_seal_failure_as_an_incident() {
        let refusals = [
            SealError::Unauthentic { chunk: 3 },
            SealError::Truncated { chunks: 7 },
            SealError::Binding {
                expected: "snap_a".into(),
                found: "snap_b".into(),
            },
            SealError::Format("chunks of 12 bytes".into()),
            SealError::Archive("an entry of type Symlink".into()),
        ];
        for refusal in refusals {
            let shown = refusal.to_string();
            let err = SandboxError::Seal {
                snapshot_id: "snap_1".into(),
                source: Box::new(refusal),
            };
            match from_status(NODE, &to_status(&err)) {
                SandboxError::Seal {
                    snapshot_id,
                    source,
                } => {
                    assert_eq!(snapshot_id, "snap_1");
                    assert_eq!(source.to_string(), shown, "the same refusal comes back");
                }
                other => panic!("a refused stream comes back as one, not {other:?}"),
            }
        }
        let local = SandboxError::Seal {
            snapshot_id: "snap_1".into(),
            source: Box::new(SealError::NotTmpfs {
                path: "/var/lib/docker/plain".into(),
                fs_type: "ext4".into(),
            }),
        };
        let (status, _) = node_log(|| to_status(&local));
        assert_clean(status.message(), "a node-side seal failure");
        assert!(
            matches!(from_status(NODE, &status), SandboxError::NodeFailed { .. }),
            "the node's own failure crosses as an incident"
        );
    }
}
