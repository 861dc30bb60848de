//! A tenant's call quotas at a call's start and end: calls per minute and calls in flight,
//! shared by every replica through Postgres (`sandgate_store::quotas`). One statement admits a
//! call (both limits), one frees its slot when it ends; a call running longer than a third of
//! the slot's time to live renews it, so a replica that dies mid-call frees its slots by
//! themselves within `limits.call_slot_ttl_seconds`.
//!
//! Neither statement waits for the WAL flush (the counters are not durable data, see
//! `sandgate_store::quotas`), and the release runs behind the answer: spawned on the service's
//! tracker of work after answers, which shutdown drains. A call that follows the answer at once
//! may still see the slot taken for the moment the release takes; at the in-flight cap it is
//! refused with "retry in 1 s" like any call at the cap.

use std::time::Duration;

use sandgate_store::PgPool;
use sandgate_store::quotas::{self, Admission, CallLimits};
use sandgate_store::sandboxes::SandboxRow;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::error::Quota;
use super::{Caller, SandboxService, ServiceError};

/// Suggested wait after a refusal for calls in flight: a slot frees when any call ends, which
/// nobody can predict; a second is short enough not to idle and long enough not to hammer.
const IN_FLIGHT_RETRY_SECONDS: u32 = 1;

/// A call's admission: holds its in-flight slot until [`CallPermit::release`] (or drop).
#[derive(Debug)]
pub struct CallPermit {
    tenant: Uuid,
    slot: String,
    db: PgPool,
    renewer: Option<JoinHandle<()>>,
    after_answer: TaskTracker,
}

impl SandboxService {
    /// Admits a call of `caller` under its calls-per-minute and calls-in-flight limits, in one
    /// statement; a refusal is a [`ServiceError::Quota`] naming the limit and when to retry.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant))]
    pub async fn admit(&self, caller: &Caller) -> Result<CallPermit, ServiceError> {
        self.admit_reading(caller, None)
            .await
            .map(|(permit, _)| permit)
    }

    /// [`Self::admit`] for a call that names `sandbox_id`: the same statement reads the
    /// tenant's sandbox by that id (one round trip for both), kept in
    /// [`Caller::read_at_admission`] for the call's lookup.
    #[tracing::instrument(skip_all, fields(tenant_id = %caller.tenant))]
    pub async fn admit_naming(
        &self,
        caller: &mut Caller,
        sandbox_id: &str,
    ) -> Result<CallPermit, ServiceError> {
        let (permit, row) = self.admit_reading(caller, Some(sandbox_id)).await?;
        caller.read_at_admission = row;
        Ok(permit)
    }

    async fn admit_reading(
        &self,
        caller: &Caller,
        sandbox_id: Option<&str>,
    ) -> Result<(CallPermit, Option<SandboxRow>), ServiceError> {
        let slot = Uuid::new_v4().simple().to_string();
        let ttl = self.limits.call_slot_ttl_seconds;
        let limits = CallLimits {
            per_minute: caller.limits.max_calls_per_minute,
            in_flight: caller.limits.max_calls_in_flight,
            slot_ttl_seconds: ttl,
        };
        let mut conn = self.db.acquire().await?;
        let (admission, row) =
            quotas::admit_and_read(&mut conn, caller.tenant, &slot, limits, sandbox_id).await?;
        match admission {
            Admission::Admitted => {}
            Admission::OverRate {
                retry_after_seconds,
            } => {
                return Err(ServiceError::Quota {
                    quota: Quota::CallsPerMinute,
                    limit: limits.per_minute,
                    retry_after_seconds,
                });
            }
            Admission::OverInFlight => {
                return Err(ServiceError::Quota {
                    quota: Quota::CallsInFlight,
                    limit: limits.in_flight,
                    retry_after_seconds: IN_FLIGHT_RETRY_SECONDS,
                });
            }
        }
        drop(conn);
        let renewer = tokio::spawn(renew_until_dropped(
            self.db.clone(),
            caller.tenant,
            slot.clone(),
            ttl,
        ));
        let permit = CallPermit {
            tenant: caller.tenant,
            slot,
            db: self.db.clone(),
            renewer: Some(renewer),
            after_answer: self.after_answer.clone(),
        };
        Ok((permit, row))
    }
}

/// Renews a running call's slot every third of its time to live.
async fn renew_until_dropped(db: PgPool, tenant: Uuid, slot: String, ttl: u32) {
    let every = Duration::from_secs(u64::from(ttl)) / 3;
    loop {
        tokio::time::sleep(every).await;
        let renewed = async {
            let mut conn = db.acquire().await?;
            quotas::renew(&mut conn, tenant, &slot, ttl).await
        }
        .await;
        match renewed {
            Ok(true) => {}
            // It expired (Postgres was away for longer than its life): the call finishes, and
            // the tenant briefly gets one call more than its limit.
            Ok(false) => return,
            Err(err) => {
                tracing::warn!(error = %err, tenant_id = %tenant, "renewing a call's in-flight slot failed")
            }
        }
    }
}

impl CallPermit {
    /// Frees the slot behind the answer (one statement, spawned on the service's tracker that
    /// shutdown drains). A failure is logged: the slot then expires by itself.
    pub fn release(self) {
        // Drop does it: it is the same whether the call ended or was cancelled.
        drop(self);
    }
}

async fn release(db: &PgPool, tenant: Uuid, slot: &str) {
    let released = async {
        let mut conn = db.acquire().await?;
        quotas::release(&mut conn, tenant, slot).await
    }
    .await;
    if let Err(err) = released {
        tracing::warn!(error = %err, tenant_id = %tenant, "freeing a call's in-flight slot failed; it expires by itself");
    }
}

impl Drop for CallPermit {
    /// Frees the slot in the background, whether the call ended ([`CallPermit::release`]) or
    /// was cancelled (its future dropped).
    fn drop(&mut self) {
        let Some(renewer) = self.renewer.take() else {
            return;
        };
        renewer.abort();
        if tokio::runtime::Handle::try_current().is_ok() {
            let (db, tenant, slot) = (self.db.clone(), self.tenant, std::mem::take(&mut self.slot));
            self.after_answer
                .spawn(async move { release(&db, tenant, &slot).await });
        }
    }
}
