//! The one catalogue of error kinds: what a face tells apart about a failed call, and what an
//! integrator branches on (the README's table lists the same kinds). Each face maps the kinds
//! exhaustively, once: MCP tool answers and JSON-RPC errors, HTTP statuses.

use sandgate_sandbox::{AgentError, ChannelError, SandboxError};

use super::ServiceError;

/// Why a call failed, machine-readable: the `error` of a tool answer's structured content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The call's arguments were malformed (a JSON-RPC invalid-params error, not a tool answer).
    InvalidParams,
    /// No such sandbox for this tenant (another tenant's answers the same).
    NotFound,
    /// The sandbox ended: closed, expired idle or at its lifetime, or its app was disconnected.
    Ended,
    /// The sandbox's container died or vanished; its files and variables are gone.
    Lost,
    /// The node that runs the sandbox did not answer; retrying shortly may work.
    NodeAway,
    /// The connection to a sandbox that still runs dropped mid-call; the outcome is unknown,
    /// the sandbox is intact: retry.
    ConnectionLost,
    /// A limit refused the call (sandboxes per tenant, file size, idle timeout, jobs, an
    /// answer too large); retrying the same call does not help.
    Limit,
    /// The sandbox node is busy starting other sandboxes, or a shared bound (transcript loads,
    /// bytes in flight on a node) is reached for the moment; retry after `retry_after_seconds`.
    Capacity,
    /// A call quota (calls per minute, in flight, per sandbox) refused the call; retry after
    /// `retry_after_seconds`.
    QuotaExceeded,
    /// sandgate's database is temporarily unavailable; retry shortly.
    Unavailable,
    /// An internal error; retry, and report it if it persists.
    Internal,
    /// The path names no usable file or directory: outside /home/user, missing, a directory
    /// where a file was expected (or the reverse), or a file that exists without overwrite.
    BadPath,
    /// No background job by that id in the sandbox.
    NoSuchJob,
    /// The sandbox refused the operation for another reason (a bad argument, a full disk, a
    /// permission).
    SandboxRefused,
    /// The sandbox failed the operation (starting it, talking to its agent); retrying may work.
    SandboxFailed,
    /// The sandbox did not answer in time, or the command hit its timeout and was killed.
    Timeout,
    /// The user's command ran and exited with a non-zero status (or was killed by a signal).
    CommandFailed,
}

impl ErrorKind {
    /// Every kind, in the order the README's catalogue lists them.
    pub const ALL: [ErrorKind; 17] = [
        ErrorKind::InvalidParams,
        ErrorKind::NotFound,
        ErrorKind::Ended,
        ErrorKind::Lost,
        ErrorKind::NodeAway,
        ErrorKind::ConnectionLost,
        ErrorKind::Limit,
        ErrorKind::Capacity,
        ErrorKind::QuotaExceeded,
        ErrorKind::Unavailable,
        ErrorKind::Internal,
        ErrorKind::BadPath,
        ErrorKind::NoSuchJob,
        ErrorKind::SandboxRefused,
        ErrorKind::SandboxFailed,
        ErrorKind::Timeout,
        ErrorKind::CommandFailed,
    ];

