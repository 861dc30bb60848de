//! Which sandboxes have calls in flight in this process: the reaper leaves those alone, and the
//! end of a call restarts a sandbox's idle clock.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use sandgate_store::PgPool;
use sandgate_store::sandboxes;

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
