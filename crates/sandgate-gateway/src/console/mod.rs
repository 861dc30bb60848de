//! The console (issue 28): where a tenant's signed-in users take over the bot's live sandbox.
//!
//! - [`pages`]: the tenant's conversations (searchable by id) and a conversation's page: a
//!   live notebook of its sandbox (every cell and command so far, the bot's and people's, each
//!   marked with who ran it; the files with download links; the forms to act).
//! - [`act`]: running a cell or command (output streamed as server-sent events), interrupting
//!   the sandbox's running calls (the bot's too), uploading a file, and confirming the
//!   password, which running code needs to have happened recently.
//!
//! Who may do what: every user of the tenant may read; only the `takeover` role (set with
//! `sandgate admin user role`) may act, and only within [`RECENT_SIGN_IN`] of proving their
//! password. Every action goes through the service's operations as the tools do (quotas, the
//! audit trail under `user:<email>`, transcript entries naming the person). Another tenant's
//! conversation, and one that does not exist, get the same missing-conversation page on every
//! URL.
//!
//! The pages carry the OAuth pages' headers, with a CSP that allows the one script by its hash
//! ([`csp`]), `data:` images, and nothing remote; rich HTML results render only in a
//! `sandbox=""` frame under that policy. Forms carry the session's CSRF token; actions also
//! refuse a cross-site `Origin` / `Sec-Fetch-Site`.
//!
//! - [`approvals`]: the hosts a sandbox asked for outside the tenant's egress policy, which a
//!   user with the `approver` role approves or denies for that sandbox (off unless the tenant's
//!   policy turns approvals on).
//! - [`takeover`]: "take over in a copy" (the sandbox forked into a conversation of its own,
//!   the bot's left alone), resuming a paused sandbox, and the console's file download (bound
//!   to the signed-in user's tenant, as every other console URL).

use std::sync::LazyLock;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use axum::routing::{get, post};
use base64::Engine;
use maud::{DOCTYPE, Markup, PreEscaped, html};
use sandgate_service::grants::Session;
use sha2::Digest;

use crate::AppState;
use crate::oauth::{html as oauth_html, session};

pub mod act;
pub mod approvals;
pub mod pages;
pub mod takeover;

/// The console's paths.
pub mod paths {
    /// The tenant's conversations (`?q=` searches their ids).
    pub const LIST: &str = crate::oauth::paths::CONSOLE;
    /// A conversation's page (`?id=`).
    pub const CONVERSATION: &str = "/console/conversation";
    /// Runs a cell or a command (POST form), answering with its output as it comes.
    pub const RUN: &str = "/console/run";
    /// Interrupts the running calls of a conversation's sandbox (POST form).
    pub const INTERRUPT: &str = "/console/interrupt";
    /// Uploads a file (POST body; `?conversation=&name=`).
    pub const UPLOAD: &str = "/console/upload";
    /// Confirms the password again (POST form).
    pub const CONFIRM: &str = "/console/confirm";
    /// Forks the conversation's sandbox into a copy of its own (POST form).
    pub const FORK: &str = "/console/fork";
    /// Resumes the conversation's paused sandbox (POST form).
    pub const RESUME: &str = "/console/resume";
    /// Downloads a file of the conversation's sandbox (`?conversation=&path=`).
    pub const FILE: &str = "/console/file";
    /// The tenant's requests for hosts outside its egress policy (`?id=` puts one on top).
    pub const EGRESS: &str = sandgate_service::egress::APPROVALS_PATH;
    /// Approves or denies one (POST form).
    pub const EGRESS_DECIDE: &str = "/console/egress/decide";
    /// Confirms the password again, back to the requests (POST form).
    pub const EGRESS_CONFIRM: &str = "/console/egress/confirm";
}

/// How long after proving their password a user may run code.
pub const RECENT_SIGN_IN: chrono::TimeDelta = chrono::TimeDelta::minutes(15);

/// The console's one script, inline in the conversation page.
pub const SCRIPT: &str = include_str!("console.js");

/// The console's Content-Security-Policy: its script by hash only, `data:` images, inline
/// styles, fetches to itself; nothing remote, no framing of it, forms to itself only. A
/// sandboxed `srcdoc` frame inherits it, so an HTML result can load nothing remote either.
pub fn csp() -> &'static str {
    static CSP: LazyLock<String> = LazyLock::new(|| {
        let hash = base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(SCRIPT));
        format!(
            "default-src 'none'; script-src 'sha256-{hash}'; img-src data:; \
             style-src 'unsafe-inline'; connect-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'"
        )
    });
    &CSP
}

