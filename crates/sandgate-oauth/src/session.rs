//! Login and the browser session: a signed, `HttpOnly`, `SameSite=Lax` cookie holding a random
//! session id whose hash is stored in Postgres (so a session can end server-side).
//!
//! Cookie names: when the public URL is https, or its host is loopback (browsers treat
//! `http://127.0.0.1` and `http://localhost` as secure contexts and accept `Secure` cookies
//! there), the cookies are `__Host-` prefixed and `Secure`. For plain-http development on any
//! other host the prefix cannot be used (it requires `Secure`, which such a browser would never
//! send back), so the cookies are unprefixed and not `Secure`; a warning says so at start-up.

use axum::extract::{Form, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use chrono::Utc;
use hmac::{Hmac, Mac};
use sandgate_auth::password;
use sandgate_auth::secret::{self, SecretKind};
use sandgate_store::StoreError;
use sandgate_store::users::{self, Session};
use serde::Deserialize;
use sha2::Sha256;

use super::html::{self, escape, page, see_other};
use super::paths;
use crate::AppState;
use crate::config::Config;

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

    fn set(&self, name: &str, value: &str, max_age: i64) -> HeaderValue {
        let secure = if self.secure { "; Secure" } else { "" };
        HeaderValue::from_str(&format!(
            "{name}={value}; Path=/; HttpOnly; SameSite=Lax; Max-Age={max_age}{secure}"
        ))
        .expect("cookie values are URL-safe base64")
    }
}

type HmacSha256 = Hmac<Sha256>;

fn sign(key: &[u8; 32], value: &str) -> String {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(value.as_bytes());
    format!(
        "{value}.{}",
        URL_SAFE_NO_PAD.encode(mac.finalize().into_bytes())
    )
}

fn unsign<'a>(key: &[u8; 32], signed: &'a str) -> Option<&'a str> {
    let (value, tag) = signed.rsplit_once('.')?;
    let tag = URL_SAFE_NO_PAD.decode(tag).ok()?;
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(value.as_bytes());
    mac.verify_slice(&tag).ok()?;
    Some(value)
}

/// The value of cookie `name` in the request, if present.
pub fn cookie<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The logged-in user of this request, if any.
pub async fn current(state: &AppState, headers: &HeaderMap) -> Result<Option<Session>, StoreError> {
    let policy = CookiePolicy::of(&state.config);
    let Some(id) = cookie(headers, policy.session).and_then(|c| unsign(&state.oauth.cookie_key, c))
    else {
        return Ok(None);
    };
    if !secret::is_kind(id, SecretKind::Session) {
        return Ok(None);
    }
    let mut conn = state.db.acquire().await?;
    users::session(&mut conn, &secret::hash(id)).await
}

/// Where to send a browser that needs to log in first, coming back to `next` afterwards.
pub fn login_redirect(next: &str) -> Response {
    let query = url::form_urlencoded::Serializer::new(String::new())
        .append_pair("next", next)
        .finish();
    see_other(&format!("{}?{query}", paths::LOGIN))
}

/// Only local paths are followed after login (no open redirect).
fn safe_next(next: Option<&str>) -> &str {
    match next {
        Some(n) if n.starts_with('/') && !n.starts_with("//") && !n.contains('\\') => n,
        _ => paths::APPS,
    }
}

/// Query of `GET /login`.
#[derive(Debug, Deserialize)]
pub struct LoginQuery {
    next: Option<String>,
}

/// `GET /login`: the login form.
pub async fn login_page(State(state): State<AppState>, Query(q): Query<LoginQuery>) -> Response {
    render_login(&state, safe_next(q.next.as_deref()), None, StatusCode::OK)
}

