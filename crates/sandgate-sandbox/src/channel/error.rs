//! Errors of the agent channel.

#[allow(clippy::wildcard_imports)] // the channel's modules share one set of imports
use super::*;

/// A failure reported by the agent for one request (PROTOCOL.md, error kinds). The messages are
/// meant for the end user (they reach the model as tool errors).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// The path resolves outside /home/user (`..`, an absolute path elsewhere, a symlink out).
    #[error("{message}; files are confined to /home/user")]
    OutsideHome {
        /// The agent's text.
        message: String,
    },
    /// The file or directory does not exist.
    #[error("{message}")]
    NotFound {
        /// The agent's text.
        message: String,
    },
    /// The file exists and overwriting was not asked for.
    #[error("{message}; pass overwrite to replace it")]
    Exists {
        /// The agent's text.
        message: String,
    },
    /// A directory was given where a file was expected.
    #[error("{message}")]
    IsDirectory {
        /// The agent's text.
        message: String,
    },
    /// A file was given where a directory was expected.
    #[error("{message}")]
    NotADirectory {
        /// The agent's text.
        message: String,
    },
    /// The file is larger than the caller's limit.
    #[error("{message}")]
    TooLarge {
        /// The file's size, when the agent's text names it.
        size: Option<u64>,
        /// The limit that was asked for.
        limit: u64,
        /// The agent's text.
        message: String,
    },
    /// The request was malformed (a NUL byte in a path, a bad argument).
    #[error("bad request: {message}")]
    BadRequest {
        /// The agent's text.
        message: String,
    },
    /// An I/O error inside the sandbox (disk full, permission denied …).
    #[error("{message}")]
    Io {
        /// The agent's text.
        message: String,
    },
    /// A limit of the sandbox was reached (e.g. too many background jobs).
    #[error("{message}")]
    Limit {
        /// The agent's text (names the limit and what to do).
        message: String,
    },
    /// A bug in the agent.
    #[error("the sandbox agent failed: {message}")]
    Internal {
        /// The agent's text.
        message: String,
    },
}

impl AgentError {
    pub(crate) fn from_wire(err: WireError, limit: u64) -> Self {
        let WireError { kind, message } = err;
        match kind.as_str() {
            "outside_home" => Self::OutsideHome { message },
            "not_found" => Self::NotFound { message },
            "exists" => Self::Exists { message },
            "is_directory" => Self::IsDirectory { message },
            "not_a_directory" => Self::NotADirectory { message },
            "too_large" => Self::TooLarge {
                size: size_in_message(&message),
                limit,
                message,
            },
            "bad_request" => Self::BadRequest { message },
            "io" => Self::Io { message },
            "limit" => Self::Limit { message },
            "internal" => Self::Internal { message },
            other => Self::Internal {
                message: format!("{other}: {message}"),
            },
        }
    }
}

/// The agent writes "<path> is N bytes, larger than the limit of M"; the size is the number before
/// the first " bytes".
pub(crate) fn size_in_message(message: &str) -> Option<u64> {
    let before = &message[..message.find(" bytes")?];
    let digits = before.rsplit(|c: char| !c.is_ascii_digit()).next()?;
    digits.parse().ok()
}

/// What went wrong talking to a sandbox's agent.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ChannelError {
    /// The attach stream ended or broke; every call in flight fails with this.
    #[error("the connection to the sandbox was lost: {reason}")]
    AttachLost {
        /// What the channel saw (stream ended, read or write error).
        reason: String,
    },
    /// The agent did not say ready in time.
    #[error("the sandbox's agent did not become ready within {}s", waited.as_secs())]
    ReadyTimeout {
        /// How long the channel waited.
        waited: Duration,
    },
    /// The agent speaks another protocol version.
    #[error("the sandbox's agent speaks protocol {found}; this gateway speaks {expected}")]
    ProtocolVersion {
        /// What the agent announced.
        found: u64,
        /// What this gateway speaks.
        expected: u64,
    },
    /// The kernel was restarted while this call was in flight.
    #[error(
        "the Python kernel was restarted before this call finished; variables defined earlier are gone (files in /home/user are kept)"
    )]
    KernelRestarted,
    /// The agent did not answer in time.
    #[error("the sandbox did not answer {op} within {}s", waited.as_secs())]
    Unresponsive {
        /// The operation.
        op: &'static str,
        /// How long the channel waited.
        waited: Duration,
    },
    /// The agent refused or failed the request.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The answer was larger than the gateway accepts and was dropped.
    #[error(
        "the answer was {len} bytes, more than the {limit} bytes the gateway accepts, and was dropped (kernel state is kept; e.g. assign a large value to a variable instead of displaying it)"
    )]
    FrameTooLarge {
        /// Bytes seen.
        len: usize,
        /// The gateway's limit.
        limit: usize,
    },
    /// A file arrived different from what the agent said it sent.
    #[error("the transfer of {path} was corrupted ({detail})")]
    TransferCorrupted {
        /// The file.
        path: String,
        /// What did not match.
        detail: String,
    },
    /// The agent sent something this gateway does not understand.
    #[error("the sandbox's agent sent an unexpected answer: {detail}")]
    Protocol {
        /// What was unexpected.
        detail: String,
    },
}
