//! What sandgate keeps after a sandbox ends, and for how long (docs/data.md): the settings, the
//! purge job that enforces them, and the operator's "remove everything of this tenant now".
//!
//! - Files live only in the sandbox's container and go with it at close (`files_seconds = 0`).
//! - Transcripts are kept `transcripts_seconds` after their sandbox ended (a tenant's own value
//!   wins), then deleted by [`start_purge`].

use std::time::Duration;

use sandgate_sandbox::{DockerBackend, SandboxBackend};
use sandgate_store::{PgPool, StoreError, sandboxes, transcripts};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use crate::admin::AdminError;
use crate::config::{Config, ConfigError};

/// The `[retention]` settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// How long an ended sandbox's transcript is kept, seconds.
    pub transcripts_seconds: u64,
    /// How long an ended sandbox's files are kept, seconds (only 0: they go with the container).
    pub files_seconds: u64,
    /// How often the purge job runs, seconds.
    pub purge_interval_seconds: u64,
    /// Most entries one sandbox's transcript keeps.
    pub transcript_max_entries: u32,
    /// Most bytes one sandbox's transcript keeps.
    pub transcript_max_bytes: u64,
}

impl RetentionConfig {
    /// Checks the settings; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: &str| {
            Err(ConfigError::Invalid {
                key: format!("retention.{key}"),
                message: message.to_owned(),
            })
        };
        if self.files_seconds != 0 {
            return invalid(
                "files_seconds",
                "only 0 is supported: a sandbox's files live in its container, which is removed when the sandbox ends",
            );
        }
        if self.transcripts_seconds > i32::MAX as u64 {
            return invalid(
                "transcripts_seconds",
                "must be at most 2147483647 (68 years)",
            );
        }
        if self.purge_interval_seconds == 0 {
            return invalid("purge_interval_seconds", "must be at least 1");
        }
        if self.transcript_max_entries == 0 || self.transcript_max_entries > i32::MAX as u32 {
            return invalid("transcript_max_entries", "must be between 1 and 2147483647");
        }
        if self.transcript_max_bytes < 1024 || self.transcript_max_bytes > i64::MAX as u64 {
            return invalid("transcript_max_bytes", "must be at least 1024");
        }
        Ok(())
    }
}

/// Starts the purge job: every `purge_interval_seconds` (and once at start), deletes the
/// transcripts whose retention is over. Stops when `stop` is cancelled.
pub fn start_purge(
    db: PgPool,
    config: &RetentionConfig,
    stop: CancellationToken,
    tracker: &TaskTracker,
) {
    let interval = Duration::from_secs(config.purge_interval_seconds);
    let default_seconds = config.transcripts_seconds as i64;
    tracker.spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = ticker.tick() => {}
            }
            match purge_once(&db, default_seconds).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(transcripts = n, "purged transcripts past their retention"),
                Err(err) => tracing::warn!(error = ?err, "purging expired transcripts failed; retrying at the next interval"),
            }
        }
    });
}

async fn purge_once(db: &PgPool, default_seconds: i64) -> Result<u64, StoreError> {
    let mut conn = db.acquire().await?;
    let purged = transcripts::purge_expired(&mut conn, default_seconds).await?;
    // MCP session states whose session ended (closed, expired, refused at the cap); ten minutes
    // old at least, so that a state saved just before its binding is never taken for one.
    sandgate_store::mcp_session_states::purge_unbound(&mut conn, 600).await?;
    Ok(purged)
}

/// What `sandgate admin tenant purge` removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Purged {
    /// Live sandboxes closed (their containers, and so their files, removed).
    pub sandboxes_closed: usize,
    /// Containers that could not be removed (reconciliation removes them later).
    pub containers_left: Vec<String>,
    /// Transcripts deleted.
    pub transcripts: u64,
}

/// Removes everything of a tenant's content now: closes its live sandboxes and removes their
/// containers (files and variables go with them), deletes its transcripts and forgets its
/// conversation ids. The tenant, its users, connections and audit trail (which never holds
/// content) stay.
pub async fn purge_tenant(config: &Config, tenant: Uuid) -> Result<Purged, AdminError> {
    let db = crate::admin::pool(config).await?;
    let mut tx = sandgate_store::begin(&db).await?;
    if sandgate_store::tenants::get(&mut tx, tenant)
        .await?
        .is_none()
    {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    let ended = sandboxes::end_all_of_tenant(&mut tx, tenant, "purged").await?;
    let deleted = transcripts::purge_tenant(&mut tx, tenant).await?;
    sandgate_store::commit(tx).await?;
    let mut left = Vec::new();
    let docker = DockerBackend::connect(&config.docker.host).ok();
    for row in &ended {
        let removed = match &docker {
            Some(docker) => docker.remove(&row.container_id).await.is_ok(),
            None => false,
        };
        if !removed {
            left.push(row.container_id.clone());
        }
    }
    Ok(Purged {
        sandboxes_closed: ended.len(),
        containers_left: left,
        transcripts: deleted,
    })
}

/// Sets a tenant's own transcript retention (`None`: back to the configured default); returns
/// the retention now in force, seconds.
pub async fn set_tenant_retention(
    config: &Config,
    tenant: Uuid,
    seconds: Option<u32>,
) -> Result<u64, AdminError> {
    let db = crate::admin::pool(config).await?;
    let mut conn = sandgate_store::acquire(&db).await?;
    let value = seconds
        .map(|s| {
            i32::try_from(s).map_err(|_| {
                AdminError::InvalidLimit("retention must be at most 2147483647 seconds".into())
            })
        })
        .transpose()?;
    if !transcripts::set_retention(&mut conn, tenant, value).await? {
        return Err(AdminError::NoSuchTenant(tenant));
    }
    Ok(value.map_or(config.retention.transcripts_seconds, |v| v as u64))
}

/// The transcript retention in force for a tenant, seconds.
pub async fn tenant_retention(
    db: &PgPool,
    default_seconds: u64,
    tenant: Uuid,
) -> Result<u64, StoreError> {
    let mut conn = db.acquire().await?;
    Ok(transcripts::retention_of(&mut conn, tenant)
        .await?
        .flatten()
        .map_or(default_seconds, |v| v as u64))
}