    /// The kind's wire name (snake case), as structured content and the README spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::InvalidParams => "invalid_params",
            ErrorKind::NotFound => "not_found",
            ErrorKind::Ended => "ended",
            ErrorKind::Lost => "lost",
            ErrorKind::NodeAway => "node_away",
            ErrorKind::ConnectionLost => "connection_lost",
            ErrorKind::Limit => "limit",
            ErrorKind::Capacity => "capacity",
            ErrorKind::QuotaExceeded => "quota_exceeded",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Internal => "internal",
            ErrorKind::BadPath => "bad_path",
            ErrorKind::NoSuchJob => "no_such_job",
            ErrorKind::SandboxRefused => "sandbox_refused",
            ErrorKind::SandboxFailed => "sandbox_failed",
            ErrorKind::Timeout => "timeout",
            ErrorKind::CommandFailed => "command_failed",
        }
    }

    /// Whether the same call, made again unchanged (after `retry_after_seconds` when given),
    /// may succeed.
    pub fn retryable(self) -> bool {
        match self {
            ErrorKind::NodeAway
            | ErrorKind::ConnectionLost
            | ErrorKind::Capacity
            | ErrorKind::QuotaExceeded
            | ErrorKind::Unavailable
            | ErrorKind::Internal
            | ErrorKind::SandboxFailed => true,
            ErrorKind::InvalidParams
            | ErrorKind::NotFound
            | ErrorKind::Ended
            | ErrorKind::Lost
            | ErrorKind::Limit
            | ErrorKind::BadPath
            | ErrorKind::NoSuchJob
            | ErrorKind::SandboxRefused
            | ErrorKind::Timeout
            | ErrorKind::CommandFailed => false,
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// How long a full start queue asks callers to wait ("retry in a minute").
const START_QUEUE_RETRY_SECONDS: u32 = 60;

impl ServiceError {
    /// The error's kind in the catalogue: the one classification every face maps.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ServiceError::NotFound(_) => ErrorKind::NotFound,
            ServiceError::Ended { .. } => ErrorKind::Ended,
            ServiceError::Lost { .. } => ErrorKind::Lost,
            ServiceError::NodeAway { .. } => ErrorKind::NodeAway,
            ServiceError::Limit { .. } => ErrorKind::Limit,
            ServiceError::Quota { .. } => ErrorKind::QuotaExceeded,
            ServiceError::StartQueue { .. } | ServiceError::Busy { .. } => ErrorKind::Capacity,
            ServiceError::NoSuchJob { .. } => ErrorKind::NoSuchJob,
            ServiceError::Refused(refusal) => refusal_kind(refusal),
            ServiceError::Unresponsive(_) => ErrorKind::Timeout,
            ServiceError::ConnectionLost(_) => ErrorKind::ConnectionLost,
            ServiceError::Unavailable(_) | ServiceError::DatabaseAway => ErrorKind::Unavailable,
            ServiceError::Store(_) => ErrorKind::Internal,
            ServiceError::Sandbox(err) => sandbox_kind(err),
        }
    }

    /// Whether the same call may succeed when made again (see [`ErrorKind::retryable`]).
    pub fn retryable(&self) -> bool {
        self.kind().retryable()
    }

    /// When a retry may succeed, seconds, where that is known.
    pub fn retry_after_seconds(&self) -> Option<u32> {
        match self {
            ServiceError::Quota {
                retry_after_seconds,
                ..
            } => Some(*retry_after_seconds),
            ServiceError::StartQueue { .. } => Some(START_QUEUE_RETRY_SECONDS),
            ServiceError::Busy {
                retry_after_seconds,
                ..
            } => Some(*retry_after_seconds),
            _ => None,
        }
    }

    /// The text a client (the model, a person) may read: specific, with what to do next, and
    /// never internals (a face logs those with the whole cause chain).
    pub fn public_message(&self) -> String {
        match self {
            ServiceError::Store(_) => {
                "sandgate hit an internal error; retry the call, and if it persists, tell the user"
                    .into()
            }
            ServiceError::Sandbox(inner) => sandbox_message(inner),
            ServiceError::NotFound(_)
            | ServiceError::Ended { .. }
            | ServiceError::Lost { .. }
            | ServiceError::NodeAway { .. }
            | ServiceError::Limit { .. }
            | ServiceError::Quota { .. }
            | ServiceError::StartQueue { .. }
            | ServiceError::Busy { .. }
            | ServiceError::NoSuchJob { .. }
            | ServiceError::Refused(_)
            | ServiceError::Unresponsive(_)
            | ServiceError::ConnectionLost(_)
            | ServiceError::Unavailable(_)
            | ServiceError::DatabaseAway => self.to_string(),
        }
    }
}

fn refusal_kind(refusal: &AgentError) -> ErrorKind {
    match refusal {
        AgentError::OutsideHome { .. }
        | AgentError::NotFound { .. }
        | AgentError::Exists { .. }
        | AgentError::IsDirectory { .. }
        | AgentError::NotADirectory { .. } => ErrorKind::BadPath,
        AgentError::TooLarge { .. } | AgentError::Limit { .. } => ErrorKind::Limit,
        AgentError::BadRequest { .. } | AgentError::Io { .. } => ErrorKind::SandboxRefused,
        AgentError::Internal { .. } => ErrorKind::SandboxFailed,
    }
}

