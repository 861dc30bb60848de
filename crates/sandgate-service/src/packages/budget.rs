//! The per-tenant download budget: bytes a tenant's sandboxes may make this process download from
//! the upstream index per hour (`packages.tenant_download_mb_per_hour`). Wheels already in the
//! cache cost nothing. A download is admitted while the tenant's hour has budget left and charged
//! its real size when it ends (a wheel's size is known only then), so the last download of an
//! hour may pass the budget by at most one wheel.
//!
//! A fixed hour per tenant rather than `governor`'s GCRA: the charge is known only after the
//! fact, and a cell cannot be taken back once a download fails; the budget is in this process's
//! memory (each replica applies it on its own).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use std::time::Instant;
use uuid::Uuid;

const HOUR: Duration = Duration::from_secs(3600);

/// Bytes downloaded per tenant in its current hour.
#[derive(Debug)]
pub(super) struct DownloadBudget {
    per_hour: u64,
    spent: Mutex<HashMap<Uuid, (Instant, u64)>>,
}

/// The tenant's hour is spent; it may download again after `retry_after`.
#[derive(Debug, Clone, Copy)]
pub(super) struct BudgetSpent {
    pub(super) per_hour: u64,
    pub(super) retry_after: Duration,
}

impl DownloadBudget {
    pub(super) fn new(per_hour: u64) -> Self {
        Self {
            per_hour,
            spent: Mutex::default(),
        }
    }

    /// Whether `tenant` may start a download now.
    pub(super) fn admit(&self, tenant: Uuid) -> Result<(), BudgetSpent> {
        self.admit_at(tenant, Instant::now())
    }

    fn admit_at(&self, tenant: Uuid, now: Instant) -> Result<(), BudgetSpent> {
        let mut spent = self.lock();
        spent.retain(|_, (since, _)| now.duration_since(*since) < HOUR);
        match spent.get(&tenant) {
            Some((since, bytes)) if *bytes >= self.per_hour => Err(BudgetSpent {
                per_hour: self.per_hour,
                retry_after: HOUR.saturating_sub(now.duration_since(*since)),
            }),
            _ => Ok(()),
        }
    }

    /// Charges `bytes` downloaded for `tenant`.
    pub(super) fn charge(&self, tenant: Uuid, bytes: u64) {
        let mut spent = self.lock();
        let entry = spent.entry(tenant).or_insert((Instant::now(), 0));
        entry.1 = entry.1.saturating_add(bytes);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, (Instant, u64)>> {
        self.spent.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spent_hour_refuses_until_it_is_over_and_tenants_are_apart() {
        let budget = DownloadBudget::new(100);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        budget.admit(a).unwrap();
        budget.charge(a, 60);
        budget.admit(a).unwrap();
        budget.charge(a, 60);
        let spent = budget.admit(a).expect_err("120 of 100 spent");
        assert_eq!(spent.per_hour, 100);
        budget.admit(b).expect("another tenant's budget is its own");
        let later = Instant::now() + spent.retry_after;
        budget.admit_at(a, later).expect("a new hour");
    }
}
