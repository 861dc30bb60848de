//! A profile's warm pool: its ready sandboxes and starts in flight, its numbers, and the gate that
//! bounds the starts it runs at once.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use super::Sandbox;
use crate::config::SandboxProfile;
use crate::demand::Demand;

pub(super) struct PoolState {
    pub(super) ready: VecDeque<Sandbox>,
    /// Background starts in flight for this pool (counted so refills do not overshoot the target).
    pub(super) starting: usize,
    /// Cold starts (outside the pool) in flight.
    pub(super) cold_starting: usize,
    /// What the pool's size and start concurrency follow.
    pub(super) demand: Demand,
}

pub(super) struct Pool {
    pub(super) profile: SandboxProfile,
    pub(super) state: Mutex<PoolState>,
    /// Starts running at once for this pool (background and cold), bounded by the demand's limit.
    pub(super) gate: Arc<StartGate>,
    /// The template its starts restore, where snapshots are available.
    pub(super) template: Arc<super::templates::TemplateSlot>,
}

impl Pool {
    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A cold start (waiting for its place, or launching) counted in its pool's numbers for as long
/// as it lives, so a caller that gives up half-way (a cancelled request) is uncounted too.
pub(super) struct ColdStarting<'a>(&'a Pool);

impl<'a> ColdStarting<'a> {
    pub(super) fn new(pool: &'a Pool) -> Self {
        pool.state().cold_starting += 1;
        Self(pool)
    }
}

impl Drop for ColdStarting<'_> {
    fn drop(&mut self) {
        self.0.state().cold_starting -= 1;
    }
}

/// A pool's numbers, for metrics and tests.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolStats {
    /// Ready sandboxes waiting.
    pub ready: usize,
    /// Background starts in flight.
    pub starting: usize,
    /// Cold starts (a lease found the pool empty) in flight.
    pub cold_starting: usize,
    /// Ready sandboxes the pool aims for now.
    pub target: usize,
    /// Starts allowed at once now.
    pub start_limit: usize,
    /// Average start time.
    pub start_time: Duration,
    /// Leases per second lately.
    pub lease_rate: f64,
}

/// Bounds the starts running at once by a limit that may change between acquisitions.
#[derive(Default)]
pub(super) struct StartGate {
    running: Mutex<usize>,
    freed: Notify,
}

/// A place among the starts a pool runs at once ([`SandboxManager::start_permit`]); freed on drop.
pub struct StartPermit {
    gate: Arc<StartGate>,
    pub(super) profile: String,
}

impl std::fmt::Debug for StartPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartPermit")
            .field("profile", &self.profile)
            .finish_non_exhaustive()
    }
}

impl StartGate {
    pub(super) async fn acquire(
        self: &Arc<Self>,
        profile: &str,
        limit: impl Fn() -> usize,
    ) -> StartPermit {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
                if *running < limit().max(1) {
                    *running += 1;
                    return StartPermit {
                        gate: self.clone(),
                        profile: profile.to_owned(),
                    };
                }
            }
            freed.await;
        }
    }
}

impl Drop for StartPermit {
    fn drop(&mut self) {
        *self.gate.running.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        self.gate.freed.notify_waiters();
    }
}
