//! What every call would otherwise ask Postgres for, cached briefly: whether an access token may
//! still be used (its grant live, its `jti` not revoked) and a tenant's limits.
//!
//! Invalidation is pushed, not waited out: a change notifies `sandgate_cache` in its own
//! transaction (`sandgate_store::changes`), and each replica's listener drops the entries it
//! names as soon as Postgres delivers the notification (before the changing call has even
//! answered, in practice). The cache is used only while the listener is connected: when its
//! connection is lost everything is dropped and lookups go to Postgres until it listens again,
//! and then everything is dropped once more, since notifications of the gap are lost. A lookup
//! racing a change never stores its (possibly stale) answer: every change and reconnection
//! bumps a generation, and an answer is kept only if the generation did not move while it was
//! read. [`TTL`] bounds what a missed notification could cost. The replica that makes a change
//! also drops the entries itself right after its commit ([`ChangeCache::forget`]); another
//! replica drops them when the notification arrives, which Postgres sends at the commit, before
//! the changing call has answered (its delivery and handling are asynchronous, so a call that
//! reaches another replica within that fraction of a millisecond may still be served).
//!
//! Only "the token is active" is cached: a refusal goes to Postgres every time (rare, and it
//! must never be cached past a re-approval).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandgate_store::changes::{Change, ChangeListener};
use sandgate_store::tenants::TenantLimits;
use sandgate_store::{PgPool, StoreError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

/// How long an entry lives even without a notification.
pub const TTL: Duration = Duration::from_secs(10);
/// Entries kept per map before expired ones are swept out.
const SWEEP_AT: usize = 10_000;
/// Pause before listening again after the listener could not connect.
const RELISTEN_EVERY: Duration = Duration::from_millis(500);

type TokenKey = (Option<Uuid>, String);

/// The cache. Cheap to clone; one per process.
#[derive(Debug, Clone, Default)]
pub struct ChangeCache {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    /// Whether the listener is connected: only then is anything served from (or kept in) here.
    listening: bool,
    /// Bumped by every change and every (re)connection of the listener.
    generation: u64,
    /// Tokens known active, until when.
    tokens: HashMap<TokenKey, Instant>,
    /// Tenants' own limits (`None`: no such tenant), until when.
    limits: HashMap<Uuid, (Option<TenantLimits>, Instant)>,
}

impl ChangeCache {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether an access token may still be used (see `sandgate_store::grants::token_is_active`).
    pub async fn token_is_active(
        &self,
        db: &PgPool,
        grant: Option<Uuid>,
        jti: &str,
    ) -> Result<bool, StoreError> {
        let key = (grant, jti.to_owned());
        let generation = {
            let state = self.state();
            if state.listening
                && state
                    .tokens
                    .get(&key)
                    .is_some_and(|until| *until > Instant::now())
            {
                return Ok(true);
            }
            state.generation
        };
        let mut conn = db.acquire().await?;
        let active = sandgate_store::grants::token_is_active(&mut conn, grant, jti).await?;
        if active {
            let mut state = self.state();
            if state.listening && state.generation == generation {
                sweep(&mut state.tokens, |until| *until);
                state.tokens.insert(key, Instant::now() + TTL);
            }
        }
        Ok(active)
    }

    /// A tenant's own limits; `None` when the tenant does not exist.
    pub async fn tenant_limits(
        &self,
        db: &PgPool,
        tenant: Uuid,
    ) -> Result<Option<TenantLimits>, StoreError> {
        let generation = {
            let state = self.state();
            if state.listening
                && let Some((limits, until)) = state.limits.get(&tenant)
                && *until > Instant::now()
            {
                return Ok(limits.clone());
            }
            state.generation
        };
        let mut conn = db.acquire().await?;
        let limits = sandgate_store::tenants::limits(&mut conn, tenant).await?;
        let mut state = self.state();
        if state.listening && state.generation == generation {
            sweep(&mut state.limits, |(_, until)| *until);
            state
                .limits
                .insert(tenant, (limits.clone(), Instant::now() + TTL));
        }
        Ok(limits)
    }

    /// Drops what `change` names, now: a replica that makes a change calls this after its
    /// commit, so its own next call never waits for the notification to come back.
    pub fn forget(&self, change: &Change) {
        self.apply(change);
    }

    /// Drops what `change` names.
    fn apply(&self, change: &Change) {
        let mut state = self.state();
        state.generation += 1;
        match change {
            Change::Grant(id) => state.tokens.retain(|(grant, _), _| *grant != Some(*id)),
            Change::Token(jti) => state.tokens.retain(|(_, j), _| j != jti),
            Change::Tenant(id) => {
                state.limits.remove(id);
            }
            Change::Unknown(payload) => {
                tracing::warn!(%payload, "unknown cache notification; dropping the whole cache");
                state.tokens.clear();
                state.limits.clear();
            }
        }
    }

    /// Drops everything; serves from the cache again only if `listening`.
    fn reset(&self, listening: bool) {
        let mut state = self.state();
        state.generation += 1;
        state.listening = listening;
        state.tokens.clear();
        state.limits.clear();
    }

    /// Listens for changes on `db` until `stop`, on `tasks`. Until this runs (and whenever its
    /// connection is down) every lookup goes to Postgres.
    pub fn listen(&self, db: PgPool, stop: CancellationToken, tasks: &TaskTracker) {
        let cache = self.clone();
        tasks.spawn(async move {
            loop {
                let connected = tokio::select! {
                    () = stop.cancelled() => return,
                    connected = ChangeListener::connect(&db) => connected,
                };
                match connected {
                    Ok(listener) => cache.follow(listener, &stop).await,
                    Err(err) => {
                        tracing::debug!(error = %err, "cache listener cannot connect; lookups go to Postgres")
                    }
                }
                if stop.is_cancelled() {
                    return;
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(RELISTEN_EVERY) => {}
                }
            }
        });
    }

    /// Applies the changes `listener` hears until its connection is lost for good or `stop`.
    async fn follow(&self, mut listener: ChangeListener, stop: &CancellationToken) {
        // Listening from now on; whatever changed before is unknown.
        self.reset(true);
        loop {
            let next = tokio::select! {
                () = stop.cancelled() => return self.reset(false),
                next = listener.next() => next,
            };
            match next {
                Ok(Some(change)) => self.apply(&change),
                Ok(None) => {
                    // Lost and connected again: the gap's notifications are gone.
                    tracing::info!("cache listener reconnected; cache dropped");
                    self.reset(true);
                }
                Err(err) => {
                    tracing::warn!(error = %err, "cache listener lost its connection; cache off until it is back");
                    return self.reset(false);
                }
            }
        }
    }
}

/// Sweeps expired entries out of a map grown past [`SWEEP_AT`].
fn sweep<K, V>(map: &mut HashMap<K, V>, until: impl Fn(&V) -> Instant) {
    if map.len() >= SWEEP_AT {
        let now = Instant::now();
        map.retain(|_, v| until(v) > now);
        if map.len() >= SWEEP_AT {
            map.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_drop_what_they_name_and_move_the_generation() {
        let cache = ChangeCache::default();
        cache.reset(true);
        let (grant, tenant) = (Uuid::now_v7(), Uuid::now_v7());
        {
            let mut state = cache.state();
            let until = Instant::now() + TTL;
            state.tokens.insert((Some(grant), "a".into()), until);
            state.tokens.insert((None, "b".into()), until);
            state.limits.insert(tenant, (None, until));
        }
        let before = cache.state().generation;
        cache.apply(&Change::Grant(grant));
        assert!(cache.state().generation > before);
        assert_eq!(cache.state().tokens.len(), 1, "the grant's token is gone");
        cache.apply(&Change::Token("b".into()));
        assert!(cache.state().tokens.is_empty(), "the revoked token is gone");
        cache.apply(&Change::Tenant(tenant));
        assert!(
            cache.state().limits.is_empty(),
            "the tenant's limits are gone"
        );
    }

    #[test]
    fn a_lost_listener_turns_the_cache_off() {
        let cache = ChangeCache::default();
        cache.reset(true);
        cache
            .state()
            .tokens
            .insert((None, "a".into()), Instant::now() + TTL);
        cache.reset(false);
        let state = cache.state();
        assert!(!state.listening && state.tokens.is_empty());
    }
}
