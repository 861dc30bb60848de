//! The mapping from failures of download links to HTTP answers (plain text for a person).
//! Internal detail is logged, never sent. Refusals on `/mcp` are `sandgate_mcp::refusal`'s.
//!
//! The service classifies why a link gave nothing ([`LinkError::reason`], the reason its audit
//! row records); this module only says it in HTTP.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sandgate_service::links::{DownloadReason, LinkError, LinkLimit, retry_after_seconds};

/// Why a download link gives no file: the service's answer, as an HTTP response.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct DownloadError(#[from] pub LinkError);

impl DownloadError {
    /// The status and the text a person sees: the one exhaustive mapping.
    fn answer(&self) -> (StatusCode, &'static str) {
        const AWAY: &str = "Temporarily unavailable; retry in a moment.";
        match self.0.reason() {
            DownloadReason::Invalid => (StatusCode::NOT_FOUND, "This download link is not valid."),
            DownloadReason::Expired => (
                StatusCode::GONE,
                "This download link has expired; ask for the file again.",
            ),
            DownloadReason::Revoked => (
                StatusCode::GONE,
                "The app connection that made this link was disconnected, so the link no longer works.",
            ),
            DownloadReason::TranscriptGone => (
                StatusCode::GONE,
                "This transcript is no longer kept (it was deleted after its retention period).",
            ),
            DownloadReason::RateLimited => match self.0 {
                LinkError::RateLimited {
                    limit: LinkLimit::PerLink,
                    ..
                } => (
                    StatusCode::TOO_MANY_REQUESTS,
                    "This download link was opened too often; retry after the time in Retry-After.",
                ),
                _ => (
                    StatusCode::TOO_MANY_REQUESTS,
                    "Too many downloads for this account; retry after the time in Retry-After.",
                ),
            },
            // Another tenant's sandbox answers like a missing one: both are gone for the link.
            DownloadReason::SandboxGone => (
                StatusCode::GONE,
                "The sandbox this file was in has ended, so the file is gone.",
            ),
            DownloadReason::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, AWAY),
            DownloadReason::Limit => (StatusCode::TOO_MANY_REQUESTS, AWAY),
            DownloadReason::FileGone => (StatusCode::NOT_FOUND, "The file is no longer there."),
            DownloadReason::Sandbox | DownloadReason::Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "The file could not be read; retry in a moment.",
            ),
        }
    }
}

impl IntoResponse for DownloadError {
    fn into_response(self) -> Response {
        let (status, message) = self.answer();
        if status.is_server_error() {
            tracing::error!(error = ?self.0, "serving a download link failed");
        }
        let mut response = (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            format!("{message}\n"),
        )
            .into_response();
        if let LinkError::RateLimited { retry_after, .. } = self.0 {
            response.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_seconds(retry_after)),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use sandgate_service::ServiceError;

    use super::*;

    #[test]
    fn a_database_outage_is_not_a_gone_sandbox() {
        let away = DownloadError(LinkError::Service(ServiceError::DatabaseAway));
        assert_eq!(away.answer().0, StatusCode::SERVICE_UNAVAILABLE);
        let gone = DownloadError(LinkError::Service(ServiceError::NotFound("sbx_x".into())));
        assert_eq!(gone.answer().0, StatusCode::GONE);
    }
}
