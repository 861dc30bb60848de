//! The idle clock's writes, coalesced: a call refreshes its sandbox's `last_used_at` at most
//! once per [`COALESCE`] per sandbox from this process, and in the same statement that finds
//! the sandbox and checks its owner (one round trip, `sandboxes::touch_in_time`). A call within
//! [`COALESCE`] of the last touch only reads the row, and when the call's admission read it
//! already (`SandboxService::admit_naming`, the same statement as the quota's), not even that.
//!
//! What it costs: a sandbox's idle clock may run up to [`COALESCE`] behind its last call's
//! start. It never extends a sandbox past `expires_at` (the touch refuses an overdue row, and
//! the lifetime is never moved), and the reaper still leaves a sandbox with a call running
//! alone (the busy set), whose end restarts the clock exactly (`BusyGuard`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sandgate_store::sandboxes::{self, SandboxRow};

use super::{Caller, SandboxService, ServiceError};

/// At most one idle-clock write per sandbox per this long, from one process.
pub(crate) const COALESCE: Duration = Duration::from_secs(1);
/// Entries kept before old ones are swept out.
const SWEEP_AT: usize = 4096;

/// When this process last wrote each sandbox's idle clock. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub(crate) struct IdleClock {
    touched: Arc<Mutex<HashMap<String, Instant>>>,
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
