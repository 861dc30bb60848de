//! Server-rendered pages: one small layout readable on a phone, HTML escaping, and the headers
//! every page carries (no framing: clickjacking is the classic attack on consent screens).

use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};

/// Escapes text for HTML element content and double-quoted attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// The Content-Security-Policy of every page: nothing loads from anywhere, inline styles only,
/// and no one may frame the page.
pub const CSP: &str =
    "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'; base-uri 'none'";

const STYLE: &str = "
*{box-sizing:border-box}
body{margin:0;font:16px/1.5 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;background:#f4f5f7;color:#1d2330}
main{max-width:440px;margin:0 auto;padding:24px 16px}
.card{background:#fff;border-radius:12px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:24px}
h1{font-size:1.3rem;margin:0 0 12px}
strong,h1{overflow-wrap:anywhere}
p{margin:8px 0}
.muted{color:#5b6475;font-size:.92rem}
.brand{font-weight:600;color:#3b4bd8;margin-bottom:16px}
ul.scopes{padding:0;list-style:none;margin:12px 0}
ul.scopes li{padding:10px 12px;border:1px solid #e1e4ea;border-radius:8px;margin:6px 0}
ul.scopes code{font-size:.8rem;color:#5b6475}
label{display:block;font-weight:600;margin:12px 0 4px}
input[type=email],input[type=password]{width:100%;padding:12px;font-size:1rem;border:1px solid #c7ccd6;border-radius:8px}
.actions{display:flex;gap:12px;margin-top:20px}
button{flex:1;padding:12px;font-size:1rem;border-radius:8px;border:1px solid #c7ccd6;background:#fff;cursor:pointer}
button.primary{background:#3b4bd8;border-color:#3b4bd8;color:#fff}
.error{background:#fdecec;color:#8a1c1c;border-radius:8px;padding:10px 12px}
table{width:100%;border-collapse:collapse}
.app{border-top:1px solid #e1e4ea;padding:14px 0}
.app:first-of-type{border-top:0}
";

/// A page: the layout around `body`, with the anti-framing and no-store headers.
pub fn page(status: StatusCode, title: &str, body: &str) -> Response {
    let html = format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title}</title><style>{STYLE}</style></head>\
         <body><main><div class=\"brand\">sandgate</div><div class=\"card\">{body}</div></main></body></html>",
        title = escape(title),
    );
    let mut response = (status, Html(html)).into_response();
    protect(&mut response);
    response
}

/// An error page (never a redirect: used when the client or redirect URI cannot be trusted).
pub fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    page(
        status,
        title,
        &format!(
            "<h1>{}</h1><p class=\"error\">{}</p>",
            escape(title),
            escape(message)
        ),
    )
}

/// Adds the headers every OAuth page and redirect carries.
pub fn protect(response: &mut Response) {
    let headers = response.headers_mut();
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        HeaderName::from_static("cross-origin-opener-policy"),
        HeaderValue::from_static("same-origin"),
    );
}

/// A 303 See Other to `location` (after a POST, or to move the browser along).
pub fn see_other(location: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    if let Ok(value) = HeaderValue::from_str(location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    protect(&mut response);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_neutralises_markup() {
        assert_eq!(
            escape(r#"<script>"x"&'y'</script>"#),
            "&lt;script&gt;&quot;x&quot;&amp;&#39;y&#39;&lt;/script&gt;"
        );
    }
}
