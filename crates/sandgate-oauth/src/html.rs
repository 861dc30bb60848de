//! Server-rendered pages: one small layout readable on a phone (maud templates, which escape
//! every interpolated value), and the headers every OAuth response carries (tower-http layers:
//! no framing, since clickjacking is the classic attack on consent screens; no sniffing; no
//! referrer; no caching).

use axum::Router;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use maud::{DOCTYPE, Markup, PreEscaped, html};
use tower_http::set_header::SetResponseHeaderLayer;

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

/// A page: the layout around `body`.
pub fn page(status: StatusCode, title: &str, body: Markup) -> Response {
    let document = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                main {
                    div.brand { "sandgate" }
                    div.card { (body) }
                }
            }
        }
    };
    (status, document).into_response()
}

/// An error page (never a redirect: used when the client or redirect URI cannot be trusted).
pub fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    page(
        status,
        title,
        html! {
            h1 { (title) }
            p.error role="alert" { (message) }
        },
    )
}

/// A hidden form field.
pub fn hidden(name: &str, value: &str) -> Markup {
    html! { input type="hidden" name=(name) value=(value); }
}

/// A 303 See Other to `location` (after a POST, or to move the browser along).
pub fn see_other(location: &str) -> Response {
    let mut response = StatusCode::SEE_OTHER.into_response();
    if let Ok(value) = HeaderValue::from_str(location) {
        response.headers_mut().insert(header::LOCATION, value);
    }
    response
}

/// `router` with the headers every OAuth page, redirect and JSON answer carries (tower-http
/// layers).
pub fn with_security_headers<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    with_security_headers_and_csp(router, HeaderValue::from_static(CSP))
}

/// [`with_security_headers`] with another Content-Security-Policy (the console's, which
/// allows its one hashed script and `data:` images).
pub fn with_security_headers_and_csp<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    csp: HeaderValue,
) -> Router<S> {
    let set = |name: HeaderName, value: &'static str| {
        SetResponseHeaderLayer::overriding(name, HeaderValue::from_static(value))
    };
    router
        .layer(set(header::X_FRAME_OPTIONS, "DENY"))
        .layer(SetResponseHeaderLayer::overriding(
            header::CONTENT_SECURITY_POLICY,
            csp,
        ))
        // The metadata and JWKS say how long they may be cached; everything else: never.
        .layer(SetResponseHeaderLayer::if_not_present(
            header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        ))
        .layer(set(header::REFERRER_POLICY, "no-referrer"))
        .layer(set(header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
        .layer(set(
            HeaderName::from_static("cross-origin-opener-policy"),
            "same-origin",
        ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolated_values_are_escaped() {
        let markup = html! { p { (r#"<script>"x"&'y'</script>"#) } (hidden("next", r#""><b>"#)) };
        let text = markup.into_string();
        assert!(!text.contains("<script>"), "{text}");
        assert!(text.contains("&lt;script&gt;"), "{text}");
        assert!(text.contains(r#"value="&quot;&gt;&lt;b&gt;""#), "{text}");
    }
}
