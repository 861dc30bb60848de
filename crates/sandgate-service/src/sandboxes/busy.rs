//! Which sandboxes have calls in flight in this process: the reaper leaves those alone, the end
//! of a call restarts a sandbox's idle clock, and a sandbox takes at most
//! `limits.max_calls_per_sandbox` calls at once (more would run it out of processes).
//!
//! The cap is counted where the sandbox's attach channel lives (this process): every call into
//! a sandbox goes through its channel here (and, with scale-out, through its node).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sandgate_store::PgPool;
use sandgate_store::sandboxes;

use super::ServiceError;
use super::error::Quota;

/// Sandboxes with calls in flight in this process, by id, with how many.
pub(crate) type BusyMap = Arc<Mutex<HashMap<String, usize>>>;

/// Held while a call uses a sandbox; see [`Resolved::busy`].
#[derive(Debug)]
pub struct BusyGuard {
    id: String,
    busy: BusyMap,
    db: PgPool,
}

impl BusyGuard {
    /// Marks a call on `id` unless the sandbox already runs `cap` calls.
    pub(super) fn try_new(
        id: &str,
        busy: &BusyMap,
        db: &PgPool,
        cap: u32,
    ) -> Result<Arc<Self>, ServiceError> {
        {
            let mut map = busy.lock().expect("busy map");
            let running = map.entry(id.to_owned()).or_default();
            if *running >= cap as usize {
                if *running == 0 {
                    map.remove(id);
                }
                return Err(ServiceError::Quota {
                    quota: Quota::CallsPerSandbox,
                    limit: cap,
                    retry_after_seconds: 1,
                });
            }
            *running += 1;
        }
        Ok(Arc::new(Self {
            id: id.to_owned(),
            busy: busy.clone(),
            db: db.clone(),
        }))
    }

    pub(super) fn new(id: &str, busy: &BusyMap, db: &PgPool) -> Arc<Self> {
        *busy
            .lock()
            .expect("busy map")
            .entry(id.to_owned())
            .or_default() += 1;
        Arc::new(Self {
            id: id.to_owned(),
            busy: busy.clone(),
            db: db.clone(),
        })
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        {
            let mut busy = self.busy.lock().expect("busy map");
            if let Some(n) = busy.get_mut(&self.id) {
                *n -= 1;
                if *n == 0 {
                    busy.remove(&self.id);
                }
            }
        }
        // The end of a call is use too: a long cell must not leave its sandbox already idle.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let db = self.db.clone();
            let ids = vec![self.id.clone()];
            runtime.spawn(async move {
                let result = async {
                    let mut conn = db.acquire().await?;
                    sandboxes::touch_live(&mut conn, &ids).await
                }
                .await;
                if let Err(err) = result {
                    tracing::warn!(error = %err, sandbox_id = %ids[0], "refreshing the idle clock after a call failed");
                }
            });
        }
    }
}
