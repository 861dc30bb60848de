//! Login and the browser session: a signed, `HttpOnly`, `SameSite=Lax` cookie holding a random
//! session id whose hash is stored in Postgres (so a session can end server-side).
//!
//! Cookie names: when the public URL is https, or its host is loopback (browsers treat
//! `http://127.0.0.1` and `http://localhost` as secure contexts and accept `Secure` cookies
//! there), the cookies are `__Host-` prefixed and `Secure`. For plain-http development on any
//! other host the prefix cannot be used (it requires `Secure`, which such a browser would never
//! send back), so the cookies are unprefixed and not `Secure`; a warning says so at start-up.

use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum_extra::extract::cookie::{Cookie, Key, SameSite, SignedCookieJar};
use chrono::{DateTime, Utc};
use maud::html;
use sandgate_auth::password;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_service::grants::{GrantError, Session, SignIn, User};
use serde::Deserialize;

use super::html::{self, hidden, page, see_other};
use super::paths;
use super::ratelimit::{ClientAddress, LimitKind, Limited};
use crate::AppState;
use crate::config::Config;

/// Longest email address accepted at login, bytes (RFC 5321's path limit).
pub const MAX_EMAIL_BYTES: usize = 254;
/// Longest password accepted at login, bytes.
pub const MAX_PASSWORD_BYTES: usize = 1024;

/// The cookies' names and attributes for this deployment.
#[derive(Debug, Clone, Copy)]
pub struct CookiePolicy {
    /// The session cookie's name.
    pub session: &'static str,
    /// The login form's CSRF cookie's name.
    pub login: &'static str,
    /// Whether cookies are `Secure`.
    pub secure: bool,
}

impl CookiePolicy {
    /// The policy for `config` (see the module docs).
    pub fn of(config: &Config) -> Self {
        if config.is_https() || config.is_loopback() {
            CookiePolicy {
                session: "__Host-sandgate_session",
                login: "__Host-sandgate_login",
                secure: true,
            }
        } else {
            CookiePolicy {
                session: "sandgate_session",
                login: "sandgate_login",
                secure: false,
            }
        }
    }

