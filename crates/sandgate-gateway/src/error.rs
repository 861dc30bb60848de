//! The mapping from failures of download links to HTTP answers (plain text for a person).
//! Internal detail is logged, never sent. Refusals on `/mcp` are `sandgate_mcp::refusal`'s.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sandgate_service::{ErrorKind, ServiceError};

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
    /// The status, the text a person sees and the audited reason: the one exhaustive mapping.
    fn answer(&self) -> (StatusCode, &'static str, &'static str) {
        match self {
            DownloadError::InvalidLink => (
                StatusCode::NOT_FOUND,
                "This download link is not valid.",
                "invalid",
            ),
            DownloadError::Expired => (
                StatusCode::GONE,
                "This download link has expired; ask for the file again.",
                "expired",
            ),
            DownloadError::Revoked => (
                StatusCode::GONE,
                "The app connection that made this link was disconnected, so the link no longer works.",
                "revoked",
            ),
            DownloadError::TranscriptGone => (
                StatusCode::GONE,
                "This transcript is no longer kept (it was deleted after its retention period).",
                "transcript_gone",
            ),
            DownloadError::RateLimited {
                limit: sandgate_service::links::LinkLimit::PerLink,
                ..
            } => (
                StatusCode::TOO_MANY_REQUESTS,
                "This download link was opened too often; retry after the time in Retry-After.",
                "rate_limited",
            ),
            DownloadError::RateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "Too many downloads for this account; retry after the time in Retry-After.",
                "rate_limited",
            ),
            DownloadError::Service(err) => service_answer(err.kind()),
        }
    }
}

/// A service failure's status, text and audited reason, by the catalogue's kind.
fn service_answer(kind: ErrorKind) -> (StatusCode, &'static str, &'static str) {
    const GONE: &str = "The sandbox this file was in has ended, so the file is gone.";
    const AWAY: &str = "Temporarily unavailable; retry in a moment.";
    const FAILED: &str = "The file could not be read; retry in a moment.";
    match kind {
        // Another tenant's sandbox answers like a missing one: both are gone for the link.
        ErrorKind::NotFound | ErrorKind::Ended | ErrorKind::Lost => {
            (StatusCode::GONE, GONE, "sandbox_gone")
        }
        ErrorKind::Unavailable | ErrorKind::NodeAway => {
            (StatusCode::SERVICE_UNAVAILABLE, AWAY, "unavailable")
        }
        ErrorKind::QuotaExceeded | ErrorKind::Capacity => {
            (StatusCode::TOO_MANY_REQUESTS, AWAY, "limit")
        }
        // The agent refused: the file was moved or removed, or grew past the size limit (the
        // only limit a link's read meets).
        ErrorKind::BadPath | ErrorKind::SandboxRefused | ErrorKind::Limit => (
            StatusCode::NOT_FOUND,
            "The file is no longer there.",
            "file_gone",
        ),
        ErrorKind::Internal
        | ErrorKind::SandboxFailed
        | ErrorKind::Timeout
        | ErrorKind::ConnectionLost
        | ErrorKind::InvalidParams
        | ErrorKind::NoSuchJob
        | ErrorKind::CommandFailed => (StatusCode::INTERNAL_SERVER_ERROR, FAILED, "internal"),
    }
}

impl IntoResponse for DownloadError {
    fn into_response(self) -> Response {
        let (status, message, _) = self.answer();
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
