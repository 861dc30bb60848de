//! The idle clock's writes, coalesced: a call refreshes its sandbox's `last_used_at` at most
//! once per [`COALESCE`] per sandbox from this process, and in the same statement that finds
//! the sandbox and checks its owner (one round trip, `sandboxes::touch_in_time`). A call within
//! [`COALESCE`] of the last touch only reads the row, and when the call's admission read it
//! already (`SandboxService::admit_naming`, the same statement as the quota's), not even that.
//!
//! What it costs: a sandbox's idle clock may run up to [`COALESCE`] behind its last call's
//! start. It never extends a sandbox past `expires_at` (the touch refuses an overdue row, and
//! the lifetime is never moved), and the reaper still leaves a sandbox with a call running
//! alone (the busy set), whose end restarts the clock (`BusyGuard`).
//!
//! The end of a call is coalesced too ([`EndTouches`]): its write sets the clock [`COALESCE`]
//! *ahead* of the call's end, and the ends of the calls that follow within that second write
//! nothing, since the clock already reads later than they ended. So the idle clock is never
//! earlier than a call's end (the reaper never closes a sandbox whose last call ended less than
//! its idle timeout ago) and never later than the last call's end by more than [`COALESCE`] (an
//! idle sandbox is closed at most that much after its timeout). Both need a clock that never
//! moves back: every touch keeps the later of the stored value and its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sandgate_store::sandboxes::{self, SandboxRow};

use super::{Caller, SandboxService, ServiceError};

/// At most one idle-clock write per sandbox per this long, from one process, at the start of
/// calls and at their end.
pub(crate) const COALESCE: Duration = Duration::from_secs(1);
/// Entries kept before old ones are swept out.
const SWEEP_AT: usize = 4096;

/// When this process last wrote each sandbox's idle clock. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct IdleClock {
    touched: Arc<Mutex<HashMap<String, Instant>>>,
    ends: Arc<Mutex<EndTouches>>,
}

/// The end-of-call writes of one process: for each sandbox, the value its last one set the idle
/// clock to (see the module).
#[derive(Debug, Default)]
pub(crate) struct EndTouches {
    /// Sandbox id → the value written (the clock reads at least that, as it never moves back).
    written: HashMap<String, DateTime<Utc>>,
}

impl EndTouches {
    /// A call on `id` ended at `now`: the value to write to its idle clock ([`COALESCE`] ahead
    /// of `now`), or `None` when this process already set it to `now` or later.
    pub(crate) fn call_ended(&mut self, id: &str, now: DateTime<Utc>) -> Option<DateTime<Utc>> {
        if self.written.get(id).is_some_and(|&at| at >= now) {
            return None;
        }
        if self.written.len() >= SWEEP_AT {
            // Values already past tell nothing about the calls still to end.
            self.written.retain(|_, at| *at >= now);
        }
        let at = now + ahead();
        self.written.insert(id.to_owned(), at);
        Some(at)
    }

    /// The write of `at` that [`Self::call_ended`] asked for failed: the next end writes again.
    pub(crate) fn write_failed(&mut self, id: &str, at: DateTime<Utc>) {
        if self.written.get(id) == Some(&at) {
            self.written.remove(id);
        }
    }
}

/// [`COALESCE`] as a calendar duration.
fn ahead() -> chrono::Duration {
    chrono::Duration::from_std(COALESCE).expect("a second fits")
}

impl IdleClock {
    fn recently_touched(&self, id: &str) -> bool {
        let touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        touched.get(id).is_some_and(|at| at.elapsed() < COALESCE)
    }

    fn wrote(&self, id: &str) {
        let mut touched = self.touched.lock().unwrap_or_else(|e| e.into_inner());
        if touched.len() >= SWEEP_AT {
            touched.retain(|_, at| at.elapsed() < COALESCE);
        }
        touched.insert(id.to_owned(), Instant::now());
    }

    /// A call on `id` ended now: the value to write to its idle clock, or `None` when it already
    /// reads later (see [`EndTouches::call_ended`]).
    pub(crate) fn call_ended(&self, id: &str) -> Option<DateTime<Utc>> {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        ends.call_ended(id, Utc::now())
    }

