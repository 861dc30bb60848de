//! Changes other replicas must hear of at once: a grant revoked, an access token revoked, a
//! tenant's limits changed. Triggers (migration `20261202100000_cache_invalidation`) notify the
//! channel [`CHANNEL`] in the transaction that makes the change; a [`ChangeListener`] hears them
//! (Postgres `LISTEN`, sqlx's `PgListener`).

use sqlx::postgres::PgListener;
use uuid::Uuid;

use crate::{PgPool, StoreError};

/// The notification channel the triggers notify.
pub const CHANNEL: &str = "sandgate_cache";

/// One change, as notified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A grant was revoked (or removed): its tokens stop working.
    Grant(Uuid),
    /// An access token (by `jti`) was revoked.
    Token(String),
    /// A tenant's row (its limits) changed.
    Tenant(Uuid),
    /// A payload this version does not know: drop everything to be safe.
    Unknown(String),
}

impl Change {
    fn parse(payload: &str) -> Self {
        let unknown = || Change::Unknown(payload.to_owned());
        match payload.split_once(':') {
            Some(("grant", id)) => id.parse().map_or_else(|_| unknown(), Change::Grant),
            Some(("token", jti)) => Change::Token(jti.to_owned()),
            Some(("tenant", id)) => id.parse().map_or_else(|_| unknown(), Change::Tenant),
            _ => unknown(),
        }
    }
}

/// A connection listening on [`CHANNEL`] (it holds one connection of the pool).
pub struct ChangeListener(PgListener);

impl std::fmt::Debug for ChangeListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChangeListener").finish_non_exhaustive()
    }
}

impl ChangeListener {
    /// Connects and listens.
    pub async fn connect(pool: &PgPool) -> Result<Self, StoreError> {
        let mut listener = PgListener::connect_with(pool).await?;
        listener.listen(CHANNEL).await?;
        Ok(Self(listener))
    }

    /// The next change. `Ok(None)`: the connection was lost and listening again now; whatever
    /// was notified in between is unknown. An error: the connection was lost and could not be
    /// made again.
    pub async fn next(&mut self) -> Result<Option<Change>, StoreError> {
        Ok(self.0.try_recv().await?.map(|n| Change::parse(n.payload())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_parse_and_unknown_ones_are_kept() {
        let id = Uuid::nil();
        assert_eq!(Change::parse(&format!("grant:{id}")), Change::Grant(id));
        assert_eq!(Change::parse("token:abc:d"), Change::Token("abc:d".into()));
        assert_eq!(Change::parse(&format!("tenant:{id}")), Change::Tenant(id));
        assert_eq!(
            Change::parse("grant:nope"),
            Change::Unknown("grant:nope".into())
        );
        assert_eq!(Change::parse("other"), Change::Unknown("other".into()));
    }
}
