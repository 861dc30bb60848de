//! The mapping from failures of download links to HTTP answers (plain text for a person).
//! Internal detail is logged, never sent. Refusals on `/mcp` are `sandgate_mcp::refusal`'s.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sandgate_sandbox::{ChannelError, SandboxError};
use sandgate_service::ServiceError;

/// Why a download link gives no file.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The link was not minted by us (or was altered).
    #[error("invalid link")]
    InvalidLink,
    /// The link's time is up.
    #[error("expired link")]
    Expired,
    /// The app connection (grant) that made the link was disconnected.
    #[error("revoked link")]
    Revoked,
    /// The transcript the link names is no longer kept (past its retention, or purged).
    #[error("transcript no longer kept")]
    TranscriptGone,
    /// The link, or its tenant's links together, were opened too often.
    #[error("link opened too often")]
    RateLimited {
        /// Which limit.
        limit: sandgate_service::links::LinkLimit,
        /// When a retry may succeed.
        retry_after: std::time::Duration,
    },
    /// The service could not serve the file.
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl DownloadError {
    /// The audited outcome: `refused` when the link may not be opened (now), `failed` when
    /// serving it went wrong.
    pub fn outcome(&self) -> &'static str {
        if self.answer().0.is_server_error() {
            "failed"
        } else {
            "refused"
        }
    }

    /// The audited reason, a short word.
    pub fn reason(&self) -> &'static str {
        match self {
            DownloadError::InvalidLink => "invalid",
            DownloadError::Expired => "expired",
            DownloadError::Revoked => "revoked",
            DownloadError::TranscriptGone => "transcript_gone",
            DownloadError::RateLimited { .. } => "rate_limited",
            DownloadError::Service(err) => match err {
                ServiceError::NotFound(_)
                | ServiceError::Ended { .. }
                | ServiceError::Lost { .. } => "sandbox_gone",
                ServiceError::Unavailable(_)
                | ServiceError::DatabaseAway
                | ServiceError::NodeAway { .. } => "unavailable",
                ServiceError::Limit { .. } | ServiceError::Quota { .. } => "limit",
                ServiceError::Sandbox(SandboxError::Channel(ChannelError::Agent(_))) => "file_gone",
                ServiceError::Store(_) | ServiceError::Sandbox(_) => "internal",
            },
        }
    }

    /// The status and the text a person sees: the one exhaustive mapping.
    fn answer(&self) -> (StatusCode, &'static str) {
        const GONE: &str = "The sandbox this file was in has ended, so the file is gone.";
        const AWAY: &str = "Temporarily unavailable; retry in a moment.";
        const FAILED: &str = "The file could not be read; retry in a moment.";
        match self {
            DownloadError::InvalidLink => {
                (StatusCode::NOT_FOUND, "This download link is not valid.")
            }
            DownloadError::Expired => (
                StatusCode::GONE,
                "This download link has expired; ask for the file again.",
            ),
            DownloadError::Revoked => (
                StatusCode::GONE,
                "The app connection that made this link was disconnected, so the link no longer works.",
            ),
            DownloadError::TranscriptGone => (
                StatusCode::GONE,
                "This transcript is no longer kept (it was deleted after its retention period).",
            ),
            DownloadError::RateLimited {
                limit: sandgate_service::links::LinkLimit::PerLink,
                ..
            } => (
                StatusCode::TOO_MANY_REQUESTS,
                "This download link was opened too often; retry after the time in Retry-After.",
            ),
            DownloadError::RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "Too many downloads for this account; retry after the time in Retry-After.",
            ),
            DownloadError::Service(err) => match err {
                // Another tenant's sandbox answers like a missing one: both are gone for the link.
                ServiceError::NotFound(_)
                | ServiceError::Ended { .. }
                | ServiceError::Lost { .. } => (StatusCode::GONE, GONE),
                ServiceError::Unavailable(_)
                | ServiceError::DatabaseAway
                | ServiceError::NodeAway { .. } => (StatusCode::SERVICE_UNAVAILABLE, AWAY),
                ServiceError::Limit { .. } | ServiceError::Quota { .. } => {
                    (StatusCode::TOO_MANY_REQUESTS, AWAY)
                }
                // The agent refused: the file was moved, removed or grew past the limit.
                ServiceError::Sandbox(SandboxError::Channel(ChannelError::Agent(_))) => {
                    (StatusCode::NOT_FOUND, "The file is no longer there.")
                }
                ServiceError::Store(_) | ServiceError::Sandbox(_) => {
                    (StatusCode::INTERNAL_SERVER_ERROR, FAILED)
                }
            },
        }
    }
}

impl IntoResponse for DownloadError {
    fn into_response(self) -> Response {
        let (status, message) = self.answer();
        if status.is_server_error() {
            tracing::error!(error = ?self, "serving a download link failed");
        }
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("{message}\n"),
        )
            .into_response();
        if let DownloadError::RateLimited { retry_after, .. } = self {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(sandgate_service::links::retry_after_seconds(retry_after)),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_database_outage_is_not_a_gone_sandbox() {
        let away = DownloadError::Service(ServiceError::DatabaseAway);
        assert_eq!(away.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        let gone = DownloadError::Service(ServiceError::NotFound("sbx_x".into()));
        assert_eq!(gone.answer().0, StatusCode::GONE);
    }
}
