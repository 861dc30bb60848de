//! What a tool call comes to before it is answered: its result, or why there is none. Every
//! tool's module produces these; `errors` turns them into the answer and the audit record.

use rmcp::model::CallToolResult;
use sandgate_service::{ServiceError, Target};

/// A tool's answer plus what the audit trail needs.
pub(crate) struct Answer {
    /// The result for the client.
    pub(crate) result: CallToolResult,
    /// The sandbox the call reached, for the audit trail.
    pub(crate) sandbox_id: Option<String>,
}

impl Answer {
    /// The answer of a call that reached `sandbox_id`.
    pub(crate) fn new(sandbox_id: &str, result: CallToolResult) -> Self {
        Self {
            result,
            sandbox_id: Some(sandbox_id.to_owned()),
        }
    }
}

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

/// The target of a call that named `sandbox_id` and `keep_alive` in its arguments.
pub(crate) fn target<'a>(
    sandbox_id: &'a Option<String>,
    conversation: Option<&'a str>,
    keep_alive: Option<u32>,
) -> Target<'a> {
    Target {
        sandbox_id: sandbox_id.as_deref(),
        conversation,
        keep_alive,
    }
}
