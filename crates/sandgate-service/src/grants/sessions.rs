//! Login sessions: the session behind a cookie (its id is a secret; only its hash is stored),
//! the account to check a sign-in against (unless it is locked), failed sign-ins counted
//! towards the lockout, and starting and ending a session.

use chrono::{DateTime, Utc};
use sandgate_auth::secret::{self, SecretKind};
use sandgate_store::hygiene::{self, Lockout};
use sandgate_store::users;
use uuid::Uuid;

use super::{GrantError, Grants, Session, User};

/// Whom a sign-in for an email address is checked against.
#[derive(Debug, Clone)]
pub enum SignIn {
    /// No account has this email (the password is still checked against a dummy hash).
    NoSuchUser,
    /// The account is locked until then.
    Locked(DateTime<Utc>),
    /// The account.
    User(User),
}

impl Grants {
    /// The live session whose secret id is `id` (the cookie's value), if any.
    #[tracing::instrument(skip_all)]
    pub async fn session(&self, id: &str) -> Result<Option<Session>, GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(users::session(&mut conn, &secret::hash(id)).await?)
    }

    /// The account a sign-in as `email` is checked against, unless it is locked.
    #[tracing::instrument(skip_all)]
    pub async fn sign_in(&self, email: &str) -> Result<SignIn, GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        let Some(user) = users::by_email(&mut conn, email).await? else {
            return Ok(SignIn::NoSuchUser);
        };
        Ok(match hygiene::locked_until(&mut conn, user.id).await? {
            Some(until) => SignIn::Locked(until),
            None => SignIn::User(user),
        })
    }

    /// Counts a wrong password against `user_id` (`oauth.limits.lockout_*`); when the account
    /// is now locked, until when.
    #[tracing::instrument(skip_all, fields(user_id = %user_id))]
    pub async fn failed_sign_in(&self, user_id: Uuid) -> Result<Option<DateTime<Utc>>, GrantError> {
        let l = &self.config.oauth.limits;
        let rule = Lockout {
            after_failures: i32::try_from(l.lockout_after_failures).unwrap_or(i32::MAX),
            base_seconds: i64::from(l.lockout_seconds),
            max_seconds: i64::from(l.lockout_max_seconds),
        };
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(hygiene::record_failed_login(&mut conn, user_id, rule).await?)
    }

    /// Starts a session for `user_id` (valid `oauth.session_ttl_seconds`; its failed sign-ins
    /// reset); the session's secret id, for the cookie.
    #[tracing::instrument(skip_all, fields(user_id = %user_id))]
    pub async fn start_session(&self, user_id: Uuid) -> Result<String, GrantError> {
        let id = secret::generate(SecretKind::Session);
        let csrf = secret::generate(SecretKind::Csrf);
        let expires = Utc::now() + super::seconds(self.config.oauth.session_ttl_seconds);
        let mut conn = sandgate_store::acquire(&self.db).await?;
        hygiene::clear_failed_logins(&mut conn, user_id).await?;
        users::create_session(&mut conn, &secret::hash(&id), user_id, &csrf, expires).await?;
        Ok(id)
    }

    /// Ends the session whose secret id is `id`.
    #[tracing::instrument(skip_all)]
    pub async fn end_session(&self, id: &str) -> Result<(), GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(users::delete_session(&mut conn, &secret::hash(id)).await?)
    }

    /// Records that the user of the session `id` proved their password again.
    #[tracing::instrument(skip_all)]
    pub async fn reauthenticated(&self, id: &str) -> Result<(), GrantError> {
        let mut conn = sandgate_store::acquire(&self.db).await?;
        Ok(users::reauthenticated(&mut conn, &secret::hash(id)).await?)
    }
}
