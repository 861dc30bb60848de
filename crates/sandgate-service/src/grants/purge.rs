//! The scheduled purge (issue 11): expired authorization codes, login sessions, refresh tokens
//! and revocation records, and dynamic clients that never completed a flow, every
//! `oauth.limits.purge_interval_seconds` (and once at start-up).

use std::time::Duration;

use sandgate_store::{PgPool, StoreError, hygiene};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Grants;

impl Grants {
    /// Starts the purge loop on `tasks` until `stop`.
    pub fn start_purge(&self, stop: CancellationToken, tasks: &TaskTracker) {
        let limits = &self.config.oauth.limits;
        let every = Duration::from_secs(limits.purge_interval_seconds);
        let unused_ttl = super::seconds(limits.unused_client_ttl_seconds);
        let db = self.db.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                match purge_once(&db, chrono::Utc::now() - unused_ttl).await {
                    Ok(purged) if purged != hygiene::Purged::default() => {
                        tracing::info!(?purged, "purged expired OAuth records");
                    }
                    Ok(_) => {}
                    Err(err) if err.is_unavailable() => {
                        tracing::debug!(error = %err, "purge skipped: the database is unavailable");
                    }
                    Err(err) => {
                        tracing::warn!(error = ?err, "purging expired OAuth records failed");
                    }
                }
            }
        });
    }
}

#[tracing::instrument(skip_all)]
async fn purge_once(
    db: &PgPool,
    unused_before: chrono::DateTime<chrono::Utc>,
) -> Result<hygiene::Purged, StoreError> {
    let mut conn = sandgate_store::acquire(db).await?;
    hygiene::purge(&mut conn, unused_before).await
}