    /// A cookie under this policy (host-only, whole site, `HttpOnly`, `SameSite=Lax`).
    fn cookie(&self, name: &'static str, value: String, max_age_seconds: i64) -> Cookie<'static> {
        Cookie::build((name, value))
            .path("/")
            .http_only(true)
            .same_site(SameSite::Lax)
            .secure(self.secure)
            .max_age(cookie::time::Duration::seconds(max_age_seconds))
            .build()
    }

    /// The cookie that `SignedCookieJar::remove` turns into a removal of `name` (same
    /// attributes, so browsers accept it for a `__Host-` cookie).
    fn removal(&self, name: &'static str) -> Cookie<'static> {
        self.cookie(name, String::new(), 0)
    }
}

/// The key that signs the cookies (HMAC-SHA256 by the `cookie` crate), derived from the
/// configured secret.
pub fn cookie_key(state: &AppState) -> Key {
    use sha2::Digest;
    let mut hasher = sha2::Sha512::new();
    hasher.update(b"sandgate session cookies\0");
    hasher.update(state.oauth.cookie_key());
    Key::from(&hasher.finalize())
}

/// The request's signed cookies (a cookie whose signature does not verify is absent).
fn jar(state: &AppState, headers: &HeaderMap) -> SignedCookieJar {
    SignedCookieJar::from_headers(headers, cookie_key(state))
}

/// The session id of this request's (verified) session cookie.
fn session_id(state: &AppState, headers: &HeaderMap) -> Option<String> {
    let policy = CookiePolicy::of(&state.config);
    session_id_in(jar(state, headers), policy.session)
}

/// The session id in the signed cookie `name`, when it verifies and has a session's shape.
fn session_id_in(jar: SignedCookieJar, name: &str) -> Option<String> {
    let id = jar.get(name)?.value().to_owned();
    secret::is_kind(&id, SecretKind::Session).then_some(id)
}

/// The logged-in user of this request, if any.
pub async fn current(state: &AppState, headers: &HeaderMap) -> Result<Option<Session>, GrantError> {
    let Some(id) = session_id(state, headers) else {
        return Ok(None);
    };
    state.grants.session(&id).await
}

/// Where to send a browser that needs to log in first, coming back to `next` afterwards.
pub fn login_redirect(next: &str) -> Response {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("next", next)
        .finish();
    see_other(&format!("{}?{query}", paths::LOGIN))
}

/// Only paths on this gateway are followed after login (no open redirect).
fn safe_next(state: &AppState, next: Option<&str>) -> String {
    super::redirect::same_origin_path(&state.config.public_url(), next, paths::APPS)
}

/// Query of `GET /login`.
#[derive(Debug, Deserialize)]
pub struct LoginQuery {
    next: Option<String>,
}

/// `GET /login`: the login form.
pub async fn login_page(State(state): State<AppState>, Query(q): Query<LoginQuery>) -> Response {
    render_login(
        &state,
        &safe_next(&state, q.next.as_deref()),
        None,
        StatusCode::OK,
    )
}

fn render_login(state: &AppState, next: &str, error: Option<&str>, status: StatusCode) -> Response {
    let policy = CookiePolicy::of(&state.config);
    let csrf = secret::generate(SecretKind::Csrf);
    let body = html! {
        h1 { "Sign in" }
        p.muted { "Sign in with your sandgate account to continue." }
        @if let Some(error) = error {
            p.error #login-error role="alert" { (error) }
        }
        form method="post" action=(paths::LOGIN) {
            (hidden("csrf", &csrf))
            (hidden("next", next))
            label for="email" { "Email" }
            input #email name="email" type="email" autocomplete="username" maxlength=(MAX_EMAIL_BYTES) required autofocus;
            label for="password" { "Password" }
            input #password name="password" type="password" autocomplete="current-password" required;
            div.actions { button.primary #sign-in type="submit" { "Sign in" } }
        }
    };
    let jar = SignedCookieJar::new(cookie_key(state)).add(policy.cookie(policy.login, csrf, 3600));
    (jar, page(status, "Sign in · sandgate", body)).into_response()
}

/// The login form again, saying which limit refused the attempt, with `Retry-After`.
fn render_limited(state: &AppState, next: &str, limited: Limited) -> Response {
    tracing::info!(limit = ?limited.what, retry_after = limited.retry_after_seconds(), "refused a sign-in");
    let mut response = render_login(state, next, Some(&limited.message()), limited.status());
    limited.stamp(&mut response);
    response
}

fn unavailable() -> Response {
    html::error_page(
        StatusCode::SERVICE_UNAVAILABLE,
        "Temporarily unavailable",
        "Signing in failed; please retry in a moment.",
    )
}

/// The login form.
#[derive(Debug, Deserialize)]
pub struct LoginForm {
    email: String,
    password: String,
    #[serde(default)]
    next: Option<String>,
    #[serde(default)]
    csrf: Option<String>,
}

/// `POST /login`: checks the password and starts a session. Bounded before anything costly:
/// per address, then per account, then the account's lockout, then a slot in the hashing queue.
pub async fn login(
    State(state): State<AppState>,
    address: ClientAddress,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let policy = CookiePolicy::of(&state.config);
    let next = safe_next(&state, form.next.as_deref());
    let limits = &state.oauth.limits;
    if let Err(limited) = limits.login_from(address) {
        return render_limited(&state, &next, limited);
    }
    // Login CSRF: the form's token must match the cookie set with the form (double submit).
    let csrf_ok = match (
        jar(&state, &headers).get(policy.login),
        form.csrf.as_deref(),
    ) {
        (Some(c), Some(f)) => secret::constant_time_eq(c.value(), f),
        _ => false,
    };
    if !csrf_ok {
        return render_login(
            &state,
            &next,
            Some("The sign-in form expired. Please try again."),
            StatusCode::FORBIDDEN,
        );
    }
    let email = form.email.trim();
    if email.len() > MAX_EMAIL_BYTES || form.password.len() > MAX_PASSWORD_BYTES {
        return render_login(
            &state,
            &next,
            Some(&format!(
                "Email addresses are at most {MAX_EMAIL_BYTES} characters and passwords at most \
                 {MAX_PASSWORD_BYTES}."
            )),
            StatusCode::BAD_REQUEST,
        );
    }
    if let Err(limited) = limits.login_for(email) {
        return render_limited(&state, &next, limited);
    }
    let user = match state.grants.sign_in(email).await {
        Ok(SignIn::User(user)) => Some(user),
        Ok(SignIn::NoSuchUser) => None,
        Ok(SignIn::Locked(until)) => return render_limited(&state, &next, lockout(until)),
        Err(err) => {
            super::log_failure(&err);
            return unavailable();
        }
    };
    let matches = match check_password(&state, user.as_ref(), form.password).await {
        Ok(matches) => matches,
        Err(limited) => return render_limited(&state, &next, limited),
    };
    let user_id = user.as_ref().map(|u| u.id);
    let Some(user) = user.filter(|_| matches) else {
        return failed_login(&state, &next, user_id).await;
    };
    match state.grants.start_session(user.id).await {
        Ok(id) => {
            tracing::info!(user_id = %user.id, tenant_id = %user.tenant_id, "signed in");
            let ttl = i64::try_from(state.config.oauth.session_ttl_seconds).unwrap_or(i64::MAX / 4);
            let jar = SignedCookieJar::new(cookie_key(&state))
                .add(policy.cookie(policy.session, id, ttl))
                .remove(policy.removal(policy.login));
            (jar, see_other(&next)).into_response()
        }
        Err(err) => {
            super::log_failure(&err);
            unavailable()
        }
    }
}

/// A locked account as a limit: refused until `until`.
fn lockout(until: DateTime<Utc>) -> Limited {
    Limited {
        what: LimitKind::Lockout,
        retry_after: (until - Utc::now()).to_std().unwrap_or_default(),
    }
}

/// Verifies the password on the hashing threads. A missing user is checked against a dummy hash
/// so both failures take as long. argon2 is deliberately slow and large (~19 MiB): it runs off
/// the async workers, and only as many at once as there are hashing threads.
async fn check_password(
    state: &AppState,
    user: Option<&User>,
    password: String,
) -> Result<bool, Limited> {
    let hash = user.map_or_else(
        || password::dummy_hash().to_owned(),
        |u| u.password_hash.clone(),
    );
    let verified = state
        .oauth
        .limits
        .hash(move || password::verify_password(&password, &hash))
        .await?;
    Ok(verified.unwrap_or(false))
}

/// A wrong email or password: counts the failure against the account (which may lock it).
async fn failed_login(state: &AppState, next: &str, user_id: Option<uuid::Uuid>) -> Response {
    tracing::info!("a sign-in failed");
    let locked = match user_id {
        Some(id) => state.grants.failed_sign_in(id).await.unwrap_or_else(|err| {
            super::log_failure(&err);
            None
        }),
        None => None,
    };
    match locked {
        Some(until) => {
            let limited = lockout(until);
            let message = format!("Wrong email or password. {}", limited.message());
            let mut response = render_login(state, next, Some(&message), StatusCode::UNAUTHORIZED);
            limited.stamp(&mut response);
            response
        }
        None => render_login(
            state,
            next,
            Some("Wrong email or password."),
            StatusCode::UNAUTHORIZED,
        ),
    }
}

/// The logout form.
#[derive(Debug, Deserialize)]
pub struct LogoutForm {
    #[serde(default)]
    csrf: Option<String>,
}

/// `POST /logout`: ends the session.
pub async fn logout(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<LogoutForm>,
) -> Response {
    let policy = CookiePolicy::of(&state.config);
    if let Ok(Some(session)) = current(&state, &headers).await {
        if !csrf_ok(&session, form.csrf.as_deref()) {
            return form_expired();
        }
        if let Some(id) = session_id(&state, &headers) {
            let _ = state.grants.end_session(&id).await;
        }
    }
    let jar = SignedCookieJar::new(cookie_key(&state)).remove(policy.removal(policy.session));
    (jar, see_other(paths::LOGIN)).into_response()
}

/// Why a password confirmation did not confirm.
#[derive(Debug)]
pub enum Unconfirmed {
    /// A limit refused the attempt (or the account is locked).
    Limited(Limited),
    /// The password did not match (counted against the account).
    Wrong,
    /// Postgres failed.
    Unavailable,
}

/// Checks `password` for the signed-in user of this request again, under the sign-in limits
/// (per address, per account, the lockout, the hashing queue); on a match the session counts
/// as freshly signed in (`user_sessions.authenticated_at`). For the console, whose runs need a
/// recent sign-in.
pub async fn reconfirm(
    state: &AppState,
    headers: &HeaderMap,
    address: ClientAddress,
    session: &Session,
    password: String,
) -> Result<(), Unconfirmed> {
    let limits = &state.oauth.limits;
    limits.login_from(address).map_err(Unconfirmed::Limited)?;
    limits
        .login_for(&session.email)
        .map_err(Unconfirmed::Limited)?;
    if password.len() > MAX_PASSWORD_BYTES {
        return Err(Unconfirmed::Wrong);
    }
    let user = match state.grants.sign_in(&session.email).await {
        Ok(SignIn::User(user)) => user,
        Ok(SignIn::NoSuchUser) => return Err(Unconfirmed::Wrong),
        Ok(SignIn::Locked(until)) => return Err(Unconfirmed::Limited(lockout(until))),
        Err(_) => return Err(Unconfirmed::Unavailable),
    };
    let matches = check_password(state, Some(&user), password)
        .await
        .map_err(Unconfirmed::Limited)?;
    if !matches {
        let _ = state.grants.failed_sign_in(user.id).await;
        return Err(Unconfirmed::Wrong);
    }
    let id = session_id(state, headers).ok_or(Unconfirmed::Wrong)?;
    state
        .grants
        .reauthenticated(&id)
        .await
        .map_err(|_| Unconfirmed::Unavailable)
}

/// Whether a form's CSRF token is this session's (the form came from our page in this session).
pub fn csrf_ok(session: &Session, presented: Option<&str>) -> bool {
    presented.is_some_and(|c| secret::constant_time_eq(c, &session.csrf_token))
}

/// The answer to a signed-in form whose CSRF token is missing or wrong.
pub fn form_expired() -> Response {
    html::error_page(
        StatusCode::FORBIDDEN,
        "Form expired",
        "This form expired or did not come from sandgate. Reload the page and try again.",
    )
}

/// Property tests standing in for fuzzing (bounded cases in `cargo test`): the session-cookie
/// decoder accepts only a cookie signed with our key, and never panics on a `Cookie` header.
#[cfg(test)]
mod fuzz {
    use axum::http::HeaderValue;
    use proptest::prelude::*;

    use super::*;

    const NAME: &str = "__Host-sandgate_session";

    fn key() -> Key {
        Key::from(&[9u8; 64])
    }

    fn headers(cookie: &str) -> Option<HeaderMap> {
        let mut headers = HeaderMap::new();
        headers.insert(
            axum::http::header::COOKIE,
            HeaderValue::from_str(cookie).ok()?,
        );
        Some(headers)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn any_cookie_header_is_refused_without_panicking(value in prop_oneof![
            "[ -~]{0,200}",
            "__Host-sandgate_session=[ -~]{0,120}",
        ]) {
            if let Some(headers) = headers(&value) {
                let jar = SignedCookieJar::from_headers(&headers, key());
                prop_assert_eq!(session_id_in(jar, NAME), None);
            }
        }

        #[test]
        fn a_signed_session_cookie_changed_anywhere_is_refused(at in any::<prop::sample::Index>(), with in "[A-Za-z0-9+/=_-]") {
            let id = secret::generate(SecretKind::Session);
            let jar = SignedCookieJar::new(key()).add(Cookie::new(NAME, id.clone()));
            let signed = jar.get(NAME).map(|_| ()).and_then(|()| {
                // The jar signs on the way out: read the Set-Cookie value it would send.
                let response = jar.clone().into_response();
                response.headers().get(axum::http::header::SET_COOKIE)?.to_str().ok().map(str::to_owned)
            }).expect("a signed cookie");
            let pair = signed.split(';').next().unwrap().to_owned();
            let headers_ok = headers(&pair).unwrap();
            prop_assert_eq!(session_id_in(SignedCookieJar::from_headers(&headers_ok, key()), NAME), Some(id.clone()));
            let value_at = pair.find('=').unwrap() + 1;
            let i = value_at + at.index(pair.len() - value_at);
            let mut changed = pair.clone();
            changed.replace_range(i..=i, &with);
            if changed != pair && let Some(h) = headers(&changed) {
                let got = session_id_in(SignedCookieJar::from_headers(&h, key()), NAME);
                prop_assert!(got.is_none() || got == Some(id), "a changed cookie gave another session: {changed}");
            }
        }
    }
}