fn sandbox_kind(err: &SandboxError) -> ErrorKind {
    match err {
        SandboxError::Died { .. } => ErrorKind::Lost,
        SandboxError::ConnectionLost { .. } => ErrorKind::ConnectionLost,
        SandboxError::StartQueue { .. } | SandboxError::NodeBusy { .. } => ErrorKind::Capacity,
        SandboxError::Channel(ChannelError::Agent(refusal)) => refusal_kind(refusal),
        SandboxError::Channel(ChannelError::Unresponsive { .. }) => ErrorKind::Timeout,
        SandboxError::Channel(ChannelError::FrameTooLarge { .. }) => ErrorKind::Limit,
        SandboxError::Channel(
            ChannelError::AttachLost { .. }
            | ChannelError::ReadyTimeout { .. }
            | ChannelError::ProtocolVersion { .. }
            | ChannelError::KernelRestarted
            | ChannelError::TransferCorrupted { .. }
            | ChannelError::Protocol { .. },
        )
        | SandboxError::Launch(_)
        | SandboxError::AgentStart { .. }
        | SandboxError::UnknownProfile(_)
        | SandboxError::InvalidProfile { .. }
        | SandboxError::NotOurs { .. }
        | SandboxError::Backend(_)
        // Snapshots (issue 26) are not offered to the model yet; their words are the node's.
        | SandboxError::SnapshotsUnavailable { .. }
        | SandboxError::Checkpoint { .. }
        | SandboxError::Restore { .. }
        | SandboxError::RestoredAgent { .. }
        | SandboxError::Seal { .. }
        | SandboxError::Checkpointed { .. }
        | SandboxError::NodeFailed { .. }
        | SandboxError::VersionSkew { .. }
        | SandboxError::OlderNode { .. } => ErrorKind::SandboxFailed,
    }
}

/// What the model reads about a failure of the sandbox manager.
fn sandbox_message(inner: &SandboxError) -> String {
    match inner {
        SandboxError::Channel(ch) => ch.to_string(),
        SandboxError::Died { .. } | SandboxError::ConnectionLost { .. } => inner.to_string(),
        // A node in another process reads the same as this process's own engine: the node
        // logged the reason under an incident id, which the gateway's log names.
        SandboxError::Launch(_)
        | SandboxError::AgentStart { .. }
        | SandboxError::NodeFailed { starting: true, .. } => {
            "starting a sandbox failed; retry in a few seconds".into()
        }
        // Mapped to its own variant by `From`; a stray one still reads as what it is.
        SandboxError::StartQueue { .. } | SandboxError::NodeBusy { .. } => inner.to_string(),
        SandboxError::UnknownProfile(_)
        | SandboxError::InvalidProfile { .. }
        | SandboxError::NotOurs { .. }
        | SandboxError::Backend(_)
        // Snapshots (issue 26) are not offered to the model yet; their words are the node's.
        | SandboxError::SnapshotsUnavailable { .. }
        | SandboxError::Checkpoint { .. }
        | SandboxError::Restore { .. }
        | SandboxError::RestoredAgent { .. }
        | SandboxError::Seal { .. }
        | SandboxError::Checkpointed { .. }
        | SandboxError::NodeFailed {
            starting: false, ..
        } => "the sandbox could not do that; retry, or call create_sandbox for a fresh one".into(),
        // The operator's to fix (an upgrade out of order); the gateway's log has both versions.
        SandboxError::VersionSkew { .. } | SandboxError::OlderNode { .. } => {
            "the sandbox node cannot serve this call until the operator finishes an upgrade; \
             retry later"
                .into()
        }
    }
}

#[cfg(test)]
mod tests {
    use sandgate_sandbox::ProfileError;
    use sandgate_sandbox::backend::BackendError;

    use super::*;

    fn text(err: SandboxError) -> String {
        ServiceError::Sandbox(err).public_message()
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

    #[test]
    fn agent_refusals_are_classified_by_what_the_caller_fixes() {
        let refused =
            |err: AgentError| ServiceError::from(SandboxError::from(ChannelError::from(err)));
        let outside = refused(AgentError::OutsideHome {
            message: "/etc/passwd is outside /home/user".into(),
        });
        assert_eq!(outside.kind(), ErrorKind::BadPath);
        assert!(!outside.retryable());
        assert_eq!(
            outside.public_message(),
            "/etc/passwd is outside /home/user; files are confined to /home/user"
        );
        let full = refused(AgentError::Io {
            message: "No space left on device".into(),
        });
        assert_eq!(full.kind(), ErrorKind::SandboxRefused);
        let big = refused(AgentError::Limit {
            message: "too many jobs".into(),
        });
        assert_eq!(big.kind(), ErrorKind::Limit);
    }

    #[test]
    fn wire_names_are_unique_snake_case() {
        let names: std::collections::HashSet<_> =
            ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), ErrorKind::ALL.len());
        assert!(
            names
                .iter()
                .all(|n| n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        );
    }
}
