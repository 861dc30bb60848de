//! The node's own budget for what it holds on behalf of calls (issue 24): a gateway asks for a
//! whole file or a cell's images, and without a bound of its own one tenant's reads could make
//! the node that serves every tenant run out of memory. A whole-file read reserves its bound
//! (the smaller of what the gateway asked and `node.read_bytes_per_call`) out of
//! `node.read_bytes_in_flight` before it reads anything, and is refused with a retryable
//! [`SandboxError::NodeBusy`] when the room is not there: the node says "busy", it never dies.
//! A cell's images are capped per call at `node.display_bytes_per_call`.

use std::sync::Arc;
use std::time::Duration;

use sandgate_sandbox::SandboxError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The granule the budget counts in: 64 KiB (a semaphore counts at most `u32::MAX` permits at
/// once per acquisition; this keeps budgets of terabytes expressible).
const GRANULE: u64 = 64 << 10;

/// How long a refused call is told to wait: reads in flight end within a call's time.
const RETRY_AFTER: Duration = Duration::from_secs(2);

/// The node's bounds on bytes held for calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadLimits {
    /// Most bytes whole-file reads hold at once, over every gateway and tenant.
    pub in_flight_bytes: u64,
    /// Most bytes one whole-file read may hold (a bigger file is refused as too large).
    pub per_call_bytes: u64,
    /// Most bytes of images one cell may return.
    pub display_bytes_per_call: u64,
}

impl Default for ReadLimits {
    fn default() -> Self {
        Self {
            in_flight_bytes: 256 << 20,
            per_call_bytes: 64 << 20,
            display_bytes_per_call: 16 << 20,
        }
    }
}

/// The room left in [`ReadLimits::in_flight_bytes`]. Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct ReadBudget {
    limits: ReadLimits,
    room: Arc<Semaphore>,
}

impl ReadBudget {
    pub(crate) fn new(limits: ReadLimits) -> Self {
        let granules =
            usize::try_from(limits.in_flight_bytes.div_ceil(GRANULE)).unwrap_or(usize::MAX);
        Self {
            limits,
            room: Arc::new(Semaphore::new(granules.min(Semaphore::MAX_PERMITS))),
        }
    }

    pub(crate) fn limits(&self) -> ReadLimits {
        self.limits
    }

    /// The bound of one whole-file read asking for up to `asked` bytes.
    pub(crate) fn per_call(&self, asked: u64) -> u64 {
        asked.min(self.limits.per_call_bytes)
    }

    /// Reserves room for `bytes` held until the permit drops, or refuses at once.
    pub(crate) fn reserve(&self, bytes: u64) -> Result<OwnedSemaphorePermit, SandboxError> {
        let granules = u32::try_from(bytes.div_ceil(GRANULE).max(1)).unwrap_or(u32::MAX);
        self.room
            .clone()
            .try_acquire_many_owned(granules)
            .map_err(|_| SandboxError::NodeBusy {
                what: format!(
                    "bytes held for file reads ({} MiB at once)",
                    self.limits.in_flight_bytes >> 20
                ),
                retry_after: RETRY_AFTER,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_past_the_room_are_refused_retryably_and_room_comes_back() {
        let budget = ReadBudget::new(ReadLimits {
            in_flight_bytes: 40 << 20,
            per_call_bytes: 20 << 20,
            display_bytes_per_call: 1 << 20,
        });
        assert_eq!(budget.per_call(100 << 20), 20 << 20);
        let first = budget.reserve(20 << 20).expect("room for one");
        let second = budget.reserve(20 << 20).expect("room for two");
        let refused = budget.reserve(1).expect_err("no room for a third");
        assert!(
            matches!(refused, SandboxError::NodeBusy { retry_after, .. } if retry_after >= Duration::from_secs(1)),
            "{refused:?}"
        );
        drop((first, second));
        let _all = budget.reserve(40 << 20).expect("the room is back");
    }
}