fn render_login(state: &AppState, next: &str, error: Option<&str>, status: StatusCode) -> Response {
    let policy = CookiePolicy::of(&state.config);
    let csrf = secret::generate(SecretKind::Csrf);
    let error = error
        .map(|e| format!("<p class=\"error\" role=\"alert\">{}</p>", escape(e)))
        .unwrap_or_default();
    let body = format!(
        "<h1>Sign in</h1>\
         <p class=\"muted\">Sign in with your sandgate account to continue.</p>{error}\
         <form method=\"post\" action=\"{action}\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">\
         <input type=\"hidden\" name=\"next\" value=\"{next}\">\
         <label for=\"email\">Email</label>\
         <input id=\"email\" name=\"email\" type=\"email\" autocomplete=\"username\" required autofocus>\
         <label for=\"password\">Password</label>\
         <input id=\"password\" name=\"password\" type=\"password\" autocomplete=\"current-password\" required>\
         <div class=\"actions\"><button class=\"primary\" type=\"submit\" id=\"sign-in\">Sign in</button></div>\
         </form>",
        action = paths::LOGIN,
        next = escape(next),
    );
    let mut response = page(status, "Sign in · sandgate", &body);
    response
        .headers_mut()
        .append(header::SET_COOKIE, policy.set(policy.login, &csrf, 3600));
    response
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

/// `POST /login`: checks the password and starts a session.
pub async fn login(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let policy = CookiePolicy::of(&state.config);
    let next = safe_next(form.next.as_deref()).to_owned();
    // Login CSRF: the form's token must match the cookie set with the form (double submit).
    let csrf_ok = match (cookie(&headers, policy.login), form.csrf.as_deref()) {
        (Some(c), Some(f)) => secret::constant_time_eq(c, f),
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
    let user = async {
        let mut conn = state.db.acquire().await?;
        users::by_email(&mut conn, form.email.trim()).await
    }
    .await;
    let user = match user {
        Ok(user) => user,
        Err(err) => {
            super::log_store(&err);
            return html::error_page(
                StatusCode::SERVICE_UNAVAILABLE,
                "Temporarily unavailable",
                "Signing in failed; please retry in a moment.",
            );
        }
    };
    // argon2 is deliberately slow: keep it off the async workers. A missing user is checked
    // against a dummy hash so both failures take as long.
    let hash = user.as_ref().map_or_else(
        || password::dummy_hash().to_owned(),
        |u| u.password_hash.clone(),
    );
    let password = form.password;
    let matches = tokio::task::spawn_blocking(move || password::verify_password(&password, &hash))
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or(false);
    let Some(user) = user.filter(|_| matches) else {
        tracing::info!("a sign-in failed");
        return render_login(
            &state,
            &next,
            Some("Wrong email or password."),
            StatusCode::UNAUTHORIZED,
        );
    };
    let id = secret::generate(SecretKind::Session);
    let csrf = secret::generate(SecretKind::Csrf);
    let ttl = state.config.oauth.session_ttl_seconds;
    let expires =
        Utc::now() + chrono::Duration::seconds(i64::try_from(ttl).unwrap_or(i64::MAX / 4));
    let created = async {
        let mut conn = state.db.acquire().await?;
        users::create_session(&mut conn, &secret::hash(&id), user.id, &csrf, expires).await
    }
    .await;
    if let Err(err) = created {
        super::log_store(&err);
        return html::error_page(
            StatusCode::SERVICE_UNAVAILABLE,
            "Temporarily unavailable",
            "Signing in failed; please retry in a moment.",
        );
    }
    tracing::info!(user_id = %user.id, tenant_id = %user.tenant_id, "signed in");
    let mut response = see_other(&next);
    let max_age = i64::try_from(ttl).unwrap_or(i64::MAX / 4);
    let cookies = response.headers_mut();
    cookies.append(
        header::SET_COOKIE,
        policy.set(policy.session, &sign(&state.oauth.cookie_key, &id), max_age),
    );
    cookies.append(header::SET_COOKIE, policy.set(policy.login, "", 0));
    response
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
        if form
            .csrf
            .as_deref()
            .is_some_and(|c| secret::constant_time_eq(c, &session.csrf_token))
        {
            if let Some(id) =
                cookie(&headers, policy.session).and_then(|c| unsign(&state.oauth.cookie_key, c))
                && let Ok(mut conn) = state.db.acquire().await
            {
                let _ = users::delete_session(&mut conn, &secret::hash(id)).await;
            }
        } else {
            return html::error_page(
                StatusCode::FORBIDDEN,
                "Form expired",
                "This form expired or did not come from sandgate. Reload the page and try again.",
            );
        }
    }
    let mut response = see_other(paths::LOGIN);
    response
        .headers_mut()
        .append(header::SET_COOKIE, policy.set(policy.session, "", 0));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_values_round_trip_and_tampering_is_refused() {
        let key = [7u8; 32];
        let signed = sign(&key, "sgs_abc");
        assert_eq!(unsign(&key, &signed), Some("sgs_abc"));
        assert_eq!(unsign(&[8u8; 32], &signed), None);
        assert_eq!(unsign(&key, &signed.replace("abc", "abd")), None);
        assert_eq!(unsign(&key, "sgs_abc"), None);
    }

    #[test]
    fn only_local_paths_are_followed() {
        assert_eq!(
            safe_next(Some("/oauth/authorize?x=1")),
            "/oauth/authorize?x=1"
        );
        assert_eq!(safe_next(Some("//evil.example/")), paths::APPS);
        assert_eq!(safe_next(Some("https://evil.example/")), paths::APPS);
        assert_eq!(safe_next(Some("/\\evil.example")), paths::APPS);
        assert_eq!(safe_next(None), paths::APPS);
    }
}
