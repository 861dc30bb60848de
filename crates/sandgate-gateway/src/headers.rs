//! Headers every download carries (files and transcripts alike).

use axum::http::{HeaderMap, HeaderValue, header};

/// The content came from untrusted code, so a browser must never sniff it into something
/// runnable, and no shared cache may keep it.
pub fn untrusted(headers: &mut HeaderMap) {
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("private, no-store"),
    );
}