    /// See [`EndTouches::write_failed`].
    pub(crate) fn end_write_failed(&self, id: &str, at: DateTime<Utc>) {
        let mut ends = self.ends.lock().unwrap_or_else(|e| e.into_inner());
        ends.write_failed(id, at);
    }
}

/// What [`SandboxService::touch_for_call`] found.
pub(crate) enum Touched {
    /// The live row, its clock refreshed now or within [`COALESCE`].
    Live(SandboxRow),
    /// Not refreshed: the row as it is (ended, overdue or missing; the caller says which).
    Untouched(Option<SandboxRow>),
}

impl SandboxService {
    /// Finds a tenant's sandbox for a call and refreshes its idle clock (coalesced, see the
    /// module): one statement in the common case.
    pub(crate) async fn touch_for_call(
        &self,
        caller: &Caller,
        id: &str,
        new_idle: Option<i32>,
    ) -> Result<Touched, ServiceError> {
        let tenant = caller.tenant;
        if new_idle.is_none() && self.idle_clock.recently_touched(id) {
            // The row as the call's admission read it (same statement), else read now.
            let row = match caller.read_at_admission.as_ref().filter(|r| r.id == id) {
                Some(row) => Some(row.clone()),
                None => {
                    let mut conn = self.db.acquire().await?;
                    sandboxes::get(&mut conn, tenant, id).await?
                }
            };
            return Ok(match row {
                Some(row) if row.state == sandboxes::SandboxState::Leased => {
                    if super::overdue(&row, chrono::Utc::now()) {
                        Touched::Untouched(Some(row))
                    } else {
                        Touched::Live(row)
                    }
                }
                other => Touched::Untouched(other),
            });
        }
        let mut conn = self.db.acquire().await?;
        match sandboxes::touch_in_time(&mut conn, tenant, id, new_idle).await? {
            Some(row) => {
                self.idle_clock.wrote(id);
                Ok(Touched::Live(row))
            }
            None => Ok(Touched::Untouched(
                sandboxes::get(&mut conn, tenant, id).await?,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(millis: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_800_000_000_000 + millis).expect("a time")
    }

    #[test]
    fn the_first_end_writes_a_second_ahead_and_the_ends_within_it_write_nothing() {
        let mut ends = EndTouches::default();
        assert_eq!(ends.call_ended("a", at(0)), Some(at(1000)));
        assert_eq!(ends.call_ended("a", at(10)), None);
        assert_eq!(ends.call_ended("a", at(1000)), None, "the clock reads 1000");
        assert_eq!(
            ends.call_ended("b", at(10)),
            Some(at(1010)),
            "another sandbox has its own clock"
        );
        assert_eq!(ends.call_ended("a", at(1001)), Some(at(2001)));
    }

    #[test]
    fn a_failed_write_is_written_again_at_the_next_end() {
        let mut ends = EndTouches::default();
        let first = ends.call_ended("a", at(0)).expect("a write");
        ends.write_failed("a", first);
        assert_eq!(ends.call_ended("a", at(5)), Some(at(1005)));
        // A failure reported after a newer write does not undo the newer one.
        ends.write_failed("a", first);
        assert_eq!(ends.call_ended("a", at(6)), None);
    }

    /// Call ends at irregular times: the clock (the largest value written, as it never moves back)
    /// is never earlier than any end and never more than a second later than the last one, and at
    /// most one write lands per second.
    #[test]
    fn the_clock_is_never_behind_an_end_nor_more_than_a_second_ahead_of_the_last() {
        let mut ends = EndTouches::default();
        let mut clock: Option<DateTime<Utc>> = None;
        let mut writes = Vec::new();
        let mut now = 0;
        let mut seed: u64 = 0x5eed;
        for _ in 0..10_000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            now += i64::try_from(seed >> 54).expect("small"); // 0 to 1023 ms apart
            if let Some(value) = ends.call_ended("a", at(now)) {
                clock = clock.max(Some(value));
                writes.push(now);
            }
            let clock = clock.expect("the first end writes");
            assert!(
                clock >= at(now),
                "the clock reads {clock} after a call ended at {now}"
            );
            assert!(
                clock <= at(now) + ahead(),
                "the clock reads {clock}, more than a second after the last end at {now}"
            );
        }
        assert!(
            writes.windows(2).all(|w| w[1] - w[0] > 1000),
            "at most one write a second"
        );
        assert!(writes.len() < 10_000, "ends were coalesced");
    }
}
