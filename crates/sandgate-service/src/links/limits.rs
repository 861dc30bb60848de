//! Rate limits on opening download links.

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use super::OpenedLink;

/// Rate limits on opening links (`governor`, in this process's memory: per replica): per link
/// and per tenant. Cheap to clone.
#[derive(Clone)]
pub struct LinkLimits {
    inner: Arc<LimitsInner>,
}

struct LimitsInner {
    per_link: governor::DefaultKeyedRateLimiter<String>,
    per_tenant: governor::DefaultKeyedRateLimiter<Uuid>,
}

impl std::fmt::Debug for LinkLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkLimits").finish_non_exhaustive()
    }
}

/// Which link limit refused an open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLimit {
    /// Opens of this one link.
    PerLink,
    /// Opens of all of the tenant's links.
    PerTenant,
}

impl LinkLimits {
    /// Limits of `config` (validated: each at least 1).
    pub fn new(config: &crate::config::LinksConfig) -> Self {
        let per_minute = |n: u32| {
            governor::Quota::per_minute(
                std::num::NonZeroU32::new(n).unwrap_or(std::num::NonZeroU32::MIN),
            )
        };
        Self {
            inner: Arc::new(LimitsInner {
                per_link: governor::RateLimiter::keyed(per_minute(config.per_link_per_minute)),
                per_tenant: governor::RateLimiter::keyed(per_minute(config.per_tenant_per_minute)),
            }),
        }
    }

    /// One open of `link`: `Err` with the limit and how long until a retry may succeed. The
    /// per-link limit is checked first, so one hot link does not use up its tenant's quota.
    pub fn check(&self, link: &OpenedLink) -> Result<(), (LinkLimit, Duration)> {
        use governor::clock::{Clock, DefaultClock};
        let wait = |not_until: governor::NotUntil<_>| {
            not_until.wait_time_from(DefaultClock::default().now())
        };
        self.inner
            .per_link
            .check_key(&link.id)
            .map_err(|n| (LinkLimit::PerLink, wait(n)))?;
        self.inner
            .per_tenant
            .check_key(&link.claims.t)
            .map_err(|n| (LinkLimit::PerTenant, wait(n)))
    }

    /// Forgets keys whose limit is back to full: bounds the memory a flood of distinct links
    /// leaves behind. Run periodically.
    pub fn forget_idle(&self) {
        self.inner.per_link.retain_recent();
        self.inner.per_link.shrink_to_fit();
        self.inner.per_tenant.retain_recent();
        self.inner.per_tenant.shrink_to_fit();
    }
}

/// How long a `Retry-After` for a link limit says, in whole seconds (at least 1).
pub fn retry_after_seconds(wait: Duration) -> u64 {
    wait.as_secs_f64().ceil().max(1.0) as u64
}