/// Largest form the console accepts (a cell's source, mostly).
pub const MAX_FORM_BYTES: usize = 256 * 1024;

/// The console's routes, with the OAuth pages' headers and the console's CSP; an upload may be
/// as large as `max_upload_bytes` (the service's file limit), a form [`MAX_FORM_BYTES`].
pub fn routes(max_upload_bytes: usize) -> Router<AppState> {
    let forms = Router::new()
        .route(paths::LIST, get(pages::list))
        .route(paths::CONVERSATION, get(pages::conversation))
        .route(paths::RUN, post(act::run))
        .route(paths::INTERRUPT, post(act::interrupt))
        .route(paths::CONFIRM, post(act::confirm))
        .route(paths::FORK, post(takeover::fork))
        .route(paths::RESUME, post(takeover::resume))
        .route(paths::FILE, get(takeover::file))
        .route(paths::EGRESS, get(approvals::list))
        .route(paths::EGRESS_DECIDE, post(approvals::decide))
        .route(paths::EGRESS_CONFIRM, post(approvals::confirm))
        .layer(DefaultBodyLimit::max(MAX_FORM_BYTES));
    let uploads = Router::new()
        .route(paths::UPLOAD, post(act::upload))
        .layer(DefaultBodyLimit::max(max_upload_bytes));
    let routes = forms.merge(uploads);
    let csp = HeaderValue::from_str(csp()).expect("the CSP is ASCII");
    oauth_html::with_security_headers_and_csp(routes, csp)
}

const STYLE: &str = "
*{box-sizing:border-box}
body{margin:0;font:15px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;background:#f4f5f7;color:#1d2330}
main{max-width:62rem;margin:0 auto;padding:20px 16px}
.card{background:#fff;border-radius:10px;box-shadow:0 1px 3px rgba(0,0,0,.12);padding:20px;margin-bottom:16px}
h1{font-size:1.3rem;margin:0 0 10px}h2{font-size:1.05rem;margin:16px 0 8px}
.brand{font-weight:600;color:#3b4bd8;margin-bottom:12px}
.muted,.meta{color:#5b6475;font-size:.88rem}
table{width:100%;border-collapse:collapse}td,th{text-align:left;padding:6px;border-bottom:1px solid #e1e4ea;font-size:.9rem}
pre{white-space:pre-wrap;word-break:break-word;margin:.3rem 0;padding:.4rem;background:#f5f6fa;border-radius:4px}
pre.source{background:#eef3ff}pre.stderr,pre.error{background:#fff0f0}pre.html{background:#fffbe6}
.entry{margin:.8rem 0;border:1px solid #dde;border-radius:6px;padding:.4rem .7rem}
.entry[data-by]:not([data-by=bot]){border-left:4px solid #3b4bd8}
img{max-width:100%;border:1px solid #eee}iframe.html{width:100%;height:16rem;border:1px solid #dde;background:#fff}
.note{color:#955;font-style:italic}
.error{background:#fdecec;color:#8a1c1c;border-radius:8px;padding:10px 12px}
textarea,input[type=text],input[type=password],select{width:100%;padding:8px;font:14px ui-monospace,monospace;border:1px solid #c7ccd6;border-radius:6px}
button{padding:8px 14px;font-size:.95rem;border-radius:6px;border:1px solid #c7ccd6;background:#fff;cursor:pointer}
button.primary{background:#3b4bd8;border-color:#3b4bd8;color:#fff}
.actions{display:flex;gap:10px;margin-top:10px;align-items:center}
";

/// A console page: the layout around `body`, with the script when `script` (the conversation
/// page only).
pub fn page(status: StatusCode, title: &str, body: Markup, script: bool) -> Response {
    let document = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                meta name="referrer" content="no-referrer";
                title { (title) }
                style { (PreEscaped(STYLE)) }
            }
            body {
                main {
                    div.brand { "sandgate console" }
                    (body)
                }
                @if script { script { (PreEscaped(SCRIPT)) } }
            }
        }
    };
    axum::response::IntoResponse::into_response((status, document))
}

/// A console error page.
pub fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    page(
        status,
        title,
        html! {
            div.card {
                h1 { (title) }
                p.error role="alert" { (message) }
                p { a href=(paths::LIST) { "Back to the conversations" } }
            }
        },
        false,
    )
}

/// The page for a conversation that is not one of the tenant's (or does not exist): the same
/// answer either way.
pub fn missing_conversation() -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        "No such conversation",
        "No conversation with this id: nothing ran in it, it is not one of your tenant's, or it \
         was deleted after its retention period.",
    )
}

/// The page when Postgres or the sandbox failed.
pub fn unavailable() -> Response {
    error_page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Temporarily unavailable",
        "sandgate could not do this just now; please retry in a moment.",
    )
}

/// The signed-in user of a request, or the answer to give instead (a login redirect).
pub async fn signed_in(
    state: &AppState,
    headers: &HeaderMap,
    here: &str,
) -> Result<Session, Response> {
    match session::current(&state.oauth_app(), headers).await {
        Ok(Some(s)) => Ok(s),
        Ok(None) => Err(session::login_redirect(here)),
        Err(_) => Err(unavailable()),
    }
}

/// Whether a state-changing request came from our own pages: no cross-site `Sec-Fetch-Site`,
/// and an `Origin`, when sent, that is the public origin. (The CSRF token is checked too.)
pub fn same_origin(state: &AppState, headers: &HeaderMap) -> bool {
    from_our_pages(&state.config.public_url(), headers)
}

/// [`same_origin`] against the public URL `public`. Our pages send no referrer, and for a form
/// post from such a page a browser sends `Origin: null` (the Fetch standard's rule for the
/// `no-referrer` policy; Chromium does); that is taken as ours only where the browser's own
/// `Sec-Fetch-Site` (which no page can set) says `same-origin`.
fn from_our_pages(public: &str, headers: &HeaderMap) -> bool {
    let site = headers
        .get("sec-fetch-site")
        .map(|v| v.to_str().unwrap_or("unreadable"));
    let site_ok = site.is_none_or(|v| v == "same-origin" || v == "none");
    let origin_ok = headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("unreadable"))
        .is_none_or(|origin| {
            (origin == "null" && site == Some("same-origin"))
                || url::Url::parse(public)
                    .is_ok_and(|public| public.origin().ascii_serialization() == origin)
        });
    site_ok && origin_ok
}

/// Why the user may not act now (the role, then a recent sign-in); `None` when they may.
pub fn refusal_to_act(session: &Session) -> Option<Response> {
    if !session.role.may_act() {
        return Some(error_page(
            StatusCode::FORBIDDEN,
            "Read only",
            "Your account may read conversations but not run code in them; an operator can \
             give it the takeover role (sandgate admin user role --role takeover).",
        ));
    }
    if chrono::Utc::now() - session.authenticated_at > RECENT_SIGN_IN {
        return Some(error_page(
            StatusCode::FORBIDDEN,
            "Confirm your password",
            "Running code needs a recent sign-in: confirm your password on the conversation's \
             page, then try again.",
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, HeaderValue};

    use super::from_our_pages;

    const PUBLIC: &str = "https://sandgate.example.test/";

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn our_own_pages_posts_are_ours() {
        for ours in [
            headers(&[]),
            headers(&[("origin", "https://sandgate.example.test")]),
            headers(&[
                ("origin", "https://sandgate.example.test"),
                ("sec-fetch-site", "same-origin"),
            ]),
            // A form post from a page with `Referrer-Policy: no-referrer`, as Chromium sends it.
            headers(&[("origin", "null"), ("sec-fetch-site", "same-origin")]),
        ] {
            assert!(from_our_pages(PUBLIC, &ours), "{ours:?}");
        }
    }

    #[test]
    fn another_sites_posts_are_not() {
        for theirs in [
            headers(&[("origin", "https://evil.example.test")]),
            headers(&[("origin", "http://sandgate.example.test")]),
            headers(&[("sec-fetch-site", "cross-site")]),
            headers(&[("sec-fetch-site", "same-site")]),
            // An opaque origin (a sandboxed frame, a data: URL) without the browser's word.
            headers(&[("origin", "null")]),
            headers(&[("origin", "null"), ("sec-fetch-site", "cross-site")]),
            headers(&[("origin", "null"), ("sec-fetch-site", "none")]),
            headers(&[
                ("origin", "https://sandgate.example.test"),
                ("sec-fetch-site", "cross-site"),
            ]),
        ] {
            assert!(!from_our_pages(PUBLIC, &theirs), "{theirs:?}");
        }
    }
}
